//! The offline cluster model's tests.

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
        history_tokens: 400_000,
        replicas: 1,
        shared_pending: false,
        kv_pressure: false,
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

#[test]
fn a_picks_index_keeps_crediting_a_prefix_the_engine_evicted() {
    // One engine whose cache holds one 16-id prompt: b evicts a. a's
    // repeat finds nothing either way, but the picks index still calls
    // it a prefix pick; the events index sees it cold.
    let mut c = cluster(1);
    c.cache_tokens = 16 * 512;
    let a: Vec<u64> = (0..16).collect();
    let b: Vec<u64> = (100..116).collect();
    let trace = vec![
        req(0.0, &a),
        req(10_000.0, &b),
        req(20_000.0, &b),
        req(30_000.0, &a),
    ];
    let w = Box::<Weights>::default();
    let picks = c.replay(&trace, 1.0, &Policy::Picks(w.clone()));
    let events = c.replay(&trace, 1.0, &Policy::Scored(w));
    assert_eq!(events.decisions.prefix, 1, "{events:?}");
    assert_eq!(picks.decisions.prefix, 2, "{picks:?}");
    assert_eq!(picks.hit_rate, events.hit_rate);
}

#[test]
fn a_replica_does_not_see_the_other_replicas_picks_in_prefill() {
    // A long prompt and, while it is still in prefill, three repeats: one
    // replica matches them against the first pick and queues them behind
    // it; with two, the repeats the other replica picks look cold to it.
    let mut c = cluster(4);
    let ids: Vec<u64> = (0..128).collect(); // 64k tokens: seconds of prefill
    let trace: Vec<TraceRequest> = (0..8).map(|i| req(i as f64 * 10.0, &ids)).collect();
    let w = Policy::Scored(Box::default());
    let one = c.replay(&trace, 1.0, &w);
    c.replicas = 2;
    let two = c.replay(&trace, 1.0, &w);
    c.shared_pending = true;
    let shared = c.replay(&trace, 1.0, &w);
    assert!(
        two.hit_rate < one.hit_rate,
        "{} vs {}",
        two.hit_rate,
        one.hit_rate
    );
    assert_eq!(shared.hit_rate, one.hit_rate);
    assert_eq!(shared.per_engine, one.per_engine);
}

#[test]
fn under_kv_pressure_a_running_request_keeps_its_blocks() {
    // Cache of 16 ids; a 12-id prompt still decoding when a 12-id
    // prompt arrives: without pinning the second evicts the first's
    // prefix, with pinning it evicts nothing of it (the set overflows
    // until the first ends), so a third request repeating the first
    // hits.
    let mut c = cluster(1);
    c.cache_tokens = 16 * 512;
    c.itl_ms = 1_000.0; // 10 output tokens: ~9 s of decode
    let a: Vec<u64> = (0..12).collect();
    let b: Vec<u64> = (100..112).collect();
    let trace = vec![req(0.0, &a), req(2_000.0, &b), req(8_000.0, &a)];
    let lru = c.replay(&trace, 1.0, &Policy::LeastWork);
    c.kv_pressure = true;
    let pinned = c.replay(&trace, 1.0, &Policy::LeastWork);
    assert!(
        pinned.hit_rate > lru.hit_rate,
        "{} vs {}",
        pinned.hit_rate,
        lru.hit_rate
    );
}
