//! Token budgets in one indexer (the in-process store) over real gRPC: a
//! budgeted pick reserves its prompt plus output estimate, a refusal is
//! RATE_LIMITED with the budget's status (which limit, when to retry, the
//! `x-ratelimit-*` values), and reports settle, release or cancel the
//! reservation (unary and over a `Session` stream). The endpoints are
//! loopback addresses nothing serves: admission comes before ranking, so
//! the answers past it are NO_ENDPOINTS, which is not what is tested.
//! In process, with flow control: a pick shed from the queue, or whose
//! caller goes away while it waits, gives its reservation back.

use crate::flow_support;
use crate::responses_support;
use crate::service_support;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flow_support::flow_pool;
use kvasir_cache_indexer::load::EngineLoad;
use kvasir_cache_indexer::responses::config::ResponsesConfig;
use kvasir_cache_indexer::Pool;
use kvasir_flowcontrol::FlowControlConfig;
use kvasir_proto::v1 as pb;
use responses_support::{indexer, Session};
use service_support::{ids_pick, metric_value, Running, POOL};

async fn start() -> Running {
    indexer(2, &ResponsesConfig::default()).await
}

/// A pick of `prompt` token ids under `budget` (its key set to `tenant`).
fn pick(rid: &str, tenant: &str, prompt: u32, budget: &pb::Budget) -> pb::PickRequest {
    let mut p = ids_pick(rid, (0..prompt).collect());
    p.tenant = tenant.into();
    p.budget = Some(pb::Budget {
        key: tenant.into(),
        ..budget.clone()
    });
    p
}

fn rpm(n: u64) -> pb::Budget {
    pb::Budget {
        requests_per_minute: n,
        cached_token_weight_permille: 1000,
        ..Default::default()
    }
}

fn tpm(n: u64, max_tokens: u32) -> pb::Budget {
    pb::Budget {
        tokens_per_minute: n,
        cached_token_weight_permille: 1000,
        max_tokens,
        ..Default::default()
    }
}

/// A report of `rid` (budget key `tenant`) in `phase` with usage.
fn report(
    rid: &str,
    tenant: &str,
    phase: pb::ReportPhase,
    outcome: pb::Outcome,
    usage: (u32, u32),
) -> pb::ReportRequest {
    pb::ReportRequest {
        pool: POOL.into(),
        request_id: rid.into(),
        budget_key: tenant.into(),
        phase: phase as i32,
        outcome: outcome as i32,
        prompt_tokens: usage.0,
        completion_tokens: usage.1,
        ..Default::default()
    }
}

fn done(rid: &str, tenant: &str, usage: (u32, u32)) -> pb::ReportRequest {
    let (phase, ok) = (pb::ReportPhase::Done, pb::Outcome::Success);
    report(rid, tenant, phase, ok, usage)
}

fn is_limited(p: &pb::PickResponse) -> bool {
    p.decision == pb::Decision::RateLimited as i32
}

/// The status of a RATE_LIMITED answer; panics on any other.
fn limited(p: &pb::PickResponse) -> &pb::BudgetStatus {
    assert!(is_limited(p), "{p:?}");
    assert_eq!(p.reason, "rate_limited");
    assert!(p.endpoints.is_empty(), "{p:?}");
    p.budget.as_ref().expect("a refusal carries the budget")
}

