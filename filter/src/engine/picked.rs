//! The pick's answer in a request's flow: the endpoint header and the
//! request resumed, or the reason it fails open, is refused or is answered
//! "unknown response"; and how long a pick may take.

use kvasir_policy::PoolConfig;

use super::{Flow, Host, Phase, Verdict};
use crate::pick::{self, FailOpen, NoPick, PickOutcome};
use crate::reply::unknown_response;
use crate::stats::pool_stat;

impl Flow {
    pub(super) fn fail_open(&self, why: FailOpen) {
        if let Some(r) = &self.routed {
            let s = &self.shared.stats;
            s.count(
                &pool_stat(&r.pool_name, &format!("pick.{}", why.as_str())),
                1,
            );
            s.count(&pool_stat(&r.pool_name, "failopen"), 1);
        }
        self.count("failopen", 1);
    }

    /// A gRPC answer for this request (the pick; anything else is
    /// ignored).
    pub fn on_grpc_response(&mut self, host: &mut dyn Host, token: u32, status: u32, size: usize) {
        if self.phase != Phase::Picking(token) {
            return;
        }
        let body = if status == 0 {
            host.grpc_response(size)
        } else {
            None
        };
        self.on_pick_outcome(host, token, pick::pick_outcome(status, body.as_deref()));
    }

    /// The pick's outcome, however it came ([`Host::pick`]'s token): sets
    /// the endpoint header or fails open, then resumes the request.
    pub fn on_pick_outcome(&mut self, host: &mut dyn Host, token: u32, outcome: PickOutcome) {
        if self.phase != Phase::Picking(token) {
            return;
        }
        let now = host.now_ns();
        if let Some(r) = &self.routed {
            // The pick's round trip as Envoy saw it (indexer + network).
            let us = now.saturating_sub(self.pick_started_ns) / 1000;
            self.shared
                .stats
                .record(&pool_stat(&r.pool_name, "pick_us"), us);
        }
        let pool_index = self
            .routed
            .as_ref()
            .and_then(|r| self.shared.config.policy.pool_index(&r.pool_name));
        if let (Some(s), Some(i)) = (outcome.saturation, pool_index) {
            self.shared.learn_saturation(i, s, now);
        }
        self.governance_outcome(&outcome);
        self.answer_used = !matches!(outcome.result, Err(NoPick::FailOpen(_)));
        match outcome.result {
            Ok(p) => {
                if outcome.prompt_tokens > 0 {
                    self.prompt_estimate = u64::from(outcome.prompt_tokens);
                }
                // A request bound to a stored response can be served by its
                // holder alone: a retry must go there again, not to the
                // next engine (which would answer 404 for the id). (Not
                // where one address is asked for: a cluster dialling the
                // header's address reads exactly one.)
                let one = self.shared.config.settings.max_endpoints <= 1;
                let header = match &self.response_id {
                    Some(_) if !one => format!("{0},{0}", p.first),
                    _ => p.header.clone(),
                };
                host.set_request_header(&self.shared.config.settings.endpoint_header, &header);
                if let Some(n) = p.engine_priority {
                    self.set_engine_priority(host, n);
                }
                if let Some(r) = &mut self.routed {
                    if p.engine_priority.is_some() {
                        let stat = pool_stat(&r.pool_name, "engine_priority");
                        self.shared.stats.count(&stat, 1);
                    }
                    self.shared
                        .stats
                        .count(&pool_stat(&r.pool_name, "pick.ok"), 1);
                    r.picked = Some(p);
                }
            }
            Err(NoPick::FailOpen(why)) => {
                if self.without_pick(host, why) == Verdict::Pause {
                    return;
                }
            }
            Err(NoPick::UnknownResponse) => {
                if let (Some(id), Some(r)) = (&self.response_id, &self.routed) {
                    let stat = pool_stat(&r.pool_name, "pick.unknown_response");
                    self.shared.stats.count(&stat, 1);
                    host.send_reply(&unknown_response(id));
                    self.phase = Phase::Replied;
                    return;
                }
                // An answer about a response the request never named.
                self.answer_used = false;
                if self.without_pick(host, FailOpen::BadResponse) == Verdict::Pause {
                    return;
                }
            }
            Err(NoPick::RateLimited) => {
                return self.refuse_rate_limited(host, outcome.budget.as_ref());
            }
            Err(NoPick::Shed(cause)) => {
                return self.refuse_shed(host, cause, outcome.queued_ms, outcome.budget.as_ref());
            }
        }
        self.phase = Phase::Forwarded;
        host.resume_request();
    }
}

/// Least time a pick bound to a stored response may take. The report that
/// records the response's engine and the client's follow-up travel on
/// different streams (another Envoy worker, another indexer replica), so
/// the indexer waits a grace for an id it has not seen yet (its
/// `responses.graceMs`, 250 ms by default) before answering "unknown": a
/// shorter deadline here would fail open first and send the follow-up to
/// an engine that does not hold the response. Only that race ever uses it.
pub const RESPONSE_PICK_MIN_TIMEOUT_MS: u32 = 500;

/// The pick's timeout: the pool's, raised to
/// [`RESPONSE_PICK_MIN_TIMEOUT_MS`] for a pick bound to a stored response.
pub fn pick_timeout_ms(pool_timeout_ms: u32, response_bound: bool) -> u32 {
    if response_bound {
        pool_timeout_ms.max(RESPONSE_PICK_MIN_TIMEOUT_MS)
    } else {
        pool_timeout_ms
    }
}

/// The pick's deadline, on a `Session` stream or a unary call: its timeout
/// plus the longest it may wait in the pool's flow-control queue
/// (`maxQueueWaitMs`, sent as the pick's `max_wait_ms`), so a queued pick
/// is answered (released or shed) by the indexer before the filter would
/// give up on it and fail open.
pub fn pick_deadline_ms(pool: &PoolConfig, response_bound: bool) -> u32 {
    pick_timeout_ms(pool.indexer_timeout_ms, response_bound).saturating_add(pool.max_queue_wait_ms)
}
