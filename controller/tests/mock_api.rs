//! The controller's reconcile against kube-rs' mock API server: every
//! request it makes is checked in order (method, path, body) and answered
//! with the JSON a real API server sends, including its `Status` errors.

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

fn deleting(mut v: Value) -> Value {
    v["metadata"]["deletionTimestamp"] = json!("2026-12-05T07:59:00Z");
    v
}

fn with_status(mut v: Value, conditions: Value) -> Value {
    v["status"] = json!({ "conditions": conditions });
    v
}

fn true_conditions(generation: i64) -> Value {
    let c = |t: &str, reason: &str, msg: &str| {
        json!({"type": t, "status": "True", "reason": reason, "message": msg,
               "observedGeneration": generation, "lastTransitionTime": "2026-12-05T07:00:00Z"})
    };
    json!([
        c("Accepted", "Accepted", ""),
        c("ResolvedRefs", "ResolvedRefs", ""),
        c(
            "Programmed",
            "Programmed",
            "in force on Gateway/inference-gateway (kvasir-gateway-inference-gateway, HASH)"
        )
    ])
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

    /// The list of managed policies holds the gateway's, from an earlier
    /// reconcile.
    async fn gateway_eep_listed(&mut self) {
        self.expect("GET", EEP, |_| {
            (200, json!({"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyExtensionPolicyList", "metadata": {}, "items": [
                {"apiVersion": "gateway.envoyproxy.io/v1alpha1", "kind": "EnvoyExtensionPolicy",
                 "metadata": {"name": "kvasir-gateway-inference-gateway", "namespace": "serving",
                              "labels": {"app.kubernetes.io/managed-by": "kvasir-controller",
                                         "kvasir.dev/target-kind": "Gateway", "kvasir.dev/target-name": "inference-gateway"}}}]}))
        })
        .await;
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
    Snapshot {
        namespace: NS.into(),
        policies: policies.iter().map(typed::<InferencePolicy>).collect(),
        tenants: tenants.iter().map(typed::<InferenceTenant>).collect(),
        providers: vec![],
        settings: settings.iter().map(typed::<InferenceSettings>).collect(),
        pools: pools.iter().map(typed::<InferencePool>).collect(),
        secrets: Default::default(),
    }
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

/// What `kvasirctl compile --output envoyextensionpolicy` prints for the
/// same documents (its own YAML reader, not the controller's objects).
fn kvasirctl_policy(docs: &[&str]) -> Vec<u8> {
    let mut input = kvasirctl::Input::default();
    input.add_text("fixtures.yaml", &docs.join("\n---\n"), NS);
    let scoped = kvasirctl::Scoped {
        namespace: NS.into(),
        target: kvasirctl::parse_target("Gateway/inference-gateway").expect("target"),
    };
    kvasirctl::extension_policy(&input, &scoped, &kvasir_api::Options::default(), &wasm())
        .unwrap_or_else(|r| panic!("kvasirctl: {}", r.text()))
}

fn condition<'a>(status_patch: &'a Value, t: &str) -> &'a Value {
    status_patch["status"]["conditions"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["type"] == t))
        .unwrap_or_else(|| panic!("no {t} condition in {status_patch}"))
}

/// The `t` condition of a status patch, checked to be `status` for `reason`.
fn condition_is<'a>(status_patch: &'a Value, t: &str, status: &str, reason: &str) -> &'a Value {
    let c = condition(status_patch, t);
    assert_eq!(
        (c["status"].as_str(), c["reason"].as_str()),
        (Some(status), Some(reason)),
        "{status_patch}"
    );
    c
}

fn message(condition: &Value) -> &str {
    condition["message"].as_str().unwrap_or("")
}

fn secret() -> Value {
    serde_yaml::from_str(SECRET).expect("secret")
}

