//! Index source `picks` with real simulators: no KV events at all (the
//! endpoints have no events address, nothing subscribes), the pool is ready
//! at once, and picks follow this replica's own pick history: a follow-up
//! turn goes where the conversation went, and an endpoint's history is
//! bounded by `pickHistoryBlocks`, oldest prefixes evicted first.

use crate::service_support;
use std::time::Duration;

use kvasir_cache_indexer::config::Config;
use kvasir_cache_indexer::types::IndexSource;
use kvasir_proto::v1 as pb;
use service_support::*;

/// [`config`] with index `picks` and no events or replay addresses.
fn picks_config(sims: &[&Sim], history_blocks: usize) -> Config {
    let mut cfg = config(sims);
    let pool = &mut cfg.pools[0];
    pool.index = IndexSource::Picks;
    pool.pick_history_blocks = history_blocks;
    for e in &mut pool.endpoints {
        e.events = None;
        e.replay = None;
    }
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picks_mode_follows_its_own_history_without_events() {
    let sims = Sim::start_many(3).await;
    let ix = start_indexer(&picks_config(&sims.iter().collect::<Vec<_>>(), 25_000)).await;
    // Ready without any event stream (none is configured, none started).
    ix.wait_ready().await;
    for p in ix.indexer.pools.iter() {
        assert!(!p.wants_events());
        assert!(p.endpoints().iter().all(|e| e.subscriber.is_none()));
    }
    let st = ix.state().await;
    assert!(st
        .endpoints
        .iter()
        .all(|e| e.sync_state == pb::SyncState::Unspecified as i32 && e.indexed_blocks == 0));

    // Turn 1 of a conversation behind a long system prompt: by load.
    let system = format!("You are a careful assistant. {}", filler(21, 600));
    let mut chat = vec![
        ("system", system.clone()),
        ("user", format!("First question: {}", filler(22, 40))),
    ];
    let p1 = ix.pick(chat_pick("t1", &chat)).await;
    assert_eq!(p1.reason, "load", "nothing in the history yet");
    let home = p1.endpoints[0].address.clone();
    let home_sim = sims.iter().find(|s| s.address() == home).expect("home");
    let r1 = home_sim.chat(&chat, 8).await;
    ix.report(pb::ReportRequest {
        pool: POOL.into(),
        request_id: "t1".into(),
        endpoint: home.clone(),
        prompt_tokens: prompt_tokens(&r1) as u32,
        ..Default::default()
    })
    .await;
    let blocks = ix.endpoint_state(&home).await.indexed_blocks;
    assert_eq!(
        blocks,
        prompt_tokens(&r1) / 16,
        "the history holds the prompt's full blocks"
    );

    // Turn 2 goes home, predicted from the history; the engine has at
    // least that cached (it also cached what it generated).
    chat.push(("assistant", reply(&r1)));
    chat.push(("user", "And a second one?".into()));
    let p2 = ix.pick(chat_pick("t2", &chat)).await;
    assert_eq!(p2.reason, "prefix");
    assert_eq!(p2.endpoints[0].address, home);
    let predicted = u64::from(p2.endpoints[0].predicted_cached_tokens);
    // All of turn 1's prompt but the block where the template moves on to
    // the reply (and the last partial block).
    assert!(
        predicted + 32 >= prompt_tokens(&r1),
        "system prompt and turn 1 predicted: {predicted} of {}",
        prompt_tokens(&r1)
    );
    let r2 = home_sim.chat(&chat, 8).await;
    assert!(
        cached_tokens(&r2) >= predicted,
        "engine cached {} < predicted {predicted}",
        cached_tokens(&r2)
    );
    ix.report(pb::ReportRequest {
        pool: POOL.into(),
        request_id: "t2".into(),
        endpoint: home.clone(),
        ..Default::default()
    })
    .await;

    // /metrics: the source is shown, the history per endpoint, and no
    // event-stream families for the pool.
    let text = ix.metrics().await;
    let value = |needle: &str| metric_value(&text, needle);
    assert_eq!(
        value("kvasir_indexer_index_source{pool=\"sims\",source=\"picks\"}"),
        Some(1.0)
    );
    assert_eq!(
        value("kvasir_indexer_index_source{pool=\"sims\",source=\"events\"}"),
        Some(0.0)
    );
    let hist = value(&format!(
        "kvasir_indexer_pick_history_blocks{{pool=\"sims\",endpoint=\"{home}\"}}"
    ))
    .expect("history gauge");
    assert!(hist > blocks as f64, "turn 2 added blocks: {hist}");
    for family in [
        "kvasir_indexer_sync_state{",
        "kvasir_indexer_event_messages_total{",
    ] {
        assert!(
            !text.lines().any(|l| l.starts_with(family)),
            "{family} has samples without subscribers"
        );
    }
    ix.indexer.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picks_mode_history_is_bounded_by_pick_history_blocks() {
    let sim = Sim::start(&[]).await;
    let ix = start_indexer(&picks_config(&[&sim], 64)).await;
    ix.wait_ready().await;
    let addr = sim.address();
    // Three prompts of 40 blocks (16 tokens each) into 64 blocks of history.
    let prompt = |n: u32| -> Vec<u32> { (0..640).map(|i| 1000 + n * 1000 + i).collect() };
    for n in 0..3 {
        let p = ix.pick(ids_pick(&format!("r{n}"), prompt(n))).await;
        assert_eq!(p.endpoints[0].address, addr);
        let held = ix.endpoint_state(&addr).await.indexed_blocks;
        assert!(held <= 64, "history over capacity: {held}");
    }
    assert_eq!(ix.endpoint_state(&addr).await.indexed_blocks, 64);
    // The newest is whole (all but its last block predicted), the one before
    // lost its tail, the oldest is gone.
    let p = ix.pick(ids_pick("a", prompt(2))).await;
    assert_eq!(p.reason, "prefix");
    assert_eq!(p.endpoints[0].predicted_cached_tokens, 39 * 16);
    let p = ix.pick(ids_pick("b", prompt(1))).await;
    assert_eq!(p.endpoints[0].predicted_cached_tokens, 24 * 16);
    let p = ix.pick(ids_pick("c", prompt(0))).await;
    assert_eq!(p.reason, "load");
    assert_eq!(p.endpoints[0].predicted_cached_tokens, 0);
    ix.indexer.shutdown().await;
}

/// The binary with `--index picks`: endpoints without `events=`, ready at
/// once; without `--index picks` the same flags ask each engine for its
/// KV-event sockets (`/kv_event_sources`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_runs_with_index_picks_from_flags() {
    let sim = Sim::start(&[]).await;
    let endpoint = format!("pool={POOL},address={}", sim.address());
    let bin = IndexerBin::start([
        "--tokenizer",
        "approx",
        "--index",
        "picks",
        "--pick-history-blocks",
        "1000",
        "--endpoint",
        &endpoint,
    ])
    .await;
    // Bounded as a whole; the binary is killed when `bin` drops.
    let ready = async {
        bin.wait_ready().await;
        let metrics = bin.metrics().await;
        assert!(
            metrics.contains("kvasir_indexer_index_source{pool=\"sims\",source=\"picks\"} 1"),
            "{metrics}"
        );
    };
    tokio::time::timeout(Duration::from_secs(30), ready)
        .await
        .expect("ready in time");
    drop(bin);

    let bin = IndexerBin::start(["--tokenizer", "approx", "--endpoint", &endpoint]).await;
    let asked = format!("kvasir_indexer_kv_event_source_lookups_total{{pool=\"{POOL}\"");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let metrics = bin.metrics().await;
        let n = metrics
            .lines()
            .find(|l| l.starts_with(&asked))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        if n > 0 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{metrics}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
