//! Budgets shared by two indexer replicas through a real `redis-server`
//! (started on a free loopback port, no persistence, killed at the end):
//! one tenant at 10 requests a minute gets exactly 10 admissions across
//! both replicas; a report sent to the other replica settles and releases
//! the reservation; with Redis killed every pick is still answered within
//! the store's bound, decided by `onStoreDown` and counted; with Redis back
//! the budget is shared again. The endpoints are loopback addresses
//! nothing serves: admission comes before ranking, so the answers past it
//! (NO_ENDPOINTS) are not what is tested.
//!
//! Fails, naming the package, where `redis-server` is not installed
//! (`make setup` installs it): never skipped.

use crate::responses_support;
use crate::service_support;
use std::time::{Duration, Instant};

use kvasir_cache_indexer::budgets::config::{BudgetStoreKind, BudgetsConfig};
use kvasir_cache_indexer::budgets::redis::OnStoreDown;
use kvasir_cache_indexer::responses::config::ResponsesConfig;
use kvasir_proto::v1 as pb;
use responses_support::{config, Redis};
use service_support::{ids_pick, metric_value, start_indexer, Running, POOL};

/// Bound of one Redis call in these tests, and the retry delay.
const TIMEOUT_MS: u64 = 200;
const RETRY_MS: u64 = 300;

fn budgets(redis: &Redis, on_down: OnStoreDown) -> BudgetsConfig {
    BudgetsConfig {
        store: BudgetStoreKind::Redis,
        redis_url: Some(redis.url()),
        key_prefix: "kvasir:test:".into(),
        timeout_ms: TIMEOUT_MS,
        retry_ms: RETRY_MS,
        on_store_down: on_down,
        replicas: Some(2),
    }
}

async fn replica(b: &BudgetsConfig) -> Running {
    let mut cfg = config(2, &ResponsesConfig::default());
    cfg.budgets = b.clone();
    start_indexer(&cfg).await
}

fn pick(rid: &str, tenant: &str, prompt: u32, budget: &pb::Budget) -> pb::PickRequest {
    let mut p = ids_pick(rid, (0..prompt).collect());
    p.tenant = tenant.into();
    p.budget = Some(pb::Budget {
        key: tenant.into(),
        cached_token_weight_permille: 1000,
        ..budget.clone()
    });
    p
}

fn rpm(n: u64) -> pb::Budget {
    pb::Budget {
        requests_per_minute: n,
        ..Default::default()
    }
}

fn is_limited(p: &pb::PickResponse) -> bool {
    p.decision == pb::Decision::RateLimited as i32
}

fn done(rid: &str, tenant: &str, usage: (u32, u32)) -> pb::ReportRequest {
    pb::ReportRequest {
        pool: POOL.into(),
        request_id: rid.into(),
        budget_key: tenant.into(),
        phase: pb::ReportPhase::Done as i32,
        outcome: pb::Outcome::Success as i32,
        prompt_tokens: usage.0,
        completion_tokens: usage.1,
        ..Default::default()
    }
}

/// Sends `n` picks of `tenant`, alternating between the replicas, two at a
/// time; returns how many each admitted.
async fn spread(
    a: &Running,
    b: &Running,
    tenant: &str,
    n: usize,
    budget: &pb::Budget,
) -> (usize, usize) {
    let (mut on_a, mut on_b) = (0, 0);
    for i in (0..n).step_by(2) {
        let (pa, pb_) = tokio::join!(
            a.pick(pick(&format!("{tenant}-{i}"), tenant, 16, budget)),
            b.pick(pick(&format!("{tenant}-{}", i + 1), tenant, 16, budget)),
        );
        on_a += usize::from(!is_limited(&pa));
        on_b += usize::from(!is_limited(&pb_));
    }
    (on_a, on_b)
}