#[tokio::test]
async fn create_adds_finalizers_applies_the_policy_and_reports_conditions() {
    let Fixture { ctx, mut api } = fixture(true);
    let (p, s, t, pool) = (
        stored(POLICY, 1, false),
        stored(SETTINGS, 1, false),
        stored(TENANT, 1, false),
        stored(POOL, 1, false),
    );
    let snap = snapshot(
        vec![p.clone()],
        vec![t.clone()],
        vec![s.clone()],
        vec![pool],
    );
    let expected_eep = kvasirctl_policy(&[SETTINGS, TENANT, POLICY, POOL, SECRET]);
    let script = async {
        // Finalizers first, by kind and name, guarded by resourceVersion.
        for (kind, name, obj) in [
            ("inferencepolicies", "cheap", &p),
            ("inferencesettings", "gw", &s),
            ("inferencetenants", "acme", &t),
        ] {
            let seen = api.patch(&format!("{KVASIR}/{kind}/{name}"), obj).await;
            let body = seen.json();
            assert_eq!(body["metadata"]["finalizers"], json!([FINALIZER]));
            assert_eq!(body["metadata"]["resourceVersion"], "101");
        }
        api.secret_found().await;
        let seen = api.policy_applied().await;
        assert!(
            seen.query.contains("fieldManager=kvasir-controller"),
            "{}",
            seen.query
        );
        assert!(
            !seen.query.contains("force"),
            "the controller never forces: {}",
            seen.query
        );
        assert_eq!(
            String::from_utf8_lossy(&seen.body),
            String::from_utf8_lossy(&expected_eep),
            "the controller must write exactly what kvasirctl prints"
        );
        // No API key in plain text anywhere in what is written.
        assert!(!String::from_utf8_lossy(&seen.body).contains("sk-acme-1"));
        api.empty_eep_list().await;
        let cm = api
            .expect(
                "PATCH",
                "/api/v1/namespaces/serving/configmaps/kvasir-indexer-pools",
                |s| (200, serde_json::from_slice(&s.body).expect("object")),
            )
            .await;
        assert!(cm.query.contains("fieldManager=kvasir-controller"));
        let pools_yaml = cm.json()["data"]["pools.yaml"]
            .as_str()
            .unwrap_or("")
            .to_owned();
        assert!(pools_yaml.contains("inferencePool: main"), "{pools_yaml}");
        let dep = api
            .expect("PATCH", "/apis/apps/v1/namespaces/serving/deployments/kvasir-indexer", |_| {
                (200, json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "kvasir-indexer", "namespace": "serving"}}))
            })
            .await;
        let ann =
            &dep.json()["spec"]["template"]["metadata"]["annotations"]["kvasir.dev/pools-sha256"];
        assert!(
            ann.as_str().is_some_and(|h| h.starts_with("sha256:")),
            "{ann}"
        );
        for (kind, name, obj) in [
            ("inferencepolicies", "cheap", &p),
            ("inferencesettings", "gw", &s),
            ("inferencetenants", "acme", &t),
        ] {
            let seen = api
                .patch(&format!("{KVASIR}/{kind}/{name}/status"), obj)
                .await;
            let body = seen.json();
            for t in ["Accepted", "ResolvedRefs", "Programmed"] {
                let c = condition(&body, t);
                assert_eq!(c["status"], "True", "{name}: {c}");
                assert_eq!(c["observedGeneration"], 1);
                assert_eq!(c["lastTransitionTime"], NOW);
            }
        }
        api.no_more_requests().await;
    };
    let (result, ()) = tokio::join!(reconcile::reconcile(&ctx, &snap, NOW), script);
    let outcomes = result.expect("reconcile");
    assert_eq!(outcomes.targets.len(), 1);
    let text = ctx.metrics.render();
    assert!(text.contains("kvasir_controller_config_bytes{"), "{text}");
}

#[tokio::test]
async fn an_update_reapplies_and_patches_only_the_changed_status() {
    let Fixture { ctx, mut api } = fixture(false);
    let mut changed = stored(POLICY, 2, true);
    changed["spec"]["action"]["route"]["priority"] = json!(5);
    // Conditions of generation 1: generation 2 must be reported.
    let p = with_status(changed, true_conditions(1));
    let s = with_status(stored(SETTINGS, 1, true), true_conditions(1));
    let t = with_status(stored(TENANT, 1, true), true_conditions(1));
    let pool = stored(POOL, 1, false);
    let snap = snapshot(vec![p.clone()], vec![t], vec![s], vec![pool]);
    let script = async {
        api.secret_found().await;
        let seen = api.policy_applied().await;
        let cfg = &seen.json()["spec"]["wasm"][0]["config"];
        let cheap = cfg["policies"]
            .as_array()
            .and_then(|a| a.iter().find(|p| p["name"] == "cheap"))
            .cloned()
            .unwrap_or_default();
        assert_eq!(cheap["action"]["route"]["priority"], 5, "{cfg}");
        api.gateway_eep_listed().await;
        // The settings and tenant are unchanged; the policy's Programmed
        // message names the new config hash, and all carry generation 2.
        let seen = api
            .patch(&format!("{KVASIR}/inferencepolicies/cheap/status"), &p)
            .await;
        let body = seen.json();
        assert_eq!(condition(&body, "Accepted")["observedGeneration"], 2);
        assert_eq!(
            condition(&body, "Accepted")["lastTransitionTime"],
            "2026-12-05T07:00:00Z",
            "status did not change, so the transition time stays"
        );
        // settings/tenant: Programmed message changed (new hash).
        api.settings_and_tenant_statuses(&s_of()).await;
    };
    let (result, ()) = tokio::join!(reconcile::reconcile(&ctx, &snap, NOW), script);
    result.expect("reconcile");
}

