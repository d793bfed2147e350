use super::*;
use crate::latency::StepWork;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

fn cfg(blocks: usize) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_gpu_blocks: blocks,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        max_model_len: 1024,
        enable_prefix_caching: true,
        profile: LatencyProfile::h100_8b(),
        hash_seed: HashSeed(0),
        policy: SchedulingPolicy::Fcfs,
    }
}

fn engine(blocks: usize) -> Engine {
    Engine::new(cfg(blocks), Arc::from(vec![7u32, 8, 9]))
}

fn add(
    e: &mut Engine,
    id: u64,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> UnboundedReceiver<TokenOutput> {
    let (tx, rx) = unbounded_channel();
    e.add_request(NewRequest {
        id,
        prompt,
        max_tokens,
        finish_reason: FinishReason::Length,
        cache_salt: None,
        arrival: e.now(),
        priority: 0,
        sink: tx,
    });
    rx
}

fn run_to_idle(e: &mut Engine) -> Vec<StepOutput> {
    let mut outs = Vec::new();
    for _ in 0..10_000 {
        if !e.has_work() {
            return outs;
        }
        let o = e.step();
        for (sink, t) in &o.tokens {
            let _ = sink.send(t.clone());
        }
        outs.push(o);
    }
    panic!("engine did not go idle");
}

fn drain(rx: &mut UnboundedReceiver<TokenOutput>) -> Vec<TokenOutput> {
    let mut v = Vec::new();
    while let Ok(t) = rx.try_recv() {
        v.push(t);
    }
    v
}

#[test]
fn generates_exactly_max_tokens_and_frees_blocks() {
    let mut e = engine(16);
    let mut rx = add(&mut e, 1, (0..10).collect(), 5);
    run_to_idle(&mut e);
    let toks = drain(&mut rx);
    assert_eq!(toks.len(), 5);
    assert_eq!(toks.last().unwrap().finished, Some(FinishReason::Length));
    assert!(toks[..4].iter().all(|t| t.finished.is_none()));
    assert_eq!(e.pool().free_blocks(), 16);
    // 10 prompt + 4 computed output tokens = 14 -> 3 full blocks cached.
    assert_eq!(e.pool().cached_blocks(), 3);
}

#[test]
fn shared_prefix_is_cached_and_costs_no_prefill() {
    let mut e = engine(64);
    let prefix: Vec<u32> = (100..132).collect(); // 8 blocks
    let mut p1 = prefix.clone();
    p1.extend([1, 2, 3]);
    let mut p2 = prefix.clone();
    p2.extend([4, 5, 6]);
    let mut r1 = add(&mut e, 1, p1, 1);
    let o1 = run_to_idle(&mut e);
    assert_eq!(drain(&mut r1)[0].cached_tokens, 0);
    let mut r2 = add(&mut e, 2, p2, 1);
    let o2 = run_to_idle(&mut e);
    assert_eq!(drain(&mut r2)[0].cached_tokens, 32);
    assert_eq!(o1[0].work.prefill_tokens, 35);
    assert_eq!(
        o2[0].work.prefill_tokens, 3,
        "only the uncached suffix is computed"
    );
    assert!(o2[0].duration < o1[0].duration);
    assert_eq!(e.stats().prefix_cache_hits, 32);
    assert_eq!(e.stats().prefix_cache_queries, 70);
}

#[test]
fn fully_cached_prompt_recomputes_last_block() {
    let mut e = engine(64);
    let p: Vec<u32> = (0..16).collect(); // exactly 4 blocks
    let mut r = add(&mut e, 1, p.clone(), 1);
    run_to_idle(&mut e);
    drain(&mut r);
    let mut r = add(&mut e, 2, p, 1);
    run_to_idle(&mut e);
    assert_eq!(drain(&mut r)[0].cached_tokens, 12);
}

#[test]
fn events_chain_parents_and_carry_tokens() {
    let mut e = engine(64);
    let mut r = add(&mut e, 1, (0..9).collect(), 4);
    let outs = run_to_idle(&mut e);
    drain(&mut r);
    let stored: Vec<_> = outs
        .iter()
        .flat_map(|o| o.events.iter())
        .filter_map(|ev| match ev {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                ..
            } => Some((block_hashes.clone(), *parent_block_hash, token_ids.clone())),
            _ => None,
        })
        .collect();
    // Prefill stores blocks 0,1 in one event; decode fills block 2 later.
    assert_eq!(stored.len(), 2);
    assert_eq!(stored[0].0.len(), 2);
    assert_eq!(stored[0].1, None);
    assert_eq!(stored[0].2, (0..8).collect::<Vec<u32>>());
    assert_eq!(stored[1].1, Some(stored[0].0[1]));
    assert_eq!(stored[1].2.len(), 4);
    assert_eq!(&stored[1].2[..1], &[8]);
}

