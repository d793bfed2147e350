//! An offline model of the routed cluster, for trying scoring weights in
//! seconds instead of a benchmark run's minutes: a trace's requests go, at
//! their arrival times, to one of N model engines, each an LRU prefix cache
//! (as [`crate::bound`]'s, one engine's size) in front of an FCFS prefill
//! queue (as [`crate::queue`]'s, each prefill priced alone by
//! [`EngineModel`]). A [`Policy`] picks the engine; the scored one is the
//! cache-indexer's own ranking ([`kvasir_scoring::rank`])
//! over the model's state, so a weight tried here is the weight the picker
//! would use.
//!
//! The picker sees what the indexer would: cached prefixes as they are
//! (KV events arrive within milliseconds), prefixes of picks still in
//! prefill as matched (`pending_matched_blocks`), its own picks' queued
//! prefill at once, and the engines' running and waiting counts as of the
//! last scrape, and the conversations each engine started recently (the
//! `placement` term, with the trace's full hash ids as the block chain).
//! Decoding requests count as running for `output tokens x itl_ms` after
//! their first token.
//!
//! Two indexes: `Scored` reads the engines' caches as they are (the
//! KV-event index), `Picks` a per-engine LRU of the blocks it sent there
//! (`index: picks`, which keeps blocks the engine evicted). The picks can
//! be spread over several indexer replicas, each with its own history,
//! recent placements and picks in prefill (the engines' load and the
//! KV-event index they share), and the caches can behave as the
//! simulator's block pool under pressure (`kv_pressure`: running
//! requests' blocks pinned and read as KV usage, tails evicted first).
//!
//! What it leaves out: prefills batched into shared steps and decode steps
//! between them (the queues serve one prefill at a time), preemption, and
//! (without `kv_pressure`) KV pressure altogether: the caches evict by LRU
//! alone, never pinned, never full. Its `waiting`
//! is every request not yet started, where an engine's is only those it
//! could not fit into a step's token budget. With the default weights it
//! reproduces the benchmark's whole-trace runs closely up to load 1.5 (hit
//! rate, mean and tail TTFT; README), but it is a guide to what a run
//! should try, not a result: it predicted `queue = 16384` would cut the
//! mean TTFT at load 1.5 by ~11%, and two real runs each had it 6-8%
//! worse. Check any difference it shows with `bench/routing.py --variants`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use kvasir_scoring::placements::{Placements, DEFAULT_MAX_ENDS};
use kvasir_scoring::{Candidate, Decision, Request, Weights};

use crate::bound::{reusable_tokens, EngineModel, Lru};
use crate::queue::At;
use crate::stats::Dist;
use crate::trace::TraceRequest;

/// How the model routes.
#[derive(Debug, Clone, PartialEq)]
pub enum Policy {
    /// Engines in turn (a Kubernetes Service).
    RoundRobin,
    /// The engine whose queue empties first, blind to caches.
    LeastWork,
    /// The cache-indexer's ranking with these weights, over an index that
    /// knows what each engine holds (`index: events`).
    Scored(Box<Weights>),
    /// The same ranking over an index learned from the picks (`index:
    /// picks`): per engine an LRU of the blocks it was sent, of
    /// [`Cluster::history_tokens`], blind to what the engine evicted.
    Picks(Box<Weights>),
}

impl Policy {
    fn weights(&self) -> Option<&Weights> {
        match self {
            Policy::Scored(w) | Policy::Picks(w) => Some(w),
            _ => None,
        }
    }
}

/// The modelled cluster.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// Engines.
    pub engines: usize,
    /// Each engine's prefix cache, tokens.
    pub cache_tokens: u64,
    /// Tokens per trace hash id.
    pub trace_block: usize,
    /// Tokens per engine KV block.
    pub engine_block: usize,
    /// Prefill pricing.
    pub model: EngineModel,
    /// Time per output token after the first, ms: how long a request counts
    /// as running.
    pub itl_ms: f64,
    /// Waiting requests at which an engine counts as saturated (the
    /// indexer's `saturation.waiting`).
    pub saturation_waiting: u32,
    /// How long a pick's queued prefill counts (the indexer's
    /// `inFlight.prefillHorizonMs`), ms.
    pub prefill_horizon_ms: f64,
    /// How often the engines' running and waiting counts are read, ms (the
    /// indexer scrapes `/metrics`; in-flight picks it knows at once); 0 reads
    /// them fresh at every pick.
    pub scrape_ms: f64,
    /// Each engine's pick history under [`Policy::Picks`], tokens (the
    /// indexer's `pickHistoryBlocks` x block size).
    pub history_tokens: u64,
    /// Indexer replicas the picks are spread over (each pick to one, by a
    /// hash of its place in the trace, as Envoy's workers' streams spread
    /// them). Each keeps its own pick history, recent placements and
    /// picks in prefill to match against; the engines' load (queued
    /// prefill, in-flight) and the KV-event index they share.
    pub replicas: usize,
    /// Whether replicas match a prompt against each other's picks in
    /// prefill too (a what-if: the indexer shares only their load).
    pub shared_pending: bool,
    /// Whether the engines' caches behave as the simulator's block pool
    /// under pressure: a running request's blocks cannot be evicted (and
    /// count as KV usage, which the picker reads at each scrape), and a
    /// finished prompt's tail is evicted before its prefix. Off, the
    /// caches are plain LRUs touched in prompt order (the model the
    /// README's figures were taken with).
    pub kv_pressure: bool,
}

