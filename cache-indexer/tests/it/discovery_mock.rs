//! `watch_pool` against a scripted API server: kube-rs' real client and
//! watcher over a `tower-test` mock service that answers with the JSON a
//! kube-apiserver sends (fixtures under `tests/fixtures/k8s/`).

use http::{Method, Request, Response, StatusCode};
use kube::client::Body;
use kvasir_cache_indexer::discovery::{watch_pool, DiscoveryDefaults, DiscoveryError};
use kvasir_cache_indexer::types::EndpointSpec;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tower_test::mock;

const NS: &str = "default";
const POOL: &str = "vllm-qwen3";
const POOL_PATH: &str = "/apis/inference.networking.k8s.io/v1/namespaces/default/inferencepools";
const PODS_PATH: &str = "/api/v1/namespaces/default/pods";
/// Every wait in these tests is bounded by this.
const WAIT: Duration = Duration::from_secs(10);

fn fixture(name: &str) -> Value {
    let path = format!("{}/tests/fixtures/k8s/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// One request the fake API server saw.
#[derive(Debug, Clone)]
struct Seen {
    method: Method,
    path: String,
    query: BTreeMap<String, String>,
}

impl Seen {
    fn is_watch(&self) -> bool {
        self.query.get("watch").map(String::as_str) == Some("true")
    }
    fn q(&self, key: &str) -> Option<&str> {
        self.query.get(key).map(String::as_str)
    }
}

/// Which watch a scripted body goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Stream {
    Pods,
    Pools,
}

/// A fake kube-apiserver for one namespace: answers GET pool, LIST/WATCH
/// pools and pods from fixtures, and delivers watch events when told.
struct ApiServer {
    seen: mpsc::UnboundedReceiver<Seen>,
    deliver: mpsc::UnboundedSender<(Stream, Vec<Value>)>,
    /// Everything seen so far, in order, and whether a wait claimed it.
    log: Vec<(Seen, bool)>,
    _task: JoinHandle<()>,
}

struct Script {
    /// Status code and body for GET of the pool.
    get_pool: (StatusCode, Value),
    pool_list: Value,
    /// Status code and body for LIST of pods (filtered by labelSelector).
    pod_list: (StatusCode, Value),
}

impl Script {
    /// Serve `pool` from both GET and LIST, as a consistent server would.
    fn with_pool(pool: Value) -> Self {
        let mut script = Script::happy();
        script.pool_list["items"] = json!([pool.clone()]);
        script.get_pool = (StatusCode::OK, pool);
        script
    }

    fn happy() -> Self {
        Script {
            get_pool: (StatusCode::OK, fixture("inferencepool.json")),
            pool_list: fixture("inferencepoollist.json"),
            pod_list: (StatusCode::OK, fixture("podlist.json")),
        }
    }
}

type Handle = mock::Handle<Request<Body>, Response<Body>>;
type Reply = mock::SendResponse<Response<Body>>;

fn respond(reply: Reply, status: StatusCode, body: Vec<u8>) {
    let resp = Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Body::from(body));
    match resp {
        Ok(resp) => reply.send_response(resp),
        Err(e) => reply.send_error(e),
    }
}

fn json_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

/// Watch events as the API server streams them: one JSON object a line.
fn watch_body(events: &[Value]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in events {
        out.extend(json_bytes(e));
        out.push(b'\n');
    }
    out
}

