//! Flow control with two indexer replicas sharing load through a real
//! `redis-server` (started on a free loopback port, no persistence, killed
//! at the end): one engine with room for exactly one more request, as both
//! replicas' last scrape shows it (no scrape runs meanwhile). Replica A
//! places a pick; one sharing round later replica B's pick waits instead
//! of being placed in the room A took; A's DONE, a round later, releases
//! it. The counterfactual: without sharing, B places its pick at once (the
//! overshoot sharing removes). Also what the flow hash holds, and that a
//! pool without flow control writes none.

use crate::flow_support;
use crate::responses_support;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flow_support::{done, flow_pool};
use kvasir_cache_indexer::load::EngineLoad;
use kvasir_cache_indexer::shared_load::config::SharedLoadConfig;
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
        ..FlowControlConfig::default()
    }
}

/// A replica's pool "p": one engine (the same address in every replica),
/// scraped with room for exactly one more request (4 waiting of the 5 that
/// saturate it).
fn pool(flow_control: bool) -> Arc<Pool> {
    let pool = flow_pool(flow(flow_control), 1);
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
            ..SharedLoadConfig::default()
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

/// What sharing flow control's moves costs: the flow entry's bytes, the
/// sharing round with and without the flow hash against a real
/// redis-server (8 endpoints, two replicas' fields), and the in-memory work
/// a pick's flow-control look adds (no Redis call: it reads what the
/// rounds left). Figures, not assertions: run by hand with
/// `cargo test -p kvasir-cache-indexer --test flow_replicas -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, run by hand"]
async fn measure_what_sharing_the_moves_costs() {
    use kvasir_cache_indexer::load::PeerLoad;
    use kvasir_cache_indexer::types::EndpointId;
    let ids: Vec<EndpointId> = (0..64)
        .map(|i| EndpointId::from_address(&format!("10.0.0.{i}:8000")))
        .collect();
    for n in [1usize, 8, 64] {
        for total in [999u64, 1_000_000] {
            let totals: Vec<_> = ids[..n].iter().map(|id| (*id, total, total - 1)).collect();
            let loads: Vec<_> = ids[..n]
                .iter()
                .map(|id| {
                    let l = PeerLoad {
                        in_flight: 12,
                        queued_prefill_tokens: 40_000,
                    };
                    (*id, l)
                })
                .collect();
            eprintln!(
                "endpoints {n:>2}, totals {total:>7}: flow entry {:>5} bytes (load entry {:>5})",
                shared_load::moves::encode(&totals).len(),
                shared_load::encode(1_733_000_000_000_000, &loads).len()
            );
        }
    }

    let redis = Redis::start().await;
    let client = redis::Client::open(redis.url()).expect("url");
    let mut c = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let totals: Vec<_> = ids[..8].iter().map(|id| (*id, 123_456, 123_400)).collect();
    let loads: Vec<_> = ids[..8]
        .iter()
        .map(|id| {
            (
                *id,
                PeerLoad {
                    in_flight: 12,
                    queued_prefill_tokens: 40_000,
                },
            )
        })
        .collect();
    let round = |flow: bool, seq: u64| {
        let mut pipe = redis::pipe();
        if flow {
            pipe.cmd("HSET")
                .arg("m:p:flow")
                .arg("a")
                .arg(shared_load::moves::encode(&totals))
                .ignore();
        }
        pipe.cmd("HSET")
            .arg("m:p")
            .arg("a")
            .arg(shared_load::encode(seq, &loads))
            .ignore();
        pipe.cmd("PEXPIRE").arg("m:p").arg(10_000).ignore();
        pipe.cmd("PEXPIRE").arg("m:p:pending").arg(10_000).ignore();
        if flow {
            pipe.cmd("PEXPIRE").arg("m:p:flow").arg(10_000).ignore();
        }
        pipe.cmd("HGETALL").arg("m:p");
        pipe.cmd("HGETALL").arg("m:p:pending");
        if flow {
            pipe.cmd("HGETALL").arg("m:p:flow");
        }
        pipe
    };
    // The other replica's fields, as the reads find them.
    let _: () = round(true, 1).query_async(&mut c).await.expect("seed");
    for key in ["m:p", "m:p:flow"] {
        let _: () = redis::cmd("HSET")
            .arg(key)
            .arg("b")
            .arg(if key == "m:p" {
                shared_load::encode(1, &loads)
            } else {
                shared_load::moves::encode(&totals)
            })
            .query_async(&mut c)
            .await
            .expect("seed b");
    }
    let mut times: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for block in 0..20u64 {
        for flow in [false, true] {
            for i in 0..100u64 {
                let pipe = round(flow, block * 1000 + i + 2);
                let t = Instant::now();
                let _: Vec<std::collections::HashMap<String, String>> =
                    pipe.query_async(&mut c).await.expect("round");
                times[usize::from(flow)].push(t.elapsed());
            }
        }
    }
    for (flow, t) in times.iter_mut().enumerate() {
        t.sort();
        let mean = t.iter().sum::<Duration>() / t.len() as u32;
        eprintln!(
            "round, flow hash {}: mean {:?}, p50 {:?}, p99 {:?} ({} rounds)",
            if flow == 1 { "on " } else { "off" },
            mean,
            t[t.len() / 2],
            t[t.len() * 99 / 100],
            t.len()
        );
    }

    // A pick's look: 8 endpoints, with none or a scrape interval's worth
    // (250 ms / 25 ms = 10 reads) of other replicas' moves per endpoint.
    let f = kvasir_cache_indexer::flow::PoolFlow::new(flow(true));
    let now = Instant::now();
    let views: Vec<_> = ids[..8]
        .iter()
        .map(|id| {
            let v = kvasir_cache_indexer::load::LoadView {
                engine: EngineLoad {
                    running: 4,
                    waiting: 4,
                    kv_usage: 0.2,
                },
                healthy: true,
                last_scrape_age: Some(Duration::from_secs(1)),
                ..Default::default()
            };
            (*id, v)
        })
        .collect();
    let th = kvasir_cache_indexer::load::SaturationThresholds::default();
    let look = |f: &kvasir_cache_indexer::flow::PoolFlow| {
        let n = 100_000u32;
        let t = Instant::now();
        for _ in 0..n {
            std::hint::black_box(f.with_room(&views, &th, now));
        }
        t.elapsed() / n
    };
    let before = look(&f);
    for _ in 0..10 {
        f.peer_moves(ids[..8].iter().map(|id| (*id, 1, 1)), now, Duration::ZERO);
    }
    let after = look(&f);
    eprintln!("a pick's flow-control look (8 endpoints): {before:?} without moves, {after:?} with 10 reads' moves each");
}
