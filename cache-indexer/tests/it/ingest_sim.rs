//! The ingest path end to end against real `vllm-sim` processes over real
//! ZMQ: decode, subscriber (sequence tracking, replay, resync) and index.
//!
//! The simulator binary is `$VLLM_SIM_BIN` or `target/release/vllm-sim`
//! (built with `cargo build --release -p vllm-sim`).

use crate::service_support;
use crate::testkit;
use bytes::Bytes;
use kvasir_cache_indexer::events::subscriber::{
    spawn_subscriber, SubscriberConfig, SubscriberHandle, SyncState,
};
use kvasir_cache_indexer::index::PoolIndex;
use kvasir_cache_indexer::types::{EndpointId, EndpointSpec};
use serde_json::{json, Value};
use service_support::MODEL;
use std::sync::Arc;
use std::time::{Duration, Instant};
use testkit::vllm_payload;
use zeromq::{Socket, SocketSend, ZmqMessage};

const BLOCK: u32 = testkit::BLOCK_SIZE;

/// One simulator process ([`service_support::Sim`]: fresh ports, output
/// kept, bounded start with retries, killed on drop) and what these tests
/// ask of it.
struct Sim(service_support::Sim);

impl std::ops::Deref for Sim {
    type Target = service_support::Sim;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for Sim {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl Sim {
    /// Starts a simulator on ports it picks itself.
    async fn start(extra: &[&str]) -> Sim {
        Sim(service_support::Sim::start(extra).await)
    }

    /// Restarts the process on the same ports (retrying while the old
    /// sockets are released).
    async fn restart(&mut self) {
        self.0.spawn();
        self.0.wait_healthy().await;
    }

    fn spec(&self) -> EndpointSpec {
        EndpointSpec {
            address: format!("127.0.0.1:{}", self.http),
            kv_events: format!("tcp://127.0.0.1:{}", self.events),
            replay: Some(format!("tcp://127.0.0.1:{}", self.replay)),
            metrics_url: None,
            topic: String::new(),
        }
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        let r = self.0.post(path, &body).await;
        assert!(r.status().is_success(), "{path}: {}", r.status());
        r.json().await.expect("sim json")
    }

    /// Runs one chat request; returns the prompt's token ids (from /tokenize,
    /// the same chat template the engine applies). (Not
    /// [`service_support::Sim::chat`], which returns the response.)
    async fn chat(&self, content: &str) -> Vec<u32> {
        let messages = json!([{"role": "user", "content": content}]);
        let resp = self
            .post(
                "/v1/chat/completions",
                json!({"model": MODEL, "messages": messages, "max_tokens": 2}),
            )
            .await;
        assert!(resp["usage"]["prompt_tokens"].as_u64().unwrap_or(0) > 0);
        let t = self
            .post("/tokenize", json!({"model": MODEL, "messages": messages}))
            .await;
        let toks: Vec<u32> = t["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|v| v.as_u64().expect("token id") as u32)
            .collect();
        assert_eq!(
            toks.len() as u64,
            resp["usage"]["prompt_tokens"].as_u64().unwrap_or(0)
        );
        toks
    }
}

/// A prompt of about `words` distinct words, unique per `seed`.
fn prompt(seed: u32, words: usize) -> String {
    let mut s = format!("Request {seed}: ");
    for i in 0..words {
        s.push_str(&format!("w{}x{} ", seed, i * 7 % 1000));
    }
    s
}

/// Subscriber settings tuned for tests: short timeouts and probes.
fn cfg(spec: EndpointSpec) -> SubscriberConfig {
    let mut c = SubscriberConfig::new(spec, BLOCK);
    c.reconnect = Duration::from_millis(100);
    c.connect_timeout = Duration::from_millis(500);
    c.replay_timeout = Duration::from_millis(1000);
    c.replay_deadline = Duration::from_secs(10);
    c.idle_probe = Duration::from_millis(300);
    c.stale_after = Duration::from_millis(600);
    c
}

async fn until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn subscribe(sim: &Sim, index: &Arc<PoolIndex>) -> SubscriberHandle {
    let h = spawn_subscriber(cfg(sim.spec()), index.clone());
    assert!(
        h.wait_for_state(SyncState::InSync, Duration::from_secs(10))
            .await,
        "subscriber not in sync: {:?}",
        h.state()
    );
    h
}

fn full_blocks(t: &[u32]) -> usize {
    t.len() / BLOCK as usize
}

async fn wait_matched(index: &PoolIndex, ep: EndpointId, toks: &[u32], want: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        index.flush().await;
        let got = index.overlap(toks).blocks_for(ep);
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "matched {got} blocks, want {want}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn check_prompts_indexed(extra: &[&str]) {
    let sim = Sim::start(extra).await;
    let index = Arc::new(PoolIndex::new(BLOCK));
    let h = subscribe(&sim, &index).await;
    let ep = sim.spec().id();
    let mut all = Vec::new();
    for seed in 0..3 {
        let toks = sim.chat(&prompt(seed, 60 + seed as usize * 40)).await;
        assert!(full_blocks(&toks) >= 5);
        wait_matched(&index, ep, &toks, full_blocks(&toks)).await;
        all.push(toks);
    }
    // All three prompts' blocks, once settled: under `make test`'s load the
    // count read once right after the last match was once short (a resync
    // rebuilding the endpoint from replay); the stats say if one happened.
    let want: usize = all.iter().map(|t| full_blocks(t)).sum();
    let deadline = Instant::now() + Duration::from_secs(10);
    while index.blocks(ep) < want {
        assert!(
            Instant::now() < deadline,
            "{} blocks indexed, want {want}; {:?}",
            index.blocks(ep),
            h.stats().snapshot()
        );
        index.flush().await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A different endpoint id holds nothing.
    assert_eq!(index.overlap(&all[0]).blocks_for(EndpointId(1)), 0);
    let s = h.stats().snapshot();
    assert_eq!(s.decode_errors, 0, "{s:?}");
    assert_eq!(s.gaps, 0, "{s:?}");
    assert!(s.blocks_stored > 0 && s.batches_applied > 0, "{s:?}");
    assert_eq!(h.state(), SyncState::InSync);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_prompts_are_indexed_map_int() {
    check_prompts_indexed(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_prompts_are_indexed_array_encoding() {
    check_prompts_indexed(&["--kv-events-encoding", "array"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_prompts_are_indexed_bytes_hashes() {
    check_prompts_indexed(&["--kv-events-hash-format", "bytes"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_prompts_are_indexed_array_and_bytes() {
    check_prompts_indexed(&[
        "--kv-events-encoding",
        "array",
        "--kv-events-hash-format",
        "bytes",
    ])
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_shows_as_removed_blocks() {
    // 48 blocks of 16 tokens; prompts of ~20 blocks.
    let sim = Sim::start(&["--num-gpu-blocks", "48", "--max-model-len", "768"]).await;
    let index = Arc::new(PoolIndex::new(BLOCK));
    let h = subscribe(&sim, &index).await;
    let ep = sim.spec().id();
    let first = sim.chat(&prompt(100, 40)).await;
    wait_matched(&index, ep, &first, full_blocks(&first)).await;
    // More distinct prompts than the cache holds: the first is evicted.
    for seed in 101..106 {
        sim.chat(&prompt(seed, 40)).await;
    }
    until("removals", Duration::from_secs(10), || {
        h.stats().snapshot().blocks_removed > 0
    })
    .await;
    index.flush().await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    index.flush().await;
    assert!(
        index.blocks(ep) <= 48,
        "{} blocks indexed",
        index.blocks(ep)
    );
    assert!(index.overlap(&first).blocks_for(ep) < full_blocks(&first));
    let s = h.stats().snapshot();
    assert_eq!(
        s.blocks_stored - s.blocks_removed,
        index.blocks(ep) as u64,
        "{s:?}"
    );
}

/// Every full block of every prompt as this index sees it.
fn fingerprint(index: &PoolIndex, ep: EndpointId, prompts: &[Vec<u32>]) -> Vec<usize> {
    let mut v: Vec<usize> = prompts
        .iter()
        .map(|t| index.overlap(t).blocks_for(ep))
        .collect();
    v.push(index.blocks(ep));
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_batches_are_replayed() {
    let sim = Sim::start(&[]).await;
    let ep = sim.spec().id();
    let index = Arc::new(PoolIndex::new(BLOCK));
    let h = subscribe(&sim, &index).await;
    let mut prompts = vec![sim.chat(&prompt(200, 80)).await];
    wait_matched(&index, ep, &prompts[0], full_blocks(&prompts[0])).await;

    sim.post("/sim/faults", json!({"drop_next_event_batches": 2}))
        .await;
    for seed in 201..206 {
        prompts.push(sim.chat(&prompt(seed, 80)).await);
    }
    for t in &prompts {
        wait_matched(&index, ep, t, full_blocks(t)).await;
    }
    let s = h.stats().snapshot();
    assert!(s.gaps >= 1, "{s:?}");
    assert!(s.replayed_batches >= 2, "{s:?}");
    assert_eq!(s.resyncs, 0, "{s:?}");
    until("in sync", Duration::from_secs(5), || {
        h.state() == SyncState::InSync
    })
    .await;

    // An index that never missed anything: built from replay alone.
    let reference = Arc::new(PoolIndex::new(BLOCK));
    let r = subscribe(&sim, &reference).await;
    until("reference caught up", Duration::from_secs(5), || {
        r.stats().snapshot().last_seq == h.stats().snapshot().last_seq
    })
    .await;
    index.flush().await;
    reference.flush().await;
    assert_eq!(
        fingerprint(&index, ep, &prompts),
        fingerprint(&reference, ep, &prompts)
    );
    assert_eq!(r.stats().snapshot().gaps, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_last_batch_is_found_by_the_idle_probe() {
    let sim = Sim::start(&[]).await;
    let ep = sim.spec().id();
    let index = Arc::new(PoolIndex::new(BLOCK));
    let h = subscribe(&sim, &index).await;
    sim.post("/sim/faults", json!({"drop_next_event_batches": 1}))
        .await;
    // One request, one batch, dropped: no later batch reveals the gap.
    let t = sim.chat(&prompt(300, 60)).await;
    wait_matched(&index, ep, &t, full_blocks(&t)).await;
    assert!(h.stats().snapshot().probes >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_events_clears_and_recovers() {
    let sim = Sim::start(&[]).await;
    let ep = sim.spec().id();
    let index = Arc::new(PoolIndex::new(BLOCK));
    let h = subscribe(&sim, &index).await;
    let old = sim.chat(&prompt(400, 60)).await;
    wait_matched(&index, ep, &old, full_blocks(&old)).await;

    // The engine's event sequence restarts at 0 (a new process would).
    sim.post("/sim/restart-events", json!({})).await;
    let new = sim.chat(&prompt(401, 60)).await;
    wait_matched(&index, ep, &new, full_blocks(&new)).await;
    let s = h.stats().snapshot();
    assert!(s.restarts >= 1, "{s:?}");
    // What the old sequence told us is gone; the new sequence is indexed.
    assert_eq!(index.overlap(&old).blocks_for(ep), 0);
    // Once in sync: only the new prompt's blocks (and at most one decode
    // block). Waited for, not sampled once: a probe that finds the restart
    // after the new batch was applied clears and rebuilds the endpoint from
    // replay, and a single count can fall inside that rebuild (seen under
    // load: 0 blocks while resyncing).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        index.flush().await;
        let n = index.blocks(ep);
        let settled = h.state() == SyncState::InSync;
        if settled && n >= full_blocks(&new) && n <= full_blocks(&new) + 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{n} blocks (in sync: {settled}), new prompt {} blocks, old {}: {:?}",
            full_blocks(&new),
            full_blocks(&old),
            h.stats().snapshot()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(index.overlap(&old).blocks_for(ep), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_and_restarted_engine_is_cleared_and_recovered() {
    let mut sim = Sim::start(&[]).await;
    let ep = sim.spec().id();
    let index = Arc::new(PoolIndex::new(BLOCK));
    let h = subscribe(&sim, &index).await;
    let old = sim.chat(&prompt(500, 60)).await;
    wait_matched(&index, ep, &old, full_blocks(&old)).await;

    sim.kill();
    until("disconnected", Duration::from_secs(5), || {
        h.state() == SyncState::Disconnected
    })
    .await;
    sim.restart().await;
    // The new process has an empty cache and a new sequence.
    until("cleared", Duration::from_secs(10), || {
        index.blocks(ep) == 0 && h.stats().snapshot().restarts >= 1
    })
    .await;
    let new = sim.chat(&prompt(501, 60)).await;
    wait_matched(&index, ep, &new, full_blocks(&new)).await;
    assert_eq!(index.overlap(&old).blocks_for(ep), 0);
    until("in sync", Duration::from_secs(5), || {
        h.state() == SyncState::InSync
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_then_back_is_rebuilt_from_replay() {
    let sim = Sim::start(&[]).await;
    let ep = sim.spec().id();
    let index = Arc::new(PoolIndex::new(BLOCK));
    let h = subscribe(&sim, &index).await;
    let t = sim.chat(&prompt(600, 60)).await;
    wait_matched(&index, ep, &t, full_blocks(&t)).await;
    // The service's health checks fail: it drops the endpoint.
    h.mark_unreachable();
    index.remove_endpoint(ep);
    assert_eq!(h.state(), SyncState::Disconnected);
    assert_eq!(index.blocks(ep), 0);
    // The engine answers again (the idle probe): everything it still
    // buffers comes back.
    wait_matched(&index, ep, &t, full_blocks(&t)).await;
    until("in sync", Duration::from_secs(5), || {
        h.state() == SyncState::InSync
    })
    .await;
    assert!(h.stats().snapshot().resyncs >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_prefix_cache_clears_the_endpoint() {
    let sim = Sim::start(&[]).await;
    let ep = sim.spec().id();
    let index = Arc::new(PoolIndex::new(BLOCK));
    let h = subscribe(&sim, &index).await;
    let t = sim.chat(&prompt(700, 60)).await;
    wait_matched(&index, ep, &t, full_blocks(&t)).await;
    let r = service_support::http_client()
        .post(format!("{}/reset_prefix_cache", sim.url()))
        .send()
        .await
        .expect("reset");
    assert!(r.status().is_success());
    until("cleared", Duration::from_secs(5), || {
        h.stats().snapshot().all_cleared >= 1
    })
    .await;
    wait_matched(&index, ep, &t, 0).await;
    assert_eq!(index.blocks(ep), 0);
}

fn msg(frames: Vec<Vec<u8>>) -> ZmqMessage {
    ZmqMessage::try_from(frames.into_iter().map(Bytes::from).collect::<Vec<_>>()).expect("frames")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_a_fake_publisher_is_counted_and_survived() {
    let mut publisher = zeromq::PubSocket::new();
    let kv_events = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("bind fake PUB")
        .to_string();
    let spec = EndpointSpec {
        address: "127.0.0.1:1".into(),
        kv_events,
        replay: None,
        metrics_url: None,
        topic: String::new(),
    };
    let ep = spec.id();
    let index = Arc::new(PoolIndex::new(BLOCK));
    let h = spawn_subscriber(cfg(spec), index.clone());
    // PUB drops messages until the subscription has arrived: probe with
    // garbage until the subscriber counts one.
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.stats().snapshot().decode_errors == 0 {
        assert!(Instant::now() < deadline, "subscriber never received");
        publisher
            .send(msg(vec![b"only one frame".to_vec()]))
            .await
            .expect("send");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let the last probe land before counting.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let before = h.stats().snapshot().decode_errors;
    let seq = |s: u64| s.to_be_bytes().to_vec();
    let garbage = vec![
        msg(vec![vec![], b"short".to_vec(), b"x".to_vec()]),
        msg(vec![vec![], seq(0), vec![0xc1, 0xff, 0x00]]),
        msg(vec![vec![], seq(1), vec![0x93, 0xcb, 1, 2]]),
        msg(vec![
            vec![],
            seq(2),
            vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x80, 0xc0],
        ]),
        msg(vec![vec![], seq(3), vec![], vec![]]),
    ];
    for m in garbage {
        publisher.send(m).await.expect("send");
    }
    let toks: Vec<u32> = (0..64).collect();
    let hashes = [11, 12, 13, 14];
    publisher
        .send(msg(vec![
            vec![],
            seq(4),
            vllm_payload(Some((&hashes, None, &toks)), None),
        ]))
        .await
        .expect("send");
    until("valid batch applied", Duration::from_secs(5), || {
        index.blocks(ep) == 4
    })
    .await;
    index.flush().await;
    assert_eq!(index.overlap(&toks).blocks_for(ep), 4);
    let s = h.stats().snapshot();
    assert_eq!(s.decode_errors - before, 5, "{s:?}");
    assert_eq!(s.last_seq, Some(4));
    assert_eq!(h.state(), SyncState::InSync);
}

/// The fake engine's replay buffer: (seq, payload).
type Ring = Arc<std::sync::Mutex<Vec<(u64, Vec<u8>)>>>;

/// A fake engine speaking the older replay format (no topic frame in
/// replies) with a non-empty topic: start-up replay, live batches, a gap
/// filled by a verified replay, and messages on another topic ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_replay_format_and_topic() {
    use std::sync::Mutex;
    use zeromq::SocketRecv;
    let mut publisher = zeromq::PubSocket::new();
    let kv_events = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("bind PUB")
        .to_string();
    let mut router = zeromq::RouterSocket::new();
    let replay = router
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("bind ROUTER")
        .to_string();
    // Batch k stores chain k: 2 blocks, hashes 100k+1, 100k+2.
    let chain = |k: u64| -> (Vec<u32>, Vec<u8>) {
        let toks: Vec<u32> = (0..32).map(|i| k as u32 * 1000 + i).collect();
        let p = vllm_payload(Some((&[100 * k + 1, 100 * k + 2], None, &toks)), None);
        (toks, p)
    };
    let ring: Ring = Arc::new(Mutex::new((0..3).map(|k| (k, chain(k).1)).collect()));
    let served = ring.clone();
    let replays = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let replays_seen = replays.clone();
    let router_task = tokio::spawn(async move {
        while let Ok(m) = router.recv().await {
            let f = m.into_vec();
            if f.len() != 3 || f[2].len() != 8 {
                continue;
            }
            replays_seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut start = [0u8; 8];
            start.copy_from_slice(&f[2]);
            let start = u64::from_be_bytes(start);
            let batches: Vec<(u64, Vec<u8>)> = served
                .lock()
                .expect("ring")
                .iter()
                .filter(|(s, _)| *s >= start)
                .cloned()
                .collect();
            for (s, p) in batches {
                let m = msg(vec![f[0].to_vec(), vec![], s.to_be_bytes().to_vec(), p]);
                if router.send(m).await.is_err() {
                    break;
                }
            }
            let end = msg(vec![f[0].to_vec(), vec![], vec![0xff; 8], vec![]]);
            let _ = router.send(end).await;
        }
    });
    let spec = EndpointSpec {
        address: "127.0.0.1:2".into(),
        kv_events,
        replay: Some(replay),
        metrics_url: None,
        topic: "kv-events".into(),
    };
    let ep = spec.id();
    let index = Arc::new(PoolIndex::new(BLOCK));
    let mut c = cfg(spec);
    // No idle probes during this test: gaps must be found by the stream.
    c.idle_probe = Duration::from_secs(60);
    let h = spawn_subscriber(c, index.clone());
    assert!(
        h.wait_for_state(SyncState::InSync, Duration::from_secs(10))
            .await
    );
    for k in 0..3 {
        wait_matched(&index, ep, &chain(k).0, 2).await;
    }
    // Live: seq 3 (after the subscription is surely active, repeat until
    // seen: PUB drops until then; repeats are duplicates).
    let push = |k: u64| {
        let (_, p) = chain(k);
        ring.lock().expect("ring").push((k, p.clone()));
        p
    };
    let p3 = push(3);
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.stats().snapshot().last_seq != Some(3) {
        assert!(Instant::now() < deadline, "live batch never arrived");
        publisher
            .send(msg(vec![
                b"kv-events".to_vec(),
                3u64.to_be_bytes().to_vec(),
                p3.clone(),
            ]))
            .await
            .expect("send");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Another topic sharing the prefix is not ours.
    let (_, other) = chain(50);
    publisher
        .send(msg(vec![
            b"kv-events-x".to_vec(),
            4u64.to_be_bytes().to_vec(),
            other,
        ]))
        .await
        .expect("send");
    // 4 and 5 are lost on the wire; 6 arrives: replay fills 4..5.
    push(4);
    push(5);
    let p6 = push(6);
    publisher
        .send(msg(vec![
            b"kv-events".to_vec(),
            6u64.to_be_bytes().to_vec(),
            p6,
        ]))
        .await
        .expect("send");
    for k in 3..7 {
        wait_matched(&index, ep, &chain(k).0, 2).await;
    }
    assert_eq!(index.overlap(&chain(50).0).blocks_for(ep), 0);
    let s = h.stats().snapshot();
    assert_eq!(s.last_seq, Some(6));
    assert!(s.gaps >= 1, "{s:?}");
    assert_eq!((s.resyncs, s.restarts, s.decode_errors), (0, 0, 0), "{s:?}");
    assert_eq!(index.blocks(ep), 14);
    assert!(replays.load(std::sync::atomic::Ordering::Relaxed) >= 2);
    router_task.abort();
}
