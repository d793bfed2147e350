//! A bounded, sharded LRU from segment text to its ids.
//!
//! A rendered chat is split at special tokens, so each message body is one
//! segment: a shared system prompt or a conversation's earlier turns come
//! back as identical segments request after request. Keeping the text as
//! the key (not just a hash) keeps hits exact.

use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;

use lru::LruCache;
use parking_lot::Mutex;

use crate::bpe::FxBuild;

/// Segments shorter than this are cheaper to encode than to look up.
pub(crate) const MIN_SEGMENT_BYTES: usize = 64;
const SHARDS: usize = 16;
/// Bookkeeping per entry (map slot, list links, the two allocations).
const ENTRY_OVERHEAD: usize = 96;

pub(crate) struct SegmentCache {
    shards: Box<[Mutex<Shard>]>,
    shard_budget: usize,
}

/// Keys are whole message bodies (tens of KB): xxh3 hashes them at memory
/// speed, several times faster than Fx over long inputs.
type KeyHash = xxhash_rust::xxh3::Xxh3DefaultBuilder;

struct Shard {
    map: LruCache<Box<str>, Arc<[u32]>, KeyHash>,
    bytes: usize,
}

fn cost(text: &str, ids: &[u32]) -> usize {
    text.len() + std::mem::size_of_val(ids) + ENTRY_OVERHEAD
}

impl SegmentCache {
    /// A cache that holds at most about `budget_bytes` of keys and ids.
    pub(crate) fn new(budget_bytes: usize) -> Self {
        let shards = (0..SHARDS)
            .map(|_| {
                Mutex::new(Shard {
                    map: LruCache::unbounded_with_hasher(KeyHash::default()),
                    bytes: 0,
                })
            })
            .collect();
        SegmentCache {
            shards,
            shard_budget: budget_bytes / SHARDS,
        }
    }

    /// Picks a shard from the length and the ends of the text: cheap, and
    /// segments that differ only in the middle still spread by length.
    fn shard(&self, text: &str) -> &Mutex<Shard> {
        let b = text.as_bytes();
        let mut h = FxBuild::default().build_hasher();
        h.write_usize(b.len());
        h.write(&b[..b.len().min(32)]);
        h.write(&b[b.len().saturating_sub(32)..]);
        &self.shards[(h.finish() >> 32) as usize % SHARDS]
    }

    pub(crate) fn get(&self, text: &str) -> Option<Arc<[u32]>> {
        self.shard(text).lock().map.get(text).cloned()
    }

    pub(crate) fn insert(&self, text: &str, ids: &[u32]) {
        let c = cost(text, ids);
        if c > self.shard_budget / 4 {
            // One huge segment would flush everything else for little gain.
            return;
        }
        let ids: Arc<[u32]> = ids.into();
        let mut shard = self.shard(text).lock();
        if let Some(old) = shard.map.put(text.into(), ids) {
            shard.bytes -= cost(text, &old);
        }
        shard.bytes += c;
        while shard.bytes > self.shard_budget {
            match shard.map.pop_lru() {
                Some((k, v)) => shard.bytes -= cost(&k, &v),
                None => break,
            }
        }
    }

    #[cfg(test)]
    pub(crate) fn total_bytes(&self) -> usize {
        self.shards.iter().map(|s| s.lock().bytes).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stays_within_budget_and_evicts_oldest() {
        let cache = SegmentCache::new(16 * 4096);
        let ids = vec![7u32; 100];
        for i in 0..2000 {
            let text = format!("{i:>80}");
            cache.insert(&text, &ids);
            assert!(cache.total_bytes() <= 16 * 4096);
        }
        assert!(cache.get(&format!("{:>80}", 1999)).is_some());
        assert!(cache.get(&format!("{:>80}", 0)).is_none());
    }

    #[test]
    fn replacing_an_entry_keeps_the_count_right() {
        let cache = SegmentCache::new(1 << 20);
        let text = "x".repeat(100);
        cache.insert(&text, &[1, 2, 3]);
        cache.insert(&text, &[1, 2, 3]);
        assert_eq!(cache.total_bytes(), cost(&text, &[1, 2, 3]));
        assert_eq!(cache.get(&text).as_deref(), Some(&[1, 2, 3][..]));
    }

    #[test]
    fn oversized_segments_are_not_cached() {
        let cache = SegmentCache::new(16 * 1024);
        let text = "y".repeat(10_000);
        cache.insert(&text, &[1]);
        assert!(cache.get(&text).is_none());
    }
}