fn not_found(path: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": format!("the server could not find the requested resource ({path})"),
        "reason": "NotFound", "details": {}, "code": 404
    })
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 3 <= bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(q: Option<&str>) -> BTreeMap<String, String> {
    q.unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

/// Keep the list items whose labels carry every `k=v` of the selector, as
/// the API server's label filtering would.
fn filter_list(list: &Value, selector: Option<&str>) -> Value {
    let Some(selector) = selector else {
        return list.clone();
    };
    let wanted: Vec<(&str, &str)> = selector
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .collect();
    let mut out = list.clone();
    if let Some(items) = out["items"].as_array_mut() {
        items.retain(|item| {
            wanted
                .iter()
                .all(|(k, v)| item["metadata"]["labels"][*k].as_str() == Some(*v))
        });
    }
    out
}

impl ApiServer {
    fn start(handle: Handle, script: Script) -> Self {
        let (seen_tx, seen) = mpsc::unbounded_channel();
        let (deliver, deliver_rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(serve(handle, script, seen_tx, deliver_rx));
        ApiServer {
            seen,
            deliver,
            log: Vec::new(),
            _task: task,
        }
    }

    /// Wait for the first request not yet waited for that matches `pred`
    /// (it may have arrived already: the pod and pool watches run
    /// concurrently, so their requests interleave in any order).
    async fn wait_for(&mut self, what: &str, pred: impl Fn(&Seen) -> bool) -> Seen {
        if let Some(hit) = self
            .log
            .iter_mut()
            .find(|(s, claimed)| !*claimed && pred(s))
        {
            hit.1 = true;
            return hit.0.clone();
        }
        let seen = &mut self.seen;
        let log = &mut self.log;
        bounded(what, async {
            loop {
                match seen.recv().await {
                    Some(s) => {
                        let hit = pred(&s);
                        log.push((s.clone(), hit));
                        if hit {
                            return s;
                        }
                    }
                    None => panic!("API server stopped while waiting for {what}"),
                }
            }
        })
        .await
    }

    /// Stream `events` on the (current or next) watch of `stream`; the body
    /// then ends, as when the API server's watch timeout passes, and the
    /// watcher re-watches from the last resourceVersion.
    fn deliver(&self, stream: Stream, events: Vec<Value>) {
        let _ = self.deliver.send((stream, events));
    }
}

async fn serve(
    mut handle: Handle,
    script: Script,
    seen: mpsc::UnboundedSender<Seen>,
    mut deliver: mpsc::UnboundedReceiver<(Stream, Vec<Value>)>,
) {
    // Open watches wait here until the test delivers events for them.
    let mut held: HashMap<Stream, VecDeque<Reply>> = HashMap::new();
    let mut queued: HashMap<Stream, VecDeque<Vec<Value>>> = HashMap::new();
    loop {
        tokio::select! {
            next = handle.next_request() => {
                let Some((req, reply)) = next else { return };
                let s = Seen {
                    method: req.method().clone(),
                    path: req.uri().path().to_string(),
                    query: parse_query(req.uri().query()),
                };
                let _ = seen.send(s.clone());
                let stream = match s.path.as_str() {
                    PODS_PATH => Some(Stream::Pods),
                    POOL_PATH => Some(Stream::Pools),
                    _ => None,
                };
                match (stream, s.is_watch()) {
                    (Some(st), true) => match queued.get_mut(&st).and_then(VecDeque::pop_front) {
                        Some(events) => respond(reply, StatusCode::OK, watch_body(&events)),
                        None => held.entry(st).or_default().push_back(reply),
                    },
                    (Some(Stream::Pods), false) => {
                        let (code, list) = &script.pod_list;
                        let body = if code.is_success() {
                            filter_list(list, s.q("labelSelector"))
                        } else {
                            list.clone()
                        };
                        respond(reply, *code, json_bytes(&body));
                    }
                    (Some(Stream::Pools), false) => {
                        respond(reply, StatusCode::OK, json_bytes(&script.pool_list));
                    }
                    (None, _) if s.path == format!("{POOL_PATH}/{POOL}") => {
                        let (code, body) = &script.get_pool;
                        respond(reply, *code, json_bytes(body));
                    }
                    (None, _) => respond(reply, StatusCode::NOT_FOUND, json_bytes(&not_found(&s.path))),
                }
            }
            cmd = deliver.recv() => {
                let Some((st, events)) = cmd else { return };
                match held.get_mut(&st).and_then(VecDeque::pop_front) {
                    Some(reply) => respond(reply, StatusCode::OK, watch_body(&events)),
                    None => queued.entry(st).or_default().push_back(events),
                }
            }
        }
    }
}

fn start(
    script: Script,
) -> (
    ApiServer,
    watch::Receiver<Vec<EndpointSpec>>,
    JoinHandle<Result<(), DiscoveryError>>,
) {
    let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, NS);
    let server = ApiServer::start(handle, script);
    let (tx, rx) = watch::channel(Vec::new());
    // The pool-wide port convention: these tests check the sets discovery
    // publishes, not what engines advertise (discovery_sources.rs does).
    let defaults = DiscoveryDefaults {
        kv_event_sources: false,
        ..DiscoveryDefaults::default()
    };
    let task = tokio::spawn(async move { watch_pool(client, NS, POOL, defaults, tx).await });
    (server, rx, task)
}

async fn next_set(rx: &mut watch::Receiver<Vec<EndpointSpec>>, what: &str) -> Vec<EndpointSpec> {
    bounded(what, rx.changed())
        .await
        .unwrap_or_else(|_| panic!("watch_pool stopped before {what}"));
    rx.borrow_and_update().clone()
}

fn addresses(set: &[EndpointSpec]) -> Vec<&str> {
    set.iter().map(|e| e.address.as_str()).collect()
}

fn event(kind: &str, object: Value) -> Value {
    json!({ "type": kind, "object": object })
}

#[tokio::test]
async fn pool_and_pod_changes_flow_to_the_channel() {
    let (mut api, mut rx, task) = start(Script::happy());

    // 1. GET the pool first: errors surface before any watch starts.
    let get = api.wait_for("GET pool", |s| s.path.ends_with(POOL)).await;
    assert_eq!(get.method, Method::GET);
    assert_eq!(get.path, format!("{POOL_PATH}/{POOL}"));

    // 2. LIST pods with the pool's selector, server side.
    let list = api
        .wait_for("LIST pods", |s| s.path == PODS_PATH && !s.is_watch())
        .await;
    assert_eq!(list.method, Method::GET);
    assert_eq!(list.q("labelSelector"), Some("app=vllm-qwen3"));

    // Only the Ready pod of the list counts; its annotations set the ports.
    let set = next_set(&mut rx, "initial endpoint set").await;
    assert_eq!(
        set,
        vec![EndpointSpec {
            address: "10.244.1.12:8000".to_string(),
            kv_events: "tcp://10.244.1.12:5557".to_string(),
            replay: Some("tcp://10.244.1.12:5558".to_string()),
            metrics_url: None,
            topic: "kv-events".to_string(),
        }]
    );

    // 3. WATCH pods from the list's resourceVersion, same selector.
    let w = api
        .wait_for("WATCH pods", |s| s.path == PODS_PATH && s.is_watch())
        .await;
    assert_eq!(w.q("labelSelector"), Some("app=vllm-qwen3"));
    assert_eq!(w.q("resourceVersion"), Some("48362"));
    // The pool is watched too, by name.
    let pw = api
        .wait_for("WATCH pool", |s| s.path == POOL_PATH && s.is_watch())
        .await;
    assert_eq!(pw.q("fieldSelector"), Some("metadata.name=vllm-qwen3"));

    // 4. The second pod's readiness probe passes: MODIFIED -> two endpoints.
    api.deliver(
        Stream::Pods,
        vec![event("MODIFIED", fixture("pod-ready.json"))],
    );
    let set = next_set(&mut rx, "set after pod became Ready").await;
    assert_eq!(addresses(&set), ["10.244.1.12:8000", "10.244.2.7:8000"]);

    // 5. A change that does not move any endpoint (a label added) is not
    // sent. The watcher re-watches from that event's resourceVersion only
    // after discovery consumed the event, which is our sync point.
    let mut unrelated = fixture("pod-ready.json");
    unrelated["metadata"]["resourceVersion"] = json!("48390");
    unrelated["metadata"]["labels"]["canary"] = json!("true");
    api.deliver(Stream::Pods, vec![event("MODIFIED", unrelated)]);
    api.wait_for("re-WATCH after unrelated change", |s| {
        s.path == PODS_PATH && s.is_watch() && s.q("resourceVersion") == Some("48390")
    })
    .await;
    assert!(
        !rx.has_changed().unwrap_or(true),
        "unchanged set was re-sent"
    );

    // 6. The pool gains a second target port: re-read, no pod relist, and
    // each pod now serves two endpoints (events on 5557 and 5558).
    let mut pool = fixture("inferencepool.json");
    pool["metadata"]["resourceVersion"] = json!("48400");
    pool["metadata"]["generation"] = json!(2);
    pool["spec"]["targetPorts"] = json!([{ "number": 8000 }, { "number": 8001 }]);
    api.deliver(Stream::Pools, vec![event("MODIFIED", pool.clone())]);
    let set = next_set(&mut rx, "set after targetPorts change").await;
    assert_eq!(
        addresses(&set),
        [
            "10.244.1.12:8000",
            "10.244.1.12:8001",
            "10.244.2.7:8000",
            "10.244.2.7:8001"
        ]
    );
    assert_eq!(set[1].kv_events, "tcp://10.244.1.12:5558");
    assert_eq!(set[1].replay.as_deref(), Some("tcp://10.244.1.12:5559"));

    // 7. A pod is deleted.
    let mut gone = fixture("pod-ready.json");
    gone["metadata"]["resourceVersion"] = json!("48410");
    api.deliver(Stream::Pods, vec![event("DELETED", gone)]);
    let set = next_set(&mut rx, "set after pod deletion").await;
    assert_eq!(addresses(&set), ["10.244.1.12:8000", "10.244.1.12:8001"]);

    // 8. The pool is deleted: no endpoints.
    api.deliver(Stream::Pools, vec![event("DELETED", pool.clone())]);
    let set = next_set(&mut rx, "set after pool deletion").await;
    assert!(set.is_empty());

    // 9. It comes back with a narrower selector: pods are listed again with
    // the new selector, and endpoints return.
    let mut back = fixture("inferencepool.json");
    back["metadata"]["resourceVersion"] = json!("48500");
    back["spec"]["selector"]["matchLabels"]["pod-template-hash"] = json!("7d9f8b6c5");
    api.deliver(Stream::Pools, vec![event("ADDED", back)]);
    let relist = api
        .wait_for("LIST pods with the new selector", |s| {
            s.path == PODS_PATH && !s.is_watch() && s.q("labelSelector") != Some("app=vllm-qwen3")
        })
        .await;
    assert_eq!(
        relist.q("labelSelector"),
        Some("app=vllm-qwen3,pod-template-hash=7d9f8b6c5")
    );
    let set = next_set(&mut rx, "set after pool re-created").await;
    assert_eq!(addresses(&set), ["10.244.1.12:8000"]);

    // 10. With no receiver left, the watcher stops cleanly.
    drop(rx);
    let result = bounded("watch_pool to stop", task).await;
    assert!(matches!(result, Ok(Ok(()))), "{result:?}");
}

async fn startup_error(script: Script) -> DiscoveryError {
    let (_api, _rx, task) = start(script);
    match bounded("watch_pool to fail", task).await {
        Ok(Err(e)) => e,
        other => panic!("expected a DiscoveryError, got {other:?}"),
    }
}

#[tokio::test]
async fn missing_pool_is_pool_not_found() {
    let mut script = Script::happy();
    script.get_pool = (StatusCode::NOT_FOUND, fixture("status-notfound.json"));
    let e = startup_error(script).await;
    assert!(
        matches!(&e, DiscoveryError::PoolNotFound { namespace, name } if namespace == NS && name == POOL)
    );
    let msg = e.to_string();
    assert!(
        msg.contains("default/vllm-qwen3") && msg.contains("CRD"),
        "{msg}"
    );
}

#[tokio::test]
async fn rbac_denied_pool_is_forbidden() {
    let mut script = Script::happy();
    script.get_pool = (StatusCode::FORBIDDEN, fixture("status-forbidden.json"));
    let e = startup_error(script).await;
    assert!(
        matches!(
            &e,
            DiscoveryError::Forbidden {
                verb: "get",
                resource: "inferencepools",
                ..
            }
        ),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("system:serviceaccount:default:kvasir-indexer"),
        "{msg}"
    );
}

#[tokio::test]
async fn rbac_denied_pods_is_forbidden() {
    let mut script = Script::happy();
    script.pod_list = (StatusCode::FORBIDDEN, fixture("status-forbidden-pods.json"));
    let e = startup_error(script).await;
    assert!(
        matches!(
            &e,
            DiscoveryError::Forbidden {
                verb: "list",
                resource: "pods",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string().contains("cannot list resource \"pods\""),
        "{e}"
    );
}

#[tokio::test]
async fn empty_selector_is_bad_selector() {
    let mut pool = fixture("inferencepool.json");
    pool["spec"]["selector"]["matchLabels"] = json!({});
    let e = startup_error(Script::with_pool(pool)).await;
    assert!(matches!(e, DiscoveryError::BadSelector { .. }), "{e:?}");
    assert!(e.to_string().contains("matchLabels is empty"), "{e}");
}

#[tokio::test]
async fn first_list_is_reported_even_when_empty() {
    // No pod carries this label: the list is empty, equal to the channel's
    // initial value, and still marks the channel changed once.
    let mut pool = fixture("inferencepool.json");
    pool["spec"]["selector"]["matchLabels"] = json!({ "app": "nobody" });
    let (mut api, mut rx, task) = start(Script::with_pool(pool));
    let set = next_set(&mut rx, "first (empty) set").await;
    assert!(set.is_empty());
    let list = api
        .wait_for("LIST pods", |s| s.path == PODS_PATH && !s.is_watch())
        .await;
    assert_eq!(list.q("labelSelector"), Some("app=nobody"));
    drop(rx);
    let result = bounded("watch_pool to stop", task).await;
    assert!(matches!(result, Ok(Ok(()))), "{result:?}");
}
