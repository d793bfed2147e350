//! The pool's prefix index: which endpoint holds which KV blocks, built on
//! `dynamo-kv-router`'s concurrent compressed radix tree.
//!
//! # Public API (contract for the service)
//!
//! ```text
//! PoolIndex::new(block_size) -> PoolIndex            // Send + Sync, one per pool
//! PoolIndex::block_size(&self) -> u32
//! PoolIndex::apply(&self, EndpointId, &DecodedBatch) -> ApplyOutcome
//! PoolIndex::clear_endpoint(&self, EndpointId)       // AllBlocksCleared / resync / engine restart
//! PoolIndex::remove_endpoint(&self, EndpointId)      // endpoint went away: forget it entirely
//! PoolIndex::overlap(&self, &[u32]) -> Overlap       // request token ids -> matched blocks per endpoint
//! PoolIndex::overlap_for(&self, &[u32], Option<&str>) -> Overlap   // same, under a LoRA adapter
//! PoolIndex::blocks(&self, EndpointId) -> usize
//! PoolIndex::total_blocks(&self) -> usize
//! PoolIndex::endpoints(&self) -> Vec<EndpointId>
//! PoolIndex::flush(&self).await / flush_blocking(&self)  // wait until applied events are visible
//! Overlap { request_blocks, matched: HashMap<EndpointId, usize> }
//! ApplyOutcome { stored, removed, cleared, skipped_events }
//! ```
//!
//! # How it works and why
//!
//! * **Hashing.** vLLM's own block hashes are seeded SHA-256 we cannot (and
//!   need not) reproduce. Each `BlockStored` carries the blocks' token ids, so
//!   the index re-hashes them per block with dynamo's request hashing
//!   ([`compute_block_hash_for_seq`]: xxh3-64, seed 1337, LoRA name mixed into
//!   the seed). A request is hashed the same way in [`PoolIndex::overlap`], so
//!   both sides agree. 32-byte engine hashes are folded to 64 bits
//!   ([`EngineHash::key`]).
//! * **External hashes are content-derived.** The tree is not given the
//!   engine's hashes: vLLM seeds them per process, so two engines holding the
//!   same prefix publish different hashes for it, and dynamo 1.6.1's
//!   compressed tree then under-matches the endpoint with the longer chain
//!   (it matched only the shared system prompt of a conversation's home
//!   endpoint). Instead each block's external hash is its chained sequence
//!   hash ([`compute_next_seq_hash`] over the local hashes from the root),
//!   identical on every endpoint for the same prefix; per endpoint the index
//!   maps engine hash -> chain hash for parent links and removals.
//! * **Tree.** `ConcurrentRadixTreeCompressed` is `Send + Sync` and answers
//!   `find_matches` from any thread without locks on the read path, but its
//!   mutations run only inside its worker loop (its `apply_event` is private),
//!   so the index wraps it in dynamo's own `ThreadPoolIndexer` with one writer
//!   thread. [`PoolIndex::apply`] therefore does the expensive part (token
//!   re-hashing, bookkeeping) on the caller's thread and *enqueues* the tree
//!   mutation; it becomes visible to `overlap` a few microseconds later, in
//!   order. Call [`PoolIndex::flush`] when a caller must see its own writes
//!   (tests, the end of a resync).
//! * **Bookkeeping.** Next to the tree the index keeps, per endpoint and DP
//!   rank, the set of engine hashes it holds. That makes `blocks()` exact and
//!   cheap (for `/metrics`), drops duplicate stores and removals of unknown
//!   blocks before they reach the tree (the tree logs a warning for each),
//!   and lets a store whose parent the index never saw be skipped instead of
//!   silently failing inside the tree (it means lost events: the subscriber
//!   resyncs on gaps).
//! * **Scope.** Only GPU blocks are indexed (`medium` absent or `"GPU"`):
//!   CPU/disk offload tiers are not a prefix hit on the engine's GPU. Events
//!   whose `block_size` differs from the pool's are skipped (they cannot be
//!   hashed comparably) and counted, as are hybrid models' non-full-attention
//!   groups (`kv_cache_spec_kind` such as `sliding_window`).
//! * **Data-parallel ranks.** Each rank is its own dynamo worker
//!   `(endpoint, dp_rank)`; `overlap` reports the best rank per endpoint
//!   because the endpoint's HTTP server balances across its ranks.
//! * **Concurrency.** Readers (`overlap`, `blocks`, `endpoints`) never wait
//!   on writers of the tree; `apply` for one endpoint holds that endpoint's
//!   mutex only (writers for different endpoints run in parallel up to the
//!   shared enqueue).

