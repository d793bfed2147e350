//! A restarted engine at the pick level: three
//! real `vllm-sim` processes over real ZMQ and HTTP, a real indexer (KV-event
//! index, the Qwen3 tokenizer), every pick served on the engine it chose so
//! that engine's KV events fill the index.
//!
//! One engine, X, is killed and restarted on the same ports (its cache gone,
//! its event sequence back at 0). While it is down no pick lists it; once it
//! is back (healthy, in sync) it is never credited with a prefix it lost,
//! and it takes new conversations again: it is the idle engine that has
//! started the fewest conversations lately.

use crate::service_support;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvasir_proto::v1 as pb;
use service_support::*;

/// Engines in the pool.
const ENGINES: usize = 3;
/// Conversations started before the restart: two per engine.
const CONVERSATIONS: usize = 6;
/// Completion tokens of every request.
const MAX_TOKENS: u32 = 16;

/// A conversation: its messages so far, and where it was last served.
struct Conversation {
    name: String,
    messages: Vec<(&'static str, String)>,
    turns: usize,
    home: Option<String>,
}

impl Conversation {
    /// A conversation whose first block is its own (its name comes first),
    /// so no two conversations share a cached block.
    fn new(name: &str, seed: u64) -> Conversation {
        let first = format!("Conversation {name} opens: {}", filler(seed, 220));
        Conversation {
            name: name.to_string(),
            messages: vec![("user", first)],
            turns: 0,
            home: None,
        }
    }

    /// Adds the next question (the first turn already has one).
    fn ask(&mut self) {
        if self.turns > 0 {
            let q = format!(
                "{} asks question {}: {}",
                self.name,
                self.turns,
                filler(1000 + self.turns as u64, 40)
            );
            self.messages.push(("user", q));
        }
    }

    fn request_id(&self) -> String {
        format!("{}-t{}", self.name, self.turns)
    }
}

/// The pool under test: the simulators and the indexer over them.
struct Bench {
    sims: Vec<Sim>,
    ix: Running,
}

impl Bench {
    /// [`ENGINES`] simulators and an indexer over them, failed scrapes in a
    /// row before an engine is unhealthy `unhealthy_after`.
    async fn start(unhealthy_after: u32) -> Bench {
        let sims = Sim::start_many(ENGINES).await;
        let mut cfg = config(&sims.iter().collect::<Vec<_>>());
        cfg.pools[0].scrape.unhealthy_after = unhealthy_after;
        let ix = start_indexer(&cfg).await;
        ix.wait_ready().await;
        Bench { sims, ix }
    }

    /// Index of the simulator at `address`.
    fn position(&self, address: &str) -> usize {
        self.sims
            .iter()
            .position(|s| s.address() == address)
            .unwrap_or_else(|| panic!("no simulator at {address}"))
    }

    fn sim(&self, address: &str) -> &Sim {
        self.sims
            .iter()
            .find(|s| s.address() == address)
            .unwrap_or_else(|| panic!("no simulator at {address}"))
    }

    /// Picks the conversation's next turn (not served).
    async fn pick(&self, conv: &Conversation) -> pb::PickResponse {
        let pick = self
            .ix
            .pick(chat_pick(&conv.request_id(), &conv.messages))
            .await;
        assert!(!pick.endpoints.is_empty(), "no endpoint: {pick:?}");
        pick
    }

    /// Serves a picked turn on the first endpoint, reports it done, keeps
    /// the answer in the conversation and waits until the engine's events
    /// are indexed and every engine is idle again (turns are sent one at a
    /// time, as a user types them).
    async fn serve(&self, conv: &mut Conversation, pick: &pb::PickResponse) -> String {
        let address = pick.endpoints[0].address.clone();
        let resp = self.sim(&address).chat(&conv.messages, MAX_TOKENS).await;
        self.ix
            .report(served_done(&conv.request_id(), &address, &resp, MAX_TOKENS))
            .await;
        conv.messages.push(("assistant", reply(&resp)));
        conv.turns += 1;
        conv.home = Some(address.clone());
        self.ix.wait_settled(&address).await;
        self.wait_idle().await;
        address
    }

    /// Picks and serves the conversation's next turn.
    async fn turn(&self, conv: &mut Conversation) -> (String, pb::PickResponse) {
        conv.ask();
        let pick = self.pick(conv).await;
        (self.serve(conv, &pick).await, pick)
    }

    /// Waits until the indexer's last scrapes show every engine idle and
    /// none of its picks in flight.
    async fn wait_idle(&self) {
        wait_for("every engine idle", Duration::from_secs(10), || async {
            self.ix
                .state()
                .await
                .endpoints
                .iter()
                .all(|e| e.running == 0 && e.waiting == 0 && e.in_flight == 0)
        })
        .await;
    }
}

/// The endpoint's entry in a pick's list.
fn entry<'a>(pick: &'a pb::PickResponse, address: &str) -> Option<&'a pb::PickedEndpoint> {
    pick.endpoints.iter().find(|e| e.address == address)
}

