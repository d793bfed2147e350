//! The cache hit rate one pooled cache would get: the yardstick for a
//! router's hit rate on a trace.
//!
//! Replays the trace's block ids in arrival order through a single LRU
//! cache as large as all engines' caches together, with vLLM's rules: a
//! request reuses the longest cached prefix, in whole engine blocks, never
//! its last prompt token; then its blocks are most recently used. It
//! ignores concurrency (blocks of running requests cannot be evicted in
//! vLLM, and a request can only reuse blocks finished before it starts),
//! which makes it a slightly optimistic bound.
//!
//! With a latency model it also gives the trace's *unqueued* mean TTFT:
//! every request alone on an idle engine that holds what the pooled cache
//! would, its uncached prompt prefilled in token-budget chunks: about the
//! lowest mean TTFT a router gets on this cluster, the yardstick a mean-TTFT
//! target is judged against. Not a strict floor: one LRU is not the best
//! cache there is, and a router whose hits fall on the longer prompts
//! saves more than the hit rate says.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};
use vllm_latency::{LatencyProfile, StepWork};

use crate::trace::TraceRequest;

/// The bound and what it was computed from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PooledBound {
    /// Capacity of the pooled cache, tokens.
    pub capacity_tokens: u64,
    /// Prompt tokens of all requests.
    pub prompt_tokens: u64,
    /// Prompt tokens found cached.
    pub cached_tokens: u64,
    /// cached / prompt.
    pub hit_rate: f64,
    /// Mean TTFT, ms, of the requests each alone on an idle engine holding
    /// what the pooled cache holds (absent without a latency model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unqueued_mean_ttft_ms: Option<f64>,
    /// Prompt tokens each request found cached, in trace order (a run's
    /// record ids index it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub per_request_cached: Vec<u64>,
}

/// The engine model the unqueued TTFT is priced with.
#[derive(Debug, Clone)]
pub struct EngineModel {
    /// The simulator's latency profile.
    pub profile: LatencyProfile,
    /// Prompt tokens one step may prefill (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: usize,
}

impl EngineModel {
    /// TTFT, ms, of a lone request on an idle engine: its uncached tokens
    /// in budget-sized chunks, one step each, the first token sampled at the
    /// end of the last one (the simulator's scheduler with nothing else to
    /// run).
    pub fn unqueued_ttft_ms(&self, prompt_tokens: usize, cached_tokens: usize) -> f64 {
        let budget = self.max_num_batched_tokens.max(1);
        let mut done = cached_tokens.min(prompt_tokens.saturating_sub(1));
        let mut total = 0.0;
        while done < prompt_tokens {
            let n = (prompt_tokens - done).min(budget);
            let mut w = StepWork::default();
            w.add_prefill(done as u64, n as u64);
            total += self.profile.step_time(&w).as_secs_f64() * 1e3;
            done += n;
        }
        total
    }
}

/// An LRU set of block ids: one pooled cache.
struct Lru {
    cap: usize,
    clock: u64,
    stamp: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
}

