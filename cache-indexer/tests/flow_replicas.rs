//! Flow control with two indexer replicas sharing load through a real
//! `redis-server` (started on a free loopback port, no persistence, killed
//! at the end): one engine with room for exactly one more request, as both
//! replicas' last scrape shows it (no scrape runs meanwhile). Replica A
//! places a pick; one sharing round later replica B's pick waits instead
//! of being placed in the room A took; A's DONE, a round later, releases
//! it. The counterfactual: without sharing, B places its pick at once (the
//! overshoot sharing removes). Also what the flow hash holds, and that a
//! pool without flow control writes none.

mod responses_support;
mod service_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvasir_cache_indexer::config::SharedLoadConfig;
use kvasir_cache_indexer::load::{EngineLoad, LoadConfig, LoadTracker};
use kvasir_cache_indexer::scoring::Weights;
use kvasir_cache_indexer::tokenize::RequestTokenizer;
use kvasir_cache_indexer::types::IndexSource;
use kvasir_cache_indexer::{shared_load, Pool, Pools};
use kvasir_flowcontrol::FlowControlConfig;
use kvasir_proto::v1 as pb;
use responses_support::Redis;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Round interval and TTL of the replicas.
const INTERVAL_MS: u64 = 20;
const TTL_MS: u64 = 400;
/// Bound of every wait for something to cross Redis (a busy machine).
const CROSS: Duration = Duration::from_secs(5);
const KEY_PREFIX: &str = "kvasir:load:";

fn flow(enabled: bool) -> FlowControlConfig {
    FlowControlConfig {
        enabled,
        threshold: 1.0,
        max_queued: 64,
        max_queued_per_tenant: 64,
        max_wait_ms: 10_000,
    }
}

/// A replica's pool "p": one engine (the same address in every replica),
/// scraped with room for exactly one more request (4 waiting of the 5 that
/// saturate it).
fn pool(flow_control: bool) -> Arc<Pool> {
    let pool = Pool::new(
        "p",
        "m",
        16,
        RequestTokenizer::Approx,
        LoadTracker::new(LoadConfig::default()),
        Weights::default(),
    )
    .with_index(IndexSource::Picks, 1 << 20)
    .with_flow_control(flow(flow_control));
    pool.set_idle_loopback_endpoints(1);
    let room_for_one = EngineLoad {
        running: 4,
        waiting: 4,
        kv_usage: 0.2,
    };
    for e in pool.endpoints().iter() {
        pool.load
            .record_scrape(e.id, Some(room_for_one), Instant::now());
    }
    Arc::new(pool)
}

/// A replica's sharing task; cancelled (its fields withdrawn) on drop.
struct Sharing {
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
}

impl Sharing {
    fn start(pool: &Arc<Pool>, redis: &Redis, replica: &str) -> Sharing {
        let cfg = SharedLoadConfig {
            redis_url: Some(redis.url()),
            interval_ms: INTERVAL_MS,
            ttl_ms: TTL_MS,
            timeout_ms: 200,
            retry_ms: 200,
            key_prefix: KEY_PREFIX.into(),
            replica_id: Some(replica.into()),
        };
        let settings = cfg.settings().expect("valid settings").expect("sharing on");
        let pools = Arc::new(Pools::new(vec![Arc::clone(pool)]));
        let cancel = CancellationToken::new();
        let task = tokio::spawn(shared_load::run(pools, settings, cancel.clone()));
        Sharing {
            cancel,
            task: Some(task),
        }
    }

    async fn stop(mut self) {
        self.cancel.cancel();
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(CROSS, t).await;
        }
    }
}

