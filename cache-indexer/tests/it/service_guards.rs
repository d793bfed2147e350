//! Safe by default, against real simulators: an endpoint whose requests
//! fail is avoided and comes back once it serves again (the reports are
//! the filter's), and a pathological prompt is answered with bounded
//! tokenization (`tokenizeBudget`).

use crate::service_support;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvasir_cache_indexer::config::{parse, Config};
use kvasir_proto::v1 as pb;
use service_support::*;

fn done(id: &str, endpoint: &str, outcome: pb::Outcome) -> pb::ReportRequest {
    pb::ReportRequest {
        pool: POOL.into(),
        request_id: id.into(),
        endpoint: endpoint.into(),
        outcome: outcome as i32,
        phase: pb::ReportPhase::Done as i32,
        ..Default::default()
    }
}

/// Picks `n` distinct prompts, each reported done at once: ERROR from
/// `bad` while `bad_fails`, else SUCCESS. Picks per first endpoint.
async fn run(
    ix: &Running,
    tag: &str,
    n: usize,
    bad: &str,
    bad_fails: bool,
) -> HashMap<String, usize> {
    let mut firsts = HashMap::new();
    for i in 0..n {
        let id = format!("{tag}-{i}");
        let ids: Vec<u32> = (0..64).map(|k| 1000 + (i * 64 + k) as u32).collect();
        let p = ix.pick(ids_pick(&id, ids)).await;
        let first = p.endpoints[0].address.clone();
        let outcome = if first == bad && bad_fails {
            pb::Outcome::Error
        } else {
            pb::Outcome::Success
        };
        ix.report(done(&id, &first, outcome)).await;
        *firsts.entry(first).or_insert(0) += 1;
    }
    firsts
}

