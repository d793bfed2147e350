//! Two indexer replicas fed by the same simulators give the same picks for
//! the same requests: scoring is deterministic, the
//! tie-break is a hash of the request id and the address, and each replica's
//! in-flight state follows the same picks and reports.

use crate::service_support;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvasir_proto::v1 as pb;
use service_support::*;

type Msgs = Vec<(&'static str, String)>;

/// What must agree between replicas: order, predictions, decision.
fn summary(p: &pb::PickResponse) -> (Vec<(String, u32)>, String, u32) {
    (
        p.endpoints
            .iter()
            .map(|e| (e.address.clone(), e.predicted_cached_tokens))
            .collect(),
        p.reason.clone(),
        p.prompt_tokens,
    )
}

/// How many blocks a replica indexes for each endpoint.
async fn indexed_blocks(r: &Running) -> Vec<u64> {
    let state = r.state().await;
    state.endpoints.iter().map(|e| e.indexed_blocks).collect()
}

/// Waits until both replicas index the same number of blocks for every
/// endpoint, unchanged over a few polls.
async fn wait_same_index(a: &Running, b: &Running) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut last = Vec::new();
    let mut stable = 0;
    loop {
        let (sa, sb) = (indexed_blocks(a).await, indexed_blocks(b).await);
        if sa == sb && sa == last {
            stable += 1;
            if stable >= 3 {
                return;
            }
        } else {
            stable = 0;
        }
        assert!(
            Instant::now() < deadline,
            "replicas did not converge: {sa:?} vs {sb:?}"
        );
        last = sa;
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_give_the_same_picks() {
    let sims = Sim::start_many(3).await;
    let refs: Vec<&Sim> = sims.iter().collect();
    let mut cfg = config(&refs);
    // Time-based expiry of queued prefill runs on each replica's own clock;
    // keep it out of this test's few seconds so only picks and reports
    // change in-flight state.
    cfg.pools[0].in_flight.prefill_horizon_ms = 60_000;
    let a = start_indexer(&cfg).await;
    let b = start_indexer(&cfg).await;
    a.wait_ready().await;
    b.wait_ready().await;
    let by_addr: HashMap<String, &Sim> = sims.iter().map(|s| (s.address(), s)).collect();

    // History on every engine: a few conversations, one shared system prompt.
    let system = format!("Shared rules: {}", filler(50, 300));
    let mut convs: Vec<Msgs> = (0..6)
        .map(|i| {
            vec![
                ("system", system.clone()),
                ("user", format!("Conversation {i}: {}", filler(60 + i, 120))),
            ]
        })
        .collect();
    for (i, c) in convs.iter_mut().enumerate() {
        let r = sims[i % 3].chat(c, 16).await;
        c.push(("assistant", reply(&r)));
        c.push(("user", format!("more on {i}")));
    }
    wait_same_index(&a, &b).await;

    // Round 1: the same picks, in the same order, to both replicas (no
    // reports yet, so in-flight state builds up identically on both).
    let mut requests: Vec<(String, Msgs)> = Vec::new();
    for (i, c) in convs.iter().enumerate() {
        requests.push((format!("follow-{i}"), c.clone()));
    }
    for i in 0..12u64 {
        requests.push((
            format!("new-{i}"),
            vec![("system", system.clone()), ("user", filler(200 + i, 30))],
        ));
    }
    for i in 0..6u64 {
        requests.push((format!("cold-{i}"), vec![("user", filler(300 + i, 50))]));
    }
    let mut picked = Vec::new();
    for (id, msgs) in &requests {
        let pa = a.pick(chat_pick(id, msgs)).await;
        let pb_ = b.pick(chat_pick(id, msgs)).await;
        assert_eq!(summary(&pa), summary(&pb_), "replicas disagree on {id}");
        picked.push(pa.endpoints[0].address.clone());
    }
    let distinct: std::collections::BTreeSet<_> = picked.iter().collect();
    assert!(
        distinct.len() >= 2,
        "picks used several endpoints: {picked:?}"
    );
    for i in 0..convs.len() {
        assert_eq!(picked[i], sims[i % 3].address(), "follow-up {i} goes home");
    }

    // Serve half of them where they were picked, report to both replicas,
    // let the events land on both, and pick again.
    for ((id, msgs), addr) in requests.iter().zip(&picked).step_by(2) {
        let r = by_addr[addr].chat(msgs, 8).await;
        for ix in [&a, &b] {
            ix.report(pb::ReportRequest {
                pool: POOL.into(),
                request_id: id.clone(),
                endpoint: addr.clone(),
                cached_tokens: cached_tokens(&r) as u32,
                ..Default::default()
            })
            .await;
        }
    }
    wait_same_index(&a, &b).await;
    for (i, (_, msgs)) in requests.iter().enumerate() {
        let id = format!("round2-{i}");
        let pa = a.pick(chat_pick(&id, msgs)).await;
        let pb_ = b.pick(chat_pick(&id, msgs)).await;
        assert_eq!(summary(&pa), summary(&pb_), "replicas disagree on {id}");
    }
    let (sa, sb) = (a.state().await, b.state().await);
    for (ea, eb) in sa.endpoints.iter().zip(&sb.endpoints) {
        assert_eq!(
            (ea.in_flight, ea.queued_prefill_tokens),
            (eb.in_flight, eb.queued_prefill_tokens)
        );
    }
    a.indexer.shutdown().await;
    b.indexer.shutdown().await;
}
