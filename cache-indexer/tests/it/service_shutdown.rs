//! Start-up and shutdown: a cold indexer (no scrape yet)
//! answers UNAVAILABLE, never NO_ENDPOINTS; a cancelled one ends its open
//! `Session` streams with UNAVAILABLE and stops within the grace even
//! while a caller keeps its stream open; the binary does the same on
//! SIGTERM and exits 0.

use crate::service_support;
use std::ffi::OsString;
use std::process::Command;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvasir_cache_indexer::config::{Config, EndpointConfig, PoolConfig, TokenizerSource};
use kvasir_cache_indexer::start;
use kvasir_cache_indexer::types::IndexSource;
use kvasir_proto::v1 as pb;
use service_support::*;
use tonic_health::pb::health_check_response::ServingStatus;

/// Generous bound on a shutdown with a 2 s grace (2-core noisy machine).
const EXIT_BOUND: Duration = Duration::from_secs(10);

fn session_pick(id: u64, request_id: &str) -> pb::SessionRequest {
    pb::SessionRequest {
        id,
        call: Some(pb::session_request::Call::Pick(chat_pick(
            request_id,
            &[("user", "hello".into())],
        ))),
    }
}

/// The next item of an answer stream, bounded.
async fn next(
    s: &mut tonic::Streaming<pb::SessionResponse>,
) -> Option<Result<pb::SessionResponse, tonic::Status>> {
    tokio::time::timeout(EXIT_BOUND, s.next())
        .await
        .expect("the stream answers or ends in time")
}

/// Asserts the stream's next item is its end with UNAVAILABLE.
async fn assert_shut_down(s: &mut tonic::Streaming<pb::SessionResponse>) {
    match next(s).await {
        Some(Err(st)) => {
            assert_eq!(st.code(), tonic::Code::Unavailable, "{st:?}");
            assert!(st.message().contains("shutting down"), "{st:?}");
        }
        other => panic!("expected UNAVAILABLE at shutdown, got {other:?}"),
    }
}

async fn health_status(channel: tonic::transport::Channel, service: &str) -> i32 {
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: service.into(),
        })
        .await
        .expect("health")
        .into_inner()
        .status
}

/// How long the cold pool stays cold: its first scrape round ends at this
/// scrape timeout (past the 1 s a config file may set, so that a busy
/// machine still makes its checks inside the window).
const COLD: Duration = Duration::from_secs(3);

