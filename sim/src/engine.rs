//! The engine: vLLM's continuous-batching scheduler over the block pool,
//! advancing a virtual clock by the latency model.
//!
//! Pure logic, no I/O and no real time: `step()` schedules one batch,
//! computes it in zero wall time, and says how long the modelled GPU would
//! have taken. The runner sleeps that long (times the time scale) before it
//! hands out the step's tokens and events.

use crate::block_pool::{BlockId, BlockPool, PoolChange};
use crate::hashing::{extend_chain, BlockHash, HashSeed};
use crate::kv_events::KvEvent;
use crate::latency::{LatencyProfile, StepWork};
use crate::metrics::EngineStats;
pub use crate::waiting::SchedulingPolicy;
use crate::waiting::{Queued, WaitingQueue};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc::UnboundedSender;

/// Scheduler and cache settings (vLLM's names).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block (`--block-size`).
    pub block_size: usize,
    /// KV capacity in blocks (`--num-gpu-blocks-override`).
    pub num_gpu_blocks: usize,
    /// Most sequences in one batch (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Token budget of one step (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: usize,
    /// Longest prompt plus completion (`--max-model-len`).
    pub max_model_len: usize,
    /// Whether prefix caching is on (`--enable-prefix-caching`).
    pub enable_prefix_caching: bool,
    /// The latency model.
    pub profile: LatencyProfile,
    /// Root of this engine's block-hash chains.
    pub hash_seed: HashSeed,
    /// Waiting-queue order and preemption victim (`--scheduling-policy`).
    pub policy: SchedulingPolicy,
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// Reached `max_tokens`.
    Length,
    /// Reached its natural end (the benchmark's output hint).
    Stop,
}

impl FinishReason {
    /// The OpenAI wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        }
    }
}

/// One generated token, sent to the request's HTTP handler.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOutput {
    /// The token id.
    pub token_id: u32,
    /// Zero-based position in the completion.
    pub index: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u32,
    /// Set on the last token.
    pub finished: Option<FinishReason>,
}

/// A request handed to the engine.
#[derive(Debug)]
pub struct NewRequest {
    /// Unique id (for aborts).
    pub id: u64,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Why it stops when it reaches `max_tokens`.
    pub finish_reason: FinishReason,
    /// vLLM's `cache_salt`.
    pub cache_salt: Option<String>,
    /// Virtual arrival time, seconds.
    pub arrival: f64,
    /// vLLM's request `priority` (lower is served earlier); only the
    /// priority policy reads it.
    pub priority: i64,
    /// Where tokens go.
    pub sink: UnboundedSender<TokenOutput>,
}

#[derive(Debug)]
struct Seq {
    id: u64,
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: u32,
    finish_reason: FinishReason,
    salt: Option<String>,
    num_computed: usize,
    blocks: Vec<BlockId>,
    hashes: Vec<BlockHash>,
    /// Blocks [0, registered) have been offered to the cache.
    registered: usize,
    cached_tokens: Option<u32>,
    arrival: f64,
    priority: i64,
    first_token: Option<f64>,
    last_token: f64,
    sink: UnboundedSender<TokenOutput>,
}

impl Seq {
    fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

impl Queued for Seq {
    fn id(&self) -> u64 {
        self.id
    }
    fn priority(&self) -> i64 {
        self.priority
    }
    fn arrival(&self) -> f64 {
        self.arrival
    }
}

/// What one step produced.
#[derive(Debug, Default)]
pub struct StepOutput {
    /// Modelled duration of the step.
    pub duration: Duration,
    /// Tokens to deliver once the step's time has passed.
    pub tokens: Vec<(UnboundedSender<TokenOutput>, TokenOutput)>,
    /// KV events of this step, in order (one published batch).
    pub events: Vec<KvEvent>,
    /// The work the latency model was given.
    pub work: StepWork,
}

/// The engine; see the module docs.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    pool: BlockPool,
    waiting: WaitingQueue<Seq>,
    running: Vec<Seq>,
    now: f64,
    output_vocab: Arc<[u32]>,
    stats: EngineStats,
}

