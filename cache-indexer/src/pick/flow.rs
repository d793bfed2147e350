//! Flow control of a pick: when the pool is saturated, the pick
//! waits in the pool's queue ([`crate::flow`]) and is placed when it
//! leaves (late binding): on an endpoint with room then, matched against
//! the index as it is then.
//!
//! A waiting pick gives its caller's permit back ([`super::PickPermit`]):
//! its tokenizing is done, and a full queue must not stop a `Session`
//! stream's other calls. If its caller goes away while it waits, its queue
//! entry is taken out with it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvasir_flowcontrol::Ticket;
use kvasir_proto::v1 as pb;
use tokio::sync::oneshot;

use super::matching::Matched;
use super::prompt::Call;
use super::rank::Ranked;
use super::tokenize::{PickTokens, PrefixHashes};
use super::PickPermit;
use crate::endpoint::Endpoint;
use crate::flow::recheck::RECHECK_PERIOD;
use crate::flow::{Arrival, Ask, Passage, PoolFlow, Price, ShedCause, Wake};
use crate::load::LoadView;
use crate::pool::Pool;
use crate::types::EndpointId;

/// The endpoints and prefix match a pick is ranked with once it may go,
/// and its pass through flow control (see [`Pool::flow_placed`]).
pub(crate) type Room<'p> = (Arc<Vec<Arc<Endpoint>>>, Matched<'p>, Passage);

/// Output tokens a pick is charged in the fair share when the request
/// gives no `max_tokens` (`Hints.expected_output_tokens` 0): a typical
/// chat answer. Only the order between tenants depends on it.
pub(crate) const DEFAULT_OUTPUT_ESTIMATE: u64 = 256;

