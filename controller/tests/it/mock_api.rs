//! Fault injection: the controller's reconcile against kube-rs' mock API
//! server, which answers with the failures a real API server cannot be
//! made to produce on demand (a 500 from etcd, a 409 on a stale
//! `resourceVersion`, a 403), every request checked in order (method,
//! path, body).
//!
//! What the controller does against a working API server (finalizers,
//! server-side apply and its conflicts, status, deletions, missing
//! Secrets, pools and targets, Envoy Gateway's verdict) is tested against
//! a real kube-apiserver in `tests/e2e/test_controller.py`.

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use kube::client::Body;
use kube::Client;
use kvasir_api::eep::WasmCode;
use kvasir_api::{InferencePolicy, InferencePool, InferenceSettings, InferenceTenant, TargetRef};
use kvasir_controller::metrics::Metrics;
use kvasir_controller::plan::FINALIZER;
use kvasir_controller::reconcile::{self, Context, Settings, Snapshot};
use serde_json::{json, Value};
use tower_test::mock::{self, Handle};

const NS: &str = "serving";
const NOW: &str = "2026-12-05T08:00:00Z";
const KVASIR: &str = "/apis/kvasir.dev/v1alpha1/namespaces/serving";
const EEP: &str = "/apis/gateway.envoyproxy.io/v1alpha1/namespaces/serving/envoyextensionpolicies";

const SETTINGS: &str = r#"
apiVersion: kvasir.dev/v1alpha1
kind: InferenceSettings
metadata: {name: gw, namespace: serving}
spec:
  targetRefs: [{kind: Gateway, name: inference-gateway}]
  tenantSource: {apiKey: {}}
  defaultAction: {route: {pool: main}}
"#;
const TENANT: &str = r#"
apiVersion: kvasir.dev/v1alpha1
kind: InferenceTenant
metadata: {name: acme, namespace: serving}
spec:
  class: gold
  identity: {apiKeys: {secretRef: {name: acme-keys}}}
"#;
const POLICY: &str = r#"
apiVersion: kvasir.dev/v1alpha1
kind: InferencePolicy
metadata: {name: cheap, namespace: serving}
spec:
  precedence: 10
  targetRefs: [{kind: Gateway, name: inference-gateway}]
  match: {easy: true}
  action: {route: {pool: main, priority: 1}}
"#;
const POOL: &str = r#"
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata:
  name: main
  namespace: serving
  annotations: {kvasir.dev/models: llama-3.1-8b-instruct}
spec:
  selector: {matchLabels: {app: vllm}}
  targetPorts: [{number: 8000}]
"#;
const SECRET: &str = r#"
apiVersion: v1
kind: Secret
metadata: {name: acme-keys, namespace: serving}
data: {laptop: c2stYWNtZS0x}
"#;

fn wasm() -> WasmCode {
    WasmCode {
        url: "http://kvasir-controller.kvasir-system.svc:8080/kvasir_filter.wasm".into(),
        sha256: "0f".repeat(32),
    }
}

/// The object as the API server holds it: with uid, resourceVersion,
/// generation and, when `finalized`, our finalizer.
fn stored(yaml: &str, generation: i64, finalized: bool) -> Value {
    let mut v: Value = serde_yaml::from_str(yaml).expect("fixture YAML");
    let m = &mut v["metadata"];
    m["uid"] = json!(format!("uid-{}", m["name"].as_str().unwrap_or("")));
    m["resourceVersion"] = json!(format!("{}", 100 + generation));
    m["generation"] = json!(generation);
    m["creationTimestamp"] = json!("2026-12-05T07:00:00Z");
    if finalized {
        m["finalizers"] = json!([FINALIZER]);
    }
    v
}

fn typed<K: serde::de::DeserializeOwned>(v: &Value) -> K {
    serde_json::from_value(v.clone()).expect("fixture object")
}

struct Fixture {
    ctx: Arc<Context>,
    api: ApiServer,
}

fn fixture(pools: bool) -> Fixture {
    let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(svc, "default");
    let settings = Settings {
        wasm: wasm(),
        options: kvasir_api::Options::default(),
        pools_configmap: pools.then(|| "kvasir-indexer-pools".to_owned()),
        indexer_deployment: pools.then(|| "kvasir-indexer".to_owned()),
    };
    Fixture {
        ctx: Arc::new(Context::new(client, settings, Arc::new(Metrics::new()))),
        api: ApiServer(handle),
    }
}

/// One request as the API server saw it.
#[derive(Debug)]
struct Seen {
    query: String,
    body: Vec<u8>,
}

