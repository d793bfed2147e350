//! KV-event sockets read from the engine itself (vLLM 0.34's
//! `GET /kv_event_sources`): a fake engine on 127.0.0.1 (an axum server
//! answering in vLLM's shape, ZMQ PUB sockets publishing vLLM payloads),
//! followed by the real subscriber, and by InferencePool discovery over
//! kube-rs' client against a scripted API server.

use crate::service_support;
use crate::testkit;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use bytes::Bytes;
use kvasir_cache_indexer::events::subscriber::{
    spawn_subscriber, SubscriberConfig, SubscriberHandle, SyncState,
};
use kvasir_cache_indexer::index::PoolIndex;
use kvasir_cache_indexer::types::{EndpointId, EndpointSpec};
use serde_json::json;
use testkit::vllm_payload;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

mod k8s {
    //! Just enough of a kube-apiserver for one pool and its pods: GET and
    //! LIST answer from the script, watches stay open and quiet.

    use http::{Request, Response, StatusCode};
    use kube::client::Body;
    use serde_json::{json, Value};
    use tower_test::mock;

    pub const NS: &str = "default";
    pub const POOL: &str = "engines";
    const POOLS: &str = "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools";
    const PODS: &str = "/api/v1/namespaces/default/pods";

    /// A pool selecting `app=vllm` on `port`, and one ready pod on
    /// 127.0.0.1 with `annotations`.
    pub fn objects(port: u16, annotations: Value) -> (Value, Value) {
        let pool = json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": POOL, "namespace": NS, "resourceVersion": "1"},
            "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": port}]}
        });
        let pod = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "engine-0", "namespace": NS, "resourceVersion": "1",
                         "labels": {"app": "vllm"}, "annotations": annotations},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}
        });
        (pool, pod)
    }

    fn list(kind: &str, api_version: &str, item: &Value) -> Value {
        json!({"kind": kind, "apiVersion": api_version,
               "metadata": {"resourceVersion": "1"}, "items": [item]})
    }

    /// A kube client whose requests `serve` answers.
    pub fn client(pool: Value, pod: Value) -> (kube::Client, tokio::task::JoinHandle<()>) {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let task = tokio::spawn(serve(handle, pool, pod));
        (kube::Client::new(service, NS), task)
    }

    async fn serve(
        mut handle: mock::Handle<Request<Body>, Response<Body>>,
        pool: Value,
        pod: Value,
    ) {
        // Watches are held open: the sets come from the lists.
        let mut held = Vec::new();
        while let Some((req, reply)) = handle.next_request().await {
            let path = req.uri().path().to_string();
            let watch = req.uri().query().unwrap_or("").contains("watch=true");
            let body = match path.as_str() {
                _ if watch => {
                    held.push(reply);
                    continue;
                }
                PODS => list("PodList", "v1", &pod),
                POOLS => list("InferencePoolList", "inference.networking.k8s.io/v1", &pool),
                p if p == format!("{POOLS}/{POOL}") => pool.clone(),
                _ => {
                    let resp = Response::builder()
                        .status(StatusCode::NOT_FOUND)
                        .body(Body::from(b"{}".to_vec()));
                    if let Ok(r) = resp {
                        reply.send_response(r);
                    }
                    continue;
                }
            };
            let resp = Response::builder()
                .status(StatusCode::OK)
                .header("content-type", "application/json")
                .body(Body::from(serde_json::to_vec(&body).unwrap_or_default()));
            if let Ok(r) = resp {
                reply.send_response(r);
            }
        }
    }
}

const BLOCK: u32 = testkit::BLOCK_SIZE;
/// Every wait here is bounded by this.
const WAIT: Duration = Duration::from_secs(10);

/// What the fake engine's `/kv_event_sources` answers, and how often it
/// was asked.
#[derive(Clone, Default)]
struct Answer {
    said: Arc<Mutex<(u16, String)>>,
    asked: Arc<AtomicUsize>,
}

async fn kv_event_sources(State(a): State<Answer>) -> (StatusCode, String) {
    a.asked.fetch_add(1, Ordering::Relaxed);
    let (code, body) = a.said.lock().unwrap().clone();
    (StatusCode::from_u16(code).unwrap_or(StatusCode::OK), body)
}

