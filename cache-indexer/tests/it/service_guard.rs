//! Who may call the indexer and what unanswered picks can do:
//! the bearer token on every `kvasir.v1.Indexer` call (health stays open,
//! rotation is picked up), and a flood of picks nobody reports, which may
//! shift each engine's load view by at most the cap while real traffic
//! still reaches every engine, and expires without reports.

use crate::service_support;
use std::collections::BTreeSet;
use std::time::Duration;

use futures::StreamExt;
use kvasir_proto::v1 as pb;
use service_support::*;

fn code<T: std::fmt::Debug>(r: Result<T, tonic::Status>) -> tonic::Code {
    r.expect_err("refused").code()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_indexer_call_needs_the_token_and_health_does_not() {
    let sim = Sim::start(&[]).await;
    let token = TokenFile::new("tok-1");
    let mut cfg = config(&[&sim]);
    cfg.grpc_token_file = Some(token.0.clone());
    let ix = start_indexer(&cfg).await;
    let channel = connect(ix.indexer.grpc_addr).await;
    let mut good = authed_client(channel.clone(), Some("tok-1"));
    let state = pb::PoolStateRequest { pool: POOL.into() };
    wait_for("endpoint healthy", Duration::from_secs(10), || {
        let mut c = good.clone();
        let s = state.clone();
        async move {
            c.pool_state(s)
                .await
                .is_ok_and(|r| r.into_inner().endpoints.iter().all(|e| e.healthy))
        }
    })
    .await;
    let chat = [("user", "hello".to_string())];
    let p = good
        .pick(chat_pick("a1", &chat))
        .await
        .expect("pick")
        .into_inner();
    assert_eq!(p.endpoints[0].address, sim.address());

    // No token: every method, the stream included, is UNAUTHENTICATED.
    let mut none = authed_client(channel.clone(), None);
    let unauth = tonic::Code::Unauthenticated;
    let e = none.pick(chat_pick("x", &chat)).await.expect_err("refused");
    assert_eq!(e.code(), unauth);
    assert!(
        e.message().contains("Bearer"),
        "clear message: {}",
        e.message()
    );
    let report = pb::ReportRequest {
        pool: POOL.into(),
        request_id: "a1".into(),
        ..Default::default()
    };
    assert_eq!(code(none.report(report.clone()).await), unauth);
    assert_eq!(code(none.pool_state(state.clone()).await), unauth);
    let (_tx, rx) = futures::channel::mpsc::unbounded::<pb::SessionRequest>();
    assert_eq!(code(none.session(rx).await), unauth);
    // A wrong token is refused the same way.
    let mut wrong = authed_client(channel.clone(), Some("tok-2"));
    assert_eq!(code(wrong.pick(chat_pick("y", &chat)).await), unauth);
    assert!(
        good.report(report)
            .await
            .expect("report")
            .into_inner()
            .matched
    );

    // Health answers without credentials (probes, Envoy's health checks).
    let health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    wait_for(
        "health SERVING, asked with no token",
        Duration::from_secs(5),
        || {
            let mut h = health.clone();
            async move {
                let st = h
                    .check(tonic_health::pb::HealthCheckRequest { service: "".into() })
                    .await
                    .expect("health needs no token")
                    .into_inner();
                st.status == tonic_health::pb::health_check_response::ServingStatus::Serving as i32
            }
        },
    )
    .await;
    let text = ix.metrics().await;
    let metric = |reason: &str| {
        let l = format!("kvasir_indexer_grpc_unauthenticated_total{{reason=\"{reason}\"}}");
        metric_value(&text, &l).unwrap_or_else(|| panic!("no {l}"))
    };
    assert_eq!((metric("missing"), metric("invalid")), (4.0, 1.0));

    // Rotation: the new token is taken up from the file, the old refused;
    // a file that turns empty keeps the last good token.
    token.write("tok-2");
    wait_for("rotated token accepted", Duration::from_secs(10), || {
        let mut c = wrong.clone();
        async move {
            c.pool_state(pb::PoolStateRequest { pool: POOL.into() })
                .await
                .is_ok()
        }
    })
    .await;
    assert_eq!(code(good.pool_state(state.clone()).await), unauth);
    token.write("\n");
    tokio::time::sleep(kvasir_cache_indexer::TOKEN_RELOAD_INTERVAL * 2).await;
    assert!(
        wrong.pool_state(state).await.is_ok(),
        "last good token kept"
    );
    ix.indexer.shutdown().await;
}

/// 10,000 picks nobody reports (distinct prompts and ids, as a flood
/// would send) move each engine's in-flight count by at most the cap; the
/// rest are answered, not accounted, and counted. Real picks still reach
/// every engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fake_pick_flood_is_bounded_and_real_traffic_flows() {
    const CAP: u32 = 32;
    const FLOOD: usize = 10_000;
    let sims = Sim::start_many(3).await;
    let mut cfg = config(&sims.iter().collect::<Vec<_>>());
    cfg.pools[0].in_flight.max_unconfirmed_per_endpoint = CAP;
    let ix = start_indexer(&cfg).await;
    ix.wait_ready().await;

    let answered = futures::stream::iter(0..FLOOD)
        .map(|i| {
            let mut c = ix.client.clone();
            let base = (i as u32) * 64;
            let req = ids_pick(&format!("fake-{i}"), (base..base + 64).collect());
            async move { c.pick(req).await.map(|r| r.into_inner().endpoints.len()) }
        })
        .buffer_unordered(64)
        .filter(|r| futures::future::ready(matches!(r, Ok(n) if *n > 0)))
        .count()
        .await;
    assert_eq!(answered, FLOOD, "every fake pick is answered");

    let st = ix.state().await;
    for e in &st.endpoints {
        assert!(
            e.in_flight <= CAP,
            "{} holds {} phantom picks, over the cap {CAP}",
            e.address,
            e.in_flight
        );
    }
    let text = ix.metrics().await;
    let capped = metric_value(
        &text,
        "kvasir_indexer_picks_unaccounted_total{pool=\"sims\",reason=\"endpoint_cap\"}",
    )
    .expect("unaccounted metric");
    assert!(
        capped >= (FLOOD - 3 * CAP as usize) as f64,
        "picks past the cap are counted: {capped}"
    );
    assert_eq!(
        metric_value(&text, "kvasir_indexer_in_flight_unconfirmed{pool=\"sims\"}"),
        Some(st.endpoints.iter().map(|e| f64::from(e.in_flight)).sum())
    );

    // Real requests (reported as they go) still go to every engine.
    let mut served = BTreeSet::new();
    for i in 0..30 {
        let id = format!("real-{i}");
        let p = ix
            .pick(chat_pick(&id, &[("user", filler(100 + i, 40))]))
            .await;
        served.insert(p.endpoints[0].address.clone());
        for phase in [pb::ReportPhase::FirstToken, pb::ReportPhase::Done] {
            ix.report(pb::ReportRequest {
                pool: POOL.into(),
                request_id: id.clone(),
                phase: phase as i32,
                ..Default::default()
            })
            .await;
        }
    }
    let all: BTreeSet<String> = sims.iter().map(|s| s.address()).collect();
    assert_eq!(served, all, "real traffic reaches every engine");
    ix.indexer.shutdown().await;
}

