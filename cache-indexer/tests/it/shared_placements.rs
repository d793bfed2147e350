//! Replicas that share recent placements: two indexer replicas
//! over three real `vllm-sim` engines (KV events over ZMQ, both replicas
//! indexing them), sharing load and placements through a real
//! `redis-server` (free loopback port, no persistence, killed at the end).
//!
//! * A conversation started through replica A continues through replica B:
//!   new conversations through B avoid A's engine, which B counts as
//!   placed; B knows the prompt A placed ended where B's prompt goes on, so
//!   the later turn is not charged as a new conversation (no `placement`
//!   term on any endpoint, though B's own counts differ) and stays on A's
//!   engine.
//! * Six cold conversations sent through A and B (A, A, A, B, B, A) spread
//!   two per engine, as they do through one replica (`pick_spread.rs`).
//!   Each replica spreading only its own would put B's first two wherever
//!   its ties fall (two per engine by luck one time in three).

use crate::responses_support;
use crate::service_support;
use std::collections::HashMap;
use std::time::Duration;

use kvasir_cache_indexer::config::Config;
use kvasir_cache_indexer::shared_load::config::SharedLoadConfig;
use kvasir_proto::v1 as pb;
use responses_support::{metric, Redis};
use service_support::*;

/// Bound of every wait for a change to cross Redis (a busy 2-core machine).
const CROSS: Duration = Duration::from_secs(5);

fn shared(sims: &[Sim], redis: &Redis, id: &str) -> Config {
    let mut cfg = config(&sims.iter().collect::<Vec<_>>());
    cfg.shared_load = SharedLoadConfig {
        redis_url: Some(redis.url()),
        interval_ms: 20,
        ttl_ms: 400,
        timeout_ms: 200,
        retry_ms: 200,
        replica_id: Some(id.into()),
        ..SharedLoadConfig::default()
    };
    cfg
}

/// The other replica's starts (`kind` "start") or prompt ends ("end")
/// merged by `ix`.
async fn merged(ix: &Running, kind: &str) -> f64 {
    let line = format!(
        "kvasir_indexer_shared_load_peer_placements_total{{pool=\"{POOL}\",kind=\"{kind}\"}}"
    );
    metric(ix, &line).await
}

async fn gauge(ix: &Running, name: &str) -> f64 {
    metric(ix, &format!("{name}{{pool=\"{POOL}\"}}")).await
}

/// Waits until `ix` merged at least `starts` of the other's conversation
/// starts and `ends` of its prompt ends, and counts none of its picks in
/// flight: the next pick differs from the other replica's by nothing but
/// what each placed.
async fn wait_merged(ix: &Running, starts: f64, ends: f64) {
    let what = format!("{starts} peer starts and {ends} ends merged");
    wait_for(&what, CROSS, || async {
        merged(ix, "start").await >= starts
            && merged(ix, "end").await >= ends
            && gauge(ix, "kvasir_indexer_shared_load_peer_in_flight").await == 0.0
    })
    .await;
}

async fn start_pair(sims: &[Sim], redis: &Redis) -> (Running, Running) {
    let a = start_indexer(&shared(sims, redis, "a")).await;
    let b = start_indexer(&shared(sims, redis, "b")).await;
    for ix in [&a, &b] {
        ix.wait_ready().await;
        wait_for("the other replica live", CROSS, || async {
            gauge(ix, "kvasir_indexer_shared_load_peers").await == 1.0
        })
        .await;
    }
    (a, b)
}

