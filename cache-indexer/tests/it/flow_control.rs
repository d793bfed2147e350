//! Flow control in the pick path, in process: pools whose
//! engines' load is set by recorded scrapes, picks that wait while every
//! engine is saturated, and DONE reports of picks the scrape counted that
//! free one slot each. Late binding (a released pick goes where the room
//! is, not where its prefix was), priority bands, token-weighted fair
//! share, the bounds (maximum wait, pool and tenant queue lengths, callers
//! that cannot wait), a caller that goes away, flow control off, and the
//! config's checks.

use crate::flow_support;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flow_support::{done, flow_pool, pick};
use kvasir_cache_indexer::config;
use kvasir_cache_indexer::load::EngineLoad;
use kvasir_cache_indexer::Pool;
use kvasir_flowcontrol::FlowControlConfig;
use kvasir_proto::v1 as pb;
use tokio::task::JoinHandle;

/// Bound of every wait for something the test caused (a busy machine).
const BOUND: Duration = Duration::from_secs(10);

fn flow_on(max_queued: usize, per_tenant: usize, max_wait_ms: u64) -> FlowControlConfig {
    FlowControlConfig {
        enabled: true,
        threshold: 1.0,
        max_queued,
        max_queued_per_tenant: per_tenant,
        max_wait_ms,
        // (The fair order and bounds by request counts alone; the
        // reserve's and the work term's tests set them.)
        reserve: 0.0,
        saturated_prefill_tokens: 0,
        ..FlowControlConfig::default()
    }
}

/// A pool of `n` idle engines whose index is its own picks (block size 16).
fn pool(flow: FlowControlConfig, n: usize) -> Arc<Pool> {
    Arc::new(flow_pool(flow, n))
}

/// Every engine of `pool` scraped now with this load.
fn scrape_all(pool: &Pool, running: u32, waiting: u32, kv_usage: f64) {
    let load = EngineLoad {
        running,
        waiting,
        kv_usage,
    };
    for e in pool.endpoints().iter() {
        pool.load.record_scrape(e.id, Some(load), Instant::now());
    }
}

fn ids(start: u32, len: u32) -> Vec<u32> {
    (start..start + len).collect()
}

fn req(request_id: &str, tenant: &str, prompt: Vec<u32>) -> pb::PickRequest {
    pb::PickRequest {
        pool: "p".into(),
        tenant: tenant.into(),
        request_id: request_id.into(),
        prompt: Some(pb::pick_request::Prompt::TokenIds(pb::TokenIds {
            ids: prompt,
        })),
        max_wait_ms: 60_000,
        ..Default::default()
    }
}

fn with_priority(mut r: pb::PickRequest, priority: i32) -> pb::PickRequest {
    r.hints = Some(pb::Hints {
        priority,
        ..Default::default()
    });
    r
}

/// Starts a pick as its own task and waits until it is in the queue.
async fn queued(pool: &Arc<Pool>, r: pb::PickRequest) -> JoinHandle<pb::PickResponse> {
    let before = pool.flow.len();
    let p = Arc::clone(pool);
    let task = tokio::spawn(async move { pick(&p, r).await });
    wait_len(pool, before + 1).await;
    task
}

