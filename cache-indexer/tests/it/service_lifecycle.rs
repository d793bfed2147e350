//! The indexer's life with real simulators: an engine killed and restarted,
//! readiness, `/metrics`, gRPC health, and the binary itself (flags,
//! SIGTERM).

use crate::service_support;
use std::collections::BTreeSet;
use std::ffi::OsString;
use std::process::Command;
use std::time::Duration;

use kvasir_cache_indexer::load::parse_sample;
use kvasir_proto::v1 as pb;
use service_support::*;

/// A killed simulator leaves the picks (unhealthy, its blocks dropped) and
/// comes back after a restart on the same ports, rebuilt from its events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_simulator_is_dropped_and_recovers() {
    let mut sims = Sim::start_many(2).await;
    let ix = start_indexer(&config(&sims.iter().collect::<Vec<_>>())).await;
    ix.wait_ready().await;
    let b_addr = sims[1].address();
    let chat = vec![("user", format!("Remember this: {}", filler(5, 200)))];
    sims[1].chat(&chat, 4).await;
    ix.wait_settled(&b_addr).await;

    sims[1].kill();
    // Unhealthy first (the scrape that failed), its blocks dropped right
    // after (the scrape loop's went_down): wait for both.
    wait_for(
        "killed engine becomes unhealthy and its blocks are dropped",
        Duration::from_secs(5),
        || async {
            let st = ix.endpoint_state(&b_addr).await;
            !st.healthy && st.indexed_blocks == 0
        },
    )
    .await;
    let st = ix.endpoint_state(&b_addr).await;
    assert_eq!(st.indexed_blocks, 0, "its blocks stay dropped");
    assert_eq!(st.saturation, 1.0);
    for i in 0..10 {
        let p = ix.pick(chat_pick(&format!("while-dead-{i}"), &chat)).await;
        assert!(
            p.endpoints.iter().all(|e| e.address != b_addr),
            "dead endpoint picked: {p:?}"
        );
        assert_eq!(p.endpoints.len(), 1);
    }
    let readyz = ix
        .http
        .get(format!("{}/readyz", ix.http_url()))
        .send()
        .await
        .expect("readyz");
    assert_eq!(readyz.status(), 503, "not ready while an endpoint is down");

    sims[1].spawn();
    sims[1].wait_healthy().await;
    wait_for(
        "restarted engine healthy and in sync",
        Duration::from_secs(20),
        || async {
            let st = ix.endpoint_state(&b_addr).await;
            st.healthy && st.sync_state == pb::SyncState::InSync as i32
        },
    )
    .await;
    let p = ix.pick(chat_pick("", &[("user", "anything".into())])).await;
    assert!(
        p.endpoints.iter().any(|e| e.address == b_addr),
        "back in the picks: {p:?}"
    );
    // Never for the prefix it lost: the restarted engine is credited with
    // none of it (its blocks went with the process).
    let p = ix.pick(chat_pick("", &chat)).await;
    let b = p.endpoints.iter().find(|e| e.address == b_addr);
    assert!(
        b.is_some_and(|e| e.predicted_cached_tokens == 0
            && e.score.as_ref().is_some_and(|s| s.matched_blocks == 0)),
        "the lost prefix is not credited to the restarted engine: {p:?}"
    );

    // Its cache starts empty; new traffic is indexed again.
    sims[1].chat(&chat, 4).await;
    ix.wait_settled(&b_addr).await;
    let mut follow = chat.clone();
    follow.push(("assistant", "ok".into()));
    follow.push(("user", "and now?".into()));
    let p = ix.pick(chat_pick("", &follow)).await;
    assert_eq!(p.endpoints[0].address, b_addr);
    let r = sims[1].chat(&follow, 2).await;
    assert_eq!(
        cached_tokens(&r),
        u64::from(p.endpoints[0].predicted_cached_tokens)
    );
    ix.indexer.shutdown().await;
}