impl Engine {
    /// A new, idle engine. `output_vocab` holds the token ids the synthetic
    /// completions cycle through (must be non-empty).
    pub fn new(cfg: EngineConfig, output_vocab: Arc<[u32]>) -> Self {
        assert!(
            !output_vocab.is_empty(),
            "output vocabulary must not be empty"
        );
        assert!(cfg.block_size > 0, "block size must be positive");
        Engine {
            pool: BlockPool::new(cfg.num_gpu_blocks),
            waiting: WaitingQueue::new(cfg.policy),
            cfg,
            running: Vec::new(),
            now: 0.0,
            output_vocab,
            stats: EngineStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Virtual time, seconds since start.
    pub fn now(&self) -> f64 {
        self.now
    }

    /// Whether there is anything to schedule.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Requests in the running batch.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting for admission.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// The block pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Counters and histograms.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Queues a request. The caller has validated lengths.
    pub fn add_request(&mut self, r: NewRequest) {
        let prompt_len = r.prompt.len();
        self.waiting.add(Seq {
            id: r.id,
            tokens: r.prompt,
            prompt_len,
            max_tokens: r.max_tokens.max(1),
            finish_reason: r.finish_reason,
            salt: r.cache_salt,
            num_computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            registered: 0,
            cached_tokens: None,
            arrival: r.arrival.min(self.now),
            priority: r.priority,
            first_token: None,
            last_token: 0.0,
            sink: r.sink,
        });
    }

    /// Drops a request (its client went away), freeing its blocks.
    pub fn abort(&mut self, id: u64) -> bool {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.pool.release(&s.blocks);
            self.stats.aborted += 1;
            return true;
        }
        if let Some(s) = self.waiting.remove(id) {
            self.pool.release(&s.blocks);
            self.stats.aborted += 1;
            return true;
        }
        false
    }

    /// vLLM's `reset_prefix_cache`: only when no request holds blocks.
    /// Returns the event to publish on success.
    pub fn reset_prefix_cache(&mut self) -> Option<KvEvent> {
        if self.pool.reset() {
            Some(KvEvent::AllBlocksCleared)
        } else {
            None
        }
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.block_size)
    }