async fn wait_len(pool: &Pool, n: usize) {
    let start = Instant::now();
    while pool.flow.len() != n {
        assert!(
            start.elapsed() < BOUND,
            "queue length {} never became {n}",
            pool.flow.len()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn answer(task: JoinHandle<pb::PickResponse>) -> pb::PickResponse {
    tokio::time::timeout(BOUND, task)
        .await
        .expect("answered in time")
        .expect("the pick task ran")
}

/// Places `n` picks on idle engines (ids `f0`..) before the engines are
/// scraped busy: the scrape counts them, so each DONE frees a slot.
async fn fillers(pool: &Pool, n: usize) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for i in 0..n {
        let id = format!("f{i}");
        let a = pick(
            pool,
            req(&id, "filler", ids(1_000_000 + 1000 * i as u32, 32)),
        )
        .await;
        out.push((id, a.endpoints[0].address.clone()));
    }
    out
}

fn is_shed(a: &pb::PickResponse, cause: &str) -> bool {
    a.decision == pb::Decision::Shed as i32
        && a.reason == "shed"
        && a.shed_cause == cause
        && a.endpoints.is_empty()
}

/// Late binding: a pick whose prompt's prefix is on engine `home` arrives
/// while both engines are saturated; a DONE frees a slot on the other.
/// Returns where it went.
async fn late_binding_scenario(flow: FlowControlConfig) -> (String, String, pb::PickResponse) {
    let pool = pool(flow, 2);
    let prompt = ids(0, 64);
    let home = pick(&pool, req("r0", "t", prompt.clone())).await.endpoints[0]
        .address
        .clone();
    // A pick on the other engine, in flight when the engines saturate.
    let mut other = None;
    for i in 0..16u32 {
        let id = format!("o{i}");
        let a = pick(&pool, req(&id, "t", ids(10_000 * (i + 1), 32))).await;
        if a.endpoints[0].address != home {
            other = Some((id, a.endpoints[0].address.clone()));
            break;
        }
    }
    let (other_id, other) = other.expect("a pick landed on the other engine");
    scrape_all(&pool, 2, 5, 0.3);
    let mut longer = prompt;
    longer.extend(ids(500, 64));
    let r = req("late", "t", longer);
    let a = if pool.flow.enabled() {
        let task = queued(&pool, r).await;
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(!task.is_finished(), "no room: it waits");
        done(&pool, &other_id);
        answer(task).await
    } else {
        pick(&pool, r).await
    };
    (home, other, a)
}

#[tokio::test]
async fn a_waiting_pick_is_released_by_a_done_and_placed_where_the_room_is() {
    let (home, other, a) = late_binding_scenario(flow_on(64, 64, 10_000)).await;
    assert_eq!(a.endpoints.len(), 1, "only the engine with room: {a:?}");
    assert_eq!(a.endpoints[0].address, other);
    assert_ne!(other, home);
    assert_eq!(a.endpoints[0].predicted_cached_tokens, 0);
    assert!(a.queued_ms >= 25, "queued_ms {}", a.queued_ms);
    assert_ne!(a.decision, pb::Decision::Shed as i32);
    // Without flow control the same pick goes at once where its prefix is
    // (both engines saturated).
    let (home, _, a) = late_binding_scenario(FlowControlConfig::default()).await;
    assert_eq!(a.endpoints[0].address, home);
    assert!(a.endpoints[0].predicted_cached_tokens >= 48, "{a:?}");
    assert_eq!(a.queued_ms, 0);
}

#[tokio::test]
async fn the_more_urgent_band_is_released_first() {
    let pool = pool(flow_on(64, 64, 10_000), 1);
    let f = fillers(&pool, 2).await;
    scrape_all(&pool, 2, 5, 0.3);
    let batch = queued(&pool, with_priority(req("batch", "a", ids(0, 48)), 1)).await;
    let urgent = queued(&pool, with_priority(req("urgent", "b", ids(100, 48)), 0)).await;
    done(&pool, &f[0].0);
    let a = answer(urgent).await;
    assert_eq!(a.endpoints.len(), 1);
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(!batch.is_finished(), "one freed slot, one release");
    assert_eq!(pool.flow.len(), 1);
    done(&pool, &f[1].0);
    let b = answer(batch).await;
    assert_eq!(b.endpoints.len(), 1);
    assert_eq!(pool.flow.metrics.released.get(), 2);
}

#[tokio::test]
async fn tenants_of_equal_weight_get_equal_tokens_not_equal_requests() {
    const RELEASES: usize = 50;
    let pool = pool(flow_on(1024, 512, 60_000), 1);
    let f = fillers(&pool, RELEASES).await;
    scrape_all(&pool, RELEASES as u32, 5, 0.5);
    let mut tasks = Vec::new();
    for i in 0..4u32 {
        let r = req(&format!("x{i}"), "x", ids(2_000_000 + 40_000 * i, 30_000));
        tasks.push(("x", queued(&pool, r).await));
    }
    for i in 0..100u32 {
        let r = req(&format!("y{i}"), "y", ids(4_000_000 + 2_000 * i, 1_000));
        tasks.push(("y", queued(&pool, r).await));
    }
    for (id, _) in &f {
        done(&pool, id);
    }
    wait_len(&pool, 104 - RELEASES).await;
    let start = Instant::now();
    while tasks.iter().filter(|(_, t)| t.is_finished()).count() < RELEASES {
        assert!(start.elapsed() < BOUND, "released picks answer");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (mut tokens, mut requests) = ([0u64; 2], [0usize; 2]);
    for (tenant, t) in tasks {
        if !t.is_finished() {
            t.abort();
            continue;
        }
        let a = answer(t).await;
        assert!(!a.endpoints.is_empty());
        let i = usize::from(tenant == "y");
        // Charged as prompt + the default output estimate (no max_tokens).
        tokens[i] += u64::from(a.prompt_tokens) + 256;
        requests[i] += 1;
    }
    assert_eq!(requests[0] + requests[1], RELEASES);
    let gap = tokens[0].abs_diff(tokens[1]);
    assert!(
        gap <= 30_256,
        "tokens released x {} y {} (requests {requests:?}): within one large request",
        tokens[0],
        tokens[1]
    );
    assert!(requests[1] >= 10 * requests[0], "requests {requests:?}");
    assert!(requests[0] >= 1, "the large tenant is not starved");
}

#[tokio::test]
async fn a_pick_that_waits_its_longest_is_shed_within_the_bound() {
    let pool = pool(flow_on(64, 64, 10_000), 2);
    scrape_all(&pool, 4, 5, 0.3);
    let mut r = req("w", "t", ids(0, 40));
    r.max_wait_ms = 200;
    let start = Instant::now();
    let a = pick(&pool, r).await;
    let waited = start.elapsed();
    assert!(is_shed(&a, "max_wait"), "{a:?}");
    assert!(
        waited >= Duration::from_millis(190) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    assert_eq!(a.prompt_tokens, 40);
    assert_eq!(a.pool_saturation, 1.0);
    assert!(a.queued_ms >= 190, "queued_ms {}", a.queued_ms);
    assert_eq!(pool.flow.len(), 0);
    let m = &pool.flow.metrics;
    assert_eq!(m.shed[3].get(), 1, "max_wait counted once");
    // The pool's own maximum holds for a caller that would wait longer.
    let short = pool_with_wait(100);
    let start = Instant::now();
    let a = pick(&short, req("w2", "t", ids(0, 40))).await;
    assert!(is_shed(&a, "max_wait"), "{a:?}");
    assert!(start.elapsed() < Duration::from_secs(3));
}

fn pool_with_wait(max_wait_ms: u64) -> Arc<Pool> {
    let p = pool(flow_on(64, 64, max_wait_ms), 1);
    scrape_all(&p, 4, 5, 0.3);
    p
}

#[tokio::test]
async fn full_queues_and_callers_that_cannot_wait_are_shed() {
    let pool = pool(flow_on(2, 1, 10_000), 1);
    scrape_all(&pool, 4, 5, 0.3);
    let a1 = queued(&pool, req("a1", "a", ids(0, 20))).await;
    let a2 = pick(&pool, req("a2", "a", ids(100, 20))).await;
    assert!(is_shed(&a2, "tenant_full"), "{a2:?}");
    let b1 = queued(&pool, req("b1", "b", ids(200, 20))).await;
    let c1 = pick(&pool, req("c1", "c", ids(300, 20))).await;
    assert!(is_shed(&c1, "pool_full"), "{c1:?}");
    assert_eq!(c1.prompt_tokens, 20);
    let mut now = req("d1", "d", ids(400, 20));
    now.max_wait_ms = 0;
    let d1 = pick(&pool, now).await;
    assert!(is_shed(&d1, "no_wait"), "{d1:?}");
    assert_eq!(pool.flow.len(), 2);
    let shed: Vec<u64> = pool.flow.metrics.shed.iter().map(|c| c.get()).collect();
    assert_eq!(
        shed,
        [1, 1, 1, 0],
        "pool_full, tenant_full, no_wait, max_wait"
    );
    a1.abort();
    b1.abort();
    wait_len(&pool, 0).await;
}

#[tokio::test]
async fn a_caller_that_goes_away_leaves_the_queue() {
    let pool = pool(flow_on(8, 8, 10_000), 1);
    let f = fillers(&pool, 1).await;
    scrape_all(&pool, 1, 5, 0.3);
    let gone = queued(&pool, req("gone", "t", ids(0, 20))).await;
    let stays = queued(&pool, req("stays", "u", ids(100, 20))).await;
    gone.abort();
    wait_len(&pool, 1).await;
    assert_eq!(pool.flow.metrics.cancelled.get(), 1);
    assert_eq!(pool.flow.tenants().len(), 1);
    done(&pool, &f[0].0);
    assert_eq!(answer(stays).await.endpoints.len(), 1);
    assert_eq!((pool.flow.len(), pool.flow.in_transit()), (0, 0));
}

#[tokio::test]
async fn flow_control_off_changes_nothing() {
    let pool = pool(FlowControlConfig::default(), 2);
    scrape_all(&pool, 4, 5, 0.3);
    let start = Instant::now();
    for i in 0..20u32 {
        let a = pick(&pool, req(&format!("r{i}"), "t", ids(100 * i, 20))).await;
        assert_eq!(a.endpoints.len(), 2);
        assert_eq!((a.queued_ms, a.shed_cause.as_str()), (0, ""));
        assert_eq!(a.decision, pb::Decision::AllSaturated as i32);
    }
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(pool.flow.len(), 0);
    assert_eq!(pool.flow.metrics.queued.get(), 0);
}

#[test]
fn the_config_names_the_bad_flow_control_setting() {
    let yaml = |flow: &str| {
        format!(
            "pools:\n  - name: a\n    tokenizer: approx\n    endpoints:\n      - {{ address: \"127.0.0.1:8001\", events: \"tcp://127.0.0.1:5557\" }}\n    flowControl: {flow}\n"
        )
    };
    let check = |flow: &str| {
        let cfg = config::parse(&yaml(flow), Path::new("t.yaml")).expect("parses");
        cfg.validate().map_err(|e| e.to_string())
    };
    let ok = config::parse(
        &yaml("{ enabled: true, threshold: 0.8, maxWaitMs: 2000 }"),
        Path::new("t.yaml"),
    )
    .unwrap();
    ok.validate().unwrap();
    assert!(ok.pools[0].flow_control.enabled);
    assert_eq!(ok.pools[0].flow_control.max_wait_ms, 2000);
    let e = check("{ enabled: true, threshold: 0 }").unwrap_err();
    assert!(e.contains("pools[0].flowControl.threshold"), "{e}");
    let e = check("{ maxQueued: 4, maxQueuedPerTenant: 5 }").unwrap_err();
    assert!(e.contains("pools[0].flowControl.maxQueuedPerTenant"), "{e}");
    assert!(config::parse(&yaml("{ treshold: 1 }"), Path::new("t.yaml")).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_reports_release_exactly_one_pick_per_freed_slot() {
    const FREED: usize = 40;
    const WAITING: usize = 100;
    let pool = pool(flow_on(1024, 1024, 60_000), 1);
    let f = fillers(&pool, FREED).await;
    scrape_all(&pool, FREED as u32, 5, 0.5);
    let tasks: Vec<JoinHandle<pb::PickResponse>> = (0..WAITING)
        .map(|i| {
            let p = Arc::clone(&pool);
            let tenant = format!("t{}", i % 7);
            let r = req(&format!("w{i}"), &tenant, ids(100_000 * (i as u32 + 1), 64));
            tokio::spawn(async move { pick(&p, r).await })
        })
        .collect();
    wait_len(&pool, WAITING).await;
    let reports: Vec<JoinHandle<()>> = f
        .into_iter()
        .map(|(id, _)| {
            let p = Arc::clone(&pool);
            tokio::spawn(async move { done(&p, &id) })
        })
        .collect();
    for r in reports {
        r.await.unwrap();
    }
    wait_len(&pool, WAITING - FREED).await;
    let start = Instant::now();
    while tasks.iter().filter(|t| t.is_finished()).count() < FREED || pool.flow.in_transit() > 0 {
        assert!(start.elapsed() < BOUND, "released picks answer");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(pool.flow.metrics.released.get(), FREED as u64);
    assert_eq!(
        pool.flow.len(),
        WAITING - FREED,
        "no more room: the rest wait"
    );
    assert_eq!(tasks.iter().filter(|t| t.is_finished()).count(), FREED);
    for t in tasks {
        t.abort();
    }
    wait_len(&pool, 0).await;
}

/// Flow control with the indexer's defaults for the work term and the
/// given reserve.
fn flow_reserved(reserve: f64) -> FlowControlConfig {
    FlowControlConfig {
        enabled: true,
        reserve,
        ..FlowControlConfig::default()
    }
}

#[tokio::test]
async fn a_tenant_under_its_share_goes_at_once_while_an_over_share_tenants_picks_wait() {
    let pool = pool(flow_reserved(0.5), 1);
    // On the idle engine: one pick of b, three of a (a holds 3/4 of the
    // work in flight, its share is 1/2).
    pick(&pool, req("b1", "b", ids(0, 32))).await;
    for i in 0..3u32 {
        pick(&pool, req(&format!("a{i}"), "a", ids(1_000 * (i + 1), 32))).await;
    }
    assert!(pool.flow.over_share("a") && !pool.flow.over_share("b"));
    // 3 of 5 waiting: saturation 0.6, room below the threshold (1.0) but
    // not below a's bound (0.5).
    scrape_all(&pool, 4, 3, 0.2);
    let a_next = queued(&pool, req("a3", "a", ids(10_000, 32))).await;
    let b = pick(&pool, req("b2", "b", ids(20_000, 32))).await;
    assert_eq!(b.endpoints.len(), 1, "{b:?}");
    assert_eq!((b.queued_ms, pool.flow.len()), (0, 1), "b went at once");
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(!a_next.is_finished(), "a's pick is held for the reserve");
    // a's first picks end: back within its share, its pick goes.
    done(&pool, "a0");
    let a = answer(a_next).await;
    assert_eq!(a.endpoints.len(), 1, "{a:?}");
    assert!(a.queued_ms >= 25, "queued_ms {}", a.queued_ms);
    assert_eq!(pool.flow.metrics.released.get(), 1);
}

/// Picks of one tenant that may not wait, on two engines scraped with
/// room: how many go before one would have to wait (it is shed).
async fn alone_through(reserve: f64) -> usize {
    let pool = pool(flow_reserved(reserve), 2);
    scrape_all(&pool, 4, 0, 0.2);
    for i in 0..200u32 {
        let mut r = req(&format!("a{i}"), "a", ids(100_000 * (i + 1), 64));
        r.max_wait_ms = 0;
        let a = pick(&pool, r).await;
        if is_shed(&a, "no_wait") {
            assert_eq!(pool.flow.len(), 0);
            return i as usize;
        }
        assert!(!a.endpoints.is_empty(), "{a:?}");
        assert!(!pool.flow.over_share("a"), "alone: never over its share");
    }
    panic!("the engines never filled");
}

#[tokio::test]
async fn a_tenant_alone_uses_the_whole_pool() {
    let all = alone_through(0.0).await;
    // Both engines take picks until KV and their queues are full (more
    // than the requests' bound of one engine alone: 5 waiting).
    assert!(all > 10, "{all}");
    assert_eq!(alone_through(0.5).await, all);
    assert_eq!(alone_through(0.9).await, all);
}

#[tokio::test]
async fn a_long_prefill_backlog_leaves_no_room() {
    let saturated = 65_536;
    let pool = pool(
        FlowControlConfig {
            saturated_prefill_tokens: u64::from(saturated),
            ..flow_reserved(0.0)
        },
        1,
    );
    scrape_all(&pool, 1, 0, 0.05);
    // One long prompt placed (nothing waiting by count): its prefill is
    // the engine's backlog until its first token.
    pick(&pool, req("long", "a", ids(0, saturated))).await;
    let next = queued(&pool, req("next", "b", ids(5_000_000, 32))).await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    assert!(!next.is_finished(), "the backlog is long: it waits");
    pool.report(&pb::ReportRequest {
        pool: "p".into(),
        request_id: "long".into(),
        phase: pb::ReportPhase::FirstToken as i32,
        ..Default::default()
    })
    .expect("a valid report");
    let a = answer(next).await;
    assert_eq!(
        a.endpoints.len(),
        1,
        "its first token frees the room: {a:?}"
    );
}

#[tokio::test]
async fn answers_carry_the_engine_priority_only_when_the_pool_asks_for_it() {
    let prioritized = FlowControlConfig {
        engine_priority: true,
        ..flow_on(64, 64, 10_000)
    };
    let pool = pool(prioritized, 2);
    scrape_all(&pool, 0, 0, 0.1);
    let a0 = pick(&pool, req("a0", "a", ids(0, 64))).await;
    let b0 = pick(&pool, req("b0", "b", ids(1000, 16))).await;
    // a holds 4x b's work: over its half, behind b in the engine.
    let a1 = pick(&pool, req("a1", "a", ids(2000, 64))).await;
    let b1 = pick(&pool, req("b1", "b", ids(3000, 16))).await;
    let batch = pick(&pool, with_priority(req("b2", "b", ids(4000, 16)), 1)).await;
    let got = [&a0, &b0, &a1, &b1, &batch].map(|a| a.engine_priority);
    assert_eq!(got, [Some(0), Some(0), Some(1), Some(0), Some(2)]);
    assert!([&a0, &a1]
        .iter()
        .all(|a| a.endpoints.len() == 2 && a.queued_ms == 0));
    // a's work done: no longer over.
    done(&pool, "a0");
    done(&pool, "a1");
    let a2 = pick(&pool, req("a2", "a", ids(5000, 16))).await;
    assert_eq!(a2.engine_priority, Some(0));

    let off = pool_with_wait(10_000);
    scrape_all(&off, 0, 0, 0.1);
    for i in 0..3u32 {
        let a = pick(&off, req(&format!("o{i}"), "a", ids(100 * i, 64))).await;
        assert_eq!(a.engine_priority, None, "off: the body keeps the client's");
    }
}

#[tokio::test]
async fn by_prefill_answers_put_the_shortest_uncached_prompt_first() {
    let by_prefill = FlowControlConfig {
        engine_priority: true,
        engine_priority_by: kvasir_flowcontrol::EnginePriorityBy::Prefill,
        ..flow_on(64, 64, 10_000)
    };
    let pool = pool(by_prefill, 2);
    scrape_all(&pool, 0, 0, 0.1);
    // Nothing cached: the whole prompt is prefill, in 256-token steps.
    let long = pick(&pool, req("long", "a", ids(0, 1000))).await;
    let short = pick(&pool, req("short", "a", ids(5000, 100))).await;
    let batch = pick(&pool, with_priority(req("b", "b", ids(9000, 100)), 1)).await;
    let got = [&long, &short, &batch].map(|a| a.engine_priority);
    assert_eq!(got, [Some(3), Some(0), Some(64)], "{long:?}");
}

#[test]
fn engine_priority_is_a_pools_file_setting() {
    let yaml = "pools:\n  - name: a\n    tokenizer: approx\n    endpoints:\n      - { address: \"127.0.0.1:8001\", events: \"tcp://127.0.0.1:5557\" }\n    flowControl: { enabled: true, enginePriority: true }\n";
    let cfg = config::parse(yaml, Path::new("t.yaml")).unwrap();
    cfg.validate().unwrap();
    assert!(cfg.pools[0].flow_control.engine_priority);
    let by_prefill = yaml.replace(
        "enginePriority: true",
        "enginePriority: true, enginePriorityBy: prefill",
    );
    let cfg = config::parse(&by_prefill, Path::new("t.yaml")).unwrap();
    assert_eq!(
        cfg.pools[0].flow_control.engine_priority_by,
        kvasir_flowcontrol::EnginePriorityBy::Prefill
    );
    let wrong = yaml.replace("enginePriority: true", "enginePriorityBy: fastest");
    let e = config::parse(&wrong, Path::new("t.yaml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("fastest"), "{e}");
}

/// Through the pick path: with `releaseOrder: quickestFirst` a freed slot
/// goes to the tenant's waiting pick with the least prefill (the shortest
/// uncached prompt), with the fair order to the oldest; each freed slot
/// releases one pick either way.
#[tokio::test]
async fn quickest_first_releases_the_shortest_prefill_and_fair_the_oldest() {
    for (order, first) in [
        (kvasir_flowcontrol::ReleaseOrder::Fair, "long"),
        (kvasir_flowcontrol::ReleaseOrder::QuickestFirst, "short"),
    ] {
        let flow = FlowControlConfig {
            release_order: order,
            ..flow_on(64, 64, 10_000)
        };
        let pool = pool(flow, 1);
        let f = fillers(&pool, 2).await;
        scrape_all(&pool, 2, 5, 0.3);
        let long = queued(&pool, req("long", "a", ids(0, 640))).await;
        let short = queued(&pool, req("short", "a", ids(5_000, 48))).await;
        done(&pool, &f[0].0);
        let (released, held) = if first == "short" {
            (short, long)
        } else {
            (long, short)
        };
        assert_eq!(answer(released).await.endpoints.len(), 1, "{order:?}");
        wait_len(&pool, 1).await;
        assert!(!held.is_finished(), "one freed slot, one release");
        done(&pool, &f[1].0);
        assert_eq!(answer(held).await.endpoints.len(), 1, "{order:?}");
    }
}
