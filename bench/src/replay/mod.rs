//! A run's conversations replayed in virtual time through the
//! simulator's own engines ([`vllm_sim::engine::Engine`]: vLLM's
//! scheduler with chunked prefill and batching, its block pool evicting
//! under pressure, the latency model), placed by the run's own choices or
//! by an oracle router.
//!
//! Why: the queue yardsticks ([`crate::queue`]) serve one prefill at a
//! time and never evict, so a routing rule they favour can do worse on
//! real engines. Here the same conversations meet the engines' batching
//! and eviction. Replaying the run's own placements checks the replay
//! against the measurement; the oracles then ask whether a router that
//! holds requests in one queue until an engine frees beats one that places
//! each at arrival, on these engines.
//!
//! A trace run replays too ([`trace_requests`]): each answered request as
//! a one-turn conversation with its trace request's prompt, sent when the
//! run sent it.
//!
//! The conversations ([`conversations`]): each answered turn of the run,
//! in order. A first turn is its tenant's system prompt (the most any
//! first turn of the tenant found cached) and new tokens up to the run's
//! prompt length; a later turn is its conversation's previous prompt, the
//! answer the replay's engine gave it, and as many new tokens as the run's
//! prompt grew by. First turns are sent when the run sent them; a later
//! turn the think time the run had after the replay's answer to the turn
//! before (closed loop, as the load generator).
//!
//! The oracle knows each engine's cache exactly (the KV-event index
//! without its delay) and, per engine, the requests it placed there that
//! have no first token yet, each priced as if alone
//! ([`EngineModel::unqueued_ttft_ms`]): their sum is the engine's backlog.
//! Left out: the run's engine restart, requests that failed in the run,
//! and flow control holding picks at the gateway: every request reaches
//! its engine when it was sent, so where late binding held many picks the
//! queue the run had at the gateway sits in the engines here, and
//! `--shortest-first` reorders it where the real engines had little to
//! reorder (bench/results/engine-priority-prefill/).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use vllm_sim::engine::{Engine, EngineConfig, FinishReason, NewRequest, StepOutput, TokenOutput};
use vllm_sim::hashing::{extend_chain, BlockHash};

use kvasir_scoring::placements::{Placements, DEFAULT_MAX_ENDS};

use crate::bound::EngineModel;
use crate::queue::At;
use crate::record::{Outcome, Record};
use crate::trace::{self, TraceRequest};

mod place;
pub use place::Placement;

/// One turn of a replayed conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// When the run sent it, simulated seconds (read for first turns).
    pub sent_s: f64,
    /// Seconds between the answer to the turn before and this one.
    pub think_s: f64,
    /// Prompt tokens it adds to what came before (the system prompt, for a
    /// first turn; the previous prompt and its answer, for a later one).
    pub new_tokens: usize,
    /// Tokens it generates.
    pub completion_tokens: u32,
    /// The engine the run placed it on (an index into the run's endpoints).
    pub endpoint: usize,
}

/// A conversation to replay.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// Its tenant, by index.
    pub tenant: usize,
    /// Its tenant's system prompt, tokens.
    pub system_tokens: usize,
    /// Its answered turns, in order.
    pub turns: Vec<Turn>,
    /// A trace request's prompt (its hash ids' tokens, [`trace::prompt_tokens`]
    /// with this many tokens per id) in place of a system prompt and new
    /// tokens: a trace is replayed as one-turn conversations.
    pub trace: Option<(TraceRequest, usize)>,
}

/// A run's answered chat records as conversations, with the run's
/// endpoints (in first-use order) that [`Turn::endpoint`] indexes.
/// `system` is each tenant's system prompt in tokens.
pub fn conversations(
    records: &[Record],
    system: &HashMap<&str, u64>,
) -> (Vec<Conversation>, Vec<String>) {
    let mut endpoints: Vec<String> = Vec::new();
    let mut tenants: HashMap<&str, usize> = HashMap::new();
    let mut by_conv: HashMap<usize, Vec<&Record>> = HashMap::new();
    let mut order = Vec::new();
    for r in records.iter().filter(|r| r.outcome == Outcome::Ok) {
        let Some(c) = r.conversation else { continue };
        by_conv
            .entry(c)
            .or_insert_with(|| {
                order.push(c);
                Vec::new()
            })
            .push(r);
    }
    let mut out = Vec::new();
    for c in order {
        let mut rs = by_conv.remove(&c).unwrap_or_default();
        rs.sort_by_key(|r| r.turn);
        let n = tenants.len();
        let tenant = *tenants.entry(rs[0].tenant.as_str()).or_insert(n);
        let system_tokens = system.get(rs[0].tenant.as_str()).copied().unwrap_or(0) as usize;
        let mut turns = Vec::with_capacity(rs.len());
        let mut before: Option<&Record> = None;
        for r in rs {
            let endpoint = endpoint_index(&mut endpoints, &r.endpoint);
            let (think_s, had) = match before {
                Some(b) => (
                    (r.sent_s - b.sent_s - b.e2e_ms / 1e3).max(0.0),
                    (b.prompt_tokens + b.completion_tokens) as usize,
                ),
                None => (0.0, system_tokens),
            };
            turns.push(Turn {
                sent_s: r.sent_s,
                think_s,
                new_tokens: (r.prompt_tokens as usize).saturating_sub(had).max(1),
                completion_tokens: r.completion_tokens.max(1) as u32,
                endpoint,
            });
            before = Some(r);
        }
        out.push(Conversation {
            tenant,
            system_tokens,
            turns,
            trace: None,
        });
    }
    (out, endpoints)
}