    /// Schedules, computes and completes one step.
    pub fn step(&mut self) -> StepOutput {
        let mut out = StepOutput::default();
        let mut changes = Vec::new();
        let mut budget = self.cfg.max_num_batched_tokens;
        // (index into running, tokens scheduled)
        let mut sched: Vec<(usize, usize)> = Vec::new();

        // 1. Running requests, in batch order, each gets its next chunk.
        let preempted = self.schedule_running(&mut budget, &mut sched, &mut changes);

        // 2. Admit waiting requests while the batch and the cache allow.
        while !preempted
            && budget > 0
            && self.running.len() < self.cfg.max_num_seqs
            && !self.waiting.is_empty()
        {
            let bs = self.cfg.block_size;
            let s = self.waiting.front_mut().expect("non-empty");
            let salt = s.salt.clone();
            extend_chain(
                self.cfg.hash_seed,
                &mut s.hashes,
                &s.tokens,
                bs,
                salt.as_deref(),
            );
            // vLLM recomputes at least the last token, so hits count only
            // full blocks inside the first len-1 tokens.
            let hit_blocks = if self.cfg.enable_prefix_caching {
                let limit = (s.tokens.len() - 1) / bs;
                self.pool
                    .longest_cached_prefix(&s.hashes[..limit.min(s.hashes.len())])
            } else {
                0
            };
            let computed = hit_blocks * bs;
            let n = (s.tokens.len() - computed).min(budget);
            let need = (computed + n).div_ceil(bs) - hit_blocks;
            let hit_ids: Vec<BlockId> = s.hashes[..hit_blocks]
                .iter()
                .map(|h| self.pool.lookup(*h).expect("cached"))
                .collect();
            let revived = hit_ids
                .iter()
                .filter(|id| self.pool.ref_count(**id) == 0)
                .count();
            if self.pool.free_blocks() < revived + need {
                break;
            }
            let mut s = self.waiting.pop_front().expect("non-empty");
            for id in &hit_ids {
                self.pool.touch(*id);
            }
            s.blocks = hit_ids;
            s.registered = hit_blocks;
            allocate_n(&mut self.pool, need, &mut s.blocks, &mut changes);
            s.num_computed = computed;
            if s.cached_tokens.is_none() {
                s.cached_tokens = Some(computed as u32);
                self.stats.prefix_cache_queries += s.prompt_len as u64;
                self.stats.prefix_cache_hits += computed as u64;
            }
            self.running.push(s);
            sched.push((self.running.len() - 1, n));
            budget -= n;
        }

        for c in changes {
            let PoolChange::Evicted(h) = c;
            push_removed(&mut out.events, h);
        }

        // 3. The latency model prices the batch.
        for &(i, n) in &sched {
            let s = &self.running[i];
            if n == 1 && s.num_computed + 1 == s.tokens.len() && s.num_computed >= s.prompt_len {
                out.work.add_decode(s.tokens.len() as u64);
            } else {
                out.work.add_prefill(s.num_computed as u64, n as u64);
            }
        }
        out.duration = self.cfg.profile.step_time(&out.work);
        self.now += out.duration.as_secs_f64();
        self.stats.steps += 1;
        self.stats.prompt_tokens_computed += out.work.prefill_tokens;
        self.stats.prefill_seconds += self.cfg.profile.prefill_time(&out.work).as_secs_f64();

        // 4. Complete: cache full blocks, sample, finish.
        let bs = self.cfg.block_size;
        let mut finished = Vec::new();
        for &(i, n) in &sched {
            let s = &mut self.running[i];
            s.num_computed += n;
            let full = s.num_computed / bs;
            let salt = s.salt.clone();
            extend_chain(
                self.cfg.hash_seed,
                &mut s.hashes,
                &s.tokens[..full * bs],
                bs,
                salt.as_deref(),
            );
            let mut run_start: Option<usize> = None;
            for b in s.registered..full {
                let stored =
                    self.cfg.enable_prefix_caching && self.pool.cache(s.blocks[b], s.hashes[b]);
                match (stored, run_start) {
                    (true, None) => run_start = Some(b),
                    (false, Some(st)) => {
                        out.events.push(stored_event(s, st, b, bs));
                        run_start = None;
                    }
                    _ => {}
                }
            }
            if let Some(st) = run_start {
                out.events.push(stored_event(s, st, full, bs));
            }
            s.registered = full;

            if s.num_computed == s.tokens.len() {
                let k = s.output_len();
                let tok = self.output_vocab[(s.id as usize + k) % self.output_vocab.len()];
                s.tokens.push(tok);
                let done = s.output_len() >= s.max_tokens as usize;
                let now = self.now;
                if s.first_token.is_none() {
                    s.first_token = Some(now);
                    self.stats.ttft.observe(now - s.arrival);
                } else {
                    self.stats.itl.observe(now - s.last_token);
                }
                s.last_token = now;
                self.stats.generation_tokens += 1;
                let msg = TokenOutput {
                    token_id: tok,
                    index: k as u32,
                    cached_tokens: s.cached_tokens.unwrap_or(0),
                    finished: done.then_some(s.finish_reason),
                };
                out.tokens.push((s.sink.clone(), msg));
                if done {
                    finished.push(i);
                }
            }
        }
        // Remove finished requests, highest index first to keep indices valid.
        finished.sort_unstable();
        for &i in finished.iter().rev() {
            let s = self.running.remove(i);
            self.pool.release(&s.blocks);
            self.stats.e2e.observe(self.now - s.arrival);
            self.stats.prompt_tokens += s.prompt_len as u64;
            match s.finish_reason {
                FinishReason::Length => self.stats.finished_length += 1,
                FinishReason::Stop => self.stats.finished_stop += 1,
            }
        }
        out
    }