fn gauge(text: &str, name: &str, endpoint: &str) -> f64 {
    let prefix = format!("{name}{{pool=\"{POOL}\",endpoint=\"{endpoint}\"}}");
    metric_value(text, &prefix).unwrap_or_else(|| panic!("no {prefix} in /metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picks_move_off_a_failing_endpoint_and_come_back_after_it_recovers() {
    let sims = Sim::start_many(3).await;
    let mut cfg: Config = config(&sims.iter().collect::<Vec<_>>());
    let cool = Duration::from_millis(1500);
    cfg.pools[0].failures.cool_down_ms = cool.as_millis() as u64;
    cfg.pools[0].failures.min_requests = 5.0;
    let ix = start_indexer(&cfg).await;
    ix.wait_ready().await;
    let bad = sims[0].address();

    // Idle engines: picks spread by the tie-break, the bad one included,
    // until its errors reach minRequests.
    let warm = run(&ix, "warm", 60, &bad, true).await;
    assert!(warm.get(&bad).copied().unwrap_or(0) >= 5, "{warm:?}");
    let m = ix.metrics().await;
    assert_eq!(gauge(&m, "kvasir_indexer_endpoint_failing", &bad), 1.0);
    assert_eq!(
        gauge(&m, "kvasir_indexer_endpoint_ejections_total", &bad),
        1.0
    );
    assert!(gauge(&m, "kvasir_indexer_endpoint_error_ratio", &bad) > 0.9);
    assert_eq!(
        gauge(&m, "kvasir_indexer_endpoint_failing", &sims[1].address()),
        0.0
    );

    // Failing: it still looks idle, yet no pick goes there in the cool-down.
    // (The asserts hold while the cool-down lasts; 30 picks take ~50 ms.)
    let started = Instant::now();
    let during = run(&ix, "during", 30, &bad, true).await;
    // Still in the answer, for a request with nowhere else to go: last.
    let p = ix.pick(ids_pick("ranked", vec![7; 64])).await;
    if started.elapsed() < cool {
        assert_eq!(during.get(&bad), None, "{during:?}");
        let last = p.endpoints.last().map(|e| e.address.as_str());
        assert_eq!(last, Some(bad.as_str()));
    }
    ix.report(done(
        "ranked",
        &p.endpoints[0].address,
        pb::Outcome::Success,
    ))
    .await;

    // Recovered engine: after the cool-down a probe goes there, succeeds,
    // and it takes its share again.
    tokio::time::sleep(cool + Duration::from_millis(100)).await;
    let after = run(&ix, "after", 60, &bad, false).await;
    assert!(after.get(&bad).copied().unwrap_or(0) >= 5, "{after:?}");
    let m = ix.metrics().await;
    assert_eq!(gauge(&m, "kvasir_indexer_endpoint_failing", &bad), 0.0);
    assert!(gauge(&m, "kvasir_indexer_endpoint_request_successes_total", &bad) >= 5.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_megabyte_of_one_character_is_picked_within_the_budget() {
    let sims = Sim::start_many(2).await;
    let ix = start_indexer(&config(&sims.iter().collect::<Vec<_>>())).await;
    ix.wait_ready().await;
    let huge = "a".repeat(1 << 20);
    let mut req = chat_pick("huge", &[("user", huge)]);
    req.max_endpoints = 2;
    let p = ix.pick(req).await;
    assert_eq!(p.endpoints.len(), 2);
    assert_eq!(p.tokenize_mode, "tokenizer");
    // The head was tokenized, the rest estimated (131,072 real tokens).
    assert!(p.prompt_tokens > 100_000, "{}", p.prompt_tokens);
    let m = ix.metrics().await;
    let limited = format!("kvasir_indexer_tokenize_limited_total{{pool=\"{POOL}\"}}");
    assert_eq!(metric_value(&m, &limited), Some(1.0));

    // A normal prompt afterwards is not limited (it stops where no engine
    // holds it, as before, with its length estimated from the head).
    let chat = [("user", filler(3, 300))];
    let p = ix.pick(chat_pick("normal", &chat)).await;
    let real = prompt_tokens(&sims[0].chat(&chat, 1).await) as f64;
    let est = f64::from(p.prompt_tokens);
    assert!(
        (est - real).abs() < 0.2 * real,
        "estimated {est}, real {real}"
    );
    assert_eq!(metric_value(&ix.metrics().await, &limited), Some(1.0));
}

#[test]
fn budget_and_failure_settings_parse_and_validate_with_their_place() {
    let text = r#"
pools:
  - name: p
    tokenizer: approx
    index: picks
    endpoints: [{ address: "127.0.0.1:8001" }]
    tokenizeBudget: { maxBytes: 65536, maxPieceBytes: 2048 }
    failures: { halfLifeMs: 5000, minRequests: 20, errorRatio: 0.8, coolDownMs: 1000 }
"#;
    let cfg = parse(text, "t.yaml".as_ref()).expect("parses");
    cfg.validate().expect("valid");
    let p = &cfg.pools[0];
    assert_eq!(
        (
            p.tokenize_budget.max_bytes,
            p.tokenize_budget.max_piece_bytes
        ),
        (65_536, 2048)
    );
    assert_eq!(p.failures.min_requests, 20.0);
    assert!(p.failures.enabled);
    let mut bad = cfg.clone();
    bad.pools[0].tokenize_budget.max_piece_bytes = 1 << 20;
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("pools[0].tokenizeBudget.maxPieceBytes"), "{e}");
    let mut bad = cfg.clone();
    bad.pools[0].failures.error_ratio = 0.0;
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("pools[0].failures.errorRatio"), "{e}");
    assert!(parse(
        "pools: [{ name: p, failures: { errRatio: 1 } }]",
        "t.yaml".as_ref()
    )
    .is_err());
}

/// An engine that resets every request before answering: Envoy retries each
/// on the pick's next endpoint, so every report is a SUCCESS, but served by
/// another engine than the one picked. That counts against the picked one,
/// so it stops being picked first (Envoy's override-host would keep
/// sending it every request's first attempt).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_whose_requests_are_served_elsewhere_counts_as_failing() {
    let sims = Sim::start_many(3).await;
    let mut cfg: Config = config(&sims.iter().collect::<Vec<_>>());
    cfg.pools[0].failures.min_requests = 5.0;
    let ix = start_indexer(&cfg).await;
    ix.wait_ready().await;
    let bad = sims[0].address();
    let other = sims[1].address();
    let mut first_on_bad = 0;
    for i in 0..60 {
        let id = format!("retried-{i}");
        let ids: Vec<u32> = (0..64).map(|k| 5000 + (i * 64 + k) as u32).collect();
        let p = ix.pick(ids_pick(&id, ids)).await;
        let first = p.endpoints[0].address.clone();
        let served = if first == bad {
            first_on_bad += 1;
            other.clone()
        } else {
            first
        };
        ix.report(done(&id, &served, pb::Outcome::Success)).await;
    }
    assert!(first_on_bad >= 5, "the bad endpoint was never picked first");
    let m = ix.metrics().await;
    assert_eq!(gauge(&m, "kvasir_indexer_endpoint_failing", &bad), 1.0);
    assert_eq!(gauge(&m, "kvasir_indexer_endpoint_failing", &other), 0.0);
    // Failing: ranked after the others (its cool-down is 5 s by default).
    let p = ix
        .pick(ids_pick("after", (0..64).map(|k| 90_000 + k).collect()))
        .await;
    assert_ne!(p.endpoints[0].address, bad);
}
