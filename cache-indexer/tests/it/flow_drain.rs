//! A held pick released by the passage of time alone (below
//! saturation): flow control counts an engine's queued prefill work, which
//! drains at the prefill rate its first-token reports showed; while picks
//! wait, a timer looks again, so a pick goes when the engine has worked
//! its backlog down to the threshold, with no report and no scrape in
//! between. And it does not go before: without a learned rate nothing
//! drains, and the drain never passes the oldest pick in prefill without
//! its report. In process: one engine, scraped once (idle), no scrape loop.

use crate::flow_support;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flow_support::{first_token, flow_pool, pick};
use kvasir_cache_indexer::Pool;
use kvasir_flowcontrol::FlowControlConfig;
use kvasir_proto::v1 as pb;

/// Bound of every wait for something the test caused (a busy machine).
const BOUND: Duration = Duration::from_secs(10);

/// Queued prefill tokens that saturate the engine; picks wait from half.
const SATURATED: u64 = 10_000;

/// How long the learning pick's prefill takes at least.
const LEARN: Duration = Duration::from_millis(100);

/// Tokens of the learning pick: its rate is at most this over [`LEARN`]
/// (40k tokens/s).
const LEARN_TOKENS: u32 = 4000;

fn pool() -> Arc<Pool> {
    let flow = FlowControlConfig {
        enabled: true,
        threshold: 0.5,
        saturated_prefill_tokens: SATURATED,
        max_queued: 64,
        max_queued_per_tenant: 64,
        max_wait_ms: 10_000,
        ..FlowControlConfig::default()
    };
    Arc::new(flow_pool(flow, 1))
}

/// A pick of `len` tokens no other pick shares (`seed` apart).
fn req(request_id: &str, seed: u32, len: u32, max_wait_ms: u32) -> pb::PickRequest {
    let ids = (seed * 100_000..seed * 100_000 + len).collect();
    pb::PickRequest {
        pool: "p".into(),
        tenant: "t".into(),
        request_id: request_id.into(),
        prompt: Some(pb::pick_request::Prompt::TokenIds(pb::TokenIds { ids })),
        max_wait_ms,
        ..Default::default()
    }
}

/// Teaches the engine's prefill rate: one pick whose first token comes
/// [`LEARN`] after it (at most [`LEARN_TOKENS`] / [`LEARN`]).
async fn learn_rate(pool: &Pool) {
    let a = pick(pool, req("learn", 1, LEARN_TOKENS, 1000)).await;
    assert_eq!(a.queued_ms, 0, "an idle engine: it goes");
    tokio::time::sleep(LEARN).await;
    first_token(pool, "learn");
}

/// Places a pick that goes at once (room).
async fn place(pool: &Pool, id: &str, seed: u32, len: u32) {
    let a = pick(pool, req(id, seed, len, 1000)).await;
    assert_ne!(a.decision, pb::Decision::Shed as i32, "{a:?}");
    assert_eq!(a.queued_ms, 0, "{id} had room: {a:?}");
}

#[tokio::test]
async fn a_held_pick_goes_once_the_engine_has_prefilled_down_to_the_threshold() {
    let pool = pool();
    learn_rate(&pool).await;
    // 8000 tokens queued: saturation 0.8, no room at 0.5 until 3000 of
    // them are done: 75 ms at 40k tokens/s, longer at a slower rate.
    place(&pool, "long", 2, 8000).await;
    let placed = Instant::now();
    let a = tokio::time::timeout(BOUND, pick(&pool, req("held", 3, 64, 10_000)))
        .await
        .expect("released by time within the bound");
    let took = placed.elapsed();
    assert_ne!(a.decision, pb::Decision::Shed as i32, "{a:?}");
    assert!(
        a.queued_ms >= 50,
        "not before the estimate had room: {}",
        a.queued_ms
    );
    assert!(took < BOUND);
    assert!(pool.flow.recheck.ticks() > 0, "the timer released it");
    assert!(
        !pool.flow.recheck.ticking(),
        "and stopped with the queue empty"
    );
    assert!(pool.flow.is_empty());
}

#[tokio::test]
async fn without_a_learned_rate_nothing_drains() {
    let pool = pool();
    place(&pool, "long", 2, 8000).await;
    let a = tokio::time::timeout(BOUND, pick(&pool, req("held", 3, 64, 300)))
        .await
        .expect("answered within the bound");
    assert_eq!(a.decision, pb::Decision::Shed as i32, "{a:?}");
    assert_eq!(a.shed_cause, "max_wait", "{a:?}");
    assert!(
        pool.flow.recheck.ticks() > 0,
        "the timer looked, found no room"
    );
    assert!(!pool.flow.recheck.ticking());
}

#[tokio::test]
async fn the_drain_stops_at_the_oldest_prefill_until_its_report() {
    let pool = pool();
    learn_rate(&pool).await;
    // 2000 then 8000 tokens: by time alone at most the first 2000 are
    // done, 8000 stay queued (0.8): the held pick waits for the report.
    place(&pool, "short", 2, 2000).await;
    place(&pool, "long", 3, 8000).await;
    let p = Arc::clone(&pool);
    let task = tokio::spawn(async move { pick(&p, req("held", 4, 64, 10_000)).await });
    let start = Instant::now();
    while pool.flow.len() != 1 {
        assert!(start.elapsed() < BOUND, "the pick never queued");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Ten times what 2000 tokens take at the learned rate, or more.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!task.is_finished(), "no room by the estimate: it waits");
    assert!(pool.flow.recheck.ticking(), "the timer runs while it waits");
    // The short pick's first token: the long one drains from now.
    first_token(&pool, "short");
    let a = tokio::time::timeout(BOUND, task)
        .await
        .expect("released within the bound")
        .expect("the pick task ran");
    assert_ne!(a.decision, pb::Decision::Shed as i32, "{a:?}");
    assert!(a.queued_ms >= 500, "{a:?}");
    assert!(!pool.flow.recheck.ticking());
}
