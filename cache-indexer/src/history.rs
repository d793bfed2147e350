//! The pick history: which prompt prefixes this replica sent to which
//! endpoint, as a stand-in for the engines' KV events.
//!
//! This is the Gateway API Inference Extension's approximate prefix-cache
//! scorer: hash each prompt in blocks (chained, so equal ids mean equal
//! prefixes: [`crate::load::prefix::block_chain`]), remember per server the blocks
//! of the requests it was sent in an LRU of a fixed capacity, and score a
//! new request by the longest prefix each server holds. It is a guess: it
//! knows neither what the engine evicted nor what other routers sent there.
//!
//! Two choices differ from a plain "add every block in order":
//!
//! * [`PickHistory::record`] refreshes a chain from its last block to its
//!   first, so the first block is the most recently used and an endpoint's
//!   LRU drops suffixes before the prefixes they extend (vLLM frees a
//!   finished request's blocks tail first for the same reason). A chain
//!   longer than the capacity keeps its leading blocks.
//! * [`PickHistory::overlap`] counts, per endpoint, the blocks it holds
//!   consecutively from the start of the chain and stops at its first gap:
//!   an engine cannot reuse a block whose prefix it lacks.
//!
//! Pure and single-threaded (`&mut self` to change it); the pool wraps it in
//! a lock.

use lru::LruCache;
use rustc_hash::{FxBuildHasher, FxHashMap};

use crate::index::Overlap;
use crate::types::EndpointId;

/// Default capacity of one endpoint's history, in blocks: about an 80 GB
/// H100's KV capacity for an 8B model (FACTS.md), vllm-sim's default
/// `--num-gpu-blocks`.
pub const DEFAULT_PICK_HISTORY_BLOCKS: usize = 25_000;

/// Chain hashes are xxh3 digests already: Fx is plenty to spread them.
type Blocks = LruCache<u64, (), FxBuildHasher>;

/// Per endpoint, an LRU of the prompt block chain hashes it was sent.
pub struct PickHistory {
    capacity_blocks: usize,
    endpoints: FxHashMap<EndpointId, Blocks>,
}

impl std::fmt::Debug for PickHistory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PickHistory")
            .field("capacity_blocks", &self.capacity_blocks)
            .field("endpoints", &self.endpoints.len())
            .field("blocks", &self.total_blocks())
            .finish()
    }
}

impl Default for PickHistory {
    fn default() -> Self {
        PickHistory::new(DEFAULT_PICK_HISTORY_BLOCKS)
    }
}

impl PickHistory {
    /// An empty history holding at most `capacity_blocks` blocks per
    /// endpoint (at least 1).
    pub fn new(capacity_blocks: usize) -> Self {
        PickHistory {
            capacity_blocks: capacity_blocks.max(1),
            endpoints: FxHashMap::default(),
        }
    }

    /// Blocks one endpoint may hold.
    pub fn capacity_blocks(&self) -> usize {
        self.capacity_blocks
    }

    /// Records that `endpoint` was sent a request whose prompt has these
    /// full-block chain hashes: inserts the new blocks, refreshes the known
    /// ones (the chain's first block ends up most recent), then evicts the
    /// endpoint's least recently used blocks beyond the capacity.
    pub fn record(&mut self, endpoint: EndpointId, chain: &[u64]) {
        if chain.is_empty() {
            return;
        }
        let cap = self.capacity_blocks;
        let blocks = self.endpoints.entry(endpoint).or_insert_with(|| {
            // Unbounded (lazily allocated) and trimmed by hand: `new(cap)`
            // would allocate the whole capacity for every endpoint up front.
            LruCache::unbounded_with_hasher(FxBuildHasher)
        });
        for h in chain.iter().rev() {
            blocks.put(*h, ());
        }
        while blocks.len() > cap {
            blocks.pop_lru();
        }
    }

    /// For each endpoint, the leading blocks of `chain` it holds
    /// consecutively from the start (endpoints matching nothing are absent).
    /// Does not refresh anything: only [`PickHistory::record`] does.
    pub fn overlap(&self, chain: &[u64]) -> Overlap {
        let mut out = Overlap {
            request_blocks: chain.len(),
            matched: Default::default(),
        };
        let Some(first) = chain.first() else {
            return out;
        };
        for (id, blocks) in &self.endpoints {
            if !blocks.contains(first) {
                continue;
            }
            let n = 1 + chain[1..]
                .iter()
                .take_while(|h| blocks.contains(*h))
                .count();
            out.matched.insert(*id, n);
        }
        out
    }

    /// Forgets an endpoint (it left the pool).
    pub fn remove_endpoint(&mut self, endpoint: EndpointId) {
        self.endpoints.remove(&endpoint);
    }

    /// Empties an endpoint's history (it went away and may come back with an
    /// empty cache).
    pub fn clear_endpoint(&mut self, endpoint: EndpointId) {
        if let Some(b) = self.endpoints.get_mut(&endpoint) {
            b.clear();
        }
    }

    /// Blocks held for an endpoint.
    pub fn blocks(&self, endpoint: EndpointId) -> usize {
        self.endpoints.get(&endpoint).map_or(0, LruCache::len)
    }