/// The engine's HTTP side on 127.0.0.1 (aborted on drop).
struct FakeEngine {
    addr: SocketAddr,
    answer: Answer,
    task: JoinHandle<()>,
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl FakeEngine {
    async fn start() -> FakeEngine {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind fake engine");
        let addr = listener.local_addr().expect("local addr");
        let answer = Answer::default();
        answer.said.lock().unwrap().0 = 200;
        let app = axum::Router::new()
            .route("/kv_event_sources", axum::routing::get(kv_event_sources))
            .with_state(answer.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        FakeEngine { addr, answer, task }
    }

    fn say(&self, status: u16, body: impl Into<String>) {
        *self.answer.said.lock().unwrap() = (status, body.into());
    }

    /// Advertise rank 0 publishing on `port` as vLLM writes it: the bind
    /// address `tcp://*:port`, every field of `KVEventsConfig`.
    fn advertise(&self, port: u16) {
        let rank = json!({
            "enable_kv_cache_events": true, "publisher": "zmq",
            "endpoint": format!("tcp://*:{port}"), "replay_endpoint": null,
            "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": ""
        });
        self.say(200, json!({ "0": rank }).to_string());
    }

    fn asked(&self) -> usize {
        self.answer.asked.load(Ordering::Relaxed)
    }

    /// The endpoint as discovery or a config without `events:` gives it.
    fn spec(&self) -> EndpointSpec {
        EndpointSpec {
            address: self.addr.to_string(),
            kv_events: String::new(),
            replay: None,
            metrics_url: None,
            topic: String::new(),
        }
    }
}

/// A PUB socket on a free port of 127.0.0.1, and the port.
async fn publisher() -> (PubSocket, u16) {
    let mut s = PubSocket::new();
    let ep = s
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("bind PUB")
        .to_string();
    let port = ep
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .expect("bound port");
    (s, port)
}

/// Subscriber settings for tests: short timeouts, fast source retries.
fn cfg(spec: EndpointSpec, http: &reqwest::Client) -> SubscriberConfig {
    let mut c = SubscriberConfig::new(spec, BLOCK).with_source(http);
    c.reconnect = Duration::from_millis(100);
    c.connect_timeout = Duration::from_millis(500);
    c.source_retry_min = Duration::from_millis(50);
    c.source_retry_max = Duration::from_millis(300);
    if let Some(s) = c.source.as_mut() {
        s.timeout = Duration::from_millis(500);
    }
    c
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Tokens of a 4-block chain unique to `seed`, and its vLLM payload.
fn chain(seed: u32) -> (Vec<u32>, Vec<u8>) {
    let toks: Vec<u32> = (0..4 * BLOCK).map(|i| seed * 10_000 + i).collect();
    let hashes: Vec<u64> = (1..=4).map(|i| u64::from(seed) * 100 + i).collect();
    let payload = vllm_payload(Some((&hashes, None, &toks)), None);
    (toks, payload)
}

/// Publishes batch `seq` until the subscriber has applied it (PUB drops
/// messages until the subscription arrives; repeats are dropped as
/// duplicates).
async fn publish_until_indexed(
    publisher: &mut PubSocket,
    seq: u64,
    payload: &[u8],
    index: &PoolIndex,
    ep: EndpointId,
    toks: &[u32],
) {
    let deadline = Instant::now() + WAIT;
    loop {
        let frames = vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::copy_from_slice(payload),
        ];
        let msg = ZmqMessage::try_from(frames).expect("frames");
        publisher.send(msg).await.expect("send");
        tokio::time::sleep(Duration::from_millis(30)).await;
        index.flush().await;
        if index.overlap(toks).blocks_for(ep) == 4 {
            return;
        }
        assert!(Instant::now() < deadline, "batch {seq} never indexed");
    }
}

async fn state_is(h: &SubscriberHandle, want: SyncState) {
    let ok = h.wait_for_state(want, WAIT).await;
    assert!(ok, "state {:?}, wanted {want:?}", h.state());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_advertised_socket_is_followed_and_its_events_indexed() {
    let engine = FakeEngine::start().await;
    let (mut publ, port) = publisher().await;
    engine.advertise(port);
    let index = Arc::new(PoolIndex::new(BLOCK));
    let spec = engine.spec();
    let ep = spec.id();
    let h = spawn_subscriber(cfg(spec, &http()), index.clone());
    // The wildcard bind address became the engine's host.
    until("the advertised socket", || {
        h.kv_events() == format!("tcp://127.0.0.1:{port}")
    })
    .await;
    let (toks, payload) = chain(1);
    publish_until_indexed(&mut publ, 0, &payload, &index, ep, &toks).await;
    state_is(&h, SyncState::InSync).await;
    let s = h.stats().snapshot();
    assert!(s.source_lookups >= 1 && s.source_failures == 0, "{s:?}");
    // In sync and connected: the engine is not asked again.
    let asked = engine.asked();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(engine.asked(), asked);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_on_a_new_socket_is_followed() {
    let engine = FakeEngine::start().await;
    let (mut first, port) = publisher().await;
    engine.advertise(port);
    let index = Arc::new(PoolIndex::new(BLOCK));
    let spec = engine.spec();
    let ep = spec.id();
    let h = spawn_subscriber(cfg(spec, &http()), index.clone());
    let (old, payload) = chain(1);
    publish_until_indexed(&mut first, 0, &payload, &index, ep, &old).await;

    // The engine restarts publishing elsewhere: the old socket closes,
    // the new process advertises its own.
    let (mut second, new_port) = publisher().await;
    engine.advertise(new_port);
    drop(first);
    until("the new socket", || {
        h.kv_events() == format!("tcp://127.0.0.1:{new_port}")
    })
    .await;
    let (new, payload) = chain(2);
    publish_until_indexed(&mut second, 0, &payload, &index, ep, &new).await;
    index.flush().await;
    assert_eq!(
        index.overlap(&old).blocks_for(ep),
        0,
        "the old process's blocks are gone"
    );
    assert_eq!(index.blocks(ep), 4);
    let s = h.stats().snapshot();
    assert_eq!(s.source_changes, 1, "{s:?}");
    assert!(s.restarts >= 1, "{s:?}");
    state_is(&h, SyncState::InSync).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_after_being_unreachable_the_engine_is_asked_again() {
    let engine = FakeEngine::start().await;
    let (mut first, port) = publisher().await;
    engine.advertise(port);
    let index = Arc::new(PoolIndex::new(BLOCK));
    let spec = engine.spec();
    let ep = spec.id();
    let h = spawn_subscriber(cfg(spec, &http()), index.clone());
    let (toks, payload) = chain(1);
    publish_until_indexed(&mut first, 0, &payload, &index, ep, &toks).await;

    // The service saw the HTTP side fail (as the scrape loop does) while
    // the engine came back with another socket; the old one stays open.
    let (mut second, new_port) = publisher().await;
    engine.advertise(new_port);
    h.mark_unreachable();
    until("the new socket", || {
        h.kv_events() == format!("tcp://127.0.0.1:{new_port}")
    })
    .await;
    let (toks, payload) = chain(2);
    publish_until_indexed(&mut second, 0, &payload, &index, ep, &toks).await;
    state_is(&h, SyncState::InSync).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_off_is_no_source_until_the_engine_publishes() {
    let engine = FakeEngine::start().await;
    engine.say(200, "{}");
    let index = Arc::new(PoolIndex::new(BLOCK));
    let spec = engine.spec();
    let ep = spec.id();
    let h = spawn_subscriber(cfg(spec, &http()), index.clone());
    state_is(&h, SyncState::NoSource).await;
    // Asked again with backoff, never hanging.
    until("retries", || engine.asked() >= 3).await;
    assert_eq!(h.kv_events(), "");
    assert!(h.stats().snapshot().source_failures >= 3);

    // Events turned on (a restart with --kv-events-config): followed.
    let (mut publ, port) = publisher().await;
    engine.advertise(port);
    let (toks, payload) = chain(3);
    publish_until_indexed(&mut publ, 0, &payload, &index, ep, &toks).await;
    state_is(&h, SyncState::InSync).await;

    // And off again after a restart: the endpoint is cleared.
    engine.say(200, "{}");
    h.mark_unreachable();
    state_is(&h, SyncState::NoSource).await;
    until("cleared", || index.blocks(ep) == 0).await;
    assert_eq!(h.kv_events(), "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_malformed_and_missing_routes_are_no_source() {
    // Nothing listening at all.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    let index = Arc::new(PoolIndex::new(BLOCK));
    let mut spec = FakeEngine::start().await.spec();
    spec.address = closed.to_string();
    let h = spawn_subscriber(cfg(spec, &http()), index.clone());
    state_is(&h, SyncState::NoSource).await;
    until("retries", || h.stats().snapshot().source_failures >= 2).await;

    let engine = FakeEngine::start().await;
    let h = spawn_subscriber(cfg(engine.spec(), &http()), index.clone());
    for (status, body) in [
        (200, "not json"),
        (200, r#"{"zero": {"endpoint": "tcp://*:5557"}}"#),
        (200, r#"{"0": {"endpoint": "ipc:///tmp/kv"}}"#),
        (500, "oops"),
        (404, r#"{"detail":"Not Found"}"#),
    ] {
        engine.say(status, body);
        let before = engine.asked();
        until("asked again", || engine.asked() > before + 1).await;
        assert_eq!(h.state(), SyncState::NoSource, "{status} {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_explicit_events_address_wins_and_the_engine_is_not_asked() {
    let engine = FakeEngine::start().await;
    let (mut publ, port) = publisher().await;
    // The engine would say something else.
    engine.advertise(1);
    let mut spec = engine.spec();
    spec.kv_events = format!("tcp://127.0.0.1:{port}");
    let ep = spec.id();
    let index = Arc::new(PoolIndex::new(BLOCK));
    let c = cfg(spec, &http());
    assert!(c.source.is_none());
    let h = spawn_subscriber(c, index.clone());
    let (toks, payload) = chain(4);
    publish_until_indexed(&mut publ, 0, &payload, &index, ep, &toks).await;
    assert_eq!(engine.asked(), 0);
    assert_eq!(h.stats().snapshot().source_lookups, 0);
}

/// InferencePool discovery with a pod that has no events annotation: the
/// endpoint is only its HTTP address, and the subscriber started for it
/// (as the indexer's discovery applier starts it) reads the engine's
/// sockets and indexes its events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovered_pods_need_only_their_http_address() {
    use kvasir_cache_indexer::discovery::{watch_pool, DiscoveryDefaults};
    let engine = FakeEngine::start().await;
    let (mut publ, port) = publisher().await;
    engine.advertise(port);
    let (pool, pod) = k8s::objects(engine.addr.port(), json!({}));
    let (client, api) = k8s::client(pool, pod);
    let (tx, mut rx) = tokio::sync::watch::channel(Vec::new());
    let watcher = tokio::spawn(watch_pool(
        client,
        k8s::NS,
        k8s::POOL,
        DiscoveryDefaults::default(),
        tx,
    ));
    tokio::time::timeout(WAIT, rx.changed())
        .await
        .expect("an endpoint set in time")
        .expect("discovery running");
    let specs = rx.borrow_and_update().clone();
    assert_eq!(specs, vec![engine.spec()], "no events address of its own");

    let index = Arc::new(PoolIndex::new(BLOCK));
    let http = http();
    let subs: Vec<SubscriberHandle> = specs
        .iter()
        .map(|s| spawn_subscriber(cfg(s.clone(), &http), index.clone()))
        .collect();
    let ep = specs[0].id();
    let (toks, payload) = chain(5);
    publish_until_indexed(&mut publ, 0, &payload, &index, ep, &toks).await;
    state_is(&subs[0], SyncState::InSync).await;
    assert_eq!(subs[0].kv_events(), format!("tcp://127.0.0.1:{port}"));

    // The annotation wins: same pod, annotated, gets the port it names.
    let (pool, pod) = k8s::objects(
        engine.addr.port(),
        json!({ "kvasir.io/kv-events-port": "7000" }),
    );
    let (client, api2) = k8s::client(pool, pod);
    let (tx, mut rx) = tokio::sync::watch::channel(Vec::new());
    let watcher2 = tokio::spawn(watch_pool(
        client,
        k8s::NS,
        k8s::POOL,
        DiscoveryDefaults::default(),
        tx,
    ));
    tokio::time::timeout(WAIT, rx.changed())
        .await
        .expect("an endpoint set in time")
        .expect("discovery running");
    assert_eq!(rx.borrow().clone()[0].kv_events, "tcp://127.0.0.1:7000");
    for t in [watcher, watcher2] {
        t.abort();
    }
    for t in [api, api2] {
        t.abort();
    }
}

/// The real simulator (`target/release/vllm-sim`, or `$VLLM_SIM_BIN`)
/// serves `/kv_event_sources` as vLLM does: an address-only endpoint gets
/// its PUB and replay sockets from it, starts with a replay and indexes a
/// chat's prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_simulator_advertises_its_sockets() {
    let sim = service_support::Sim::start(&[]).await;
    let spec = EndpointSpec {
        address: sim.address(),
        kv_events: String::new(),
        replay: None,
        metrics_url: None,
        topic: String::new(),
    };
    let ep = spec.id();
    let index = Arc::new(PoolIndex::new(BLOCK));
    let h = spawn_subscriber(cfg(spec, &http()), index.clone());
    state_is(&h, SyncState::InSync).await;
    assert_eq!(h.kv_events(), format!("tcp://127.0.0.1:{}", sim.events));
    assert!(
        h.stats().snapshot().replays >= 1,
        "the advertised replay socket was used"
    );
    let prompt = "word ".repeat(200);
    sim.chat(&[("user", prompt)], 2).await;
    until("the prompt's blocks", || index.blocks(ep) >= 8).await;
}