fn s_of() -> Value {
    stored(SETTINGS, 1, true)
}

const BAD_POLICY: &str = r#"
apiVersion: kvasir.dev/v1alpha1
kind: InferencePolicy
metadata: {name: broken, namespace: serving}
spec:
  precedence: 20
  targetRefs: [{kind: Gateway, name: inference-gateway}]
  match: {easy: true}
  action: {route: {pool: main, rewriteModel: no-such-model}}
"#;

#[tokio::test]
async fn an_invalid_policy_is_refused_with_its_path_and_the_last_good_config_stays() {
    let Fixture { ctx, mut api } = fixture(false);
    let good = stored(POLICY, 1, true);
    let bad = stored(BAD_POLICY, 1, true);
    let snap = snapshot(
        vec![good.clone(), bad.clone()],
        vec![stored(TENANT, 1, true)],
        vec![stored(SETTINGS, 1, true)],
        vec![stored(POOL, 1, false)],
    );
    let script = async {
        api.secret_found().await;
        // No PATCH to the EnvoyExtensionPolicy: the list comes next.
        api.empty_eep_list().await;
        let seen = api
            .patch(&format!("{KVASIR}/inferencepolicies/broken/status"), &bad)
            .await;
        let body = seen.json();
        let msg = message(condition_is(&body, "Accepted", "False", "Invalid"));
        assert!(msg.starts_with("spec.action.route.rewriteModel"), "{msg}");
        assert!(msg.contains("no-such-model"), "{msg}");
        let seen = api
            .patch(&format!("{KVASIR}/inferencepolicies/cheap/status"), &good)
            .await;
        let body = seen.json();
        assert_eq!(condition(&body, "Accepted")["status"], "True");
        let p = condition(&body, "Programmed");
        assert_eq!(p["status"], "False");
        let msg = message(p);
        assert!(
            msg.contains("keeps its last good configuration")
                && msg.contains("InferencePolicy/broken"),
            "{msg}"
        );
        api.settings_and_tenant_statuses(&s_of()).await;
    };
    let (result, ()) = tokio::join!(reconcile::reconcile(&ctx, &snap, NOW), script);
    // An invalid resource is the user's to fix, not an API error to retry.
    result.expect("reconcile");
    assert!(ctx
        .metrics
        .render()
        .contains("kvasir_controller_errors_total{kind=\"invalid\"} 1"));
}

#[tokio::test]
async fn a_deleted_policy_leaves_the_config_before_its_finalizer_goes() {
    let Fixture { ctx, mut api } = fixture(false);
    let gone = deleting(stored(
        BAD_POLICY
            .replace("rewriteModel: no-such-model", "priority: 3")
            .as_str(),
        1,
        true,
    ));
    let snap = snapshot(
        vec![stored(POLICY, 1, true), gone.clone()],
        vec![stored(TENANT, 1, true)],
        vec![stored(SETTINGS, 1, true)],
        vec![stored(POOL, 1, false)],
    );
    let script = async {
        api.secret_found().await;
        let seen = api.policy_applied().await;
        let text = String::from_utf8_lossy(&seen.body).to_string();
        assert!(
            !text.contains("\"broken\""),
            "the deleted policy is still in the config: {text}"
        );
        api.empty_eep_list().await;
        for (kind, name) in [
            ("inferencepolicies", "cheap"),
            ("inferencesettings", "gw"),
            ("inferencetenants", "acme"),
        ] {
            api.patch(&format!("{KVASIR}/{kind}/{name}/status"), &s_of())
                .await;
        }
        // Only now, with the config applied without it, the finalizer goes.
        let seen = api
            .patch(&format!("{KVASIR}/inferencepolicies/broken"), &gone)
            .await;
        let body = seen.json();
        assert_eq!(body["metadata"]["finalizers"], json!([]));
        assert_eq!(body["metadata"]["resourceVersion"], "101");
        api.no_more_requests().await;
    };
    let (result, ()) = tokio::join!(reconcile::reconcile(&ctx, &snap, NOW), script);
    result.expect("reconcile");
}

