//! The paged KV-cache block pool with vLLM's prefix-caching semantics.
//!
//! Every block is either in use (reference count > 0, held by running
//! requests) or free. Free blocks sit in one queue, least recently used at
//! the head; a free block may still carry a cached hash and be revived by a
//! later request with the same prefix. Allocation takes the head of the free
//! queue and, if that block was cached, evicts it. As in vLLM, a finished
//! request returns its blocks tail-first, so a sequence's last blocks are
//! evicted before its prefix.

use crate::hashing::BlockHash;
use std::collections::HashMap;

/// Index of a physical block.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    ref_cnt: u32,
    hash: Option<BlockHash>,
    prev: u32,
    next: u32,
    in_free: bool,
}

/// What the pool did that the outside world (KV events) must hear about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolChange {
    /// A cached block was evicted to make room.
    Evicted(BlockHash),
}

/// The block pool; see the module docs.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    cached: HashMap<BlockHash, BlockId>,
    head: u32,
    tail: u32,
    free_count: usize,
}

impl BlockPool {
    /// A pool of `num_blocks` free, uncached blocks.
    pub fn new(num_blocks: usize) -> Self {
        let n = num_blocks as u32;
        let blocks = (0..n)
            .map(|i| Block {
                ref_cnt: 0,
                hash: None,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == n { NIL } else { i + 1 },
                in_free: true,
            })
            .collect();
        BlockPool {
            blocks,
            cached: HashMap::with_capacity(num_blocks),
            head: if n == 0 { NIL } else { 0 },
            tail: if n == 0 { NIL } else { n - 1 },
            free_count: num_blocks,
        }
    }

    /// Total number of blocks.
    pub fn capacity(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks with no running request (including cached, evictable ones).
    pub fn free_blocks(&self) -> usize {
        self.free_count
    }

    /// Blocks that currently hold a cached hash.
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// vLLM's `kv_cache_usage_perc`: the fraction of blocks in use.
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.free_count as f64 / self.blocks.len() as f64
    }