    /// Gives each running request its next chunk, in batch order
    /// (vLLM's first loop of `schedule`). When the blocks run out it
    /// preempts (recompute) the policy's victim until the chunk fits or the
    /// request itself is the victim. Returns whether anything was preempted.
    fn schedule_running(
        &mut self,
        budget: &mut usize,
        sched: &mut Vec<(usize, usize)>,
        changes: &mut Vec<PoolChange>,
    ) -> bool {
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let s = &self.running[i];
            let n = (s.tokens.len() - s.num_computed).min(*budget);
            let need = self
                .blocks_for(s.num_computed + n)
                .saturating_sub(s.blocks.len());
            let mut preempted_itself = false;
            while self.pool.free_blocks() < need {
                let v = self.victim();
                let victim = self.running.remove(v);
                // A victim scheduled earlier in this step gives its tokens
                // back (only the priority policy picks one before `i`).
                if let Some(k) = sched.iter().position(|&(j, _)| j == v) {
                    *budget += sched.remove(k).1;
                }
                for e in sched.iter_mut().filter(|e| e.0 > v) {
                    e.0 -= 1;
                }
                self.preempt(victim);
                preempted = true;
                if v == i {
                    preempted_itself = true;
                    break;
                }
                if v < i {
                    i -= 1;
                }
            }
            if preempted_itself {
                // FCFS: everything after it was preempted already. Priority:
                // the requests after it rank higher and may still fit in the
                // blocks it freed; `i` already points at the next one.
                match self.cfg.policy {
                    SchedulingPolicy::Fcfs => break,
                    SchedulingPolicy::Priority => continue,
                }
            }
            allocate_n(&mut self.pool, need, &mut self.running[i].blocks, changes);
            sched.push((i, n));
            *budget -= n;
            i += 1;
        }
        preempted
    }

    /// The running request to preempt: the last admitted under FCFS; under
    /// priority the largest (priority, arrival). vLLM's arrivals are wall
    /// timestamps that never tie; virtual ones can (a burst reaching an
    /// idle engine), so the later submission counts as the later arrival.
    fn victim(&self) -> usize {
        match self.cfg.policy {
            SchedulingPolicy::Fcfs => self.running.len() - 1,
            SchedulingPolicy::Priority => {
                let key = |s: &Seq| (s.priority, s.arrival, s.id);
                let mut best = 0;
                for (j, s) in self.running.iter().enumerate().skip(1) {
                    if key(s) > key(&self.running[best]) {
                        best = j;
                    }
                }
                best
            }
        }
    }

    fn preempt(&mut self, mut s: Seq) {
        self.pool.release(&s.blocks);
        s.blocks.clear();
        s.num_computed = 0;
        s.registered = 0;
        self.stats.preemptions += 1;
        self.waiting.prepend(s);
    }
}

/// Appends `n` fresh blocks; the caller has checked that they are free.
fn allocate_n(
    pool: &mut BlockPool,
    n: usize,
    blocks: &mut Vec<BlockId>,
    changes: &mut Vec<PoolChange>,
) {
    for _ in 0..n {
        blocks.push(pool.allocate(changes).expect("caller checked free blocks"));
    }
}

fn push_removed(events: &mut Vec<KvEvent>, h: BlockHash) {
    if let Some(KvEvent::BlockRemoved { block_hashes }) = events.last_mut() {
        block_hashes.push(h);
    } else {
        events.push(KvEvent::BlockRemoved {
            block_hashes: vec![h],
        });
    }
}

fn stored_event(s: &Seq, start: usize, end: usize, bs: usize) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: s.hashes[start..end].to_vec(),
        parent_block_hash: start.checked_sub(1).map(|p| s.hashes[p]),
        token_ids: s.tokens[start * bs..end * bs].to_vec(),
        block_size: bs as u32,
        lora_name: None,
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