#[tokio::test]
async fn deleting_the_settings_deletes_the_policy_then_releases_the_finalizer() {
    let Fixture { ctx, mut api } = fixture(false);
    let settings = deleting(stored(SETTINGS, 1, true));
    let snap = snapshot(
        vec![],
        vec![],
        vec![settings.clone()],
        vec![stored(POOL, 1, false)],
    );
    let script = async {
        api.gateway_eep_listed().await;
        api.expect("DELETE", &format!("{EEP}/kvasir-gateway-inference-gateway"), |_| {
            (200, json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 200}))
        })
        .await;
        let seen = api
            .patch(&format!("{KVASIR}/inferencesettings/gw"), &settings)
            .await;
        assert_eq!(seen.json()["metadata"]["finalizers"], json!([]));
        api.no_more_requests().await;
    };
    let (result, ()) = tokio::join!(reconcile::reconcile(&ctx, &snap, NOW), script);
    result.expect("reconcile");
}

#[tokio::test]
async fn a_missing_secret_is_resolved_refs_false_and_nothing_is_applied() {
    let Fixture { ctx, mut api } = fixture(false);
    let t = stored(TENANT, 1, true);
    let snap = snapshot(
        vec![stored(POLICY, 1, true)],
        vec![t.clone()],
        vec![stored(SETTINGS, 1, true)],
        vec![stored(POOL, 1, false)],
    );
    let script = async {
        api.expect(
            "GET",
            "/api/v1/namespaces/serving/secrets/acme-keys",
            |_| status_error(404, "NotFound", "secrets \"acme-keys\" not found"),
        )
        .await;
        api.empty_eep_list().await;
        api.patch(&format!("{KVASIR}/inferencepolicies/cheap/status"), &t)
            .await;
        api.patch(&format!("{KVASIR}/inferencesettings/gw/status"), &t)
            .await;
        let seen = api
            .patch(&format!("{KVASIR}/inferencetenants/acme/status"), &t)
            .await;
        let body = seen.json();
        let r = condition_is(&body, "ResolvedRefs", "False", "SecretNotFound");
        assert!(message(r).contains("acme-keys"), "{r}");
        assert_eq!(condition(&body, "Accepted")["status"], "True");
        assert_eq!(condition(&body, "Programmed")["status"], "False");
        api.no_more_requests().await;
    };
    let (result, ()) = tokio::join!(reconcile::reconcile(&ctx, &snap, NOW), script);
    result.expect("reconcile");
}

#[tokio::test]
async fn a_missing_inference_pool_is_resolved_refs_false_on_the_policy() {
    let Fixture { ctx, mut api } = fixture(false);
    let p = stored(POLICY, 1, true);
    // The policy routes to `main`; no InferencePool exists at all.
    let snap = snapshot(
        vec![p.clone()],
        vec![stored(TENANT, 1, true)],
        vec![stored(SETTINGS, 1, true)],
        vec![],
    );
    let script = async {
        api.secret_found().await;
        api.empty_eep_list().await;
        let seen = api
            .patch(&format!("{KVASIR}/inferencepolicies/cheap/status"), &p)
            .await;
        let body = seen.json();
        let r = condition_is(&body, "ResolvedRefs", "False", "PoolNotFound");
        assert!(message(r).starts_with("spec.action.route.pool"), "{r}");
        api.settings_and_tenant_statuses(&p).await;
    };
    let (result, ()) = tokio::join!(reconcile::reconcile(&ctx, &snap, NOW), script);
    result.expect("reconcile");
}

#[tokio::test]
async fn a_conflicting_owner_is_reported_not_overridden() {
    let Fixture { ctx, mut api } = fixture(false);
    let p = stored(POLICY, 1, true);
    let snap = settled(p.clone());
    let script = async {
        api.secret_found().await;
        let seen = api
            .expect("PATCH", &format!("{EEP}/kvasir-gateway-inference-gateway"), |_| {
                status_error(409, "Conflict", "Apply failed with 1 conflict: conflict with \"kubectl-client-side-apply\" using gateway.envoyproxy.io/v1alpha1: .spec.wasm")
            })
            .await;
        assert!(!seen.query.contains("force"), "{}", seen.query);
        api.empty_eep_list().await;
        let seen = api
            .patch(&format!("{KVASIR}/inferencepolicies/cheap/status"), &p)
            .await;
        let body = seen.json();
        let c = condition_is(&body, "Programmed", "False", "Conflicted");
        assert!(message(c).contains("kubectl-client-side-apply"), "{c}");
        api.settings_and_tenant_statuses(&p).await;
    };
    let (result, ()) = tokio::join!(reconcile::reconcile(&ctx, &snap, NOW), script);
    result.expect("a conflict waits for people, it is not retried in a loop");
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
