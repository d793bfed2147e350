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

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

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
}

/// An LRU set of block ids.
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

    fn contains(&self, id: u64) -> bool {
        self.stamp.contains_key(&id)
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

/// The pooled-cache hit rate of `trace` with `capacity_tokens` of cache,
/// `trace_block` tokens per trace id and `engine_block` tokens per engine
/// block.
pub fn pooled_hit_rate(
    trace: &[TraceRequest],
    trace_block: usize,
    engine_block: usize,
    capacity_tokens: u64,
) -> PooledBound {
    let cap_ids = (capacity_tokens / trace_block as u64) as usize;
    let mut lru = Lru::new(cap_ids);
    let (mut prompt, mut cached) = (0u64, 0u64);
    for r in trace {
        let matched = r
            .hash_ids
            .iter()
            .take_while(|id| lru.contains(**id))
            .count();
        let reusable = (matched * trace_block).min(r.input_length.saturating_sub(1));
        cached += (reusable / engine_block * engine_block) as u64;
        prompt += r.input_length as u64;
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
        let b = pooled_hit_rate(&t, 512, 16, 1 << 20);
        // Second: 1024 of 1536. Third: all but the last token, in 16-token
        // blocks: 1008 of 1024.
        assert_eq!(b.cached_tokens, 1024 + 1008);
        assert_eq!(b.prompt_tokens, 1024 + 1536 + 1024);
    }

    #[test]
    fn a_prefix_stops_at_the_first_missing_block() {
        let t = vec![req(1536, &[1, 2, 3]), req(1536, &[1, 9, 3])];
        assert_eq!(pooled_hit_rate(&t, 512, 16, 1 << 20).cached_tokens, 512);
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
        let b = pooled_hit_rate(&t, 512, 16, 1024);
        // Third reuses [1] (512, capped below the last token at 1024 -> 512);
        // inserting 1 and 4 evicts 2, so the fourth misses.
        assert_eq!(b.cached_tokens, 512);
    }
}