/// What one replay gave.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Prompt tokens found cached over all prompt tokens.
    pub hit_rate: f64,
    /// TTFT distribution, ms.
    pub ttft: Dist,
    /// Requests per engine.
    pub per_engine: Vec<usize>,
    /// Scored picks by why the first endpoint won.
    pub decisions: Decisions,
}

/// Scored picks by decision (the indexer's `decision` counter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Decisions {
    /// The first endpoint held the longest (indexed) prefix.
    pub prefix: usize,
    /// Chosen by load.
    pub load: usize,
    /// Every endpoint saturated.
    pub all_saturated: usize,
}

/// A request queued or prefilling on a model engine.
#[derive(Debug, Clone, Copy)]
struct Queued {
    arrival: f64,
    start: f64,
    done: f64,
    /// Prefill work the picker expected, prefill-token equivalents.
    work: u64,
    /// The request's place in the trace.
    index: usize,
    /// The indexer replica that picked it.
    replica: usize,
}

struct Engine {
    address: String,
    /// [`Cluster::kv_pressure`].
    kv_pressure: bool,
    cache: Lru,
    /// What a picks index remembers sending here ([`Policy::Picks`]).
    history: Vec<Lru>,
    /// Prompts whose prefill ends at the time given, then cached and held
    /// until their request ends; in FCFS order, which is also time order.
    to_cache: VecDeque<(f64, f64, Vec<u64>)>,
    /// Prompts held in the cache until the time given.
    pinned: BinaryHeap<Reverse<(At, usize)>>,
    /// The ids each entry of `pinned` holds, by trace index.
    pinned_ids: std::collections::HashMap<usize, Vec<u64>>,
    /// Trace index of the prompts in `to_cache`, in the same order.
    to_cache_index: VecDeque<usize>,
    /// Requests not yet past their first token, FCFS.
    queue: VecDeque<Queued>,
    /// When the queue's last prefill ends.
    free_at: f64,
    /// When each request still running ends.
    ends: BinaryHeap<Reverse<At>>,
    /// The last scrape: (scrape period it was taken in, running, waiting,
    /// KV usage).
    scraped: (i64, u32, u32, f64),
}

/// An engine's (running, waiting, KV usage) as scraped.
type Scraped = (u32, u32, f64);

impl Engine {
    /// Brings the engine to time `t`: finished prefills cached, finished
    /// requests gone.
    fn advance(&mut self, t: f64) {
        while self.to_cache.front().is_some_and(|(d, _, _)| *d <= t) {
            let (Some((_, end, ids)), Some(index)) =
                (self.to_cache.pop_front(), self.to_cache_index.pop_front())
            else {
                break;
            };
            if self.kv_pressure {
                self.cache.touch_chain(&ids);
                self.cache.pin(&ids);
            } else {
                for &id in &ids {
                    self.cache.touch(id);
                }
            }
            self.pinned.push(Reverse((At(end), index)));
            self.pinned_ids.insert(index, ids);
        }
        while self
            .pinned
            .peek()
            .is_some_and(|Reverse((At(e), _))| *e <= t)
        {
            if let Some(Reverse((_, index))) = self.pinned.pop() {
                if let Some(ids) = self.pinned_ids.remove(&index) {
                    self.cache.unpin(&ids);
                }
            }
        }
        while self.queue.front().is_some_and(|q| q.done <= t) {
            self.queue.pop_front();
        }
        while self.ends.peek().is_some_and(|Reverse(At(e))| *e <= t) {
            self.ends.pop();
        }
    }

    /// (running, waiting) right now.
    fn counts(&self, t: f64) -> (u32, u32) {
        let waiting = self.queue.iter().filter(|q| q.start > t).count() as u32;
        ((self.ends.len() as u32).saturating_sub(waiting), waiting)
    }