#[test]
fn eviction_emits_removals_lru_first() {
    let mut e = engine(4);
    let mut r = add(&mut e, 1, (0..8).collect(), 1); // 2 blocks + 1 for the 9th? no: 8 tokens, output 1
    run_to_idle(&mut e);
    drain(&mut r);
    assert_eq!(e.pool().cached_blocks(), 2);
    let mut r = add(&mut e, 2, (50..66).collect(), 1); // needs 4 fresh blocks
    let outs = run_to_idle(&mut e);
    drain(&mut r);
    let removed: Vec<_> = outs
        .iter()
        .flat_map(|o| o.events.iter())
        .filter_map(|ev| match ev {
            KvEvent::BlockRemoved { block_hashes } => Some(block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect();
    assert_eq!(removed.len(), 2);
    // The tail block of request 1 goes before its first block.
    let mut h = Vec::new();
    extend_chain(HashSeed(0), &mut h, &(0..8).collect::<Vec<u32>>(), 4, None);
    assert_eq!(removed, vec![h[1], h[0]]);
}

#[test]
fn chunked_prefill_respects_token_budget_and_batch_limit() {
    let mut c = cfg(256);
    c.max_num_batched_tokens = 16;
    c.max_num_seqs = 2;
    let mut e = Engine::new(c, Arc::from(vec![1u32]));
    let mut rxs: Vec<_> = (0..3)
        .map(|i| add(&mut e, i, (0..40).map(|t| t + i as u32 * 1000).collect(), 2))
        .collect();
    let outs = run_to_idle(&mut e);
    assert_eq!(outs[0].work.prefill_tokens, 16);
    assert_eq!(
        outs[0].work.prefill_seqs, 1,
        "one 16-token chunk fills the budget"
    );
    assert!(outs
        .iter()
        .all(|o| o.work.prefill_tokens + o.work.decode_seqs as u64 <= 16));
    assert!(outs
        .iter()
        .all(|o| o.work.prefill_seqs + o.work.decode_seqs <= 2));
    for rx in &mut rxs {
        assert_eq!(drain(rx).len(), 2);
    }
}

#[test]
fn preemption_when_cache_runs_out_still_completes_everything() {
    let mut e = engine(6); // 24 tokens of KV
    let mut a = add(&mut e, 1, (0..8).collect(), 12); // grows to 20 tokens
    let mut b = add(&mut e, 2, (100..108).collect(), 12);
    run_to_idle(&mut e);
    assert_eq!(drain(&mut a).len(), 12);
    assert_eq!(drain(&mut b).len(), 12);
    assert!(e.stats().preemptions > 0);
    assert_eq!(e.pool().free_blocks(), 6);
}

#[test]
fn ttft_includes_queueing_and_is_in_virtual_time() {
    let mut c = cfg(256);
    c.max_num_seqs = 1;
    let mut e = Engine::new(c, Arc::from(vec![1u32]));
    let _a = add(&mut e, 1, (0..20).collect(), 10);
    let _b = add(&mut e, 2, (100..120).collect(), 1);
    run_to_idle(&mut e);
    let s = e.stats();
    assert_eq!(s.ttft.count(), 2);
    // The second waited for ten steps of the first.
    assert!(s.ttft.sum() > 2.0 * 0.030 + 9.0 * 0.006);
}

#[test]
fn abort_frees_blocks() {
    let mut e = engine(16);
    let _r = add(&mut e, 1, (0..30).collect(), 100);
    e.step();
    assert!(e.pool().free_blocks() < 16);
    assert!(e.abort(1));
    assert_eq!(e.pool().free_blocks(), 16);
    assert!(!e.has_work());
}

#[test]
fn reset_prefix_cache_only_when_idle() {
    let mut e = engine(16);
    let _r = add(&mut e, 1, (0..30).collect(), 3);
    e.step();
    assert!(e.reset_prefix_cache().is_none());
    run_to_idle(&mut e);
    assert_eq!(e.reset_prefix_cache(), Some(KvEvent::AllBlocksCleared));
    assert_eq!(e.pool().cached_blocks(), 0);
}

// ---- --scheduling-policy priority ----

fn policy_engine(policy: SchedulingPolicy, blocks: usize, max_num_seqs: usize) -> Engine {
    let mut c = cfg(blocks);
    c.policy = policy;
    c.max_num_seqs = max_num_seqs;
    Engine::new(c, Arc::from(vec![7u32, 8, 9]))
}

/// Queues a request with a priority and an explicit virtual arrival.
fn add_p(e: &mut Engine, id: u64, prompt_len: u32, priority: i64, arrival: f64) {
    let (tx, rx) = unbounded_channel();
    // The receiver is dropped: these tests read the engine's queues.
    drop(rx);
    e.add_request(NewRequest {
        id,
        prompt: (0..prompt_len).map(|t| t + id as u32 * 1000).collect(),
        max_tokens: 20,
        finish_reason: FinishReason::Length,
        cache_salt: None,
        arrival,
        priority,
        sink: tx,
    });
}

fn running_ids(e: &Engine) -> Vec<u64> {
    e.running.iter().map(|s| s.id).collect()
}

/// Steps to idle; the ids in the order they first entered the batch.
fn admission_order(e: &mut Engine) -> Vec<u64> {
    let mut order = Vec::new();
    for _ in 0..10_000 {
        if !e.has_work() {
            return order;
        }
        e.step();
        for id in running_ids(e) {
            if !order.contains(&id) {
                order.push(id);
            }
        }
    }
    panic!("engine did not go idle");
}

#[test]
fn priority_admits_a_later_higher_priority_request_first() {
    let order = |policy| {
        let mut e = policy_engine(policy, 256, 1);
        add_p(&mut e, 1, 8, 0, 0.0);
        e.step();
        add_p(&mut e, 2, 8, 5, 0.0);
        add_p(&mut e, 3, 8, 0, 0.0);
        add_p(&mut e, 4, 8, -1, 0.0);
        admission_order(&mut e)
    };
    assert_eq!(order(SchedulingPolicy::Priority), vec![1, 4, 3, 2]);
    // FCFS reads no priority: arrival order.
    assert_eq!(order(SchedulingPolicy::Fcfs), vec![1, 2, 3, 4]);
}

#[test]
fn equal_priorities_keep_arrival_order() {
    let mut e = policy_engine(SchedulingPolicy::Priority, 256, 1);
    e.now = 1.0;
    add_p(&mut e, 1, 8, 1, 0.3);
    add_p(&mut e, 2, 8, 1, 0.1);
    add_p(&mut e, 3, 8, 1, 0.2);
    // Same arrival: submission order.
    add_p(&mut e, 4, 8, 1, 0.5);
    add_p(&mut e, 5, 8, 1, 0.5);
    assert_eq!(e.waiting.ids(), vec![2, 3, 1, 4, 5]);
    assert_eq!(admission_order(&mut e), vec![2, 3, 1, 4, 5]);
}

/// Batch [1: p1 t.3, a, b] out of blocks in the step after a and b joined
/// (7 blocks of 4; 8-token prompts). Returns (running, waiting, decodes in
/// that step) after it.
fn kv_pressure(
    policy: SchedulingPolicy,
    a: (i64, f64),
    b: (i64, f64),
) -> (Vec<u64>, Vec<u64>, u32) {
    let mut e = policy_engine(policy, 7, 8);
    e.now = 1.0;
    add_p(&mut e, 1, 8, 1, 0.3);
    e.step(); // 1 prefilled: 2 blocks, 9 tokens
    add_p(&mut e, 2, 8, a.0, a.1);
    add_p(&mut e, 3, 8, b.0, b.1);
    e.step(); // 1 takes its 3rd block; 2 and 3 take the other 4
    assert_eq!(e.pool().free_blocks(), 0);
    assert_eq!(e.stats().preemptions, 0);
    let o = e.step(); // the second in the batch needs a 3rd block
    assert_eq!(e.stats().preemptions, 1);
    (running_ids(&e), e.waiting.ids(), o.work.decode_seqs)
}

#[test]
fn the_victim_under_kv_pressure_is_the_lowest_priority_latest_arrival() {
    // 1 (p1, t.3) outranks nobody: 3 (p0) is higher, 2 (p1, t.1) arrived
    // earlier. It goes although it is first in the batch and was already
    // scheduled this step; its decode is undone.
    let (running, waiting, decodes) = kv_pressure(SchedulingPolicy::Priority, (1, 0.1), (0, 0.2));
    assert_eq!(running, vec![3, 2]);
    assert_eq!(waiting, vec![1]);
    assert_eq!(decodes, 2);
    // FCFS on the same requests: the last admitted goes.
    let (running, waiting, decodes) = kv_pressure(SchedulingPolicy::Fcfs, (1, 0.1), (0, 0.2));
    assert_eq!(running, vec![1, 2]);
    assert_eq!(waiting, vec![3]);
    assert_eq!(decodes, 2);
}

#[test]
fn a_lowest_priority_request_preempts_itself_and_the_batch_goes_on() {
    let victim_step = |policy| {
        let mut e = policy_engine(policy, 6, 8);
        add_p(&mut e, 1, 8, 5, 0.0);
        e.step();
        add_p(&mut e, 2, 8, 0, 0.0);
        add_p(&mut e, 3, 8, 0, 0.0);
        for _ in 0..100 {
            let o = e.step();
            if e.stats().preemptions > 0 {
                return (running_ids(&e), e.waiting.ids(), o.work.decode_seqs);
            }
        }
        panic!("no preemption");
    };
    // 1 needs a block, is itself the lowest priority, and goes; 2, after
    // it in the batch, still runs. 1 waits behind 3 (higher priority).
    assert_eq!(
        victim_step(SchedulingPolicy::Priority),
        (vec![2], vec![3, 1], 1)
    );
    // FCFS: 2, the last admitted, goes back to the front.
    assert_eq!(
        victim_step(SchedulingPolicy::Fcfs),
        (vec![1], vec![2, 3], 1)
    );
}

#[test]
fn priority_with_equal_priorities_schedules_as_fcfs() {
    // Same arrivals in submission order and one priority: the policies
    // must not differ in any step's work or events.
    let (fcfs, preemptions) = trace(SchedulingPolicy::Fcfs, |_| 0);
    assert!(preemptions > 0, "the scenario must preempt");
    let (prio, _) = trace(SchedulingPolicy::Priority, |_| 0);
    assert_same(&fcfs, &prio);
}

#[test]
fn fcfs_ignores_priorities() {
    let (zero, _) = trace(SchedulingPolicy::Fcfs, |_| 0);
    let (mixed, _) = trace(SchedulingPolicy::Fcfs, |id| {
        [3, -7, 0, 9, 1, -1][id as usize]
    });
    assert_same(&zero, &mixed);
    // The same priorities do change the priority policy's schedule.
    let (prio, _) = trace(SchedulingPolicy::Priority, |id| {
        [3, -7, 0, 9, 1, -1][id as usize]
    });
    assert_ne!(format!("{zero:?}"), format!("{prio:?}"));
}

type Trace = Vec<(StepWork, Vec<KvEvent>, Vec<u64>, Vec<u64>)>;

/// Six requests of growing length on 12 blocks, 3 at a time (chunked
/// prefill, prefix misses, preemptions); every step's work, events, batch
/// and queue.
fn trace(policy: SchedulingPolicy, priority: impl Fn(u64) -> i64) -> (Trace, u64) {
    let mut e = policy_engine(policy, 12, 3);
    for id in 0..6 {
        add_p(&mut e, id, 8 + id as u32 * 3, priority(id), 0.0);
    }
    let mut trace = Vec::new();
    for _ in 0..1000 {
        if !e.has_work() {
            break;
        }
        let o = e.step();
        trace.push((o.work, o.events, running_ids(&e), e.waiting.ids()));
    }
    (trace, e.stats().preemptions)
}

fn assert_same(a: &Trace, b: &Trace) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(format!("{x:?}"), format!("{y:?}"), "step {i}");
    }
}