/// The status of an admitted answer; panics on a refusal.
fn admitted(p: &pb::PickResponse) -> &pb::BudgetStatus {
    assert!(!is_limited(p), "{p:?}");
    let s = p
        .budget
        .as_ref()
        .expect("an admitted budgeted pick carries the budget");
    assert!(s.limited_by.is_empty(), "{s:?}");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_per_minute_admits_two_then_limits_with_retry_and_headers() {
    let ix = start().await;
    let b = rpm(2);
    let s = admitted(&ix.pick(pick("r1", "a", 10, &b)).await).clone();
    assert_eq!((s.limit_requests, s.remaining_requests), (2, 1));
    assert_eq!(s.limit_tokens, 0, "no token budget: no token headers");
    let s = admitted(&ix.pick(pick("r2", "a", 10, &b)).await).clone();
    assert_eq!(s.remaining_requests, 0);

    let p = ix.pick(pick("r3", "a", 10, &b)).await;
    assert_eq!(p.prompt_tokens, 10);
    let s = limited(&p);
    assert_eq!(s.limited_by, "requests");
    // One request refills every 30 s; a few ms went by since the first.
    assert!(
        (29_000..=30_000).contains(&s.retry_after_ms),
        "{}",
        s.retry_after_ms
    );
    assert_eq!((s.limit_requests, s.remaining_requests), (2, 0));
    assert!(
        (59_000..=60_000).contains(&s.reset_requests_ms),
        "{}",
        s.reset_requests_ms
    );
    // Unbudgeted picks (and other tenants) are not affected.
    let p = ix.pick(ids_pick("r4", (0..10).collect())).await;
    assert!(!is_limited(&p) && p.budget.is_none(), "{p:?}");
    admitted(&ix.pick(pick("r5", "b", 10, &b)).await);

    let m = ix.metrics().await;
    for line in [
        "kvasir_indexer_budget_requests_total{tenant=\"a\",decision=\"admitted\"} 2\n",
        "kvasir_indexer_budget_requests_total{tenant=\"a\",decision=\"limited\"} 1\n",
        "kvasir_indexer_budget_requests_total{tenant=\"b\",decision=\"admitted\"} 1\n",
        "kvasir_indexer_budget_limited_total{tenant=\"a\",limited_by=\"requests\"} 1\n",
        "kvasir_indexer_budget_open_reservations 3\n",
        "kvasir_indexer_budget_store{store=\"memory\"} 1\n",
        "kvasir_indexer_picks_total{pool=\"sims\",decision=\"rate_limited\"} 1\n",
    ] {
        assert!(m.contains(line), "no `{line}` in\n{m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_per_minute_reserves_prompt_and_max_tokens_and_release_gives_the_rest_back() {
    let ix = start().await;
    // Each pick reserves 100 prompt + 700 completion of 1000 a minute.
    let b = tpm(1000, 700);
    let s = admitted(&ix.pick(pick("a1", "a", 100, &b)).await).clone();
    assert_eq!((s.limit_tokens, s.remaining_tokens), (1000, 200));
    let s = limited(&ix.pick(pick("a2", "a", 100, &b)).await).clone();
    assert_eq!(s.limited_by, "tokens");
    assert_eq!(s.remaining_tokens, 200);
    // 600 short at 1000 a minute: 36 s.
    assert!(
        (35_000..=36_000).contains(&s.retry_after_ms),
        "{}",
        s.retry_after_ms
    );
    // Another tenant has its own budget.
    admitted(&ix.pick(pick("b1", "b", 100, &b)).await);

    // a1 streams (usage so far) and ends having used 10 of its 700.
    let usage = report(
        "a1",
        "a",
        pb::ReportPhase::Usage,
        pb::Outcome::Unspecified,
        (100, 5),
    );
    assert!(
        !ix.report(usage).await.matched,
        "USAGE is not a load report"
    );
    ix.report(done("a1", "a", (100, 10))).await;
    let s = admitted(&ix.pick(pick("a2", "a", 100, &b)).await).clone();
    assert_eq!(s.remaining_tokens, 1000 - 110 - 800);

    let m = ix.metrics().await;
    let v = |name: &str| metric_value(&m, &format!("{name}{{tenant=\"a\"}}"));
    assert_eq!(
        v("kvasir_indexer_budget_tokens_reserved_total"),
        Some(1600.0)
    );
    assert_eq!(v("kvasir_indexer_budget_tokens_settled_total"), Some(110.0));
    assert_eq!(
        v("kvasir_indexer_budget_tokens_refunded_total"),
        Some(690.0)
    );
    assert_eq!(v("kvasir_indexer_budget_tokens_overrun_total"), Some(0.0));
    for line in [
        "kvasir_indexer_budget_reports_total{op=\"settle\",result=\"matched\"} 1\n",
        "kvasir_indexer_budget_reports_total{op=\"release\",result=\"matched\"} 1\n",
        "kvasir_indexer_budget_limited_total{tenant=\"a\",limited_by=\"tokens\"} 1\n",
        "kvasir_indexer_budget_tokens_limited_total{tenant=\"a\"} 800\n",
    ] {
        assert!(m.contains(line), "no `{line}` in\n{m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_beyond_the_reservation_is_charged_as_it_streams() {
    let ix = start().await;
    // No max_tokens: the default estimate (50) is reserved.
    let b = pb::Budget {
        default_output_tokens: 50,
        ..tpm(1000, 0)
    };
    let s = admitted(&ix.pick(pick("a1", "a", 100, &b)).await).clone();
    assert_eq!(s.remaining_tokens, 850);
    let usage = report(
        "a1",
        "a",
        pb::ReportPhase::Usage,
        pb::Outcome::Unspecified,
        (100, 400),
    );
    ix.report(usage).await;
    // 100 + 400 are taken: a pick of 100 + 50 still fits, one of 400 not.
    let s = admitted(&ix.pick(pick("a2", "a", 100, &b)).await).clone();
    assert_eq!(s.remaining_tokens, 1000 - 500 - 150);
    let s = limited(&ix.pick(pick("a3", "a", 400, &b)).await).clone();
    assert_eq!(s.limited_by, "tokens");
    let m = ix.metrics().await;
    let line = "kvasir_indexer_budget_tokens_overrun_total{tenant=\"a\"} 350\n";
    assert!(m.contains(line), "no `{line}` in\n{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_concurrency_limit_frees_on_done_over_a_session() {
    let ix = start().await;
    let b = pb::Budget {
        max_concurrent: 1,
        cached_token_weight_permille: 1000,
        ..Default::default()
    };
    let mut s = Session::open(&ix).await;
    let id = s.send_pick(pick("c1", "a", 10, &b));
    admitted(&s.answer(id).await);
    let id = s.send_pick(pick("c2", "a", 10, &b));
    let refused = s.answer(id).await;
    let st = limited(&refused);
    assert_eq!(
        (st.limited_by.as_str(), st.retry_after_ms),
        ("concurrent", 1000)
    );
    // A report on the stream is applied before the pick sent after it.
    s.report(done("c1", "a", (10, 3)));
    let id = s.send_pick(pick("c2", "a", 10, &b));
    admitted(&s.answer(id).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_request_gives_everything_back() {
    let ix = start().await;
    let b = rpm(1);
    admitted(&ix.pick(pick("r1", "a", 10, &b)).await);
    limited(&ix.pick(pick("r2", "a", 10, &b)).await);
    let rejected = report(
        "r1",
        "a",
        pb::ReportPhase::Done,
        pb::Outcome::Rejected,
        (0, 0),
    );
    ix.report(rejected).await;
    // The request itself was given back: r2 fits now.
    admitted(&ix.pick(pick("r2", "a", 10, &b)).await);
    let m = ix.metrics().await;
    let line = "kvasir_indexer_budget_reports_total{op=\"cancel\",result=\"matched\"} 1\n";
    assert!(m.contains(line), "no `{line}` in\n{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_large_unknown_reports_and_missing_ids() {
    let ix = start().await;
    // 50 + 100 of a 100-token minute: never admissible.
    let s = limited(&ix.pick(pick("t1", "a", 50, &tpm(100, 100))).await).clone();
    assert_eq!((s.limited_by.as_str(), s.retry_after_ms), ("too_large", 0));

    // A report nothing here reserved is harmless, and counted.
    let r = ix.report(done("ghost", "a", (10, 10))).await;
    assert!(!r.matched);
    admitted(&ix.pick(pick("t2", "a", 10, &tpm(100, 10))).await);

    // A budgeted pick must carry a request id and a key.
    let mut p = pick("", "a", 10, &rpm(5));
    let err = ix.client.clone().pick(p.clone()).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    p.request_id = "t3".into();
    p.budget.as_mut().unwrap().key.clear();
    let err = ix.client.clone().pick(p).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");

    let m = ix.metrics().await;
    for line in [
        "kvasir_indexer_budget_limited_total{tenant=\"a\",limited_by=\"too_large\"} 1\n",
        "kvasir_indexer_budget_reports_total{op=\"release\",result=\"unmatched\"} 1\n",
        "kvasir_indexer_budget_reservations_dropped_total{reason=\"expired\"} 0\n",
    ] {
        assert!(m.contains(line), "no `{line}` in\n{m}");
    }
}

/// A pool of one engine scraped saturated, with flow control on: every
/// pick waits (at most `max_wait_ms`).
fn saturated_pool(max_wait_ms: u64) -> Arc<Pool> {
    let flow = FlowControlConfig {
        enabled: true,
        threshold: 1.0,
        max_queued: 8,
        max_queued_per_tenant: 8,
        max_wait_ms,
        ..FlowControlConfig::default()
    };
    let pool = flow_pool(flow, 1);
    let busy = EngineLoad {
        running: 4,
        waiting: 5,
        kv_usage: 0.3,
    };
    for e in pool.endpoints().iter() {
        pool.load.record_scrape(e.id, Some(busy), Instant::now());
    }
    Arc::new(pool)
}

fn waiting_pick(rid: &str, b: &pb::Budget) -> pb::PickRequest {
    let mut p = pick(rid, "a", 10, b);
    p.pool = "p".into();
    p.max_wait_ms = 60_000;
    p
}

#[tokio::test]
async fn a_pick_shed_from_the_queue_gives_its_reservation_back() {
    let pool = saturated_pool(50);
    let b = rpm(1);
    let a = pool.pick(waiting_pick("s1", &b)).await.unwrap();
    assert_eq!(a.decision, pb::Decision::Shed as i32, "{a:?}");
    assert_eq!(a.shed_cause, "max_wait");
    assert_eq!(pool.budgets.open_reservations(), 0);
    // The request itself came back: the one a minute is free again.
    let a = pool.pick(waiting_pick("s2", &b)).await.unwrap();
    assert_eq!(a.decision, pb::Decision::Shed as i32, "{a:?}");
    let c = pool.budgets.metrics().tenant("a");
    assert_eq!((c.admitted, c.limited), (2, 0));
}

#[tokio::test]
async fn a_caller_gone_from_the_queue_gives_its_reservation_back() {
    let pool = saturated_pool(60_000);
    let p = Arc::clone(&pool);
    let task = tokio::spawn(async move { p.pick(waiting_pick("g1", &rpm(1))).await });
    let start = Instant::now();
    while pool.flow.len() != 1 {
        assert!(start.elapsed() < Duration::from_secs(10), "never queued");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(pool.budgets.open_reservations(), 1);
    task.abort();
    while pool.budgets.open_reservations() != 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "never given back"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let m = &pool.budgets.metrics().reports_matched;
    assert_eq!(m[2].get(), 1, "one cancel");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follow_up_bound_to_a_stored_response_is_budgeted_too() {
    // A Responses API follow-up (previous_response_id) takes the affinity
    // path, not the prompt stages: it must still reserve, or a tenant
    // chaining every call would never be limited.
    let ix = start().await;
    let holder = responses_support::addr(1);
    let mut first = responses_support::report("first", "resp_budget1", &holder);
    first.tenant = "a".into();
    ix.report(first).await;
    let follow = |rid: &str| {
        let mut p = responses_support::response_pick(rid, "resp_budget1");
        p.tenant = "a".into();
        p.prompt = Some(pb::pick_request::Prompt::Text("and now? ".repeat(10)));
        p.budget = Some(pb::Budget {
            key: "a".into(),
            ..rpm(2)
        });
        p
    };
    let a = ix.pick(follow("f1")).await;
    assert_eq!(responses_support::routed(&a), holder);
    let s = admitted(&a);
    assert_eq!((s.limit_requests, s.remaining_requests), (2, 1));
    admitted(&ix.pick(follow("f2")).await);
    let s = limited(&ix.pick(follow("f3")).await).clone();
    assert_eq!(s.limited_by, "requests");
    assert!(s.retry_after_ms > 0, "{s:?}");

    // An id no engine holds: nothing is served, so the reservation goes
    // back at once, the request count included (as with any cancel): a
    // tenant allowed one request a minute can ask twice.
    let lost = |rid: &str| {
        let mut p = follow(rid);
        p.response_id = "resp_nobody".into();
        p.tenant = "b".into();
        p.budget = Some(pb::Budget {
            key: "b".into(),
            ..rpm(1)
        });
        p
    };
    for rid in ["l1", "l2"] {
        let p = ix.pick(lost(rid)).await;
        responses_support::assert_unknown(&p);
    }
}