    /// Share of the cache held by running requests.
    fn kv_usage(&self) -> f64 {
        self.cache.pinned() as f64 / self.cache.capacity().max(1) as f64
    }

    /// (running, waiting, KV usage) as the last scrape saw them, scraping
    /// anew when a period has passed since.
    fn scrape(&mut self, t: f64, every_ms: f64) -> Scraped {
        if every_ms <= 0.0 {
            let (r, w) = self.counts(t);
            return (r, w, self.kv_usage());
        }
        let period = (t / every_ms).floor() as i64;
        if period != self.scraped.0 {
            let (r, w) = self.counts(t);
            self.scraped = (period, r, w, self.kv_usage());
        }
        (self.scraped.1, self.scraped.2, self.scraped.3)
    }
}

impl Cluster {
    /// Replays `trace` at `speed` (2 = arrivals twice as fast) under `policy`.
    pub fn replay(&self, trace: &[TraceRequest], speed: f64, policy: &Policy) -> Outcome {
        let n = self.engines.max(1);
        let cap_ids = (self.cache_tokens / self.trace_block.max(1) as u64) as usize;
        let replicas = self.replicas.max(1);
        let history_ids = (self.history_tokens / self.trace_block.max(1) as u64) as usize;
        let mut engines: Vec<Engine> = (0..n)
            .map(|i| Engine {
                address: format!("10.0.0.{i}:8000"),
                kv_pressure: self.kv_pressure,
                cache: Lru::new(cap_ids),
                history: (0..replicas)
                    .map(|_| Lru::new(history_ids.max(1)))
                    .collect(),
                to_cache: VecDeque::new(),
                pinned: BinaryHeap::new(),
                pinned_ids: Default::default(),
                to_cache_index: VecDeque::new(),
                queue: VecDeque::new(),
                free_at: f64::NEG_INFINITY,
                ends: BinaryHeap::new(),
                scraped: (i64::MIN, 0, 0, 0.0),
            })
            .collect();
        let t0 = trace.first().map_or(0.0, |r| r.timestamp);
        let (mut prompt_all, mut cached_all) = (0u64, 0u64);
        let mut ttft = Vec::with_capacity(trace.len());
        let mut per_engine = vec![0; n];
        let half_life = policy.weights().map_or(0.0, |w| w.placement_half_life_ms);
        let mut decisions = Decisions::default();
        let mut placements: Vec<Placements<usize>> = (0..replicas)
            .map(|_| Placements::new(half_life, DEFAULT_MAX_ENDS))
            .collect();
        for (i, r) in trace.iter().enumerate() {
            let t = (r.timestamp - t0) / speed.max(1e-9);
            let mut scraped = Vec::with_capacity(n);
            for e in &mut engines {
                e.advance(t);
                scraped.push(e.scrape(t, self.scrape_ms));
            }
            let (pick, work) = match policy {
                Policy::RoundRobin => (i % n, 0),
                Policy::LeastWork => {
                    let best = (0..n)
                        .min_by(|&a, &b| engines[a].free_at.total_cmp(&engines[b].free_at))
                        .unwrap_or(0);
                    (best, 0)
                }
                Policy::Scored(_) | Policy::Picks(_) => {
                    let at = Now {
                        i,
                        t,
                        replica: replica_of(i, replicas),
                    };
                    let (pick, work, decision) =
                        self.scored(&mut engines, &scraped, &mut placements, trace, at, policy);
                    match decision {
                        Decision::Prefix => decisions.prefix += 1,
                        Decision::AllSaturated => decisions.all_saturated += 1,
                        _ => decisions.load += 1,
                    }
                    (pick, work)
                }
            };
            let e = &mut engines[pick];
            let start = e.free_at.max(t);
            // Everything queued ahead is cached by the time this starts.
            e.advance(start);
            let matched = e.cache.prefix_len(&r.hash_ids);
            let hit = reusable_tokens(matched, self.trace_block, self.engine_block, r.input_length);
            if self.kv_pressure {
                e.cache.touch_chain(&r.hash_ids[..matched]);
            } else {
                for &id in &r.hash_ids[..matched] {
                    e.cache.touch(id);
                }
            }
            let done = start + self.model.unqueued_ttft_ms(r.input_length, hit);
            let decode = r.output_length.saturating_sub(1) as f64 * self.itl_ms;
            e.free_at = done;
            e.to_cache
                .push_back((done, done + decode, r.hash_ids.clone()));
            e.to_cache_index.push_back(i);
            e.queue.push_back(Queued {
                arrival: t,
                start,
                done,
                work,
                index: i,
                replica: replica_of(i, replicas),
            });
            e.ends.push(Reverse(At(done + decode)));
            per_engine[pick] += 1;
            prompt_all += r.input_length as u64;
            cached_all += hit as u64;
            ttft.push(done - t);
        }
        Outcome {
            hit_rate: if prompt_all == 0 {
                f64::NAN
            } else {
                cached_all as f64 / prompt_all as f64
            },
            ttft: Dist::of(ttft),
            per_engine,
            decisions,
        }
    }

