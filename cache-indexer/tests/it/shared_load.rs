//! Replicas that act as one (shared load through a real `redis-server`,
//! started by the test on a free loopback port, no persistence, killed at
//! the end): replica A's picks in flight steer replica B's picks away from
//! their engine and stop counting once reported; a replica that stops
//! writing stops counting within the TTL and its field is deleted later; a
//! replica that shuts down withdraws its field; with Redis gone each
//! replica falls back to its own counts, counts the failures and never
//! hangs, and shares again once Redis is back; a prompt A placed and that
//! is still in prefill gives B's picks sharing its prefix their prefix
//! credit on A's engine, until A's first token.
//!
//! The engines are idle stand-ins that only answer `/metrics` (index
//! `picks`, or `events` with no events ever coming), so every difference in
//! the picks comes from what the replicas placed.

use crate::responses_support;
use crate::service_support;
use std::path::Path;
use std::time::{Duration, Instant};

use kvasir_cache_indexer::config::{self, Config};
use kvasir_cache_indexer::shared_load::config::SharedLoadConfig;
use kvasir_proto::v1 as pb;
use responses_support::{metric, Redis};
use service_support::{ids_pick, start_indexer, wait_for, Running, POOL};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Round interval and TTL of the tests' replicas.
const INTERVAL_MS: u64 = 20;
const TTL_MS: u64 = 400;
/// Bound of every wait for a change to cross Redis (generous: a busy
/// 2-core machine).
const CROSS: Duration = Duration::from_secs(5);

/// An engine that answers every request with an idle `/metrics` page.
struct IdleEngine {
    address: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for IdleEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl IdleEngine {
    async fn start() -> IdleEngine {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let address = l.local_addr().expect("local addr").to_string();
        let task = tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                tokio::spawn(answer_idle(s));
            }
        });
        IdleEngine { address, task }
    }
}

async fn answer_idle(mut s: tokio::net::TcpStream) {
    let body =
        "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n";
    let mut buf = vec![0u8; 8192];
    let mut got = 0;
    let read_head = async {
        while got < buf.len() {
            match s.read(&mut buf[got..]).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => got += n,
            }
            if buf[..got].windows(4).any(|w| w == b"\r\n\r\n") {
                return true;
            }
        }
        false
    };
    if !tokio::time::timeout(Duration::from_secs(2), read_head)
        .await
        .unwrap_or(false)
    {
        return;
    }
    let reply = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = s.write_all(reply.as_bytes()).await;
    let _ = s.shutdown().await;
}

/// A config over `engines` (index `picks`, approx tokenizer) sharing load
/// through `redis` as replica `id`.
fn config(engines: &[IdleEngine], redis: &Redis, id: &str) -> Config {
    config_with_index(engines, redis, id, "picks")
}

fn config_with_index(engines: &[IdleEngine], redis: &Redis, id: &str, index: &str) -> Config {
    let endpoints: Vec<String> = engines
        .iter()
        .map(|e| format!("      - address: {}", e.address))
        .collect();
    let yaml = format!(
        "grpcAddr: 127.0.0.1:0\nhttpAddr: 127.0.0.1:0\npools:\n  - name: {POOL}\n    tokenizer: approx\n    index: {index}\n    scrape: {{ intervalMs: 100, timeoutMs: 50 }}\n    endpoints:\n{}\n",
        endpoints.join("\n")
    );
    let mut cfg = config::parse(&yaml, Path::new("test.yaml")).expect("test config parses");
    cfg.shared_load = SharedLoadConfig {
        redis_url: Some(redis.url()),
        interval_ms: INTERVAL_MS,
        ttl_ms: TTL_MS,
        timeout_ms: 200,
        retry_ms: 200,
        replica_id: Some(id.into()),
        ..SharedLoadConfig::default()
    };
    cfg
}

/// `n` distinct token ids from `seed`: a prompt no one has seen.
fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| seed.wrapping_mul(100_003).wrapping_add(i) % 150_000)
        .collect()
}