fn done(request_id: &str, endpoint: &str) -> pb::ReportRequest {
    pb::ReportRequest {
        pool: POOL.into(),
        request_id: request_id.into(),
        endpoint: endpoint.into(),
        phase: pb::ReportPhase::Done as i32,
        outcome: pb::Outcome::Success as i32,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_started_on_one_replica_continues_on_the_other() {
    let redis = Redis::start().await;
    let sims = Sim::start_many(3).await;
    let by_addr: HashMap<String, &Sim> = sims.iter().map(|s| (s.address(), s)).collect();
    let (a, b) = start_pair(&sims, &redis).await;

    // Turn 1 through A, served where A put it; both replicas index it.
    let mut conv = vec![
        (
            "system",
            format!("You are a helpful assistant. {}", filler(1, 900)),
        ),
        ("user", format!("first question: {}", filler(2, 20))),
    ];
    let pick = a.pick(chat_pick("t1", &conv)).await;
    let home = pick.endpoints[0].address.clone();
    let resp = by_addr[&home].chat(&conv, 24).await;
    a.report(served_done("t1", &home, &resp, 24)).await;
    conv.push(("assistant", reply(&resp)));
    for ix in [&a, &b] {
        ix.wait_settled(&home).await;
    }
    // Its start and its prompt's end (remembered by A's chain completion).
    wait_merged(&b, 1.0, 1.0).await;

    // A new conversation through B (nothing of it cached anywhere): A's
    // engine has started one, the others none, so it goes elsewhere.
    let own = vec![
        ("system", format!("You write haiku. {}", filler(5, 300))),
        ("user", format!("a theme: {}", filler(6, 20))),
    ];
    let pick = b.pick(chat_pick("n0", &own)).await;
    let second = pick.endpoints[0].address.clone();
    assert_ne!(second, home, "{pick:?}");
    b.report(done("n0", &second)).await;

    // Turn 2 through B: a later turn, charged no placement anywhere (were
    // it a new one, B's own start just now would charge one), on A's
    // engine by its prefix.
    conv.push(("user", format!("second question: {}", filler(3, 20))));
    let pick = b.pick(chat_pick("t2", &conv)).await;
    assert_eq!(pick.endpoints[0].address, home, "{pick:?}");
    assert_eq!(pick.reason, "prefix", "{pick:?}");
    for e in &pick.endpoints {
        let placement = e.score.as_ref().map_or(-1.0, |s| s.placement);
        assert_eq!(
            placement, 0.0,
            "turn 2 charged as a new conversation: {pick:?}"
        );
    }
    b.report(done("t2", &home)).await;

    // Another new one through B: the one engine that started none.
    let other = vec![
        (
            "system",
            format!("You translate legal text. {}", filler(7, 300)),
        ),
        ("user", format!("a question: {}", filler(8, 20))),
    ];
    let pick = b.pick(chat_pick("n1", &other)).await;
    let third = &pick.endpoints[0].address;
    assert!(third != &home && third != &second, "{pick:?}");
    let at_home = pick.endpoints.iter().find(|e| e.address == home);
    let charged = at_home.and_then(|e| e.score.as_ref()).map(|s| s.placement);
    assert!(charged.is_some_and(|c| c > 0.0), "{pick:?}");
    for ix in [a, b] {
        ix.indexer.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_conversations_through_two_replicas_spread_two_per_engine() {
    let redis = Redis::start().await;
    let sims = Sim::start_many(3).await;
    let (a, b) = start_pair(&sims, &redis).await;
    let mut per: HashMap<String, usize> = HashMap::new();
    let mut sent = [0.0, 0.0];
    for (i, through_b) in [false, false, false, true, true, false]
        .into_iter()
        .enumerate()
    {
        let i = i as u64;
        let (ix, other) = if through_b { (&b, &a) } else { (&a, &b) };
        let conv = vec![
            ("system", format!("Assistant {i}. {}", filler(100 + i, 200))),
            ("user", format!("question {i}: {}", filler(200 + i, 20))),
        ];
        let id = format!("c{i}");
        let pick = ix.pick(chat_pick(&id, &conv)).await;
        let got = pick.endpoints[0].address.clone();
        ix.report(done(&id, &got)).await;
        *per.entry(got).or_default() += 1;
        // Its start crossed to the other replica before the next pick
        // there.
        sent[usize::from(through_b)] += 1.0;
        wait_merged(other, sent[usize::from(through_b)], 0.0).await;
    }
    eprintln!("conversations started per engine: {per:?}");
    assert_eq!(per.len(), 3, "every engine starts some: {per:?}");
    assert!(per.values().all(|&n| n == 2), "two per engine: {per:?}");
    for ix in [a, b] {
        ix.indexer.shutdown().await;
    }
}