/// The conversations started before a restart, and X, the engine that
/// serves conversation A (`convs[A]`) and B (`convs[b]`).
struct Before {
    convs: Vec<Conversation>,
    x: String,
    b: usize,
}

/// Index of conversation A.
const A: usize = 0;

/// Starts [`CONVERSATIONS`] conversations one at a time on the idle pool
/// (every engine starts some); then A's second turn goes back to X, the
/// engine it started on, for its prefix.
async fn before_restart(b: &Bench) -> Before {
    let mut convs: Vec<Conversation> = (0..CONVERSATIONS)
        .map(|i| Conversation::new(&format!("c{i}"), 10 + i as u64))
        .collect();
    let mut per: HashMap<String, usize> = HashMap::new();
    for conv in &mut convs {
        let (address, _) = b.turn(conv).await;
        *per.entry(address).or_default() += 1;
    }
    eprintln!("conversations started per engine: {per:?}");
    assert_eq!(per.len(), ENGINES, "every engine starts some: {per:?}");
    let x = convs[A].home.clone().expect("served");
    let other = (0..CONVERSATIONS)
        .find(|&i| i != A && convs[i].home.as_deref() == Some(x.as_str()))
        .unwrap_or_else(|| panic!("X ({x}) started only one conversation: {per:?}"));
    let (to, pick) = b.turn(&mut convs[A]).await;
    assert_eq!(to, x, "A's second turn goes back to X: {pick:?}");
    assert_eq!(pick.decision, pb::Decision::Prefix as i32, "{pick:?}");
    assert!(pick.endpoints[0].predicted_cached_tokens > 0, "{pick:?}");
    assert!(b.ix.endpoint_state(&x).await.indexed_blocks > 0);
    Before { convs, x, b: other }
}

/// Picks a next turn of a conversation only X ever held, after X's
/// restart: X is listed and nobody is credited with any of it (so the
/// decision is not a prefix); then serves it.
async fn lost_only_on_x(b: &Bench, conv: &mut Conversation, x: &str) {
    conv.ask();
    let pick = b.pick(conv).await;
    let on_x = entry(&pick, x).unwrap_or_else(|| panic!("X not listed: {pick:?}"));
    assert_eq!(
        on_x.predicted_cached_tokens, 0,
        "X credited with {}: {pick:?}",
        conv.name
    );
    assert!(
        pick.endpoints
            .iter()
            .all(|e| e.predicted_cached_tokens == 0),
        "{pick:?}"
    );
    assert_ne!(pick.decision, pb::Decision::Prefix as i32, "{pick:?}");
    b.serve(conv, &pick).await;
}

/// The `placement` term of `address` in a pick (NaN when not listed).
fn placement(pick: &pb::PickResponse, address: &str) -> f64 {
    entry(pick, address)
        .and_then(|e| e.score.as_ref())
        .map_or(f64::NAN, |s| s.placement)
}

/// Kills X and waits until the indexer's scrapes find it unhealthy (its
/// blocks dropped); then, while it is down, A's next turn and new
/// conversations are picked and served: no pick lists X. Returns where A
/// was served.
async fn down_phase(b: &mut Bench, before: &mut Before) -> String {
    let x = before.x.clone();
    let xi = b.position(&x);
    let killed = Instant::now();
    b.sims[xi].kill();
    wait_for("X unhealthy", Duration::from_secs(10), || async {
        !b.ix.endpoint_state(&x).await.healthy
    })
    .await;
    eprintln!("X ({x}) unhealthy {:?} after the kill", killed.elapsed());
    let down = b.ix.endpoint_state(&x).await;
    assert_eq!(down.indexed_blocks, 0, "X's blocks dropped: {down:?}");

    let (a_home, pick) = b.turn(&mut before.convs[A]).await;
    assert!(entry(&pick, &x).is_none(), "X listed while down: {pick:?}");
    assert_ne!(a_home, x);
    for i in 0..3 {
        let mut conv = Conversation::new(&format!("down{i}"), 100 + i);
        let (to, pick) = b.turn(&mut conv).await;
        assert!(entry(&pick, &x).is_none(), "X listed while down: {pick:?}");
        assert_ne!(to, x);
        before.convs.push(conv);
    }
    a_home
}