async fn metric(ix: &Running, prefix: &str) -> f64 {
    metric_value(&ix.metrics().await, prefix).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_enforce_one_budget_and_settle_each_others_reports() {
    let redis = Redis::start().await;
    let cfg = budgets(&redis, OnStoreDown::Local);
    let (a, b) = (replica(&cfg).await, replica(&cfg).await);

    // 30 picks over both replicas at 10 a minute: exactly 10 admitted, in
    // all, whichever replica each reached.
    let (on_a, on_b) = spread(&a, &b, "acme", 30, &rpm(10)).await;
    assert_eq!(on_a + on_b, 10, "a admitted {on_a}, b {on_b}");
    assert!(on_a > 0 && on_b > 0, "a {on_a}, b {on_b}");
    // Each replica's refusal carries the shared budget's figures.
    let p = b.pick(pick("acme-late", "acme", 16, &rpm(10))).await;
    let s = p.budget.expect("status");
    assert_eq!(
        (
            s.limited_by.as_str(),
            s.limit_requests,
            s.remaining_requests
        ),
        ("requests", 10, 0)
    );
    assert!(
        (1..=6_000).contains(&s.retry_after_ms),
        "{}",
        s.retry_after_ms
    );

    // Tokens: 1,000 a minute; a pick of 100 prompt tokens and max_tokens
    // 500 holds 600, so a second one does not fit anywhere...
    let tpm = pb::Budget {
        tokens_per_minute: 1_000,
        max_tokens: 500,
        ..Default::default()
    };
    assert!(!is_limited(&a.pick(pick("t-1", "tok", 100, &tpm)).await));
    // (The budget refills 1 token every 60 ms: a few come back while the
    // test runs, more on a loaded machine.)
    let s = b
        .pick(pick("t-2", "tok", 100, &tpm))
        .await
        .budget
        .expect("status");
    assert_eq!(s.limited_by, "tokens");
    assert!((400..=450).contains(&s.remaining_tokens), "{s:?}");
    // ...until its DONE, sent to the other replica, gives back 490 of them.
    b.report(done("t-1", "tok", (100, 10))).await;
    let s = a
        .pick(pick("t-3", "tok", 100, &tpm))
        .await
        .budget
        .expect("status");
    assert!(s.limited_by.is_empty(), "{s:?}");
    assert!((290..=340).contains(&s.remaining_tokens), "{s:?}");
    // A second DONE of the same request changes nothing (idempotent).
    b.report(done("t-1", "tok", (100, 10))).await;
    let s = b
        .pick(pick("t-4", "tok", 100, &tpm))
        .await
        .budget
        .expect("status");
    assert_eq!(s.limited_by, "tokens");
    assert!((290..=350).contains(&s.remaining_tokens), "{s:?}");

    for ix in [&a, &b] {
        let m = ix.metrics().await;
        assert!(
            m.contains("kvasir_indexer_budget_store{store=\"redis\"} 1\n"),
            "{m}"
        );
        for op in ["reserve", "settle", "release", "cancel"] {
            let errors: f64 = ["down", "timeout", "failed", "malformed"]
                .iter()
                .map(|e| {
                    let line = format!(
                        "kvasir_indexer_budget_store_errors_total{{op=\"{op}\",error=\"{e}\"}}"
                    );
                    metric_value(&m, &line).expect("the family is written")
                })
                .sum();
            assert_eq!(errors, 0.0, "{op}: {m}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_down_picks_are_answered_locally_and_counted_then_shared_again() {
    let mut redis = Redis::start().await;
    let cfg = budgets(&redis, OnStoreDown::Local);
    let (a, b) = (replica(&cfg).await, replica(&cfg).await);
    assert!(!is_limited(
        &a.pick(pick("warm", "warm", 16, &rpm(10))).await
    ));

    redis.kill();
    // Every pick is answered within the store's bound (connect included),
    // never a hang; the first one on each replica pays at most that bound,
    // the rest find Redis left alone.
    let started = Instant::now();
    let (on_a, on_b) = spread(&a, &b, "down", 20, &rpm(10)).await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(10 * 2 * TIMEOUT_MS),
        "{took:?}"
    );
    // Each replica enforces its share: 10 / 2 replicas = 5 each.
    assert_eq!((on_a, on_b), (5, 5));
    for ix in [&a, &b] {
        let failed = metric(
            ix,
            "kvasir_indexer_budget_store_errors_total{op=\"reserve\",error=\"failed\"}",
        )
        .await
            + metric(
                ix,
                "kvasir_indexer_budget_store_errors_total{op=\"reserve\",error=\"timeout\"}",
            )
            .await
            + metric(
                ix,
                "kvasir_indexer_budget_store_errors_total{op=\"reserve\",error=\"down\"}",
            )
            .await;
        assert!(failed >= 10.0, "{failed}");
        let line =
            "kvasir_indexer_budget_store_down_picks_total{mode=\"local\",decision=\"admitted\"}";
        assert_eq!(metric(ix, line).await, 5.0);
        let line =
            "kvasir_indexer_budget_store_down_picks_total{mode=\"local\",decision=\"limited\"}";
        assert_eq!(metric(ix, line).await, 5.0);
    }
    // A report of a request admitted locally settles on that replica.
    a.report(done("down-0", "down", (16, 1))).await;
    assert!(metric(&a, "kvasir_indexer_budget_store_local_reports_total").await >= 1.0);

    // Redis back (empty: no persistence): after the retry delay the
    // budget is shared again, exactly 4 of 12 at 4 a minute.
    redis.restart().await;
    tokio::time::sleep(Duration::from_millis(RETRY_MS + 100)).await;
    let (on_a, on_b) = spread(&a, &b, "back", 12, &rpm(4)).await;
    assert_eq!(on_a + on_b, 4, "a {on_a}, b {on_b}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_refuses_and_open_admits_while_redis_is_down() {
    let mut redis = Redis::start().await;
    let closed = replica(&budgets(&redis, OnStoreDown::Closed)).await;
    let open = replica(&budgets(&redis, OnStoreDown::Open)).await;
    redis.kill();
    for i in 0..3 {
        let p = closed
            .pick(pick(&format!("c{i}"), "t", 16, &rpm(100)))
            .await;
        let s = p.budget.clone().expect("status");
        assert!(is_limited(&p), "{p:?}");
        assert_eq!(
            (s.limited_by.as_str(), s.retry_after_ms),
            ("store", RETRY_MS)
        );
        let p = open.pick(pick(&format!("o{i}"), "t", 16, &rpm(1))).await;
        assert!(!is_limited(&p), "{p:?}");
    }
    let line = "kvasir_indexer_budget_store_down_picks_total{mode=\"closed\",decision=\"limited\"}";
    assert_eq!(metric(&closed, line).await, 3.0);
    let line = "kvasir_indexer_budget_store_down_picks_total{mode=\"open\",decision=\"admitted\"}";
    assert_eq!(metric(&open, line).await, 3.0);
}