fn report(request_id: &str, endpoint: &str, phase: pb::ReportPhase) -> pb::ReportRequest {
    pb::ReportRequest {
        pool: POOL.into(),
        request_id: request_id.into(),
        endpoint: endpoint.into(),
        phase: phase as i32,
        outcome: pb::Outcome::Success as i32,
        ..Default::default()
    }
}

fn picked(p: &pb::PickResponse) -> String {
    p.endpoints.first().expect("an endpoint").address.clone()
}

async fn gauge(ix: &Running, name: &str) -> f64 {
    metric(ix, &format!("{name}{{pool=\"{POOL}\"}}")).await
}

/// Waits until `ix`'s gauge `name` is `want`.
async fn wait_gauge(ix: &Running, name: &str, want: f64) {
    wait_for(&format!("{name} = {want}"), CROSS, || async {
        gauge(ix, name).await == want
    })
    .await;
}

async fn rounds(ix: &Running, result: &str) -> f64 {
    let line =
        format!("kvasir_indexer_shared_load_rounds_total{{pool=\"{POOL}\",result=\"{result}\"}}");
    metric(ix, &line).await
}

/// A command sent straight to Redis (bounded); `None` on any failure.
async fn redis_cmd<T: redis::FromRedisValue>(redis: &Redis, cmd: &redis::Cmd) -> Option<T> {
    let client = redis::Client::open(redis.url()).ok()?;
    let fut = async {
        let mut c = client.get_multiplexed_async_connection().await.ok()?;
        cmd.query_async::<T>(&mut c).await.ok()
    };
    tokio::time::timeout(Duration::from_secs(2), fut)
        .await
        .ok()?
}