impl Seen {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("request body is JSON")
    }
}

struct ApiServer(Handle<Request<Body>, Response<Body>>);

fn status_error(code: u16, reason: &str, message: &str) -> (u16, Value) {
    (
        code,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": message, "reason": reason, "code": code}),
    )
}

impl ApiServer {
    /// Awaits the next request, checks its method and path, and answers
    /// with `reply(request)`.
    async fn expect(
        &mut self,
        method: &str,
        path: &str,
        reply: impl FnOnce(&Seen) -> (u16, Value),
    ) -> Seen {
        let next = tokio::time::timeout(Duration::from_secs(10), self.0.next_request()).await;
        let (req, send) = next
            .unwrap_or_else(|_| panic!("no request came; expected {method} {path}"))
            .unwrap_or_else(|| panic!("client gone; expected {method} {path}"));
        let got = format!("{} {}", req.method(), req.uri().path());
        assert_eq!(got, format!("{method} {path}"), "request out of script");
        let query = req.uri().query().unwrap_or("").to_owned();
        let body = req
            .into_body()
            .collect_bytes()
            .await
            .expect("body")
            .to_vec();
        let seen = Seen { query, body };
        let (code, value) = reply(&seen);
        let resp = Response::builder()
            .status(StatusCode::from_u16(code).expect("status code"))
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(&value).expect("reply JSON")))
            .expect("response");
        send.send_response(resp);
        seen
    }

    /// Answers a patch with the patched object the way the server would
    /// (the controller reads only that it succeeded).
    async fn patch(&mut self, path: &str, object: &Value) -> Seen {
        let obj = object.clone();
        self.expect("PATCH", path, move |_| (200, obj)).await
    }

    /// The tenant's key Secret exists.
    async fn secret_found(&mut self) {
        self.expect(
            "GET",
            "/api/v1/namespaces/serving/secrets/acme-keys",
            |_| (200, secret()),
        )
        .await;
    }

    /// The target's EnvoyExtensionPolicy is applied (the server echoes it).
    async fn policy_applied(&mut self) -> Seen {
        let path = format!("{EEP}/kvasir-gateway-inference-gateway");
        self.expect("PATCH", &path, |s| {
            (200, serde_json::from_slice(&s.body).expect("object"))
        })
        .await
    }

    /// The settings' and the tenant's status patches close the script.
    async fn settings_and_tenant_statuses(&mut self, reply: &Value) {
        self.patch(&format!("{KVASIR}/inferencesettings/gw/status"), reply)
            .await;
        self.patch(&format!("{KVASIR}/inferencetenants/acme/status"), reply)
            .await;
        self.no_more_requests().await;
    }

    async fn no_more_requests(&mut self) {
        let next = tokio::time::timeout(Duration::from_millis(200), self.0.next_request()).await;
        if let Ok(Some((req, _))) = next {
            panic!("unexpected request {} {}", req.method(), req.uri());
        }
    }

    async fn empty_eep_list(&mut self) {
        self.expect("GET", EEP, |s| {
            assert!(s.query.contains("labelSelector=app.kubernetes.io%2Fmanaged-by%3Dkvasir-controller"), "{}", s.query);
            (200, json!({"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyExtensionPolicyList", "metadata": {"resourceVersion": "1"}, "items": []}))
        })
        .await;
    }
}

fn snapshot(
    policies: Vec<Value>,
    tenants: Vec<Value>,
    settings: Vec<Value>,
    pools: Vec<Value>,
) -> Snapshot {
    Snapshot::with_all_targets(kvasir_api::Resources {
        namespace: NS.into(),
        policies: policies.iter().map(typed::<InferencePolicy>).collect(),
        tenants: tenants.iter().map(typed::<InferenceTenant>).collect(),
        providers: vec![],
        settings: settings.iter().map(typed::<InferenceSettings>).collect(),
        pools: pools.iter().map(typed::<InferencePool>).collect(),
        secrets: Default::default(),
    })
}

/// A namespace where everything already carries the finalizer: `policy`,
/// the tenant, the settings and the pool.
fn settled(policy: Value) -> Snapshot {
    snapshot(
        vec![policy],
        vec![stored(TENANT, 1, true)],
        vec![stored(SETTINGS, 1, true)],
        vec![stored(POOL, 1, false)],
    )
}

fn condition<'a>(status_patch: &'a Value, t: &str) -> &'a Value {
    status_patch["status"]["conditions"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["type"] == t))
        .unwrap_or_else(|| panic!("no {t} condition in {status_patch}"))
}