pub mod kv_events;

use crate::types::EndpointId;
use dynamo_kv_router::indexer::concurrent_radix_tree_compressed::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::indexer::{KvIndexerInterface, SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, compute_next_seq_hash, BlockHashOptions, DpRank,
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, WorkerWithDpRank,
};
use futures::FutureExt;
pub use kv_events::{DecodedBatch, EngineEvent, EngineHash};
use parking_lot::{Mutex, RwLock};
use rustc_hash::FxHashMap;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// How much of a request's prefix each endpoint already holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overlap {
    /// Full blocks in the request (`tokens.len() / block_size`): the most any
    /// endpoint can match.
    pub request_blocks: usize,
    /// Matched leading blocks per endpoint; endpoints that match nothing are
    /// absent.
    pub matched: HashMap<EndpointId, usize>,
}

impl Overlap {
    /// Matched leading blocks of `endpoint` (0 when absent).
    pub fn blocks_for(&self, endpoint: EndpointId) -> usize {
        self.matched.get(&endpoint).copied().unwrap_or(0)
    }

    /// The most leading blocks any endpoint holds.
    pub fn max_blocks(&self) -> usize {
        self.matched.values().copied().max().unwrap_or(0)
    }
}

/// What one [`PoolIndex::apply`] did, for the subscriber's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Blocks newly indexed.
    pub stored: usize,
    /// Blocks removed from the index.
    pub removed: usize,
    /// `AllBlocksCleared` events applied.
    pub cleared: usize,
    /// Events not indexed: non-GPU medium, other block size, unknown parent,
    /// token ids that do not cover the listed blocks.
    pub skipped_events: usize,
}

/// Blocks one DP rank of one endpoint holds (the index's own bookkeeping
/// next to the tree).
#[derive(Default)]
struct RankBlocks {
    dp_rank: DpRank,
    /// Engine hash -> the block's chain hash (its external hash in the tree).
    blocks: FxHashMap<u64, u64>,
    /// Engine blocks per chain hash: two engine blocks can share content (a
    /// `cache_salt` the index does not see), and the tree must keep the chain
    /// until the last of them is removed.
    chain_refs: FxHashMap<u64, u32>,
}

impl RankBlocks {
    fn clear(&mut self) {
        self.blocks = FxHashMap::default();
        self.chain_refs = FxHashMap::default();
    }

    /// Forgets one engine block; the chain hash to remove from the tree when
    /// no other engine block of this rank shares it.
    fn remove(&mut self, engine: u64) -> Option<u64> {
        let chain = self.blocks.remove(&engine)?;
        match self.chain_refs.get_mut(&chain) {
            Some(n) if *n > 1 => {
                *n -= 1;
                None
            }
            _ => {
                self.chain_refs.remove(&chain);
                Some(chain)
            }
        }
    }
}

/// Per-endpoint state; its mutex serializes writers of one endpoint so the
/// bookkeeping and the tree's FIFO lane stay in the same order.
#[derive(Default)]
struct EndpointState {
    /// Usually one entry (no data parallelism).
    ranks: Vec<RankBlocks>,
}

impl EndpointState {
    fn rank_mut(&mut self, dp_rank: DpRank) -> &mut RankBlocks {
        let pos = match self.ranks.iter().position(|r| r.dp_rank == dp_rank) {
            Some(pos) => pos,
            None => {
                self.ranks.push(RankBlocks {
                    dp_rank,
                    ..RankBlocks::default()
                });
                self.ranks.len() - 1
            }
        };
        &mut self.ranks[pos]
    }

    fn total(&self) -> usize {
        self.ranks.iter().map(|r| r.blocks.len()).sum()
    }
}

/// The prefix index of one pool (fixed block size). `Send + Sync`: share it
/// as `Arc<PoolIndex>` between subscribers (writers) and pickers (readers).
pub struct PoolIndex {
    block_size: u32,
    tree: ThreadPoolIndexer<ConcurrentRadixTreeCompressed>,
    endpoints: RwLock<FxHashMap<EndpointId, Arc<Mutex<EndpointState>>>>,
    /// Per-endpoint block counts, readable without touching endpoint locks.
    counts: RwLock<FxHashMap<EndpointId, Arc<AtomicUsize>>>,
    /// dynamo wants an event id per event (it only logs it).
    next_event_id: AtomicU64,
}

