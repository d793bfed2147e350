//! Responses API affinity in one indexer over real gRPC: a reported
//! response id routes its follow-ups to the endpoint that produced it
//! (unary and over `Session` streams, healthy or not), an unknown id is
//! UNKNOWN_RESPONSE, and so is one whose engine left the pool, restarted
//! or whose record expired or was evicted; a report arriving shortly after
//! the pick still routes it (the grace), and a pick's deadline holds.

use crate::responses_support;
use crate::service_support;
use std::time::{Duration, Instant};

use kvasir_cache_indexer::responses::config::ResponsesConfig;
use kvasir_cache_indexer::types::EndpointSpec;
use kvasir_proto::v1 as pb;
use responses_support::*;
use serde_json::json;
use service_support::{config as sim_config, start_indexer, Sim, POOL};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reported_id_routes_its_follow_ups_unary_and_over_sessions() {
    let ix = indexer(3, &grace(300)).await;
    // Nothing serves these endpoints: they are unhealthy, and a response
    // pick still goes to its one holder.
    assert!(ix.state().await.endpoints.iter().all(|e| !e.healthy));

    let r = ix.report(report("req-1", "resp_unary", &addr(1))).await;
    assert!(!r.matched, "no pick preceded it");
    let p = ix.pick(response_pick("req-2", "resp_unary")).await;
    assert_eq!(routed(&p), addr(1));
    assert!(p.endpoints[0].score.is_none());

    // The pick is accounted on its endpoint; its report releases it.
    assert_eq!(ix.endpoint_state(&addr(1)).await.in_flight, 1);
    assert!(ix.report(report("req-2", "", &addr(1))).await.matched);

    // Over one stream: a report is applied before the pick sent after it.
    let mut a = Session::open(&ix).await;
    a.report(report("req-3", "resp_stream", &addr(2)));
    assert_eq!(
        routed(&a.pick(response_pick("req-4", "resp_stream")).await),
        addr(2)
    );

    // Another worker's stream sees it too, and a prompt alongside the id
    // does not change the answer.
    let mut b = Session::open(&ix).await;
    let mut with_prompt = response_pick("req-5", "resp_stream");
    with_prompt.prompt = Some(pb::pick_request::Prompt::Text("next turn".into()));
    assert_eq!(routed(&b.pick(with_prompt).await), addr(2));

    let unknown = b.pick(response_pick("req-6", "resp_nobody")).await;
    assert_unknown(&unknown);

    let m = ix.metrics().await;
    for line in [
        "kvasir_indexer_responses_recorded_total{pool=\"sims\"} 2\n",
        "kvasir_indexer_response_lookups_total{pool=\"sims\",result=\"hit\"} 3\n",
        "kvasir_indexer_response_lookups_total{pool=\"sims\",result=\"not_recorded\"} 1\n",
        "kvasir_indexer_picks_total{pool=\"sims\",decision=\"response\"} 3\n",
        "kvasir_indexer_picks_total{pool=\"sims\",decision=\"unknown_response\"} 1\n",
        "kvasir_indexer_responses_entries{pool=\"sims\"} 2\n",
    ] {
        assert!(m.contains(line), "no `{line}` in\n{m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_50ms_after_the_pick_still_routes_it_within_the_grace() {
    let ix = indexer(2, &grace(1000)).await;
    // The follow-up comes in on one worker's stream, the report carrying
    // the id on another's, 50 ms later.
    let mut picker = Session::open(&ix).await;
    let mut reporter = Session::open(&ix).await;
    let started = Instant::now();
    let id = picker.send_pick(response_pick("req-1", "resp_race"));
    tokio::time::sleep(Duration::from_millis(50)).await;
    reporter.report(report("req-0", "resp_race", &addr(1)));
    let p = picker.answer(id).await;
    assert_eq!(routed(&p), addr(1));
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(900),
        "woken by the report, not the grace: {took:?}"
    );
    assert_eq!(
        metric(&ix, "kvasir_indexer_response_waits_total{pool=\"sims\"}").await,
        1.0
    );

    // An id nobody reports is answered once the grace has passed.
    let started = Instant::now();
    assert_unknown(&ix.pick(response_pick("req-2", "resp_never")).await);
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1000) && took < Duration::from_secs(3),
        "{took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pick_deadline_shorter_than_the_grace_still_holds() {
    let ix = indexer(2, &grace(3000)).await;
    // The deadline only as the header says it (no client-side timer): the
    // server must end the call itself.
    let mut req = tonic::Request::new(response_pick("req-1", "resp_never"));
    req.metadata_mut()
        .insert("grpc-timeout", "150m".parse().expect("header value"));
    let started = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(5), ix.client.clone().pick(req))
        .await
        .expect("the server ends the call by itself");
    let took = started.elapsed();
    let status = r.expect_err("past its deadline");
    assert!(
        matches!(
            status.code(),
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        ),
        "{status:?}"
    );
    assert!(took < Duration::from_millis(1500), "{took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_that_left_the_pool_loses_its_ids_even_when_back() {
    let ix = indexer(3, &grace(0)).await;
    ix.report(report("req-1", "resp_gone", &addr(2))).await;
    ix.report(report("req-2", "resp_stays", &addr(0))).await;
    assert_eq!(
        routed(&ix.pick(response_pick("req-3", "resp_gone")).await),
        addr(2)
    );

    let pool = ix.indexer.pools.get(POOL).expect("pool");
    // Ids are compared in ms with when the endpoint left.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let two: Vec<EndpointSpec> = pool.endpoints()[..2]
        .iter()
        .map(|e| e.spec.clone())
        .collect();
    pool.set_endpoints(two, |_| None);
    assert_unknown(&ix.pick(response_pick("req-4", "resp_gone")).await);
    assert_eq!(
        routed(&ix.pick(response_pick("req-5", "resp_stays")).await),
        addr(0)
    );

    // Back (a new process at the same address, as far as anyone knows).
    let three = (0..3).map(EndpointSpec::loopback).collect();
    pool.set_endpoints(three, |_| None);
    assert_unknown(&ix.pick(response_pick("req-6", "resp_gone")).await);
    tokio::time::sleep(Duration::from_millis(5)).await;
    ix.report(report("req-7", "resp_new", &addr(2))).await;
    assert_eq!(
        routed(&ix.pick(response_pick("req-8", "resp_new")).await),
        addr(2)
    );
    let gone = metric(
        &ix,
        "kvasir_indexer_response_lookups_total{pool=\"sims\",result=\"endpoint_gone\"}",
    )
    .await;
    assert_eq!(gone, 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_expire_after_the_ttl() {
    let ix = indexer(
        2,
        &ResponsesConfig {
            ttl_s: 1,
            grace_ms: 0,
            ..ResponsesConfig::default()
        },
    )
    .await;
    ix.report(report("req-1", "resp_old", &addr(1))).await;
    assert_eq!(
        routed(&ix.pick(response_pick("req-2", "resp_old")).await),
        addr(1)
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_unknown(&ix.pick(response_pick("req-3", "resp_old")).await);
    let m = ix.metrics().await;
    for line in [
        "kvasir_indexer_response_lookups_total{pool=\"sims\",result=\"expired\"} 1\n",
        "kvasir_indexer_responses_dropped_total{pool=\"sims\",reason=\"expired\"} 1\n",
        "kvasir_indexer_responses_entries{pool=\"sims\"} 0\n",
    ] {
        assert!(m.contains(line), "no `{line}` in\n{m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_bound_evicts_the_least_recently_used_id() {
    let ix = indexer(
        2,
        &ResponsesConfig {
            max_entries: 3,
            grace_ms: 0,
            ..ResponsesConfig::default()
        },
    )
    .await;
    for i in 0..3 {
        ix.report(report(&format!("req-{i}"), &format!("resp_{i}"), &addr(1)))
            .await;
    }
    // resp_0 is used again: resp_1 is now the least recently used.
    assert_eq!(
        routed(&ix.pick(response_pick("p-0", "resp_0")).await),
        addr(1)
    );
    ix.report(report("req-3", "resp_3", &addr(0))).await;
    assert_unknown(&ix.pick(response_pick("p-1", "resp_1")).await);
    for (id, at) in [("resp_0", 1), ("resp_2", 1), ("resp_3", 0)] {
        assert_eq!(
            routed(&ix.pick(response_pick("p", id)).await),
            addr(at),
            "{id}"
        );
    }
    let m = ix.metrics().await;
    for line in [
        "kvasir_indexer_responses_dropped_total{pool=\"sims\",reason=\"evicted\"} 1\n",
        "kvasir_indexer_responses_entries{pool=\"sims\"} 3\n",
    ] {
        assert!(m.contains(line), "no `{line}` in\n{m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_response_ids_are_refused_or_skipped() {
    let ix = indexer(2, &grace(0)).await;
    let long = "r".repeat(300);
    let e = ix
        .client
        .clone()
        .pick(response_pick("req-1", &long))
        .await
        .expect_err("too long");
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().starts_with("response_id:"), "{}", e.message());
    // A report with one is still accounted; the id is not recorded.
    ix.report(report("req-2", &long, &addr(0))).await;
    assert_eq!(
        metric(
            &ix,
            "kvasir_indexer_responses_recorded_total{pool=\"sims\"}"
        )
        .await,
        0.0
    );
}

/// A real engine whose event stream restarts (its sequence starts over, as
/// a new process's does): the ids it produced before are unknown, the ones
/// after route to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_seen_on_its_events_loses_its_ids() {
    let sim = Sim::start(&[]).await;
    let mut cfg = sim_config(&[&sim]);
    cfg.responses = grace(0);
    let ix = start_indexer(&cfg).await;
    ix.wait_ready().await;
    let chat = |seed: u64| vec![("user", service_support::filler(seed, 120))];
    sim.chat(&chat(1), 4).await;
    ix.wait_settled(&sim.address()).await;
    ix.report(report("req-1", "resp_before", &sim.address()))
        .await;
    assert_eq!(
        routed(&ix.pick(response_pick("req-2", "resp_before")).await),
        sim.address()
    );

    tokio::time::sleep(Duration::from_millis(5)).await;
    sim.post("/sim/restart-events", &json!({})).await;
    sim.chat(&chat(2), 4).await;
    service_support::wait_for("the restart seen", Duration::from_secs(10), || async {
        metric(&ix, "kvasir_indexer_engine_restarts_total{").await >= 1.0
    })
    .await;
    assert_unknown(&ix.pick(response_pick("req-3", "resp_before")).await);
    tokio::time::sleep(Duration::from_millis(5)).await;
    ix.report(report("req-4", "resp_after", &sim.address()))
        .await;
    assert_eq!(
        routed(&ix.pick(response_pick("req-5", "resp_after")).await),
        sim.address()
    );
    let restarted = metric(
        &ix,
        "kvasir_indexer_response_lookups_total{pool=\"sims\",result=\"endpoint_restarted\"}",
    )
    .await;
    assert_eq!(restarted, 1.0);
}
