//! Late binding that keeps prefixes: a pick held by flow control
//! and released when another engine gets room goes to the engine holding
//! its prefix while that one is only just over the threshold (the ranking
//! weighs its queue against the prefill saved), and to the engine with
//! room once the holder is saturated. In process: two engines whose load
//! is set by recorded scrapes, a DONE report that frees a slot.

use crate::flow_support;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flow_support::{done, flow_pool, pick};
use kvasir_cache_indexer::load::EngineLoad;
use kvasir_cache_indexer::types::EndpointId;
use kvasir_cache_indexer::Pool;
use kvasir_flowcontrol::FlowControlConfig;
use kvasir_proto::v1 as pb;

/// Bound of every wait for something the test caused (a busy machine).
const BOUND: Duration = Duration::from_secs(10);

/// Tokens of the shared prefix: far more prefill than one waiting
/// request's price in the ranking (`queue`, 1024).
const PREFIX: u32 = 8192;

/// A pool of two idle engines whose index is its own picks (block size
/// 16), holding picks while no engine is below saturation 0.2 (one
/// request waiting).
fn pool() -> Arc<Pool> {
    let flow = FlowControlConfig {
        enabled: true,
        threshold: 0.2,
        max_queued: 64,
        max_queued_per_tenant: 64,
        max_wait_ms: 10_000,
        ..FlowControlConfig::default()
    };
    Arc::new(flow_pool(flow, 2))
}

fn scrape(pool: &Pool, address: &str, waiting: u32) {
    let load = EngineLoad {
        running: 2,
        waiting,
        kv_usage: 0.1,
    };
    let id = EndpointId::from_address(address);
    pool.load.record_scrape(id, Some(load), Instant::now());
}

fn req(request_id: &str, prompt: Vec<u32>) -> pb::PickRequest {
    pb::PickRequest {
        pool: "p".into(),
        tenant: "t".into(),
        request_id: request_id.into(),
        prompt: Some(pb::pick_request::Prompt::TokenIds(pb::TokenIds {
            ids: prompt,
        })),
        max_wait_ms: 10_000,
        ..Default::default()
    }
}

/// The prefix goes to one engine (`home`), a pick to the other; then the
/// engines are scraped with one request waiting on the other and
/// `home_waiting` on home, so neither has room at 0.2; a pick extending
/// the prefix waits, and the DONE of the other engine's pick releases it.
/// Returns (home, other, the released pick's answer).
async fn released(home_waiting: u32) -> (String, String, pb::PickResponse) {
    let pool = pool();
    let prefix: Vec<u32> = (0..PREFIX).collect();
    let home = pick(&pool, req("r0", prefix.clone())).await.endpoints[0]
        .address
        .clone();
    let mut other = None;
    for i in 0..16u32 {
        let id = format!("o{i}");
        let prompt = (100_000 * (i + 1)..100_000 * (i + 1) + 32).collect();
        let a = pick(&pool, req(&id, prompt)).await;
        if a.endpoints[0].address != home {
            other = Some((id, a.endpoints[0].address.clone()));
            break;
        }
    }
    let (other_id, other) = other.expect("a pick landed on the other engine");
    scrape(&pool, &home, home_waiting);
    scrape(&pool, &other, 1);
    let mut prompt = prefix;
    prompt.extend(50_000..50_064);
    let p = Arc::clone(&pool);
    let task = tokio::spawn(async move { pick(&p, req("late", prompt)).await });
    let start = Instant::now();
    while pool.flow.len() != 1 {
        assert!(start.elapsed() < BOUND, "the pick never queued");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!task.is_finished(), "no room: it waits");
    done(&pool, &other_id);
    let a = tokio::time::timeout(BOUND, task)
        .await
        .expect("released in time")
        .expect("the pick task ran");
    assert_ne!(a.decision, pb::Decision::Shed as i32, "{a:?}");
    assert!(a.queued_ms >= 15, "queued_ms {}", a.queued_ms);
    (home, other, a)
}

#[tokio::test]
async fn a_released_pick_waits_on_its_prefix_holder_just_over_the_threshold() {
    let (home, other, a) = released(1).await;
    assert_ne!(home, other);
    assert_eq!(a.endpoints[0].address, home, "{a:?}");
    assert!(
        a.endpoints[0].predicted_cached_tokens >= PREFIX - 16,
        "{a:?}"
    );
    // The engine with room is still ranked, after the holder.
    assert!(a.endpoints.iter().any(|e| e.address == other), "{a:?}");
}

#[tokio::test]
async fn a_released_pick_leaves_a_saturated_holder_for_the_engine_with_room() {
    let (home, other, a) = released(5).await;
    assert_eq!(a.endpoints.len(), 1, "only the engine with room: {a:?}");
    assert_eq!(a.endpoints[0].address, other);
    assert_ne!(other, home);
    assert_eq!(a.endpoints[0].predicted_cached_tokens, 0);
}