fn secret() -> Value {
    serde_yaml::from_str(SECRET).expect("secret")
}

#[tokio::test]
async fn an_api_failure_is_retried_and_reported_pending() {
    let Fixture { ctx, mut api } = fixture(false);
    let p = stored(POLICY, 1, true);
    let snap = settled(p.clone());
    let script = async {
        api.secret_found().await;
        api.expect(
            "PATCH",
            &format!("{EEP}/kvasir-gateway-inference-gateway"),
            |_| status_error(500, "InternalError", "etcdserver: request timed out"),
        )
        .await;
        api.empty_eep_list().await;
        let seen = api
            .patch(&format!("{KVASIR}/inferencepolicies/cheap/status"), &p)
            .await;
        assert_eq!(condition(&seen.json(), "Programmed")["reason"], "Pending");
        api.settings_and_tenant_statuses(&p).await;
    };
    let (result, ()) = tokio::join!(reconcile::reconcile(&ctx, &snap, NOW), script);
    assert!(result.is_err(), "an API failure must be retried");
    assert!(ctx
        .metrics
        .render()
        .contains("kvasir_controller_reconciles_total{result=\"error\"} 1"));
}

#[test]
fn targets_are_named_as_kvasirctl_names_them() {
    let t: TargetRef = kvasirctl::parse_target("Gateway/inference-gateway").expect("target");
    assert_eq!(
        kvasir_api::eep::name(&t),
        "kvasir-gateway-inference-gateway"
    );
}

#[tokio::test]
async fn a_failed_status_write_is_retried_and_the_others_are_still_written() {
    let Fixture { ctx, mut api } = fixture(false);
    let p = stored(POLICY, 1, true);
    let snap = settled(p.clone());
    let script = async {
        api.secret_found().await;
        api.policy_applied().await;
        api.empty_eep_list().await;
        api.expect(
            "PATCH",
            &format!("{KVASIR}/inferencepolicies/cheap/status"),
            |_| status_error(500, "InternalError", "etcdserver: leader changed"),
        )
        .await;
        // One failed write does not stop the others.
        api.settings_and_tenant_statuses(&p).await;
    };
    let (result, ()) = tokio::join!(reconcile::reconcile(&ctx, &snap, NOW), script);
    let err = result.expect_err("a failed status write must be retried");
    assert!(
        err.to_string().contains("status of InferencePolicy/cheap"),
        "{err}"
    );
}

#[tokio::test]
async fn a_finalizer_patch_on_a_stale_object_is_retried_before_anything_else() {
    let Fixture { ctx, mut api } = fixture(false);
    // Not finalized yet: the first write is the finalizer, guarded by the
    // resourceVersion read; the server has a newer object.
    let snap = snapshot(
        vec![stored(POLICY, 1, false)],
        vec![stored(TENANT, 1, true)],
        vec![stored(SETTINGS, 1, true)],
        vec![stored(POOL, 1, false)],
    );
    let script = async {
        let seen = api
            .expect("PATCH", &format!("{KVASIR}/inferencepolicies/cheap"), |_| {
                status_error(
                    409,
                    "Conflict",
                    "Operation cannot be fulfilled on inferencepolicies.kvasir.dev \"cheap\": the object has been modified; please apply your changes to the latest version and try again",
                )
            })
            .await;
        assert_eq!(seen.json()["metadata"]["resourceVersion"], "101");
        // Nothing is applied from a snapshot the server says is stale.
        api.no_more_requests().await;
    };
    let (result, ()) = tokio::join!(reconcile::reconcile(&ctx, &snap, NOW), script);
    assert!(result.is_err(), "retried with the next snapshot");
}

#[tokio::test]
async fn a_forbidden_list_is_an_error_not_a_deletion() {
    let Fixture { ctx, mut api } = fixture(false);
    let p = stored(POLICY, 1, true);
    let snap = settled(p.clone());
    let script = async {
        api.secret_found().await;
        api.policy_applied().await;
        api.expect("GET", EEP, |_| {
            status_error(
                403,
                "Forbidden",
                "envoyextensionpolicies.gateway.envoyproxy.io is forbidden: User \"system:serviceaccount:kvasir-system:kvasir-controller\" cannot list resource",
            )
        })
        .await;
        // No DELETE follows, nor anything else: the next reconcile starts
        // over.
        api.no_more_requests().await;
    };
    let (result, ()) = tokio::join!(reconcile::reconcile(&ctx, &snap, NOW), script);
    let err = result.expect_err("retried");
    assert!(
        err.to_string().contains("listing EnvoyExtensionPolicies"),
        "{err}"
    );
}