impl Pool {
    /// Waits, when the pool's flow control says so, until the pick may be
    /// placed; then returns the endpoints and the prefix match as they are
    /// now. A pick that may not wait, or waited its longest, gets the
    /// answer to send (decision SHED).
    pub(crate) async fn wait_for_room<'p>(
        &'p self,
        call: &Call,
        tokens: &PickTokens,
        endpoints: Arc<Vec<Arc<Endpoint>>>,
        matched: Matched<'p>,
        hashes: &mut PrefixHashes,
        permit: &mut PickPermit,
    ) -> Result<Room<'p>, pb::PickResponse> {
        if !self.flow.enabled() {
            return Ok((endpoints, matched, Passage::free()));
        }
        let now = Instant::now();
        let loads = self.flow_loads(&endpoints, now);
        let ask = Ask {
            request_id: call.request_id.clone(),
            tenant: call.tenant.clone(),
            priority: call.priority,
            weight: call.weight,
            tokens: charge(call, tokens),
            max_wait: Duration::from_millis(call.max_wait_ms.into()),
            price: self.price(tokens, &matched),
        };
        let thresholds = &self.load.config().saturation;
        let (ticket, rx, deadline) = match self.flow.arrive(&loads, thresholds, ask, now) {
            Arrival::Go(pass) => return Ok((endpoints, matched, pass)),
            Arrival::Shed(cause) => return Err(self.shed(call, tokens, &loads, cause)),
            Arrival::Queued {
                ticket,
                rx,
                deadline,
            } => (ticket, rx, deadline),
        };
        permit.give_back();
        let recheck = || self.capacity_freed();
        let Some(pass) = wait_in_queue(&self.flow, ticket, rx, deadline, recheck).await else {
            let loads = self.flow_loads(&self.endpoints(), Instant::now());
            let mut shed = self.shed(call, tokens, &loads, ShedCause::MaxWait);
            shed.queued_ms = millis(now.elapsed());
            return Err(shed);
        };
        let (endpoints, matched) = self.bind_late(call, tokens, matched, hashes);
        Ok((endpoints, matched, pass))
    }

    /// Late binding of a released pick: the prefix matched against the
    /// index as it is now (engines stored and evicted blocks while the pick
    /// waited), and the endpoints it may go to (all of them if none has
    /// room): those with room now and the unsaturated holders of more of
    /// its prefix ([`PoolFlow::placeable`]), for the ranking to weigh a
    /// holder's queue against the prefill it saves.
    fn bind_late<'p>(
        &'p self,
        call: &Call,
        tokens: &PickTokens,
        matched: Matched<'p>,
        hashes: &mut PrefixHashes,
    ) -> (Arc<Vec<Arc<Endpoint>>>, Matched<'p>) {
        // (The chain was handed to the first match; its hashes stay valid.)
        if let Some(chain) = &matched.chain {
            hashes.chain = chain.to_vec();
        }
        drop(matched);
        let matched = self.match_prefix(tokens, call.salted, hashes);
        let now = Instant::now();
        let endpoints = self.candidates(call);
        let views = self.load.views_matching(
            endpoints.iter().map(|e| e.id),
            now,
            matched.pending_chain.as_deref(),
        );
        let loads: Vec<(EndpointId, LoadView)> =
            endpoints.iter().map(|e| e.id).zip(views).collect();
        let held = |id: EndpointId| {
            let indexed = matched.overlap.as_ref().map_or(0, |o| o.blocks_for(id));
            let pending = loads
                .iter()
                .find(|(l, _)| *l == id)
                .map_or(0, |(_, v)| v.pending_matched_blocks);
            indexed.max(pending)
        };
        let placeable = self
            .flow
            .placeable(&loads, &self.load.config().saturation, now, held);
        if placeable.is_empty() {
            return (endpoints, matched);
        }
        let endpoints = endpoints
            .iter()
            .filter(|e| placeable.contains(&e.id))
            .cloned()
            .collect();
        (Arc::new(endpoints), matched)
    }

    /// A waiting pick's prefill on each endpoint, by its prefix match now
    /// (for `releaseOrder: quickestFirst`; empty when it was not matched:
    /// its whole prompt is uncached everywhere).
    fn price(&self, tokens: &PickTokens, matched: &Matched<'_>) -> Price {
        let block = u64::from(self.block_size);
        let cached = matched.overlap.as_ref().map_or_else(Vec::new, |o| {
            o.matched
                .iter()
                .map(|(id, blocks)| (*id, *blocks as u64 * block))
                .collect()
        });
        Price {
            prompt_tokens: u64::from(prompt_tokens(tokens)),
            cached,
        }
    }

    /// Something freed room in the pool (a report, a scrape, an endpoint
    /// change, or time alone, on the re-check timer while picks wait:
    /// engines drain their queued prefill): waiting picks may go.
    pub(crate) fn capacity_freed(&self) {
        if !self.flow.enabled() || self.flow.is_empty() {
            return;
        }
        let now = Instant::now();
        let loads = self.flow_loads(&self.endpoints(), now);
        self.flow
            .release(&loads, &self.load.config().saturation, now);
    }

    /// A pick that went through flow control was ranked: its wait goes in
    /// the answer, and its first endpoint counts the placement.
    pub(crate) fn flow_placed(
        &self,
        pass: Passage,
        ranked: &Ranked,
        answer: &mut pb::PickResponse,
    ) {
        answer.queued_ms = millis(pass.queued());
        let first = ranked.ranking.order.first();
        answer.engine_priority =
            pass.engine_priority(first.map_or(0, |r| u64::from(r.cost.uncached_tokens)));
        let first = first.map(|r| ranked.endpoints[r.candidate].id);
        self.flow.placed(pass, first);
    }

    /// A request's report: a DONE with usage settles its fair-share charge
    /// if it waited (see [`PoolFlow::settle`]).
    pub(crate) fn flow_settle(&self, req: &pb::ReportRequest, done: bool) {
        if done && self.flow.enabled() {
            let actual = u64::from(req.prompt_tokens) + u64::from(req.completion_tokens);
            self.flow.settle(&req.request_id, actual);
        }
    }

    fn flow_loads(&self, endpoints: &[Arc<Endpoint>], now: Instant) -> Vec<(EndpointId, LoadView)> {
        let views = self.load.views(endpoints.iter().map(|e| e.id), now);
        endpoints.iter().map(|e| e.id).zip(views).collect()
    }

    /// The answer to a shed pick: no endpoint, the cause, the prompt's
    /// length and the pool's saturation (as a ranked answer's).
    fn shed(
        &self,
        call: &Call,
        tokens: &PickTokens,
        loads: &[(EndpointId, LoadView)],
        cause: ShedCause,
    ) -> pb::PickResponse {
        let views: Vec<LoadView> = loads.iter().map(|(_, v)| v.clone()).collect();
        tracing::debug!(
            pool = %self.name,
            tenant = %call.tenant,
            request_id = %call.request_id,
            cause = cause.as_label(),
            waiting = self.flow.len(),
            "pick shed"
        );
        let mut answer = pb::PickResponse {
            prompt_tokens: prompt_tokens(tokens),
            pool_saturation: crate::load::pool_saturation(&views),
            ..Default::default()
        };
        answer.set_decision_and_reason(pb::Decision::Shed);
        answer.set_tokenize_mode(tokens.mode);
        answer.set_shed_cause(cause);
        answer
    }
}