/// Picks with no report at all leave the load view after the unconfirmed
/// timeout; a pick that got its FIRST_TOKEN stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreported_picks_expire_after_the_unconfirmed_timeout() {
    let sim = Sim::start(&[]).await;
    let mut cfg = config(&[&sim]);
    cfg.pools[0].in_flight.unconfirmed_timeout_ms = 1_000;
    let ix = start_indexer(&cfg).await;
    ix.wait_ready().await;
    for i in 0..50u32 {
        ix.pick(ids_pick(&format!("f{i}"), (i * 64..i * 64 + 64).collect()))
            .await;
    }
    ix.pick(ids_pick("real", (9000..9064).collect())).await;
    ix.report(pb::ReportRequest {
        pool: POOL.into(),
        request_id: "real".into(),
        phase: pb::ReportPhase::FirstToken as i32,
        ..Default::default()
    })
    .await;
    assert_eq!(ix.endpoint_state(&sim.address()).await.in_flight, 51);
    wait_for(
        "unreported picks expired",
        Duration::from_secs(10),
        || async { ix.endpoint_state(&sim.address()).await.in_flight == 1 },
    )
    .await;
    let text = ix.metrics().await;
    assert_eq!(
        metric_value(
            &text,
            "kvasir_indexer_in_flight_unconfirmed_expired_total{pool=\"sims\"}"
        ),
        Some(50.0)
    );
    ix.indexer.shutdown().await;
}