/// `address`'s place in `endpoints`, added at the end when new.
fn endpoint_index(endpoints: &mut Vec<String>, address: &str) -> usize {
    match endpoints.iter().position(|e| e == address) {
        Some(i) => i,
        None => {
            endpoints.push(address.to_string());
            endpoints.len() - 1
        }
    }
}

/// A trace run's answered records as one-turn conversations sent at the
/// run's send times, each with its trace request's prompt (a record's id
/// is its request's place in `trace`; `block_tokens` per hash id), with
/// the run's endpoints as [`conversations`] gives them. Errors when a
/// record does not match its trace request (another trace, or window).
pub fn trace_requests(
    records: &[Record],
    trace: &[TraceRequest],
    block_tokens: usize,
) -> Result<(Vec<Conversation>, Vec<String>), String> {
    let mut endpoints: Vec<String> = Vec::new();
    let mut out = Vec::new();
    for r in records.iter().filter(|r| r.outcome == Outcome::Ok) {
        let t = trace.get(r.id).ok_or_else(|| {
            format!(
                "record {} is past the trace's {} requests",
                r.id,
                trace.len()
            )
        })?;
        if t.input_length == 0 {
            return Err(format!(
                "record {}'s trace request has no prompt tokens",
                r.id
            ));
        }
        if t.input_length as u64 != r.prompt_tokens {
            return Err(format!(
                "record {} has {} prompt tokens, the trace's request {} has {}: not the trace (or window) the run replayed",
                r.id, r.prompt_tokens, r.id, t.input_length
            ));
        }
        let endpoint = endpoint_index(&mut endpoints, &r.endpoint);
        out.push(Conversation {
            tenant: 0,
            system_tokens: 0,
            turns: vec![Turn {
                sent_s: r.sent_s,
                think_s: 0.0,
                new_tokens: 0,
                completion_tokens: r.completion_tokens.max(1) as u32,
                endpoint,
            }],
            trace: Some((t.clone(), block_tokens)),
        });
    }
    Ok((out, endpoints))
}

/// The replayed cluster.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Engines (at least the run's endpoints, for [`Placement::Own`]).
    pub engines: usize,
    /// Each engine's settings.
    pub engine: EngineConfig,
    /// The oracle's prefill pricing.
    pub model: EngineModel,
    /// Each request sent with the `priority` the pool's
    /// `enginePriorityBy: prefill` gives it on its engine
    /// ([`kvasir_flowcontrol::prefill_priority`], band 0), for engines at
    /// `--scheduling-policy priority`: shortest prefill first in their
    /// waiting queues.
    pub shortest_first: bool,
}

/// What a replay gave.
#[derive(Debug, Clone, PartialEq)]
pub struct Replayed {
    /// TTFT of each replayed turn, ms, in the order their first tokens came.
    pub ttft_ms: Vec<f64>,
    /// Prompt tokens sent.
    pub prompt_tokens: u64,
    /// Of those, found in the prefix cache.
    pub cached_tokens: u64,
    /// Turns per engine.
    pub per_engine: Vec<usize>,
    /// Running requests the engines preempted.
    pub preemptions: u64,
}

impl Replayed {
    /// Cached over prompt tokens.
    pub fn hit_rate(&self) -> f64 {
        self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64
    }
}

/// A turn in flight: sent, placed or waiting.
struct Req {
    conv: usize,
    turn: usize,
    tokens: Vec<u32>,
    hashes: Vec<BlockHash>,
    sent: f64,
    rx: Option<UnboundedReceiver<TokenOutput>>,
    output: Vec<u32>,
}