    /// The scored pick of `trace[i]` at time `t` with the engines' last
    /// scraped state, the prefill work it expects there, and why it won.
    /// Under [`Policy::Scored`] an engine's match is the longer of its
    /// cached prefix and the prefix it shares with a pick still in prefill
    /// there, as the indexer counts it (`pending_matched_blocks`); under
    /// [`Policy::Picks`] it is what the engine's pick history holds, which
    /// records each pick at once. The pick is recorded in `placements` as
    /// the indexer records it, and in the picked engine's history, the
    /// trace's full hash ids standing for the prompt's block chain.
    fn scored(
        &self,
        engines: &mut [Engine],
        scraped: &[Scraped],
        placements: &mut [Placements<usize>],
        trace: &[TraceRequest],
        Now { i, t, replica }: Now,
        policy: &Policy,
    ) -> (usize, u64, Decision) {
        let (w, from_history) = match policy {
            Policy::Scored(w) => (w, false),
            Policy::Picks(w) => (w, true),
            _ => unreachable!("scored policies only"),
        };
        let r = &trace[i];
        let full = (r.input_length / self.trace_block.max(1)).min(r.hash_ids.len());
        let chain = &r.hash_ids[..full];
        let placements = &mut placements[replica];
        let starts = placements.starts_conversation(chain);
        let seed = i as u64;
        let block = self.engine_block.max(1);
        let candidates: Vec<Candidate<'_>> = engines
            .iter()
            .zip(scraped)
            .enumerate()
            .map(|(k, (e, &(running, waiting, kv_usage)))| {
                let in_flight = e.ends.len() as u32;
                // Picks within the horizon: their queued work, and the
                // longest prefix one of them shares with this request.
                let (queued, pending) = e
                    .queue
                    .iter()
                    .filter(|q| t - q.arrival < self.prefill_horizon_ms)
                    .fold((0u64, 0usize), |(work, longest), q| {
                        if q.replica != replica && !self.shared_pending {
                            return (work + q.work, longest);
                        }
                        let shared = trace[q.index]
                            .hash_ids
                            .iter()
                            .zip(&r.hash_ids)
                            .take_while(|(a, b)| a == b)
                            .count();
                        (work + q.work, longest.max(shared))
                    });
                let matched_ids = if from_history {
                    e.history[replica].prefix_len(chain)
                } else {
                    e.cache.prefix_len(&r.hash_ids).max(pending)
                };
                let matched_tokens = matched_ids * self.trace_block;
                let kv_full = kv_usage >= KV_FULL;
                Candidate {
                    address: &e.address,
                    matched_blocks: u32::try_from(matched_tokens / block).unwrap_or(u32::MAX),
                    running,
                    waiting,
                    kv_usage,
                    in_flight,
                    queued_prefill_tokens: queued,
                    healthy: true,
                    saturated: kv_full || waiting >= self.saturation_waiting,
                    left_out: kv_full,
                    failing: false,
                    recent_placements: placements.recent(k, t),
                }
            })
            .collect();
        let req = Request {
            prompt_tokens: u32::try_from(r.input_length).unwrap_or(u32::MAX),
            block_size: u32::try_from(block).unwrap_or(u32::MAX),
            seed,
            max_endpoints: 1,
            indexed: true,
            starts_conversation: starts,
        };
        let ranking = kvasir_scoring::rank(&req, &candidates, w);
        let (pick, work) = ranking
            .order
            .first()
            .map_or((0, 0), |f| (f.candidate, f.cost.prefill_work));
        placements.record(pick, chain, starts, t);
        engines[pick].history[replica].touch_chain(chain);
        (pick, work, ranking.decision)
    }
}

/// KV usage at which the indexer leaves an engine out (its
/// `saturation.kvUsage` default).
const KV_FULL: f64 = 0.9;

/// Which request a scored pick is for, when it arrives (ms), and the
/// replica that picks it.
#[derive(Debug, Clone, Copy)]
struct Now {
    i: usize,
    t: f64,
    replica: usize,
}

/// The replica that picks the `i`th request: a fixed scatter, so every
/// policy sees the same split.
fn replica_of(i: usize, replicas: usize) -> usize {
    if replicas <= 1 {
        return 0;
    }
    let h = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
    (h % replicas as u64) as usize
}

#[cfg(test)]
#[path = "cluster_tests.rs"]
mod tests;
