//! Responses API affinity shared through a real `redis-server` (started by
//! the test on a free loopback port, no persistence, killed at the end):
//! two indexer replicas route a follow-up the other one recorded, also when
//! the report reaches the other replica after the pick; with Redis gone
//! each replica answers from its own records, counts the fallback and never
//! hangs, and picks up Redis again once it is back.
//!
//! Fails, naming the package, where `redis-server` is not installed
//! (`make setup` installs it): never skipped.

use crate::responses_support;
use crate::service_support;
use std::time::{Duration, Instant};

use kvasir_cache_indexer::responses::config::ResponsesConfig;
use kvasir_proto::v1 as pb;
use responses_support::*;
use service_support::Running;

/// Both replicas over the same three endpoints and the same Redis.
async fn replicas(responses: &ResponsesConfig) -> (Running, Running) {
    (indexer(3, responses).await, indexer(3, responses).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_response_ids_through_redis() {
    let redis = Redis::start().await;
    let (a, b) = replicas(&redis.responses(1000)).await;

    a.report(report("req-1", "resp_shared", &addr(2))).await;
    // The write-through is in the background: the value lands shortly.
    let key = "kvasir:responses:sims:resp_shared";
    service_support::wait_for("the record in redis", Duration::from_secs(5), || async {
        redis.get(key).await.is_some()
    })
    .await;
    let value = redis.get(key).await.expect("value");
    assert!(
        value.ends_with(&format!(" {} {TENANT}", addr(2))),
        "the record names its endpoint and its owner: {value}"
    );

    assert_eq!(
        routed(&b.pick(response_pick("req-2", "resp_shared")).await),
        addr(2)
    );
    // Read once, then held locally.
    assert_eq!(
        metric(&b, "kvasir_indexer_responses_entries{pool=\"sims\"}").await,
        1.0
    );

    // The follow-up reaches replica B before the report reaches replica A.
    let started = Instant::now();
    let late = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        a.report(report("req-3", "resp_race", &addr(0))).await;
    };
    let (p, ()) = tokio::join!(b.pick(response_pick("req-4", "resp_race")), late);
    assert_eq!(routed(&p), addr(0));
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "{:?}",
        started.elapsed()
    );

    assert_unknown(&b.pick(response_pick("req-5", "resp_nobody")).await);
    for ix in [&a, &b] {
        let m = ix.metrics().await;
        for line in [
            "kvasir_indexer_responses_store{pool=\"sims\",store=\"redis\"} 1\n",
            "kvasir_indexer_responses_store_fallbacks_total{pool=\"sims\",op=\"get\"} 0\n",
            "kvasir_indexer_responses_store_fallbacks_total{pool=\"sims\",op=\"put\"} 0\n",
        ] {
            assert!(m.contains(line), "no `{line}` in\n{m}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_gone_each_replica_uses_its_own_records_and_counts_it() {
    let mut redis = Redis::start().await;
    let responses = ResponsesConfig {
        redis_retry_ms: 200,
        ..redis.responses(300)
    };
    let (a, b) = replicas(&responses).await;
    a.report(report("req-1", "resp_before", &addr(1))).await;
    service_support::wait_for("the record in redis", Duration::from_secs(5), || async {
        redis
            .get("kvasir:responses:sims:resp_before")
            .await
            .is_some()
    })
    .await;

    redis.kill();
    // Replica A still has its own record; B cannot read Redis and answers
    // unknown once the grace has passed, no later.
    assert_eq!(
        routed(&a.pick(response_pick("req-2", "resp_before")).await),
        addr(1)
    );
    let started = Instant::now();
    assert_unknown(&b.pick(response_pick("req-3", "resp_before")).await);
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "no hang: {took:?}");
    assert!(
        metric(
            &b,
            "kvasir_indexer_responses_store_fallbacks_total{pool=\"sims\",op=\"get\"}"
        )
        .await
            >= 1.0
    );

    // A record made meanwhile stays local, and that is counted.
    a.report(report("req-4", "resp_during", &addr(0))).await;
    assert_eq!(
        routed(&a.pick(response_pick("req-5", "resp_during")).await),
        addr(0)
    );
    service_support::wait_for(
        "the failed write-through counted",
        Duration::from_secs(5),
        || async {
            metric(
                &a,
                "kvasir_indexer_responses_store_fallbacks_total{pool=\"sims\",op=\"put\"}",
            )
            .await
                >= 1.0
        },
    )
    .await;

    // Back: after the retry delay the replicas use it again.
    redis.restart().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut n = 0;
    loop {
        n += 1;
        let id = format!("resp_after_{n}");
        a.report(report(&format!("req-a{n}"), &id, &addr(2))).await;
        let p = b.pick(response_pick(&format!("req-b{n}"), &id)).await;
        if p.endpoints.first().is_some_and(|e| e.address == addr(2)) {
            break;
        }
        // The first calls after the restart may still meet the retry delay.
        assert!(
            Instant::now() < deadline,
            "replicas never shared again: {p:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_response_is_its_tenants_alone_on_every_replica() {
    let redis = Redis::start().await;
    let (a, b) = replicas(&redis.responses(100)).await;
    a.report(report("req-1", "resp_owned", &addr(1))).await;
    let key = "kvasir:responses:sims:resp_owned";
    service_support::wait_for("the record in redis", Duration::from_secs(5), || async {
        redis.get(key).await.is_some()
    })
    .await;
    let other = |rid: &str| pb::PickRequest {
        tenant: "beta".into(),
        ..response_pick(rid, "resp_owned")
    };
    // Another tenant gets what an unknown id gets, from either replica,
    // also from the one that reads the record from Redis.
    assert_unknown(&b.pick(other("req-2")).await);
    assert_unknown(&a.pick(other("req-3")).await);
    assert_eq!(
        routed(&b.pick(response_pick("req-4", "resp_owned")).await),
        addr(1)
    );
    // Its report of the same id (no engine would give it one) changes
    // nothing: the first record stands, here and in Redis.
    let mut r = report("req-5", "resp_owned", &addr(0));
    r.tenant = "beta".into();
    b.report(r).await;
    a.report(report("req-6", "resp_owned", &addr(0))).await;
    let value = redis.get(key).await.expect("value");
    assert!(
        value.ends_with(&format!(" {} {TENANT}", addr(1))),
        "{value}"
    );
    assert_eq!(
        routed(&a.pick(response_pick("req-7", "resp_owned")).await),
        addr(1)
    );
    assert_unknown(&a.pick(other("req-8")).await);
    let m = b.metrics().await;
    let line = "kvasir_indexer_response_lookups_total{pool=\"sims\",result=\"other_tenant\"} 1\n";
    assert!(m.contains(line), "no `{line}` in\n{m}");
}