/// A pool whose only endpoint's `/metrics` never answers: cold for
/// [`COLD`]. (Not validated: the timeout is over the config's limit.)
fn cold_config(blackhole: std::net::SocketAddr) -> Config {
    let mut pool = PoolConfig::new("cold");
    pool.tokenizer = TokenizerSource::Approx;
    pool.index = IndexSource::Picks;
    pool.scrape.interval_ms = COLD.as_millis() as u64;
    pool.scrape.timeout_ms = COLD.as_millis() as u64;
    pool.endpoints = vec![EndpointConfig {
        address: blackhole.to_string(),
        events: None,
        replay: None,
        metrics: None,
        topic: String::new(),
    }];
    Config {
        grpc_addr: "127.0.0.1:0".parse().expect("addr"),
        http_addr: "127.0.0.1:0".parse().expect("addr"),
        pools: vec![pool],
        ..Config::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_indexer_answers_unavailable_until_its_first_scrape() {
    // Accepts connections (the kernel's backlog) and never answers.
    let blackhole = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let cfg = cold_config(blackhole.local_addr().expect("addr"));
    let started = Instant::now();
    let indexer = start(&cfg).await.expect("starts");
    let channel = connect(indexer.grpc_addr).await;
    let mut c = authed_client(channel.clone(), None);
    let pick = || pb::PickRequest {
        pool: "cold".into(),
        request_id: "r1".into(),
        prompt: Some(pb::pick_request::Prompt::Text("hello".into())),
        ..Default::default()
    };
    let e = c.pick(pick()).await.expect_err("cold");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains("warming up"), "{e:?}");
    let e = c
        .pool_state(pb::PoolStateRequest {
            pool: "cold".into(),
        })
        .await
        .expect_err("cold");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    let (_tx, rx) = futures::channel::mpsc::unbounded::<pb::SessionRequest>();
    let e = c.session(rx).await.expect_err("cold");
    assert_eq!(e.code(), tonic::Code::Unavailable);
    assert_eq!(
        health_status(channel.clone(), "").await,
        ServingStatus::NotServing as i32
    );
    let http = http_client();
    let r = http
        .get(format!("http://{}/readyz", indexer.http_addr))
        .send()
        .await
        .expect("readyz");
    assert_eq!(r.status(), 503);
    assert!(r.text().await.expect("body").contains("warming up"));
    let cold_for = started.elapsed();
    assert!(
        cold_for < COLD,
        "checks ran within the cold window ({cold_for:?})"
    );

    // After the round (the scrape timed out: unhealthy) it answers, and
    // NO_ENDPOINTS now means what it says.
    let life = std::sync::Arc::clone(&indexer.lifecycle);
    wait_for("pool warm", Duration::from_secs(10), || {
        let w = life.all_warm();
        async move { w }
    })
    .await;
    let p = c.pick(pick()).await.expect("warm").into_inner();
    assert_eq!(p.decision, pb::Decision::NoEndpoints as i32);
    wait_for("overall health SERVING", Duration::from_secs(5), || {
        let ch = channel.clone();
        async move { health_status(ch, "").await == ServingStatus::Serving as i32 }
    })
    .await;
    let text = metrics_text(&http, &format!("http://{}", indexer.http_addr)).await;
    let refused = metric_value(
        &text,
        "kvasir_indexer_grpc_unavailable_total{reason=\"warming_up\"}",
    );
    assert_eq!(refused, Some(3.0));
    indexer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_open_sessions_and_join_is_bounded() {
    let sim = Sim::start(&[]).await;
    let mut cfg = config(&[&sim]);
    cfg.shutdown_grace_ms = 2_000;
    let ix = start_indexer(&cfg).await;
    ix.wait_ready().await;
    let channel = connect(ix.indexer.grpc_addr).await;
    // The caller keeps its side open throughout (`tx` lives to the end).
    let (tx, rx) = futures::channel::mpsc::unbounded();
    let mut answers = authed_client(channel.clone(), None)
        .session(rx)
        .await
        .expect("session")
        .into_inner();
    tx.unbounded_send(session_pick(1, "s1")).expect("send");
    let a = next(&mut answers).await.expect("answer").expect("ok");
    assert!(matches!(
        a.result,
        Some(pb::session_response::Result::Pick(_))
    ));

    let Running { indexer, .. } = ix;
    let (grpc, http) = (indexer.grpc_addr, format!("http://{}", indexer.http_addr));
    let t0 = Instant::now();
    indexer.cancel_token().cancel();
    let joined = tokio::spawn(indexer.join());
    assert_shut_down(&mut answers).await;
    tokio::time::timeout(EXIT_BOUND, joined)
        .await
        .unwrap_or_else(|_| panic!("join() still waiting after {EXIT_BOUND:?}"))
        .expect("join");
    eprintln!("stopped in {:?}", t0.elapsed());
    // The listeners are closed.
    let again = tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(1))
        .connect()
        .await;
    assert!(again.is_err(), "gRPC listener closed");
    assert!(http_client()
        .get(format!("{http}/healthz"))
        .send()
        .await
        .is_err());
    drop(tx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_with_a_token_ends_sessions_and_exits_on_sigterm() {
    let dead = Sim::reserve(&[]); // never started: scrapes fail fast
    let token = TokenFile::new("bin-token");
    let mut bin = IndexerBin::start([
        OsString::from("--grpc-token-file"),
        token.0.clone().into(),
        "--shutdown-grace-ms".into(),
        "2000".into(),
        "--index".into(),
        "picks".into(),
        "--tokenizer".into(),
        "approx".into(),
        "--endpoint".into(),
        format!("pool={POOL},address={}", dead.address()).into(),
    ])
    .await;
    let channel = connect(bin.grpc).await;
    let mut c = authed_client(channel.clone(), Some("bin-token"));
    wait_for("warm", Duration::from_secs(10), || {
        let mut c = c.clone();
        async move {
            c.pool_state(pb::PoolStateRequest { pool: POOL.into() })
                .await
                .is_ok()
        }
    })
    .await;
    let e = authed_client(channel.clone(), None)
        .pick(chat_pick("x", &[("user", "hi".into())]))
        .await
        .expect_err("no token");
    assert_eq!(e.code(), tonic::Code::Unauthenticated);

    let (tx, rx) = futures::channel::mpsc::unbounded();
    let mut answers = c.session(rx).await.expect("session").into_inner();
    tx.unbounded_send(session_pick(1, "b1")).expect("send");
    let a = next(&mut answers).await.expect("answer").expect("ok");
    let Some(pb::session_response::Result::Pick(p)) = a.result else {
        panic!("{a:?}")
    };
    assert_eq!(p.decision, pb::Decision::NoEndpoints as i32);

    let status = Command::new("kill")
        .args(["-TERM", &bin.proc.pid().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    assert_shut_down(&mut answers).await;
    let exit = bin
        .proc
        .wait_exit(EXIT_BOUND)
        .await
        .unwrap_or_else(|| panic!("no exit within {EXIT_BOUND:?}; {}", bin.proc.tail()));
    assert!(
        exit.success(),
        "exit 0 on SIGTERM: {exit}; {}",
        bin.proc.tail()
    );
    let log = bin.proc.log_text();
    assert!(log.contains("gRPC health NOT_SERVING"), "{log}");
    assert!(
        !log.contains("unauthenticated;"),
        "no open-port warning with a token"
    );
    drop(tx);
}