    /// Blocks held for all endpoints.
    pub fn total_blocks(&self) -> usize {
        self.endpoints.values().map(LruCache::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::prefix::block_chain;

    const A: EndpointId = EndpointId(1);
    const B: EndpointId = EndpointId(2);

    fn chain(tokens: &[u32]) -> Vec<u64> {
        block_chain(tokens, 4)
    }

    fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
        range.collect()
    }

    #[test]
    fn overlap_counts_leading_blocks_per_endpoint() {
        let mut h = PickHistory::new(100);
        let long = chain(&toks(0..40)); // 10 blocks
        h.record(A, &long[..4]);
        h.record(B, &long);
        let o = h.overlap(&long);
        assert_eq!(o.request_blocks, 10);
        assert_eq!(o.blocks_for(A), 4);
        assert_eq!(o.blocks_for(B), 10);
        // A different first block matches nothing, even with equal tokens
        // later (chain hashes: a block's id depends on its whole prefix).
        let mut other = toks(0..40);
        other[0] = 999;
        let o = h.overlap(&chain(&other));
        assert!(o.matched.is_empty(), "{o:?}");
        assert_eq!(h.overlap(&[]).request_blocks, 0);
    }

    #[test]
    fn overlap_stops_at_the_first_gap() {
        let mut h = PickHistory::new(100);
        let c = chain(&toks(0..40));
        // Holds blocks 0, 1, 2 and 4..10 but not 3.
        h.record(A, &c[..3]);
        h.record(A, &c[4..]);
        assert_eq!(h.blocks(A), 9);
        assert_eq!(h.overlap(&c).blocks_for(A), 3);
        // Missing the first block: nothing.
        h.record(B, &c[1..]);
        assert_eq!(h.overlap(&c).blocks_for(B), 0);
    }

    #[test]
    fn capacity_is_respected_and_evicts_least_recent_first() {
        let mut h = PickHistory::new(8);
        let old = chain(&toks(0..16)); // 4 blocks
        let mid = chain(&toks(100..116));
        let new = chain(&toks(200..216));
        h.record(A, &old);
        h.record(A, &mid);
        assert_eq!(h.blocks(A), 8);
        h.record(A, &new);
        assert_eq!(h.blocks(A), 8, "capacity respected");
        assert_eq!(h.overlap(&old).blocks_for(A), 0, "oldest evicted");
        assert_eq!(h.overlap(&mid).blocks_for(A), 4);
        assert_eq!(h.overlap(&new).blocks_for(A), 4);
        // Capacity is per endpoint.
        h.record(B, &old);
        assert_eq!(h.blocks(A), 8);
        assert_eq!(h.blocks(B), 4);
        assert_eq!(h.total_blocks(), 12);
    }

    #[test]
    fn eviction_drops_suffixes_before_prefixes() {
        let mut h = PickHistory::new(6);
        let c = chain(&toks(0..16)); // 4 blocks
        h.record(A, &c);
        h.record(A, &chain(&toks(100..108))); // 2 blocks: full
        h.record(A, &chain(&toks(200..204))); // 1 more: one of c's goes
        assert_eq!(h.blocks(A), 6);
        // The evicted block is c's last, so c still matches 3 from the start.
        assert_eq!(h.overlap(&c).blocks_for(A), 3);
        // A chain longer than the capacity keeps its leading blocks.
        let mut small = PickHistory::new(3);
        small.record(A, &c);
        assert_eq!(small.blocks(A), 3);
        assert_eq!(small.overlap(&c).blocks_for(A), 3);
    }

    #[test]
    fn re_recording_refreshes() {
        let mut h = PickHistory::new(8);
        let old = chain(&toks(0..16));
        let mid = chain(&toks(100..116));
        h.record(A, &old);
        h.record(A, &mid);
        // Sent `old` again: now `mid` is the least recent.
        h.record(A, &old);
        assert_eq!(h.blocks(A), 8, "refreshing adds nothing");
        h.record(A, &chain(&toks(200..216)));
        assert_eq!(h.overlap(&old).blocks_for(A), 4, "refreshed survives");
        assert_eq!(h.overlap(&mid).blocks_for(A), 0, "least recent evicted");
        // A shared prefix is refreshed by every request that carries it.
        let mut h = PickHistory::new(6);
        let sys = toks(0..8); // 2 blocks
        let conv = |n: u32| {
            let mut t = sys.clone();
            t.extend(1000 * n..1000 * n + 8);
            chain(&t)
        };
        h.record(A, &conv(1));
        h.record(A, &conv(2));
        h.record(A, &conv(3)); // 8 distinct blocks > 6: conv(1)'s tail goes
        assert_eq!(h.blocks(A), 6);
        assert_eq!(h.overlap(&conv(1)).blocks_for(A), 2, "system prompt kept");
        assert_eq!(h.overlap(&conv(3)).blocks_for(A), 4);
    }

    #[test]
    fn removal_and_clearing() {
        let mut h = PickHistory::new(100);
        let c = chain(&toks(0..16));
        h.record(A, &c);
        h.record(B, &c);
        h.clear_endpoint(A);
        assert_eq!(h.blocks(A), 0);
        assert_eq!(h.overlap(&c).blocks_for(A), 0);
        assert_eq!(h.overlap(&c).blocks_for(B), 4);
        h.record(A, &c);
        assert_eq!(h.blocks(A), 4, "a cleared endpoint records again");
        h.remove_endpoint(B);
        assert_eq!(h.blocks(B), 0);
        assert_eq!(h.overlap(&c).matched.len(), 1);
        h.remove_endpoint(EndpointId(99)); // unknown: no-op
        h.clear_endpoint(EndpointId(99));
        h.record(A, &[]);
        assert_eq!(h.blocks(A), 4);
    }
}