/// An engine and what the oracle knows of it.
struct Node {
    engine: Engine,
    /// When the step in flight ends, and what it produced.
    step: Option<(f64, StepOutput)>,
    /// Requests placed here without a first token: (request, priced
    /// prefill ms, uncached tokens).
    pending: Vec<(usize, f64, u64)>,
    /// Requests placed here not finished.
    active: Vec<usize>,
    /// When its last request without a first token got one (of the free
    /// engines, the one free longest chooses first).
    free_since: f64,
}

impl Node {
    fn backlog_ms(&self) -> f64 {
        self.pending.iter().map(|p| p.1).sum()
    }

    fn backlog_tokens(&self) -> u64 {
        self.pending.iter().map(|p| p.2).sum()
    }
}

/// The replay's state.
struct Cluster<'a> {
    convs: &'a [Conversation],
    setup: &'a Setup,
    nodes: Vec<Node>,
    reqs: Vec<Req>,
    arrivals: BinaryHeap<Reverse<(At, usize)>>,
    waiting: Vec<usize>,
    /// Conversations started per engine, for [`Placement::Scored`].
    placements: Placements<usize>,
    /// Each conversation's engine, for [`Placement::Dealt`].
    dealt: HashMap<usize, usize>,
    out: Replayed,
}

/// Replays `convs` on `setup`'s engines, placed by `placement`.
pub fn replay(convs: &[Conversation], setup: &Setup, placement: &Placement) -> Replayed {
    let vocab: Arc<[u32]> = (0..64).map(|i| 900_000 + i).collect::<Vec<u32>>().into();
    let engines = setup.engines.max(1);
    let mut c = Cluster {
        convs,
        setup,
        nodes: (0..engines)
            .map(|_| Node {
                engine: Engine::new(setup.engine.clone(), Arc::clone(&vocab)),
                step: None,
                pending: Vec::new(),
                active: Vec::new(),
                free_since: f64::NEG_INFINITY,
            })
            .collect(),
        reqs: Vec::new(),
        arrivals: BinaryHeap::new(),
        waiting: Vec::new(),
        placements: Placements::new(
            match placement {
                Placement::Scored(w) => w.placement_half_life_ms,
                _ => 0.0,
            },
            DEFAULT_MAX_ENDS,
        ),
        dealt: HashMap::new(),
        out: Replayed {
            ttft_ms: Vec::new(),
            prompt_tokens: 0,
            cached_tokens: 0,
            per_engine: vec![0; engines],
            preemptions: 0,
        },
    };
    for (i, conv) in convs.iter().enumerate() {
        if let Some(t) = conv.turns.first() {
            let r = c.new_turn(i, 0, Vec::new(), t.sent_s);
            c.arrivals.push(Reverse((At(t.sent_s), r)));
        }
    }
    loop {
        let arrival = c.arrivals.peek().map(|Reverse((At(t), _))| *t);
        let step = c
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(e, n)| n.step.as_ref().map(|(t, _)| (*t, e)))
            .min_by(|a, b| a.0.total_cmp(&b.0));
        let (t, changed) = match (arrival, step) {
            (_, Some((t, e))) if arrival.is_none_or(|a| t <= a) => (t, c.end_step(e, t)),
            (Some(t), _) => {
                let Some(Reverse((_, r))) = c.arrivals.pop() else {
                    break;
                };
                c.arrive(r, t, placement);
                (t, true)
            }
            _ => break,
        };
        if let (
            true,
            Placement::Central {
                quickest,
                move_penalty,
                free_tokens,
            },
        ) = (changed, placement)
        {
            c.dispatch(t, *quickest, *move_penalty, *free_tokens);
        }
    }
    c.out.preemptions = c.nodes.iter().map(|n| n.engine.stats().preemptions).sum();
    c.out
}