async fn field_exists(redis: &Redis, field: &str) -> bool {
    let mut cmd = redis::cmd("HEXISTS");
    cmd.arg(format!("kvasir:load:{POOL}")).arg(field);
    redis_cmd::<bool>(redis, &cmd).await.unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicas_picks_in_flight_steer_the_other_until_reported() {
    let redis = Redis::start().await;
    let engines = [IdleEngine::start().await, IdleEngine::start().await];
    let a = start_indexer(&config(&engines, &redis, "a")).await;
    let b = start_indexer(&config(&engines, &redis, "b")).await;
    for ix in [&a, &b] {
        wait_gauge(ix, "kvasir_indexer_shared_load_peers", 1.0).await;
    }

    // A long prompt in flight on A: neither its first token nor its end
    // reported, so its whole prefill is queued on its engine.
    let big = a.pick(ids_pick("a-1", prompt(1, 40_000))).await;
    let home = picked(&big);
    wait_gauge(&b, "kvasir_indexer_shared_load_peer_in_flight", 1.0).await;
    let seen = b.endpoint_state(&home).await;
    assert_eq!(seen.in_flight, 1, "{seen:?}");
    assert!(seen.queued_prefill_tokens >= 30_000, "{seen:?}");

    // New prompts on B: the engine A loaded is the costlier one, each
    // time (B's own picks are reported, so only A's load differs).
    for i in 0..4 {
        let id = format!("b-{i}");
        let p = b.pick(ids_pick(&id, prompt(100 + i, 2_000))).await;
        let got = picked(&p);
        assert_ne!(got, home, "pick {i} went to the engine A loaded: {p:?}");
        b.report(report(&id, &got, pb::ReportPhase::Done)).await;
    }

    // Its first token: the prefill is no longer queued, the request still
    // runs; then its end: nothing of A's counts on B any more.
    a.report(report("a-1", &home, pb::ReportPhase::FirstToken))
        .await;
    wait_gauge(
        &b,
        "kvasir_indexer_shared_load_peer_queued_prefill_tokens",
        0.0,
    )
    .await;
    assert_eq!(b.endpoint_state(&home).await.in_flight, 1);
    a.report(report("a-1", &home, pb::ReportPhase::Done)).await;
    wait_gauge(&b, "kvasir_indexer_shared_load_peer_in_flight", 0.0).await;
    assert_eq!(b.endpoint_state(&home).await.in_flight, 0);

    // B's own picks were never counted twice: A saw them come and go, and
    // B publishes nothing it read from A.
    for ix in [&a, &b] {
        assert_eq!(rounds(ix, "failed").await, 0.0);
        assert!(rounds(ix, "ok").await >= 1.0);
        assert_eq!(
            gauge(ix, "kvasir_indexer_shared_load_local_only").await,
            0.0
        );
    }
    assert_eq!(
        gauge(&a, "kvasir_indexer_shared_load_peer_in_flight").await,
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_stops_writing_stops_counting_and_one_that_stops_withdraws() {
    let redis = Redis::start().await;
    let engines = [IdleEngine::start().await, IdleEngine::start().await];
    let b = start_indexer(&config(&engines, &redis, "b")).await;
    let target = engines[0].address.clone();
    let id = kvasir_cache_indexer::types::EndpointId::from_address(&target);

    // A replica that wrote once and died (no graceful stop): its number
    // never moves again.
    let mut hset = redis::cmd("HSET");
    hset.arg(format!("kvasir:load:{POOL}"))
        .arg("ghost")
        .arg(format!("v1 1 {id}:5:9000"));
    redis_cmd::<i64>(&redis, &hset).await.expect("HSET");
    let started = Instant::now();
    wait_gauge(&b, "kvasir_indexer_shared_load_peer_in_flight", 5.0).await;
    assert_eq!(b.endpoint_state(&target).await.in_flight, 5);
    wait_gauge(&b, "kvasir_indexer_shared_load_peer_in_flight", 0.0).await;
    let counted = started.elapsed();
    assert!(
        counted >= Duration::from_millis(TTL_MS) - Duration::from_millis(50),
        "{counted:?}"
    );
    assert_eq!(gauge(&b, "kvasir_indexer_shared_load_peers").await, 0.0);
    assert_eq!(b.endpoint_state(&target).await.in_flight, 0);
    // Ten TTLs later its field is deleted.
    wait_for(
        "the dead field deleted",
        CROSS + Duration::from_secs(5),
        || {
            let redis = &redis;
            async move { !field_exists(redis, "ghost").await }
        },
    )
    .await;

    // A replica that shuts down takes its field with it.
    let a = start_indexer(&config(&engines, &redis, "a")).await;
    wait_for("A's field written", CROSS, || field_exists(&redis, "a")).await;
    wait_gauge(&b, "kvasir_indexer_shared_load_peers", 1.0).await;
    a.indexer.shutdown().await;
    assert!(!field_exists(&redis, "a").await, "withdrawn at shutdown");
    wait_gauge(&b, "kvasir_indexer_shared_load_peers", 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_gone_each_replica_counts_its_own_and_never_hangs() {
    let mut redis = Redis::start().await;
    let engines = [IdleEngine::start().await, IdleEngine::start().await];
    let a = start_indexer(&config(&engines, &redis, "a")).await;
    let b = start_indexer(&config(&engines, &redis, "b")).await;
    let big = a.pick(ids_pick("a-1", prompt(1, 40_000))).await;
    let home = picked(&big);
    wait_gauge(&b, "kvasir_indexer_shared_load_peer_in_flight", 1.0).await;

    redis.kill();
    wait_for("B's failed round counted", CROSS, || async {
        rounds(&b, "failed").await >= 1.0
    })
    .await;
    // Past the TTL of its last read B steers by its own counts only.
    wait_gauge(&b, "kvasir_indexer_shared_load_local_only", 1.0).await;
    assert_eq!(b.endpoint_state(&home).await.in_flight, 0);
    for i in 0..10 {
        let id = format!("b-{i}");
        let started = Instant::now();
        let p = b.pick(ids_pick(&id, prompt(200 + i, 2_000))).await;
        let took = started.elapsed();
        assert!(took < Duration::from_secs(1), "pick {i} took {took:?}");
        b.report(report(&id, &picked(&p), pb::ReportPhase::Done))
            .await;
    }
    // A still counts its own pick.
    assert_eq!(a.endpoint_state(&home).await.in_flight, 1);

    redis.restart().await;
    wait_gauge(&b, "kvasir_indexer_shared_load_local_only", 0.0).await;
    wait_gauge(&b, "kvasir_indexer_shared_load_peer_in_flight", 1.0).await;
    assert_eq!(b.endpoint_state(&home).await.in_flight, 1);
}

/// `prompt(seed, n)` followed by `extra` tokens of its own.
fn prompt_then(seed: u32, n: usize, extra_seed: u32, extra: usize) -> Vec<u32> {
    let mut p = prompt(seed, n);
    p.extend(prompt(extra_seed, extra).iter().map(|t| (t + 7) % 150_000));
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicas_prompt_in_prefill_gives_the_other_its_prefix_until_the_first_token() {
    let redis = Redis::start().await;
    let engines = [IdleEngine::start().await, IdleEngine::start().await];
    // Index `events`: picks still in prefill are what a prefix matches
    // before the engine's KV events say so (and here they never do).
    let a = start_indexer(&config_with_index(&engines, &redis, "a", "events")).await;
    let b = start_indexer(&config_with_index(&engines, &redis, "b", "events")).await;
    for ix in [&a, &b] {
        wait_gauge(ix, "kvasir_indexer_shared_load_peers", 1.0).await;
    }

    // A long prompt on A, no report: still in prefill on its engine.
    let big = a.pick(ids_pick("a-1", prompt(1, 8_000))).await;
    let home = picked(&big);
    wait_gauge(&b, "kvasir_indexer_shared_load_peer_pending_chains", 1.0).await;
    wait_gauge(&b, "kvasir_indexer_shared_load_peer_in_flight", 1.0).await;

    // The same prompt and more on B: A's engine, though A's prefill queues
    // there, with the whole shared prefix credited (its last block's hash
    // is published, so the match is exact).
    let p = b.pick(ids_pick("b-1", prompt_then(1, 8_000, 2, 500))).await;
    assert_eq!(picked(&p), home, "{p:?}");
    assert_eq!(p.reason, "prefix", "{p:?}");
    assert_eq!(p.endpoints[0].predicted_cached_tokens, 8_000, "{p:?}");
    b.report(report("b-1", &home, pb::ReportPhase::Done)).await;

    // A prompt leaving A's after 6,000 tokens: credited up to a sampled
    // block at or before the divergence, never past it.
    let p = b
        .pick(ids_pick("b-2", prompt_then(1, 6_000, 3, 2_500)))
        .await;
    assert_eq!(picked(&p), home, "{p:?}");
    let credit = p.endpoints[0].predicted_cached_tokens;
    assert!((6_000 - 16 * 16..=6_000).contains(&credit), "{p:?}");
    b.report(report("b-2", &home, pb::ReportPhase::Done)).await;

    // A's first token: the prompt is no longer in prefill, B no longer
    // credits it (no KV event ever came).
    a.report(report("a-1", &home, pb::ReportPhase::FirstToken))
        .await;
    wait_gauge(&b, "kvasir_indexer_shared_load_peer_pending_chains", 0.0).await;
    let p = b.pick(ids_pick("b-3", prompt_then(1, 8_000, 4, 500))).await;
    assert!(
        p.endpoints.iter().all(|e| e.predicted_cached_tokens == 0),
        "{p:?}"
    );
    assert_ne!(p.reason, "prefix", "{p:?}");
    for ix in [&a, &b] {
        assert_eq!(
            metric(
                ix,
                &format!("kvasir_indexer_shared_load_refused_entries_total{{pool=\"{POOL}\"}}")
            )
            .await,
            0.0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_pending_entry_is_refused_and_counted() {
    let redis = Redis::start().await;
    let engines = [IdleEngine::start().await, IdleEngine::start().await];
    let b = start_indexer(&config_with_index(&engines, &redis, "b", "events")).await;
    // A live load entry, a pending entry that does not parse.
    let mut hset = redis::cmd("HSET");
    hset.arg(format!("kvasir:load:{POOL}"))
        .arg("ghost")
        .arg("v1 1 ");
    redis_cmd::<i64>(&redis, &hset).await.expect("HSET");
    let mut hset = redis::cmd("HSET");
    hset.arg(format!("kvasir:load:{POOL}:pending"))
        .arg("ghost")
        .arg("p1 1=99999999999.1.ab");
    redis_cmd::<i64>(&redis, &hset).await.expect("HSET");
    wait_for("the entry refused", CROSS, || async {
        metric(
            &b,
            &format!("kvasir_indexer_shared_load_refused_entries_total{{pool=\"{POOL}\"}}"),
        )
        .await
            >= 1.0
    })
    .await;
    assert_eq!(
        gauge(&b, "kvasir_indexer_shared_load_peer_pending_chains").await,
        0.0
    );
    let p = b.pick(ids_pick("b-1", prompt(1, 2_000))).await;
    assert!(!p.endpoints.is_empty(), "{p:?}");
}

/// Interval of the replicas that wake on change: the longest allowed, so
/// that a change crossing in a fraction of it crossed by the wake.
const WAKE_INTERVAL_MS: u64 = 1_000;
/// Bound of each crossing when waking: half an interval. Without the wake
/// each of the four crossings below would make it with a chance of about a
/// half (an interval round falling within it), all four about 1 in 16.
const WAKE_CROSS: Duration = Duration::from_millis(WAKE_INTERVAL_MS / 2);

/// Waits until `ix`'s gauge `name` is `want`; returns how long it took.
async fn crossed(ix: &Running, name: &str, want: f64) -> Duration {
    let started = Instant::now();
    wait_gauge(ix, name, want).await;
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_wake_on_change_a_replicas_changes_reach_the_other_long_before_its_interval() {
    let redis = Redis::start().await;
    let engines = [IdleEngine::start().await, IdleEngine::start().await];
    let waking = |id: &str| {
        let mut cfg = config(&engines, &redis, id);
        cfg.shared_load.interval_ms = WAKE_INTERVAL_MS;
        cfg.shared_load.ttl_ms = 4 * WAKE_INTERVAL_MS;
        cfg.shared_load.wake_on_change = true;
        cfg
    };
    let a = start_indexer(&waking("a")).await;
    let b = start_indexer(&waking("b")).await;
    for ix in [&a, &b] {
        wait_gauge(ix, "kvasir_indexer_shared_load_peers", 1.0).await;
    }
    let peer_in_flight = "kvasir_indexer_shared_load_peer_in_flight";
    let peer_queued = "kvasir_indexer_shared_load_peer_queued_prefill_tokens";

    let first = a.pick(ids_pick("a-1", prompt(1, 4_000))).await;
    let home = picked(&first);
    let mut took = vec![crossed(&b, peer_in_flight, 1.0).await];
    assert!(b.endpoint_state(&home).await.queued_prefill_tokens > 0);
    a.report(report("a-1", &home, pb::ReportPhase::FirstToken))
        .await;
    took.push(crossed(&b, peer_queued, 0.0).await);
    a.report(report("a-1", &home, pb::ReportPhase::Done)).await;
    took.push(crossed(&b, peer_in_flight, 0.0).await);
    // And the other way round.
    b.pick(ids_pick("b-1", prompt(2, 4_000))).await;
    took.push(crossed(&a, peer_in_flight, 1.0).await);
    assert!(took.iter().all(|t| *t < WAKE_CROSS), "{took:?}");
    for ix in [&a, &b] {
        assert_eq!(rounds(ix, "failed").await, 0.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_that_reach_the_other_replica_end_the_pick_where_it_was_made() {
    let redis = Redis::start().await;
    let engines = [IdleEngine::start().await, IdleEngine::start().await];
    let sharing = |id: &str| {
        let mut cfg = config(&engines, &redis, id);
        cfg.shared_load.share_reports = true;
        cfg
    };
    let a = start_indexer(&sharing("a")).await;
    let b = start_indexer(&sharing("b")).await;
    for ix in [&a, &b] {
        wait_gauge(ix, "kvasir_indexer_shared_load_peers", 1.0).await;
    }
    // A pick on A whose reports go to B (a unary pick before the filter's
    // stream opened on B, say): B has no such pick.
    let big = a.pick(ids_pick("a-1", prompt(1, 40_000))).await;
    let home = picked(&big);
    wait_gauge(&b, "kvasir_indexer_shared_load_peer_in_flight", 1.0).await;
    b.report(report("a-1", &home, pb::ReportPhase::FirstToken))
        .await;
    // Through the stream of unmatched reports A ends its prefill part...
    wait_for("A's prefill ended", CROSS, || async {
        a.endpoint_state(&home).await.queued_prefill_tokens == 0
    })
    .await;
    assert_eq!(a.endpoint_state(&home).await.in_flight, 1);
    wait_gauge(
        &b,
        "kvasir_indexer_shared_load_peer_queued_prefill_tokens",
        0.0,
    )
    .await;
    // ...and then the pick, and B stops counting it.
    b.report(report("a-1", &home, pb::ReportPhase::Done)).await;
    wait_for("A's pick ended", CROSS, || async {
        a.endpoint_state(&home).await.in_flight == 0
    })
    .await;
    wait_gauge(&b, "kvasir_indexer_shared_load_peer_in_flight", 0.0).await;
    // A report neither replica's pick matches goes nowhere and nobody
    // counts anything.
    b.report(report("nobody", &home, pb::ReportPhase::Done))
        .await;
    for ix in [&a, &b] {
        assert_eq!(rounds(ix, "failed").await, 0.0);
        assert_eq!(ix.endpoint_state(&home).await.in_flight, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_done_ends_the_picks_fair_share_charge_where_it_was_made() {
    let redis = Redis::start().await;
    let engines = [IdleEngine::start().await, IdleEngine::start().await];
    // Flow control on (idle engines: picks go at once, each charged to its
    // tenant's share until its DONE).
    let sharing = |id: &str| {
        let mut cfg = config(&engines, &redis, id);
        cfg.shared_load.share_reports = true;
        cfg.pools[0].flow_control.enabled = true;
        cfg
    };
    let a = start_indexer(&sharing("a")).await;
    let b = start_indexer(&sharing("b")).await;
    for ix in [&a, &b] {
        wait_gauge(ix, "kvasir_indexer_shared_load_peers", 1.0).await;
    }
    let flow_a = &a.indexer.pools.get(POOL).expect("pool").flow;
    let mut ask = ids_pick("a-1", prompt(3, 4_000));
    ask.tenant = "acme".into();
    let home = picked(&a.pick(ask).await);
    assert_eq!(flow_a.charges_open(), 1, "a placed pick is charged");
    // Its FIRST_TOKEN reaching B ends its prefill on A, not its charge...
    b.report(report("a-1", &home, pb::ReportPhase::FirstToken))
        .await;
    wait_for("A's prefill ended", CROSS, || async {
        a.endpoint_state(&home).await.queued_prefill_tokens == 0
    })
    .await;
    assert_eq!(flow_a.charges_open(), 1);
    // ...its DONE reaching B ends both on A.
    b.report(report("a-1", &home, pb::ReportPhase::Done)).await;
    wait_for("A's charge ended", CROSS, || async {
        flow_a.charges_open() == 0
    })
    .await;
    assert_eq!(a.endpoint_state(&home).await.in_flight, 0);
}
