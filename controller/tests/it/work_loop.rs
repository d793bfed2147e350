//! The work loop against kube-rs' mock API server answering by URL: the
//! watches list real API JSON (and then hang, as a quiet watch does), and
//! every write is recorded. A replica that does not lead must write
//! nothing; when leadership comes it reconciles; when it goes, writing
//! stops.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response};
use kube::client::Body;
use kube::Client;
use kvasir_api::eep::WasmCode;
use kvasir_controller::metrics::Metrics;
use kvasir_controller::reconcile::{Context, Settings};
use kvasir_controller::run::{self, Timing};
use serde_json::{json, Value};
use tokio::sync::watch;
use tower_test::mock::{self, Handle, SendResponse};

fn object(kind: &str, name: &str, spec: Value) -> Value {
    let api = if kind == "InferencePool" {
        "inference.networking.k8s.io/v1"
    } else {
        "kvasir.dev/v1alpha1"
    };
    let mut meta = json!({"name": name, "namespace": "serving", "uid": format!("uid-{name}"),
        "resourceVersion": "5", "generation": 1, "finalizers": ["kvasir.dev/controller"]});
    if kind == "InferencePool" {
        meta["annotations"] = json!({"kvasir.dev/models": "llama"});
        meta["finalizers"] = json!([]);
    }
    json!({"apiVersion": api, "kind": kind, "metadata": meta, "spec": spec})
}

/// The list the API server returns for a collection path.
fn list_for(path: &str) -> Value {
    let items = if path.ends_with("/inferencesettings") {
        vec![object(
            "InferenceSettings",
            "gw",
            json!({"targetRefs": [{"kind": "Gateway", "name": "gw"}],
                   "tenantSource": {"apiKey": {}},
                   "defaultAction": {"route": {"pool": "main"}}}),
        )]
    } else if path.ends_with("/inferencepools") {
        vec![object(
            "InferencePool",
            "main",
            json!({"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}]}),
        )]
    } else if path.ends_with("/gateways") {
        // The target exists (the controller applies nothing for one that
        // does not).
        vec![
            json!({"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
                    "metadata": {"name": "gw", "namespace": "serving", "uid": "uid-gw", "resourceVersion": "5"}}),
        ]
    } else {
        vec![]
    };
    json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": "10"}, "items": items})
}

type Writes = Arc<Mutex<Vec<String>>>;

/// Answers by URL until the client goes away. Watch requests are parked
/// (never answered): a quiet watch.
async fn api_server(mut handle: Handle<Request<Body>, Response<Body>>, writes: Writes) {
    let mut parked: Vec<SendResponse<Response<Body>>> = Vec::new();
    while let Some((req, send)) = handle.next_request().await {
        let path = req.uri().path().to_owned();
        let query = req.uri().query().unwrap_or("").to_owned();
        let method = req.method().as_str().to_owned();
        let body = req
            .into_body()
            .collect_bytes()
            .await
            .map(|b| b.to_vec())
            .unwrap_or_default();
        if method == "GET" && query.contains("watch=true") {
            parked.push(send);
            continue;
        }
        let reply = match method.as_str() {
            "GET" => list_for(&path),
            _ => {
                if let Ok(mut w) = writes.lock() {
                    w.push(format!("{method} {path}"));
                }
                let sent: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
                // A patch answer is the object; the loop reads only success.
                let mut obj = object("InferenceSettings", "gw", json!({}));
                if sent.get("kind").is_some() {
                    obj = sent;
                }
                obj
            }
        };
        let resp = Response::builder()
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(&reply).unwrap_or_default()))
            .expect("response");
        send.send_response(resp);
    }
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// Paused time: a sleep ends once every task is idle and the virtual clock
// has moved on, so "nothing written meanwhile" is checked after the loop
// has done all it would, not after a guess at wall-clock time.
#[tokio::test(start_paused = true)]
async fn only_the_leader_writes() {
    let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(svc, "default");
    let writes: Writes = Arc::default();
    let server = tokio::spawn(api_server(handle, writes.clone()));
    let settings = Settings {
        wasm: WasmCode {
            url: "http://c/kvasir_filter.wasm".into(),
            sha256: "ab".repeat(32),
        },
        options: kvasir_api::Options::default(),
        pools_configmap: None,
        indexer_deployment: None,
    };
    let ctx = Arc::new(Context::new(client, settings, Arc::new(Metrics::new())));
    let (leading_tx, leading_rx) = watch::channel(false);
    let (ready_tx, mut ready_rx) = watch::channel(false);
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let timing = Timing {
        debounce: Duration::from_millis(10),
        ..Timing::default()
    };
    let stop = async move {
        let _ = stop_rx.wait_for(|s| *s).await;
    };
    let work = tokio::spawn(run::run(
        ctx,
        vec!["serving".into()],
        timing,
        leading_rx,
        ready_tx,
        stop,
    ));

    tokio::time::timeout(Duration::from_secs(10), ready_rx.wait_for(|r| *r))
        .await
        .expect("ready once every watch listed")
        .expect("ready channel");
    // Following: caches fill, nothing is written.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        writes.lock().expect("writes").is_empty(),
        "a follower wrote"
    );

    leading_tx.send_replace(true);
    let eep = "PATCH /apis/gateway.envoyproxy.io/v1alpha1/namespaces/serving/envoyextensionpolicies/kvasir-gateway-gw";
    eventually("the new leader applies the policy", || {
        writes.lock().is_ok_and(|w| w.iter().any(|x| x == eep))
    })
    .await;
    eventually("and writes the statuses", || {
        writes.lock().is_ok_and(|w| {
            w.iter()
                .any(|x| x.ends_with("/inferencesettings/gw/status"))
        })
    })
    .await;

    // Leadership lost: no write after that, even on a resync.
    leading_tx.send_replace(false);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let seen = writes.lock().expect("writes").len();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        writes.lock().expect("writes").len(),
        seen,
        "a former leader wrote"
    );

    stop_tx.send_replace(true);
    tokio::time::timeout(Duration::from_secs(5), work)
        .await
        .expect("the loop stops on shutdown")
        .expect("loop task");
    server.abort();
}