/// `/readyz` is 503 until every endpoint's stream is in sync, then 200;
/// `/healthz` is always 200; `/metrics` is valid Prometheus text with the
/// documented families; gRPC health follows readiness.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_health_and_metrics() {
    let up = Sim::start(&[]).await;
    let mut late = Sim::reserve(&[]);
    let ix = start_indexer(&config(&[&up, &late])).await;
    let get = |path: &str| {
        let url = format!("{}{path}", ix.http_url());
        let http = ix.http.clone();
        async move { http.get(url).send().await.expect("http") }
    };
    assert_eq!(get("/healthz").await.status(), 200);

    let channel = connect(ix.indexer.grpc_addr).await;
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    let check = |service: &str| tonic_health::pb::HealthCheckRequest {
        service: service.into(),
    };
    // Overall health is SERVING once the first scrape round is done (picks
    // are served), whatever the sync state.
    wait_for(
        "overall gRPC health SERVING",
        Duration::from_secs(5),
        || {
            let mut h = health.clone();
            async move {
                h.check(check("")).await.is_ok_and(|r| {
                    r.into_inner().status
                        == tonic_health::pb::health_check_response::ServingStatus::Serving as i32
                })
            }
        },
    )
    .await;
    let r = get("/readyz").await;
    assert_eq!(r.status(), 503);
    assert!(
        r.text().await.expect("body").contains(&late.address()),
        "names the endpoint not in sync"
    );
    let svc = health
        .check(check(kvasir_proto::INDEXER_SERVICE))
        .await
        .expect("health")
        .into_inner();
    assert_eq!(
        svc.status,
        tonic_health::pb::health_check_response::ServingStatus::NotServing as i32
    );

    late.spawn();
    late.wait_healthy().await;
    ix.wait_ready().await;
    assert_eq!(get("/readyz").await.status(), 200);
    wait_for("gRPC health SERVING", Duration::from_secs(5), || {
        let mut h = health.clone();
        async move {
            h.check(check(kvasir_proto::INDEXER_SERVICE))
                .await
                .is_ok_and(|r| {
                    r.into_inner().status
                        == tonic_health::pb::health_check_response::ServingStatus::Serving as i32
                })
        }
    })
    .await;

    // Some traffic, then the page.
    up.chat(&[("user", filler(9, 100))], 4).await;
    ix.wait_settled(&up.address()).await;
    let p = ix.pick(chat_pick("m1", &[("user", filler(9, 100))])).await;
    ix.report(pb::ReportRequest {
        pool: POOL.into(),
        request_id: "m1".into(),
        endpoint: p.endpoints[0].address.clone(),
        ..Default::default()
    })
    .await;
    let r = get("/metrics").await;
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .expect("ct")
        .starts_with("text/plain; version=0.0.4"));
    let text = r.text().await.expect("body");
    let mut families = BTreeSet::new();
    let mut typed = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let name = rest.split_whitespace().next().expect("name");
            assert!(
                typed.insert(name.to_string()),
                "TYPE given twice for {name}"
            );
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let s = parse_sample(line).unwrap_or_else(|e| panic!("bad line `{line}`: {e}"));
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suf| s.name.strip_suffix(suf).filter(|b| typed.contains(*b)))
            .unwrap_or(s.name);
        assert!(typed.contains(base), "sample {} before its TYPE", s.name);
        families.insert(s.name.to_string());
    }
    for want in [
        "kvasir_indexer_events_applied_total",
        "kvasir_indexer_decode_errors_total",
        "kvasir_indexer_event_gaps_total",
        "kvasir_indexer_replays_total",
        "kvasir_indexer_resyncs_total",
        "kvasir_indexer_indexed_blocks",
        "kvasir_indexer_sync_state",
        "kvasir_indexer_pick_duration_seconds_bucket",
        "kvasir_indexer_picks_total",
        "kvasir_indexer_tokenize_mode",
        "kvasir_indexer_tokenize_duration_seconds_count",
        "kvasir_indexer_scrape_failures_total",
        "kvasir_indexer_endpoint_healthy",
        "kvasir_indexer_endpoint_saturation",
        "kvasir_indexer_pool_saturation",
        "kvasir_indexer_reports_total",
        "kvasir_indexer_cached_tokens_total",
    ] {
        assert!(families.contains(want), "missing {want}");
    }
    let value = |needle: &str| -> f64 {
        metric_value(&text, needle).unwrap_or_else(|| panic!("no line starting with {needle}"))
    };
    assert_eq!(
        value("kvasir_indexer_tokenize_mode{pool=\"sims\",mode=\"tokenizer\"}"),
        1.0
    );
    assert_eq!(
        value("kvasir_indexer_picks_total{pool=\"sims\",decision=\"prefix\"}"),
        1.0
    );
    assert_eq!(
        value("kvasir_indexer_reports_total{pool=\"sims\",matched=\"true\"}"),
        1.0
    );
    assert!(
        value(&format!(
            "kvasir_indexer_indexed_blocks{{pool=\"sims\",endpoint=\"{}\"}}",
            up.address()
        )) > 0.0
    );
    assert!(
        value(&format!(
            "kvasir_indexer_events_applied_total{{pool=\"sims\",endpoint=\"{}\"}}",
            up.address()
        )) > 0.0
    );
    assert_eq!(
        value(&format!(
            "kvasir_indexer_sync_state{{pool=\"sims\",endpoint=\"{}\",state=\"in_sync\"}}",
            late.address()
        )),
        1.0
    );
    ix.indexer.shutdown().await;
}

/// The binary: quick-start flags, ready, a pick over gRPC, and a clean
/// exit on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_runs_from_flags_and_stops_on_sigterm() {
    let sim = Sim::start(&[]).await;
    let mut bin = IndexerBin::start([
        OsString::from("--tokenizer"),
        tokenizer_dir().into(),
        "--model".into(),
        MODEL.into(),
        "--endpoint".into(),
        format!(
            "pool={POOL},address={},events=tcp://127.0.0.1:{},replay=tcp://127.0.0.1:{}",
            sim.address(),
            sim.events,
            sim.replay
        )
        .into(),
    ])
    .await;
    bin.wait_ready().await;
    let mut c = bin.grpc_client().await;
    wait_for("endpoint scraped healthy", Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            c.pool_state(pb::PoolStateRequest { pool: POOL.into() })
                .await
                .is_ok_and(|r| r.into_inner().endpoints.iter().all(|e| e.healthy))
        }
    })
    .await;
    let p = c
        .pick(chat_pick("b1", &[("user", "hello".into())]))
        .await
        .expect("pick")
        .into_inner();
    assert_eq!(p.endpoints[0].address, sim.address());

    let status = Command::new("kill")
        .args(["-TERM", &bin.proc.pid().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    // (Killed on drop if it does not exit.)
    let exit = bin
        .proc
        .wait_exit(Duration::from_secs(10))
        .await
        .unwrap_or_else(|| panic!("cache-indexer did not exit on SIGTERM; {}", bin.proc.tail()));
    assert!(exit.success(), "clean exit on SIGTERM: {exit}");
    assert!(
        bin.proc
            .log_text()
            .contains("the gRPC port is unauthenticated"),
        "without --grpc-token-file the open port is logged"
    );

    // A bad flag is a usage error naming the problem (exit 2).
    let out = Command::new(indexer_bin())
        .args(["--endpoint", "pool=x,address=nope,events=tcp://127.0.0.1:1"])
        .env("KVASIR_TOKENIZER_DIR", "approx")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("pools[0].endpoints[0].address: not ip:port"),
        "{err}"
    );
}