/// Restarts X on its ports (empty cache, event sequence from 0) and waits
/// until the indexer has it healthy and in sync; X then holds nothing.
async fn bring_back(b: &mut Bench, x: &str) {
    let xi = b.position(x);
    b.sims[xi].spawn();
    b.sims[xi].wait_healthy().await;
    wait_for("X healthy and in sync", Duration::from_secs(20), || async {
        let s = b.ix.endpoint_state(x).await;
        s.healthy && s.sync_state == pb::SyncState::InSync as i32
    })
    .await;
    b.ix.wait_ready().await;
    let back = b.ix.endpoint_state(x).await;
    assert_eq!(back.indexed_blocks, 0, "X holds nothing yet: {back:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_engine_loses_its_prefixes_and_takes_new_conversations() {
    let mut b = Bench::start(3).await;
    let mut before = before_restart(&b).await;
    let x = before.x.clone();
    // (1) While X is down no pick lists it.
    let a_home = down_phase(&mut b, &mut before).await;
    bring_back(&mut b, &x).await;

    // (2) A's next turn: X is listed (healthy) and credited with nothing;
    // A's history now lives where it was served while X was down.
    let (to, pick) = b.turn(&mut before.convs[A]).await;
    let on_x = entry(&pick, &x).unwrap_or_else(|| panic!("X not listed: {pick:?}"));
    assert_eq!(
        on_x.predicted_cached_tokens, 0,
        "X credited with A: {pick:?}"
    );
    assert_eq!(to, a_home, "A stays where it was re-served: {pick:?}");
    assert_eq!(pick.decision, pb::Decision::Prefix as i32, "{pick:?}");

    // (3) A new conversation goes to X: every engine is idle and nobody
    // holds its prefix, and X is the one that started the fewest
    // conversations lately (its count went with its cache). Its next turn
    // stays on X, found in the events of X's new process.
    let mut fresh = Conversation::new("after", 200);
    let (to, pick) = b.turn(&mut fresh).await;
    assert_eq!(to, x, "the new conversation starts on X: {pick:?}");
    assert_eq!(placement(&pick, &x), 0.0, "{pick:?}");
    for s in b.sims.iter().filter(|s| s.address() != x) {
        assert!(placement(&pick, &s.address()) > 0.0, "{pick:?}");
    }
    let (to, pick) = b.turn(&mut fresh).await;
    assert_eq!(to, x, "the new conversation stays on X: {pick:?}");
    assert_eq!(pick.decision, pb::Decision::Prefix as i32, "{pick:?}");
    assert!(pick.endpoints[0].predicted_cached_tokens > 0, "{pick:?}");

    // (2) again for B, which only X ever held.
    lost_only_on_x(&b, &mut before.convs[before.b], &x).await;
    b.ix.indexer.shutdown().await;
}

/// Restarts X at once and waits (bounded) until its event stream is rebuilt
/// (in sync, no blocks). Every state seen meanwhile that says in sync must
/// hold none of X's old blocks: the stream, not the health checks, tells
/// the index that the cache is gone.
async fn restart_between_scrapes(b: &mut Bench, x: &str) {
    let xi = b.position(x);
    let killed = Instant::now();
    b.sims[xi].kill();
    b.sims[xi].spawn();
    b.sims[xi].wait_healthy().await;
    eprintln!(
        "X ({x}) answers again {:?} after the kill",
        killed.elapsed()
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut stale = Vec::new();
    loop {
        let s = b.ix.endpoint_state(x).await;
        let in_sync = s.sync_state == pb::SyncState::InSync as i32;
        if in_sync && s.indexed_blocks > 0 {
            stale.push(s.indexed_blocks);
        }
        if s.healthy && in_sync && s.indexed_blocks == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "X's stream not rebuilt 20 s after its restart: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("X rebuilt {:?} after the kill", killed.elapsed());
    assert!(
        stale.is_empty(),
        "X in sync with its old blocks after its restart ({} samples, blocks {:?})",
        stale.len(),
        &stale[..stale.len().min(5)]
    );
}

/// The engine restarts faster than the scrape ticks notice (they need many
/// failed scrapes in a row here). Its event stream shows the restart; the
/// probe its socket's disconnect triggers (tests/pick_liveness.rs) may also
/// find nobody listening and mark it unhealthy at once, so this test no
/// longer tells the two paths apart: with either, once the stream is back
/// in sync, X is credited with nothing it lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_restarted_between_health_checks_is_cleared_by_its_events() {
    let mut b = Bench::start(1000).await;
    let mut before = before_restart(&b).await;
    let x = before.x.clone();
    restart_between_scrapes(&mut b, &x).await;
    assert!(b.ix.endpoint_state(&x).await.healthy);
    lost_only_on_x(&b, &mut before.convs[A], &x).await;
    lost_only_on_x(&b, &mut before.convs[before.b], &x).await;

    // The health checks never saw X go, but its event stream saw the
    // restart: the conversations X started went with its cache, so its
    // placement count is forgotten (0) while the others' still count, and
    // a new conversation starts on X. (Here X's older conversations may
    // also leave it the least placed by decay alone; the unit test in
    // src/load/placed.rs is the one that fails without the forgetting.)
    let mut fresh = Conversation::new("after", 300);
    fresh.ask();
    let pick = b.pick(&fresh).await;
    assert_eq!(placement(&pick, &x), 0.0, "{pick:?}");
    for e in pick.endpoints.iter().filter(|e| e.address != x) {
        assert!(placement(&pick, &e.address) > 0.0, "{pick:?}");
    }
    assert_eq!(pick.endpoints[0].address, x, "{pick:?}");
    b.serve(&mut fresh, &pick).await;
    b.ix.indexer.shutdown().await;
}