impl Drop for Sharing {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

fn req(request_id: &str, tenant: &str, seed: u32) -> pb::PickRequest {
    pb::PickRequest {
        pool: "p".into(),
        tenant: tenant.into(),
        request_id: request_id.into(),
        prompt: Some(pb::pick_request::Prompt::TokenIds(pb::TokenIds {
            ids: (seed..seed + 64).collect(),
        })),
        max_wait_ms: 60_000,
        ..Default::default()
    }
}

fn done(pool: &Pool, request_id: &str) {
    pool.report(&pb::ReportRequest {
        pool: "p".into(),
        request_id: request_id.into(),
        phase: pb::ReportPhase::Done as i32,
        outcome: pb::Outcome::Success as i32,
        ..Default::default()
    })
    .expect("a valid report");
}

fn placed(a: &pb::PickResponse) -> bool {
    a.decision != pb::Decision::Shed as i32 && a.endpoints.len() == 1
}

/// Whether `pool`'s flow control sees room on its engine now.
fn has_room(pool: &Pool) -> bool {
    let endpoints = pool.endpoints();
    let now = Instant::now();
    let views = pool.load.views(endpoints.iter().map(|e| e.id), now);
    let loads: Vec<_> = endpoints.iter().map(|e| e.id).zip(views).collect();
    !pool
        .flow
        .with_room(&loads, &pool.load.config().saturation, now)
        .is_empty()
}

async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < CROSS, "never: {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Rounds `pool`'s sharing has done.
fn rounds(pool: &Pool) -> u64 {
    pool.load.peer_stats(Instant::now()).rounds
}

/// Waits until both replicas see each other, and a round more each (so
/// each has read the other's first flow entry).
async fn wait_paired(a: &Pool, b: &Pool) {
    for p in [a, b] {
        wait_until("the other replica is live", || {
            p.load.peer_stats(Instant::now()).peers == 1
        })
        .await;
    }
    let (ra, rb) = (rounds(a), rounds(b));
    wait_until("a round more", || rounds(a) > ra && rounds(b) > rb).await;
}

/// The flow hash's fields, read straight from Redis.
async fn flow_fields(redis: &Redis) -> Vec<(String, String)> {
    let client = redis::Client::open(redis.url()).expect("url");
    let mut c = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let mut fields: Vec<(String, String)> = redis::cmd("HGETALL")
        .arg(format!("{KEY_PREFIX}p:flow"))
        .query_async(&mut c)
        .await
        .expect("HGETALL");
    fields.sort();
    fields
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_placement_on_one_replica_holds_the_others_pick_until_its_done() {
    let redis = Redis::start().await;
    let (a, b) = (pool(true), pool(true));
    let sa = Sharing::start(&a, &redis, "a");
    let sb = Sharing::start(&b, &redis, "b");
    wait_paired(&a, &b).await;
    assert!(has_room(&b), "room for one before A places anything");

    let first = a.pick(req("a-1", "t", 1_000)).await.expect("a valid pick");
    assert!(placed(&first), "{first:?}");
    let seen_at = Instant::now();
    wait_until("B sees A's placement", || !has_room(&b)).await;
    // Rounds, not a scrape (none runs here): a few intervals at most.
    let crossed = seen_at.elapsed();

    let b2 = Arc::clone(&b);
    let task = tokio::spawn(async move { b2.pick(req("b-1", "u", 5_000)).await });
    wait_until("B's pick waits", || b.flow.len() == 1).await;
    tokio::time::sleep(Duration::from_millis(5 * INTERVAL_MS)).await;
    assert!(!task.is_finished(), "no room: B's pick keeps waiting");

    let ended_at = Instant::now();
    done(&a, "a-1");
    let answer = tokio::time::timeout(CROSS, task)
        .await
        .expect("released in time")
        .expect("the pick task ran")
        .expect("a valid pick");
    assert!(placed(&answer), "released and placed: {answer:?}");
    assert_eq!(answer.endpoints[0].address, first.endpoints[0].address);
    let waited = Duration::from_millis(answer.queued_ms.into());
    assert!(
        waited >= Duration::from_millis(5 * INTERVAL_MS),
        "{waited:?}"
    );
    assert!(b.flow.is_empty());
    eprintln!(
        "A's placement reached B's flow control in {crossed:?}; A's DONE released B's pick in {:?}",
        ended_at.elapsed()
    );

    // The flow hash: one field per replica, running totals per endpoint
    // (A placed one, and it ended; B placed one).
    let id = a.endpoints()[0].id;
    let want = [
        ("a".to_string(), format!("f1 {id}:1:1")),
        ("b".to_string(), format!("f1 {id}:1:0")),
    ];
    let start = Instant::now();
    loop {
        let fields = flow_fields(&redis).await;
        if fields == want {
            break;
        }
        assert!(start.elapsed() < CROSS, "flow hash {fields:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sa.stop().await;
    sb.stop().await;
    assert!(flow_fields(&redis).await.is_empty(), "fields withdrawn");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_sharing_both_replicas_fill_the_same_room() {
    let (a, b) = (pool(true), pool(true));
    let first = a.pick(req("a-1", "t", 1_000)).await.expect("a valid pick");
    assert!(placed(&first), "{first:?}");
    assert!(!has_room(&a), "A took the room");
    // B sees only its own placements: the room looks free, its pick goes
    // at once onto an engine now one over its saturation.
    assert!(has_room(&b));
    let second = tokio::time::timeout(CROSS, b.pick(req("b-1", "u", 5_000)))
        .await
        .expect("answered at once")
        .expect("a valid pick");
    assert!(placed(&second), "{second:?}");
    assert_eq!(second.queued_ms, 0);
    assert_eq!(second.endpoints[0].address, first.endpoints[0].address);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_without_flow_control_writes_no_flow_entry() {
    let redis = Redis::start().await;
    let (a, b) = (pool(false), pool(false));
    let _sa = Sharing::start(&a, &redis, "a");
    let _sb = Sharing::start(&b, &redis, "b");
    wait_paired(&a, &b).await;
    let first = a.pick(req("a-1", "t", 1_000)).await.expect("a valid pick");
    assert!(placed(&first));
    wait_until("B sees A's pick in flight", || {
        b.load.peer_stats(Instant::now()).peer_in_flight == 1
    })
    .await;
    assert!(flow_fields(&redis).await.is_empty());
}