impl Lru {
    fn new(cap: usize) -> Self {
        Lru {
            cap,
            clock: 0,
            stamp: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    /// How many leading `ids` are held: a prompt's cached prefix, in ids.
    fn prefix_len(&self, ids: &[u64]) -> usize {
        ids.iter()
            .take_while(|id| self.stamp.contains_key(id))
            .count()
    }

    fn touch(&mut self, id: u64) {
        self.clock += 1;
        if let Some(old) = self.stamp.insert(id, self.clock) {
            self.order.remove(&old);
        }
        self.order.insert(self.clock, id);
        while self.stamp.len() > self.cap {
            let Some((_, victim)) = self.order.pop_first() else {
                break;
            };
            self.stamp.remove(&victim);
        }
    }
}

/// Prompt tokens a request of `prompt` tokens reuses when its first
/// `matched` trace ids (`trace_block` tokens each) are cached: whole
/// `engine_block`s, never the last prompt token (vLLM always computes it).
fn reusable_tokens(
    matched: usize,
    trace_block: usize,
    engine_block: usize,
    prompt: usize,
) -> usize {
    let block = engine_block.max(1);
    (matched * trace_block).min(prompt.saturating_sub(1)) / block * block
}

/// The pooled-cache hit rate of `trace` with `capacity_tokens` of cache,
/// `trace_block` tokens per trace id and `engine_block` tokens per engine
/// block; with `model`, also the unqueued mean TTFT.
pub fn pooled_hit_rate(
    trace: &[TraceRequest],
    trace_block: usize,
    engine_block: usize,
    capacity_tokens: u64,
    model: Option<&EngineModel>,
) -> PooledBound {
    let cap_ids = (capacity_tokens / trace_block as u64) as usize;
    let mut lru = Lru::new(cap_ids);
    let (mut prompt, mut cached) = (0u64, 0u64);
    let mut ttft_sum = 0.0;
    let mut per_request = Vec::with_capacity(trace.len());
    for r in trace {
        let matched = lru.prefix_len(&r.hash_ids);
        let hit = reusable_tokens(matched, trace_block, engine_block, r.input_length);
        cached += hit as u64;
        per_request.push(hit as u64);
        prompt += r.input_length as u64;
        if let Some(m) = model {
            ttft_sum += m.unqueued_ttft_ms(r.input_length, hit);
        }
        for &id in &r.hash_ids {
            lru.touch(id);
        }
    }
    PooledBound {
        capacity_tokens,
        prompt_tokens: prompt,
        cached_tokens: cached,
        hit_rate: if prompt == 0 {
            f64::NAN
        } else {
            cached as f64 / prompt as f64
        },
        unqueued_mean_ttft_ms: model
            .filter(|_| !trace.is_empty())
            .map(|_| ttft_sum / trace.len() as f64),
        per_request_cached: per_request,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(len: usize, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp: 0.0,
            input_length: len,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn reuses_the_longest_prefix_but_never_the_last_token() {
        let t = vec![
            req(1024, &[1, 2]),
            req(1536, &[1, 2, 3]),
            req(1024, &[1, 2]),
        ];
        let b = pooled_hit_rate(&t, 512, 16, 1 << 20, None);
        // Second: 1024 of 1536. Third: all but the last token, in 16-token
        // blocks: 1008 of 1024.
        assert_eq!(b.cached_tokens, 1024 + 1008);
        assert_eq!(b.per_request_cached, vec![0, 1024, 1008]);
        assert_eq!(b.prompt_tokens, 1024 + 1536 + 1024);
    }

    #[test]
    fn a_prefix_stops_at_the_first_missing_block() {
        let t = vec![req(1536, &[1, 2, 3]), req(1536, &[1, 9, 3])];
        assert_eq!(
            pooled_hit_rate(&t, 512, 16, 1 << 20, None).cached_tokens,
            512
        );
    }

    #[test]
    fn capacity_evicts_least_recently_used_first() {
        // Room for two ids: [1], [2], touch [1], [3] evicts 2, so [2] misses and [1] would hit.
        let t = vec![
            req(512, &[1]),
            req(512, &[2]),
            req(1024, &[1, 4]),
            req(512, &[2]),
        ];
        let b = pooled_hit_rate(&t, 512, 16, 1024, None);
        // Third reuses [1] (512, capped below the last token at 1024 -> 512);
        // inserting 1 and 4 evicts 2, so the fourth misses.
        assert_eq!(b.cached_tokens, 512);
    }

    fn h100() -> EngineModel {
        EngineModel {
            profile: LatencyProfile::h100_8b(),
            max_num_batched_tokens: 8192,
        }
    }

    #[test]
    fn unqueued_ttft_is_one_step_per_budget_chunk() {
        let m = h100();
        let one = |ctx: u64, n: u64| {
            let mut w = StepWork::default();
            w.add_prefill(ctx, n);
            m.profile.step_time(&w).as_secs_f64() * 1e3
        };
        // 100 tokens: one ~33 ms step (FACTS.md: ~30 ms + 0.03 ms a token).
        let short = m.unqueued_ttft_ms(100, 0);
        assert!((short - one(0, 100)).abs() < 1e-9 && (32.0..35.0).contains(&short));
        // 20000 tokens: chunks of 8192, 8192, 3616, each attending to the ones before.
        let long = m.unqueued_ttft_ms(20_000, 0);
        let chunks = one(0, 8192) + one(8192, 8192) + one(16384, 3616);
        assert!((long - chunks).abs() < 1e-9, "{long} vs {chunks}");
        // A cached prefix leaves only the suffix, but a fully cached prompt
        // still computes its last token.
        assert!((m.unqueued_ttft_ms(20_000, 16_384) - one(16384, 3616)).abs() < 1e-9);
        assert!((m.unqueued_ttft_ms(1024, 1024) - one(1023, 1)).abs() < 1e-9);
    }

    #[test]
    fn the_bound_prices_each_request_with_what_the_pooled_cache_holds() {
        let t = vec![req(1024, &[1, 2]), req(1536, &[1, 2, 3])];
        let m = h100();
        let b = pooled_hit_rate(&t, 512, 16, 1 << 20, Some(&m));
        let want = (m.unqueued_ttft_ms(1024, 0) + m.unqueued_ttft_ms(1536, 1024)) / 2.0;
        assert!((b.unqueued_mean_ttft_ms.unwrap() - want).abs() < 1e-9);
        assert_eq!(
            pooled_hit_rate(&t, 512, 16, 1 << 20, None).unqueued_mean_ttft_ms,
            None
        );
    }
}