impl std::fmt::Debug for PoolIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolIndex")
            .field("block_size", &self.block_size)
            .field("endpoints", &self.endpoints.read().len())
            .finish_non_exhaustive()
    }
}

/// Writer threads behind the tree. One is enough for >1M blocks/s and keeps
/// the per-endpoint FIFO trivially ordered; the machine budget is small.
const WRITER_THREADS: usize = 1;

impl PoolIndex {
    /// An empty index for a pool whose engines use `block_size` tokens a
    /// block. Spawns the tree's writer thread (joined on drop).
    ///
    /// A `block_size` of 0 is treated as 1 (dynamo would otherwise hash no
    /// blocks at all and every event would be skipped).
    pub fn new(block_size: u32) -> Self {
        let block_size = block_size.max(1);
        PoolIndex {
            block_size,
            tree: ThreadPoolIndexer::new(
                ConcurrentRadixTreeCompressed::new(),
                WRITER_THREADS,
                block_size,
            ),
            endpoints: RwLock::new(FxHashMap::default()),
            counts: RwLock::new(FxHashMap::default()),
            next_event_id: AtomicU64::new(0),
        }
    }

    /// Tokens per block of this pool.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    fn endpoint_state(&self, endpoint: EndpointId) -> Arc<Mutex<EndpointState>> {
        if let Some(state) = self.endpoints.read().get(&endpoint) {
            return state.clone();
        }
        let mut map = self.endpoints.write();
        map.entry(endpoint)
            .or_insert_with(|| {
                self.counts
                    .write()
                    .entry(endpoint)
                    .or_insert_with(|| Arc::new(AtomicUsize::new(0)));
                Arc::new(Mutex::new(EndpointState::default()))
            })
            .clone()
    }

    fn count_cell(&self, endpoint: EndpointId) -> Option<Arc<AtomicUsize>> {
        self.counts.read().get(&endpoint).cloned()
    }

    fn enqueue(&self, worker: WorkerWithDpRank, data: KvCacheEventData) {
        let event_id = self.next_event_id.fetch_add(1, Ordering::Relaxed);
        let event = RouterEvent::new(
            worker.worker_id,
            KvCacheEvent {
                event_id,
                data,
                dp_rank: worker.dp_rank,
            },
        );
        if let Err(error) = self.tree.enqueue_event(event) {
            // Only when the writer thread died (it panicked): nothing to
            // recover here, the index is stale until the process restarts.
            tracing::error!(%error, "prefix index writer is gone; event dropped");
        }
    }

    /// Applies every event of one batch from `endpoint`, in order.
    ///
    /// The tree mutation is enqueued to the index's writer thread and is
    /// visible to [`PoolIndex::overlap`] shortly after (see
    /// [`PoolIndex::flush`]); the bookkeeping (`blocks`) is updated before
    /// this returns. Call it from one writer per endpoint (the subscriber);
    /// concurrent calls for the same endpoint are serialized.
    pub fn apply(&self, endpoint: EndpointId, batch: &DecodedBatch) -> ApplyOutcome {
        let state = self.endpoint_state(endpoint);
        let mut state = state.lock();
        let dp_rank = dp_rank_of(batch.dp_rank);
        let worker = WorkerWithDpRank::new(endpoint.0, dp_rank);
        let mut outcome = ApplyOutcome::default();
        for event in &batch.events {
            match event {
                EngineEvent::BlockStored {
                    block_hashes,
                    parent,
                    token_ids,
                    block_size,
                    lora_name,
                    medium,
                    group_idx: _,
                    kv_cache_spec_kind,
                } => {
                    if !is_gpu(medium.as_deref())
                        || *block_size != self.block_size
                        || !is_main_attention(kv_cache_spec_kind.as_deref())
                    {
                        outcome.skipped_events += 1;
                        continue;
                    }
                    let rank = state.rank_mut(dp_rank);
                    match self.store(worker, rank, block_hashes, parent, token_ids, lora_name) {
                        Some(n) => outcome.stored += n,
                        None => outcome.skipped_events += 1,
                    }
                }
                EngineEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    group_idx: _,
                } => {
                    if !is_gpu(medium.as_deref()) {
                        outcome.skipped_events += 1;
                        continue;
                    }
                    let rank = state.rank_mut(dp_rank);
                    let mut hashes = Vec::with_capacity(block_hashes.len());
                    for h in block_hashes {
                        let known = rank.blocks.contains_key(&h.key());
                        if let Some(chain) = rank.remove(h.key()) {
                            hashes.push(ExternalSequenceBlockHash(chain));
                        }
                        outcome.removed += usize::from(known);
                    }
                    if !hashes.is_empty() {
                        self.enqueue(
                            worker,
                            KvCacheEventData::Removed(KvCacheRemoveData {
                                block_hashes: hashes,
                            }),
                        );
                    }
                }
                EngineEvent::AllBlocksCleared => {
                    // vLLM clears its whole prefix cache on this rank.
                    state.rank_mut(dp_rank).clear();
                    self.enqueue(worker, KvCacheEventData::Cleared);
                    outcome.cleared += 1;
                }
            }
        }
        if let Some(cell) = self.count_cell(endpoint) {
            cell.store(state.total(), Ordering::Relaxed);
        }
        outcome
    }

    /// Indexes one `BlockStored`; `None` when it cannot be indexed.
    fn store(
        &self,
        worker: WorkerWithDpRank,
        rank: &mut RankBlocks,
        block_hashes: &[EngineHash],
        parent: &Option<EngineHash>,
        token_ids: &[u32],
        lora_name: &Option<String>,
    ) -> Option<usize> {
        // The parent's chain hash; a parent never seen (lost events) or
        // already evicted makes the event unindexable, as in the tree.
        let parent_chain = match parent.as_ref().map(EngineHash::key) {
            Some(p) => Some(*rank.blocks.get(&p)?),
            None => None,
        };
        let bs = self.block_size as usize;
        let n = block_hashes.len().min(token_ids.len() / bs);
        if n == 0 {
            return if block_hashes.is_empty() {
                Some(0)
            } else {
                None
            };
        }
        let local = compute_block_hash_for_seq(
            &token_ids[..n * bs],
            self.block_size,
            BlockHashOptions {
                lora_name: lora_name.as_deref(),
                ..Default::default()
            },
        );
        let mut blocks = Vec::with_capacity(n);
        let mut new = 0usize;
        let mut prev = parent_chain;
        for (h, tokens_hash) in block_hashes[..n].iter().zip(local) {
            let chain = match prev {
                None => tokens_hash.0,
                Some(p) => compute_next_seq_hash(p, tokens_hash),
            };
            prev = Some(chain);
            if let std::collections::hash_map::Entry::Vacant(e) = rank.blocks.entry(h.key()) {
                e.insert(chain);
                *rank.chain_refs.entry(chain).or_insert(0) += 1;
                new += 1;
            }
            blocks.push(KvCacheStoredBlockData {
                block_hash: ExternalSequenceBlockHash(chain),
                tokens_hash,
                mm_extra_info: None,
            });
        }
        if new == 0 {
            // A replay or a duplicate: the tree already has all of it.
            return Some(0);
        }
        // A partially new chain is sent whole: the tree re-walks the known
        // head as a no-op and attaches the new tail.
        self.enqueue(
            worker,
            KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent_chain.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks,
            }),
        );
        if n < block_hashes.len() {
            // Token ids ended early: the rest cannot be hashed.
            tracing::debug!(
                listed = block_hashes.len(),
                hashed = n,
                "BlockStored carried fewer token ids than blocks"
            );
        }
        Some(new)
    }

    /// Forgets everything `endpoint` held (all DP ranks) but keeps it known:
    /// for `AllBlocksCleared`-like resets, resyncs and engine restarts.
    pub fn clear_endpoint(&self, endpoint: EndpointId) {
        let state = self.endpoint_state(endpoint);
        let mut state = state.lock();
        for rank in &mut state.ranks {
            rank.clear();
            self.enqueue(
                WorkerWithDpRank::new(endpoint.0, rank.dp_rank),
                KvCacheEventData::Cleared,
            );
        }
        if let Some(cell) = self.count_cell(endpoint) {
            cell.store(0, Ordering::Relaxed);
        }
    }

    /// Removes `endpoint` entirely (it left the pool or is unreachable).
    /// A later `apply` for it starts from empty.
    pub fn remove_endpoint(&self, endpoint: EndpointId) {
        let Some(state) = self.endpoints.write().remove(&endpoint) else {
            return;
        };
        self.counts.write().remove(&endpoint);
        let state = state.lock();
        for rank in &state.ranks {
            // This only enqueues (no approximate-LRU, no pruning configured),
            // so the future is ready on its first poll.
            let removal = self.tree.remove_worker_dp_rank(endpoint.0, rank.dp_rank);
            if removal.now_or_never().is_none() {
                tracing::warn!(%endpoint, "prefix index removal did not complete at once");
            }
        }
    }

    /// Matched leading full blocks per endpoint for a request's token ids
    /// (no LoRA adapter).
    pub fn overlap(&self, tokens: &[u32]) -> Overlap {
        self.overlap_for(tokens, None)
    }

    /// Like [`PoolIndex::overlap`], for a request under LoRA adapter
    /// `lora_name` (the engine hashes its blocks with the adapter name).
    pub fn overlap_for(&self, tokens: &[u32], lora_name: Option<&str>) -> Overlap {
        let hashes: Vec<LocalBlockHash> = compute_block_hash_for_seq(
            tokens,
            self.block_size,
            BlockHashOptions {
                lora_name,
                ..Default::default()
            },
        );
        self.overlap_of(&hashes)
    }

    /// The index's per-block hashes of the full blocks of `tokens` (no
    /// LoRA adapter). Each depends on its block alone, so the hashes of a
    /// longer prompt extend those of its prefix.
    pub fn block_hashes(&self, tokens: &[u32]) -> Vec<LocalBlockHash> {
        compute_block_hash_for_seq(tokens, self.block_size, BlockHashOptions::default())
    }

    /// [`PoolIndex::overlap`] of already computed [`PoolIndex::block_hashes`].
    pub fn overlap_of(&self, hashes: &[LocalBlockHash]) -> Overlap {
        let mut overlap = Overlap {
            request_blocks: hashes.len(),
            matched: HashMap::new(),
        };
        if hashes.is_empty() {
            return overlap;
        }
        let scores = self.tree.backend().find_matches(hashes, false);
        for (worker, score) in scores.scores {
            let entry = overlap
                .matched
                .entry(EndpointId(worker.worker_id))
                .or_insert(0);
            *entry = (*entry).max(score as usize);
        }
        overlap.matched.retain(|_, v| *v > 0);
        overlap
    }

    /// Blocks `endpoint` holds (all DP ranks), as far as the index knows.
    pub fn blocks(&self, endpoint: EndpointId) -> usize {
        self.counts
            .read()
            .get(&endpoint)
            .map(|c| c.load(Ordering::Relaxed))
            .unwrap_or(0)
    }

    /// Blocks held over all endpoints.
    pub fn total_blocks(&self) -> usize {
        self.counts
            .read()
            .values()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    /// Endpoints the index has state for, sorted.
    pub fn endpoints(&self) -> Vec<EndpointId> {
        let mut v: Vec<EndpointId> = self.endpoints.read().keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Waits until every mutation enqueued before this call is visible to
    /// readers.
    pub async fn flush(&self) {
        self.tree.flush().await;
    }

    /// Blocking [`PoolIndex::flush`] for synchronous callers (benchmarks,
    /// plain threads). Do not call it on an async runtime's thread.
    pub fn flush_blocking(&self) {
        futures::executor::block_on(self.tree.flush());
    }
}

/// GPU blocks only: `medium` is absent (older vLLM) or `"GPU"`.
fn is_gpu(medium: Option<&str>) -> bool {
    match medium {
        None => true,
        Some(m) => m.eq_ignore_ascii_case("GPU"),
    }
}

/// Hybrid models report one event stream per KV-cache group; only the
/// full-attention groups describe a reusable prefix (dynamo filters the
/// same way). Absent means a plain model.
fn is_main_attention(kind: Option<&str>) -> bool {
    match kind {
        None => true,
        Some(k) => matches!(
            k,
            "full_attention" | "mla_attention" | "sink_full_attention"
        ),
    }
}

/// vLLM sends `data_parallel_rank` as int or nil; dynamo wants `u32`.
fn dp_rank_of(rank: Option<i64>) -> DpRank {
    rank.and_then(|r| u32::try_from(r).ok()).unwrap_or(0)
}
