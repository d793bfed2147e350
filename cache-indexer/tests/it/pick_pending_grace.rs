//! A conversation's next turn, picked right after the previous turn's DONE
//! report, goes back to the engine that served it, even before
//! that engine's KV events reach the index.
//!
//! Real `vllm-sim` processes and a real indexer, with the engines' events
//! never arriving (their addresses point at a socket that accepts nothing):
//! the lag between an engine's work and its events, which is milliseconds
//! in practice, stretched forever, so the test is deterministic. Turn 2 must
//! find turn 1's prompt credited to turn 1's engine; once the grace
//! ([`PENDING_GRACE`]) is over, nobody is credited with it any more (the
//! index alone tells, and here it never learned).

use crate::service_support;
use std::time::Duration;

use kvasir_cache_indexer::load::PENDING_GRACE;
use kvasir_proto::v1 as pb;
use service_support::*;

/// Engines in the pool.
const ENGINES: usize = 3;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_turn_finds_the_previous_prompt_before_its_events() {
    let sims = Sim::start_many(ENGINES).await;
    // Connections complete in the kernel but nothing is ever sent.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let silent_port = silent.local_addr().expect("addr").port();
    let mut cfg = config(&sims.iter().collect::<Vec<_>>());
    for e in &mut cfg.pools[0].endpoints {
        e.events = Some(format!("tcp://127.0.0.1:{silent_port}"));
        e.replay = None;
    }
    let ix = start_indexer(&cfg).await;
    wait_for("every engine healthy", Duration::from_secs(10), || async {
        ix.state().await.endpoints.iter().all(|e| e.healthy)
    })
    .await;

    let mut messages = vec![(
        "user",
        format!("Grace conversation opens: {}", filler(5, 300)),
    )];
    let pick = ix.pick(chat_pick("grace-t0", &messages)).await;
    let home = pick.endpoints[0].address.clone();
    let sim = sims
        .iter()
        .find(|s| s.address() == home)
        .expect("picked a simulator");
    let resp = sim.chat(&messages, 8).await;
    ix.report(served_done("grace-t0", &home, &resp, 8)).await;
    messages.push(("assistant", reply(&resp)));
    messages.push(("user", "Go on.".into()));

    // At once: the engine that ran turn 1 holds its prompt.
    let pick = ix.pick(chat_pick("grace-t1", &messages)).await;
    assert_eq!(
        ix.endpoint_state(&home).await.indexed_blocks,
        0,
        "no events arrive in this test"
    );
    assert_eq!(pick.endpoints[0].address, home, "{pick:?}");
    assert_eq!(pick.decision, pb::Decision::Prefix as i32, "{pick:?}");
    assert!(pick.endpoints[0].predicted_cached_tokens > 0, "{pick:?}");
    assert!(
        pick.endpoints[1..]
            .iter()
            .all(|e| e.predicted_cached_tokens == 0),
        "{pick:?}"
    );

    // Turn 2 is not served: reported done, its prompt settles like turn 1's.
    ix.report(pb::ReportRequest {
        pool: POOL.into(),
        request_id: "grace-t1".into(),
        endpoint: home.clone(),
        outcome: pb::Outcome::Success as i32,
        phase: pb::ReportPhase::Done as i32,
        ..Default::default()
    })
    .await;
    // Past the grace, a prompt sharing their first message is credited to
    // nobody.
    tokio::time::sleep(PENDING_GRACE + Duration::from_millis(200)).await;
    let other = vec![messages[0].clone(), ("user", "Something else.".into())];
    let pick = ix.pick(chat_pick("grace-t2", &other)).await;
    let on_home = pick
        .endpoints
        .iter()
        .find(|e| e.address == home)
        .unwrap_or_else(|| panic!("home not listed: {pick:?}"));
    assert_eq!(on_home.predicted_cached_tokens, 0, "{pick:?}");
    drop(silent);
    ix.indexer.shutdown().await;
}