    /// The block holding `hash`, if cached.
    pub fn lookup(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Longest run of `hashes` (a prefix chain) that is cached.
    pub fn longest_cached_prefix(&self, hashes: &[BlockHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Takes a reference on a cached block (reviving it from the free queue).
    pub fn touch(&mut self, id: BlockId) {
        let b = &self.blocks[id as usize];
        if b.in_free {
            self.unlink(id);
        }
        self.blocks[id as usize].ref_cnt += 1;
    }

    /// Allocates a fresh block for new tokens, evicting the least recently
    /// used free block if it was cached. None when no block is free.
    pub fn allocate(&mut self, changes: &mut Vec<PoolChange>) -> Option<BlockId> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.unlink(id);
        let b = &mut self.blocks[id as usize];
        b.ref_cnt = 1;
        if let Some(h) = b.hash.take() {
            self.cached.remove(&h);
            changes.push(PoolChange::Evicted(h));
        }
        Some(id)
    }

    /// Marks a full block as cached under `hash`. Returns false (and leaves
    /// the block uncached) when another block already caches that hash,
    /// which happens when two requests computed the same prefix concurrently.
    pub fn cache(&mut self, id: BlockId, hash: BlockHash) -> bool {
        if self.cached.contains_key(&hash) || self.blocks[id as usize].hash.is_some() {
            return false;
        }
        self.cached.insert(hash, id);
        self.blocks[id as usize].hash = Some(hash);
        true
    }

    /// Releases one request's blocks, given in sequence order. They enter
    /// the free queue tail-first so that prefixes outlive their suffixes.
    pub fn release(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let b = &mut self.blocks[id as usize];
            debug_assert!(b.ref_cnt > 0, "double free of block {id}");
            b.ref_cnt = b.ref_cnt.saturating_sub(1);
            if b.ref_cnt == 0 {
                self.push_tail(id);
            }
        }
    }

    /// Drops every cached hash (vLLM's `reset_prefix_cache`). Only allowed
    /// while no block is in use, as in vLLM; returns false otherwise.
    pub fn reset(&mut self) -> bool {
        if self.free_count != self.blocks.len() {
            return false;
        }
        for b in &mut self.blocks {
            b.hash = None;
        }
        self.cached.clear();
        true
    }

    /// Reference count of a block (for tests and invariants).
    pub fn ref_count(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_cnt
    }

    /// Cached hashes in eviction order (head first), for tests.
    pub fn eviction_order(&self) -> Vec<BlockHash> {
        let mut out = Vec::new();
        let mut cur = self.head;
        while cur != NIL {
            if let Some(h) = self.blocks[cur as usize].hash {
                out.push(h);
            }
            cur = self.blocks[cur as usize].next;
        }
        out
    }

    fn unlink(&mut self, id: BlockId) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            (b.prev, b.next)
        };
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        b.in_free = false;
        self.free_count -= 1;
    }

    fn push_tail(&mut self, id: BlockId) {
        let tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = tail;
            b.next = NIL;
            b.in_free = true;
        }
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.free_count += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u64) -> BlockHash {
        BlockHash(x)
    }

    #[test]
    fn allocate_until_full_then_none() {
        let mut p = BlockPool::new(3);
        let mut ch = Vec::new();
        assert!(p.allocate(&mut ch).is_some());
        assert!(p.allocate(&mut ch).is_some());
        assert!(p.allocate(&mut ch).is_some());
        assert_eq!(p.allocate(&mut ch), None);
        assert_eq!(p.free_blocks(), 0);
        assert!((p.usage() - 1.0).abs() < 1e-9);
        assert!(ch.is_empty());
    }

    #[test]
    fn reference_counts_keep_shared_blocks_alive() {
        let mut p = BlockPool::new(2);
        let mut ch = Vec::new();
        let a = p.allocate(&mut ch).unwrap();
        assert!(p.cache(a, h(1)));
        // A second request reuses the cached block.
        p.touch(a);
        assert_eq!(p.ref_count(a), 2);
        p.release(&[a]);
        assert_eq!(p.ref_count(a), 1);
        assert_eq!(p.free_blocks(), 1, "still held by one request");
        // Allocations must not steal a referenced block.
        let b = p.allocate(&mut ch).unwrap();
        assert_ne!(a, b);
        assert_eq!(p.allocate(&mut ch), None);
        p.release(&[a]);
        assert_eq!(p.ref_count(a), 0);
        assert_eq!(p.lookup(h(1)), Some(a), "free blocks stay cached");
    }

    #[test]
    fn eviction_is_lru_over_free_blocks_only_tail_first() {
        let mut p = BlockPool::new(4);
        let mut ch = Vec::new();
        // Request 1 holds blocks hashed 10, 11; request 2 holds 20, 21.
        let r1: Vec<_> = (0..2).map(|_| p.allocate(&mut ch).unwrap()).collect();
        let r2: Vec<_> = (0..2).map(|_| p.allocate(&mut ch).unwrap()).collect();
        p.cache(r1[0], h(10));
        p.cache(r1[1], h(11));
        p.cache(r2[0], h(20));
        p.cache(r2[1], h(21));
        p.release(&r1); // enters as 11, 10
        p.release(&r2); // then 21, 20
        assert_eq!(p.eviction_order(), vec![h(11), h(10), h(21), h(20)]);
        // Reviving 10 removes it from the queue; it is not evictable.
        p.touch(r1[0]);
        let mut ch = Vec::new();
        p.allocate(&mut ch).unwrap();
        p.allocate(&mut ch).unwrap();
        assert_eq!(
            ch,
            vec![PoolChange::Evicted(h(11)), PoolChange::Evicted(h(21))]
        );
        assert_eq!(p.lookup(h(10)), Some(r1[0]));
        assert_eq!(p.lookup(h(11)), None);
        // Releasing 10 again makes it most recently used.
        p.release(&[r1[0]]);
        assert_eq!(p.eviction_order(), vec![h(20), h(10)]);
    }

    #[test]
    fn duplicate_hash_is_not_cached_twice() {
        let mut p = BlockPool::new(2);
        let mut ch = Vec::new();
        let a = p.allocate(&mut ch).unwrap();
        let b = p.allocate(&mut ch).unwrap();
        assert!(p.cache(a, h(5)));
        assert!(!p.cache(b, h(5)));
        assert_eq!(p.cached_blocks(), 1);
    }

    #[test]
    fn reset_only_when_idle() {
        let mut p = BlockPool::new(2);
        let mut ch = Vec::new();
        let a = p.allocate(&mut ch).unwrap();
        p.cache(a, h(1));
        assert!(!p.reset());
        p.release(&[a]);
        assert!(p.reset());
        assert_eq!(p.cached_blocks(), 0);
        assert_eq!(p.lookup(h(1)), None);
    }
}