/// Waits for the queue's word or the deadline: a pass when released, none
/// when it waited its longest. Dropped while waiting (the caller went
/// away), it takes the pick out of the queue. Meanwhile, if no other
/// waiting pick does, it runs the pool's re-check timer, calling `recheck`
/// (a release pass) every [`RECHECK_PERIOD`] (see [`crate::flow::recheck`]).
async fn wait_in_queue(
    flow: &PoolFlow,
    ticket: Ticket,
    mut rx: oneshot::Receiver<Wake>,
    deadline: Instant,
    recheck: impl Fn(),
) -> Option<Passage> {
    let mut waiting = Waiting {
        flow,
        ticket: Some(ticket),
    };
    let expiry = tokio::time::sleep_until(deadline.into());
    tokio::pin!(expiry);
    let mut ticker = None;
    let wake = loop {
        if ticker.is_none() {
            ticker = flow.recheck.claim();
        }
        let ticking = ticker.is_some();
        let nudge = async {
            if ticking {
                tokio::time::sleep(RECHECK_PERIOD).await;
            } else {
                flow.recheck.wanted().await;
            }
        };
        tokio::select! {
            biased;
            w = &mut rx => break match w {
                Ok(w) => w,
                // The queue went away (the pool was replaced): as if expired.
                Err(_) => Wake::Expired,
            },
            () = &mut expiry => break if flow.expire_one(ticket) {
                Wake::Expired
            } else {
                // It left the queue just now: its wake is in the channel.
                rx.try_recv().unwrap_or(Wake::Expired)
            },
            () = nudge => {
                if let Some(t) = &ticker {
                    t.tick();
                    recheck();
                }
            }
        }
    };
    // (The role goes to another waiting pick, if any.)
    drop(ticker);
    waiting.ticket = None;
    match wake {
        Wake::Go(pass) => Some(pass),
        Wake::Expired => None,
    }
}

/// A pick in the queue; dropped before it leaves, it cancels its entry.
struct Waiting<'f> {
    flow: &'f PoolFlow,
    ticket: Option<Ticket>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.ticket.take() {
            self.flow.cancel(t);
        }
    }
}

fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

/// The prompt's length (estimated when only its head was tokenized), as
/// ranking counts it.
fn prompt_tokens(tokens: &PickTokens) -> u32 {
    u32::try_from(tokens.estimated_len.unwrap_or(tokens.ids.len())).unwrap_or(u32::MAX)
}

/// A pick's size in the fair share: its prompt tokens plus its output
/// estimate (its `max_tokens`, else [`DEFAULT_OUTPUT_ESTIMATE`]).
fn charge(call: &Call, tokens: &PickTokens) -> u64 {
    let output = match call.expected_output_tokens {
        0 => DEFAULT_OUTPUT_ESTIMATE,
        n => u64::from(n),
    };
    u64::from(prompt_tokens(tokens)) + output
}