impl Cluster<'_> {
    /// Turn `turn` of conversation `conv`, after the previous prompt and
    /// its answer (`before`), sent at `sent`: its index in `reqs`.
    fn new_turn(&mut self, conv: usize, turn: usize, before: Vec<u32>, sent: f64) -> usize {
        let c = &self.convs[conv];
        let t = &c.turns[turn];
        let mut tokens = before;
        if let Some((request, block_tokens)) = &c.trace {
            tokens = trace::prompt_tokens(request, *block_tokens, conv as u64);
        } else if turn == 0 {
            // The tenant's system prompt: the same tokens for all its
            // conversations, none another tenant's.
            let base = 1_000_000 + 100_000 * c.tenant as u32;
            tokens.extend((0..c.system_tokens as u32).map(|i| base + i % 90_000));
        }
        // New tokens no other conversation has after the same prefix (the
        // chain hash of a block covers everything before it); none for a
        // trace request, whose prompt is whole.
        let salt = 5_000_000 + (conv as u32).wrapping_mul(7919);
        tokens.extend((0..t.new_tokens as u32).map(|i| salt.wrapping_add(i) % 4_000_000_000));
        let mut hashes = Vec::new();
        let cfg = &self.setup.engine;
        extend_chain(cfg.hash_seed, &mut hashes, &tokens, cfg.block_size, None);
        self.reqs.push(Req {
            conv,
            turn,
            tokens,
            hashes,
            sent,
            rx: None,
            output: Vec::new(),
        });
        self.reqs.len() - 1
    }

    /// Hands `r` to engine `e` at `t`, its prefill priced by `costs`; an
    /// idle engine starts a step.
    fn place(&mut self, r: usize, e: usize, t: f64, costs: &place::Costs) {
        let req = &mut self.reqs[r];
        let turn = &self.convs[req.conv].turns[req.turn];
        let (tx, rx) = unbounded_channel();
        req.rx = Some(rx);
        let len = req.tokens.len() as u64;
        let node = &mut self.nodes[e];
        let uncached = len.saturating_sub(costs.cached[e] as u64);
        node.pending.push((r, costs.alone[e], uncached));
        node.active.push(r);
        node.engine.add_request(NewRequest {
            id: r as u64,
            prompt: req.tokens.clone(),
            max_tokens: turn.completion_tokens,
            finish_reason: FinishReason::Length,
            cache_salt: None,
            arrival: t,
            priority: if self.setup.shortest_first {
                i64::from(kvasir_flowcontrol::prefill_priority(0, uncached))
            } else {
                0
            },
            sink: tx,
        });
        self.out.per_engine[e] += 1;
        if node.step.is_none() {
            let out = node.engine.step();
            node.step = Some((t + out.duration.as_secs_f64(), out));
        }
    }

    /// Engine `e`'s step ends at `t`: its tokens go out, first tokens are
    /// timed, finished turns' next turns are sent after their think time,
    /// and the engine steps on if it has work. Returns whether an engine's
    /// backlog fell (a central queue may place).
    fn end_step(&mut self, e: usize, t: f64) -> bool {
        let Some((_, out)) = self.nodes[e].step.take() else {
            return false;
        };
        for (sink, msg) in out.tokens {
            let _ = sink.send(msg);
        }
        let mut fell = false;
        let active = std::mem::take(&mut self.nodes[e].active);
        let mut still = Vec::with_capacity(active.len());
        for r in active {
            let mut finished = false;
            while let Some(msg) = self.reqs[r].rx.as_mut().and_then(|rx| rx.try_recv().ok()) {
                if msg.index == 0 {
                    self.first_token(e, r, t, u64::from(msg.cached_tokens));
                    fell = true;
                }
                self.reqs[r].output.push(msg.token_id);
                finished |= msg.finished.is_some();
            }
            if finished {
                self.next_turn(r, t);
            } else {
                still.push(r);
            }
        }
        let node = &mut self.nodes[e];
        node.active = still;
        if node.engine.has_work() {
            let out = node.engine.step();
            node.step = Some((t + out.duration.as_secs_f64(), out));
        }
        fell
    }

    fn first_token(&mut self, e: usize, r: usize, t: f64, cached: u64) {
        let req = &self.reqs[r];
        self.out.ttft_ms.push((t - req.sent) * 1e3);
        self.out.prompt_tokens += req.tokens.len() as u64;
        self.out.cached_tokens += cached;
        let node = &mut self.nodes[e];
        node.pending.retain(|p| p.0 != r);
        if node.pending.is_empty() {
            node.free_since = t;
        }
    }

    /// `r` finished at `t`: its conversation's next turn, if any, is sent
    /// after its think time.
    fn next_turn(&mut self, r: usize, t: f64) {
        let (conv, turn) = (self.reqs[r].conv, self.reqs[r].turn + 1);
        let Some(next) = self.convs[conv].turns.get(turn) else {
            self.reqs[r].tokens = Vec::new();
            return;
        };
        let sent = t + next.think_s;
        let mut before = std::mem::take(&mut self.reqs[r].tokens);
        before.extend(std::mem::take(&mut self.reqs[r].output));
        self.reqs[r].hashes = Vec::new();
        let n = self.new_turn(conv, turn, before, sent);
        self.arrivals.push(Reverse((At(sent), n)));
    }
}

#[cfg(test)]
mod tests;
