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
//! What it leaves out: prefills batched into shared steps and decode steps
//! between them (the queues serve one prefill at a time), and KV pressure
//! (the caches evict by LRU alone, never pinned, never full). Its `waiting`
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
use kvasir_scoring::{Candidate, Request, Weights};

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
    /// The cache-indexer's ranking with these weights.
    Scored(Box<Weights>),
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
}

struct Engine {
    address: String,
    cache: Lru,
    /// Prompts whose prefill ends at the time given, then cached; in FCFS
    /// order, which is also time order.
    to_cache: VecDeque<(f64, Vec<u64>)>,
    /// Requests not yet past their first token, FCFS.
    queue: VecDeque<Queued>,
    /// When the queue's last prefill ends.
    free_at: f64,
    /// When each request still running ends.
    ends: BinaryHeap<Reverse<At>>,
    /// The last scrape: (scrape period it was taken in, running, waiting).
    scraped: (i64, u32, u32),
}

impl Engine {
    /// Brings the engine to time `t`: finished prefills cached, finished
    /// requests gone.
    fn advance(&mut self, t: f64) {
        while self.to_cache.front().is_some_and(|(d, _)| *d <= t) {
            if let Some((_, ids)) = self.to_cache.pop_front() {
                for id in ids {
                    self.cache.touch(id);
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

    /// (running, waiting) as the last scrape saw them, scraping anew when a
    /// period has passed since.
    fn scrape(&mut self, t: f64, every_ms: f64) -> (u32, u32) {
        if every_ms <= 0.0 {
            return self.counts(t);
        }
        let period = (t / every_ms).floor() as i64;
        if period != self.scraped.0 {
            let (r, w) = self.counts(t);
            self.scraped = (period, r, w);
        }
        (self.scraped.1, self.scraped.2)
    }
}

impl Cluster {
    /// Replays `trace` at `speed` (2 = arrivals twice as fast) under `policy`.
    pub fn replay(&self, trace: &[TraceRequest], speed: f64, policy: &Policy) -> Outcome {
        let n = self.engines.max(1);
        let cap_ids = (self.cache_tokens / self.trace_block.max(1) as u64) as usize;
        let mut engines: Vec<Engine> = (0..n)
            .map(|i| Engine {
                address: format!("10.0.0.{i}:8000"),
                cache: Lru::new(cap_ids),
                to_cache: VecDeque::new(),
                queue: VecDeque::new(),
                free_at: f64::NEG_INFINITY,
                ends: BinaryHeap::new(),
                scraped: (i64::MIN, 0, 0),
            })
            .collect();
        let t0 = trace.first().map_or(0.0, |r| r.timestamp);
        let (mut prompt_all, mut cached_all) = (0u64, 0u64);
        let mut ttft = Vec::with_capacity(trace.len());
        let mut per_engine = vec![0; n];
        let half_life = match policy {
            Policy::Scored(w) => w.placement_half_life_ms,
            _ => 0.0,
        };
        let mut placements = Placements::new(half_life, DEFAULT_MAX_ENDS);
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
                Policy::Scored(w) => {
                    let at = Now { i, t };
                    self.scored(&engines, &scraped, &mut placements, trace, at, w)
                }
            };
            let e = &mut engines[pick];
            let start = e.free_at.max(t);
            // Everything queued ahead is cached by the time this starts.
            e.advance(start);
            let matched = e.cache.prefix_len(&r.hash_ids);
            let hit = reusable_tokens(matched, self.trace_block, self.engine_block, r.input_length);
            for &id in &r.hash_ids[..matched] {
                e.cache.touch(id);
            }
            let done = start + self.model.unqueued_ttft_ms(r.input_length, hit);
            e.free_at = done;
            e.to_cache.push_back((done, r.hash_ids.clone()));
            e.queue.push_back(Queued {
                arrival: t,
                start,
                done,
                work,
                index: i,
            });
            let decode = r.output_length.saturating_sub(1) as f64 * self.itl_ms;
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
        }
    }

    /// The scored pick of `trace[i]` at time `t` with the engines' last
    /// scraped (running, waiting), and the prefill work it expects there.
    /// An engine's match is the longer of its cached prefix and the prefix
    /// it shares with a pick still in prefill there, as the indexer counts
    /// it (`pending_matched_blocks`). The pick is recorded in `placements`
    /// as the indexer records it, the trace's full hash ids standing for the
    /// prompt's block chain.
    fn scored(
        &self,
        engines: &[Engine],
        scraped: &[(u32, u32)],
        placements: &mut Placements<usize>,
        trace: &[TraceRequest],
        Now { i, t }: Now,
        w: &Weights,
    ) -> (usize, u64) {
        let r = &trace[i];
        let full = (r.input_length / self.trace_block.max(1)).min(r.hash_ids.len());
        let chain = &r.hash_ids[..full];
        let starts = placements.starts_conversation(chain);
        let seed = i as u64;
        let block = self.engine_block.max(1);
        let candidates: Vec<Candidate<'_>> = engines
            .iter()
            .zip(scraped)
            .enumerate()
            .map(|(k, (e, &(running, waiting)))| {
                let in_flight = e.ends.len() as u32;
                // Picks within the horizon: their queued work, and the
                // longest prefix one of them shares with this request.
                let (queued, pending) = e
                    .queue
                    .iter()
                    .filter(|q| t - q.arrival < self.prefill_horizon_ms)
                    .fold((0u64, 0usize), |(work, longest), q| {
                        let shared = trace[q.index]
                            .hash_ids
                            .iter()
                            .zip(&r.hash_ids)
                            .take_while(|(a, b)| a == b)
                            .count();
                        (work + q.work, longest.max(shared))
                    });
                let matched_tokens =
                    e.cache.prefix_len(&r.hash_ids).max(pending) * self.trace_block;
                Candidate {
                    address: &e.address,
                    matched_blocks: u32::try_from(matched_tokens / block).unwrap_or(u32::MAX),
                    running,
                    waiting,
                    kv_usage: 0.0,
                    in_flight,
                    queued_prefill_tokens: queued,
                    healthy: true,
                    saturated: waiting >= self.saturation_waiting,
                    left_out: false,
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
        (pick, work)
    }
}

/// Which request a scored pick is for, and when it arrives (ms).
#[derive(Debug, Clone, Copy)]
struct Now {
    i: usize,
    t: f64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use vllm_latency::LatencyProfile;

    fn cluster(engines: usize) -> Cluster {
        Cluster {
            engines,
            cache_tokens: 1 << 20,
            trace_block: 512,
            engine_block: 16,
            model: EngineModel {
                profile: LatencyProfile::h100_8b(),
                max_num_batched_tokens: 8192,
            },
            itl_ms: 10.0,
            saturation_waiting: 5,
            prefill_horizon_ms: 30_000.0,
            scrape_ms: 250.0,
        }
    }

    fn req(at_ms: f64, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp: at_ms,
            input_length: ids.len() * 512,
            output_length: 10,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn the_scored_policy_follows_the_prefix_and_round_robin_does_not() {
        let c = cluster(4);
        // The same 8k-token prefix four times, far apart: only the first
        // has to prefill it under the scored policy.
        let ids: Vec<u64> = (0..16).collect();
        let trace: Vec<TraceRequest> = (0..4).map(|i| req(i as f64 * 10_000.0, &ids)).collect();
        let scored = c.replay(&trace, 1.0, &Policy::Scored(Box::default()));
        assert_eq!(scored.per_engine.iter().filter(|&&k| k > 0).count(), 1);
        // Three of four reuse all but the last block.
        let want = 3.0 * (8192.0 - 16.0) / (4.0 * 8192.0);
        assert!((scored.hit_rate - want).abs() < 1e-9, "{}", scored.hit_rate);
        let rr = c.replay(&trace, 1.0, &Policy::RoundRobin);
        assert_eq!(rr.per_engine, vec![1, 1, 1, 1]);
        assert_eq!(rr.hit_rate, 0.0);
        assert!(scored.ttft.mean < rr.ttft.mean);
    }

    #[test]
    fn a_prefix_is_reusable_only_once_its_prefill_is_done() {
        let c = cluster(1);
        let ids: Vec<u64> = (0..16).collect();
        // The second arrives while the first is still prefilling: on the
        // one engine it waits for it, and then finds the prefix cached.
        let trace = vec![req(0.0, &ids), req(1.0, &ids)];
        let o = c.replay(&trace, 1.0, &Policy::LeastWork);
        assert!(o.hit_rate > 0.49, "{}", o.hit_rate);
        let first = c.model.unqueued_ttft_ms(8192, 0);
        let second = first - 1.0 + c.model.unqueued_ttft_ms(8192, 8176);
        assert!((o.ttft.mean - (first + second) / 2.0).abs() < 1e-9);
    }

    #[test]
    fn least_work_spreads_a_burst_and_speed_compresses_arrivals() {
        let c = cluster(2);
        let trace: Vec<TraceRequest> = (0..4).map(|i| req(i as f64, &[100 + i])).collect();
        let o = c.replay(&trace, 1.0, &Policy::LeastWork);
        assert_eq!(o.per_engine, vec![2, 2]);
        // Ten times apart and ten times as fast: the same replay.
        let wide: Vec<TraceRequest> = (0..4).map(|i| req(i as f64 * 10.0, &[100 + i])).collect();
        assert_eq!(c.replay(&wide, 10.0, &Policy::LeastWork), o);
    }
}
