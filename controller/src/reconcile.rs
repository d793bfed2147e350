//! One namespace against the API server: add finalizers, read the key
//! Secrets, compile and apply each target, delete the policies of gone
//! targets, write the indexer's pools, then the status conditions, then
//! release the finalizers of deleted objects that are out of force.
//!
//! Every call is made in a fixed order (objects by kind and name, targets
//! sorted), so a reconcile is reproducible request by request; the mock
//! API tests rely on it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Client, Resource, ResourceExt};
use kvasir_api::assemble::ObjectRef;
use kvasir_api::document::secret_values;
use kvasir_api::eep::{self, WasmCode, FIELD_MANAGER, MANAGED_BY_LABEL};
use kvasir_api::indexer::POOLS_KEY;
use kvasir_api::{
    InferencePolicy, InferenceProvider, InferenceSettings, InferenceTenant, Options,
    ResourceStatus, Resources, TargetKind, TargetRef,
};
use serde_json::json;
use serde_json::value::RawValue;

use crate::metrics::Metrics;
use crate::plan::{self, GatewayVerdict, Object, Outcome, Outcomes, FINALIZER};

/// Annotation on the indexer Deployment's pod template: the pools file's
/// hash, so a change rolls the indexer (it reads the file at start).
pub const POOLS_HASH_ANNOTATION: &str = "kvasir.dev/pools-sha256";

/// Deployment choices of the controller.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The filter module every policy points at.
    pub wasm: WasmCode,
    /// Compile options (the indexer's Envoy cluster).
    pub options: Options,
    /// The ConfigMap the indexer reads its pools from (`None`: not written).
    pub pools_configmap: Option<String>,
    /// The indexer Deployment rolled when its pools change (`None`: not).
    pub indexer_deployment: Option<String>,
}

/// What every reconcile shares.
pub struct Context {
    /// The API client.
    pub client: Client,
    /// Deployment choices.
    pub settings: Settings,
    /// Counters.
    pub metrics: Arc<Metrics>,
    /// Namespace -> pools hash last written, to write only on change.
    pools_written: Mutex<BTreeMap<String, String>>,
}

impl Context {
    /// A context with nothing written yet.
    pub fn new(client: Client, settings: Settings, metrics: Arc<Metrics>) -> Context {
        Context {
            client,
            settings,
            metrics,
            pools_written: Mutex::new(BTreeMap::new()),
        }
    }
}

/// A namespace as the watches hold it.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// The kvasir.dev objects (deleted ones included until their finalizer
    /// goes) and the InferencePools: compilation's [`Resources`], its
    /// `secrets` left empty, since a reconcile reads only the Secrets
    /// tenants name.
    pub resources: Resources,
    /// The Gateways and HTTPRoutes that exist in the namespace: a target
    /// not among them is reported `TargetNotFound` and nothing is applied
    /// for it.
    pub present: BTreeSet<TargetRef>,
}

impl Snapshot {
    /// A snapshot in which every target the resources name exists.
    pub fn with_all_targets(resources: Resources) -> Snapshot {
        let present = kvasir_api::targets(&resources);
        Snapshot { resources, present }
    }
}

/// Why a reconcile must be retried. Invalid resources are not errors: they
/// end in status conditions.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An API call failed.
    #[error("{what}: {source}")]
    Api {
        /// Which call.
        what: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// A target's policy could not be applied (its status says `Pending`).
    #[error("apply: {0}")]
    Apply(String),
}

fn api_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let what = what.into();
    move |source| Error::Api { what, source }
}

/// A `kvasir.dev` object with what writing to it needs.
struct Entry {
    object: Object,
    resource: ApiResource,
    resource_version: Option<String>,
    finalizers: Vec<String>,
}

fn entry<K>(o: &K, kind: &'static str, targets: Option<&[TargetRef]>) -> Entry
where
    K: Resource<DynamicType = ()> + HasStatus,
{
    let meta = o.meta();
    let finalizers = meta.finalizers.clone().unwrap_or_default();
    Entry {
        object: Object {
            id: ObjectRef {
                kind,
                name: meta.name.clone().unwrap_or_default(),
            },
            generation: meta.generation,
            deleting: meta.deletion_timestamp.is_some(),
            finalized: finalizers.iter().any(|f| f == FINALIZER),
            conditions: o.status().map(|s| s.conditions.clone()).unwrap_or_default(),
            ancestors: o.status().map(|s| s.ancestors.clone()).unwrap_or_default(),
            targets: targets.map(|t| {
                t.iter()
                    .map(|t| TargetRef::new(t.kind, t.name.clone()))
                    .collect()
            }),
        },
        resource: ApiResource::erase::<K>(&()),
        resource_version: meta.resource_version.clone(),
        finalizers,
    }
}

/// Read access to the status every kvasir.dev kind carries.
pub trait HasStatus {
    /// `status`, when set.
    fn status(&self) -> Option<&ResourceStatus>;
}

macro_rules! has_status {
    ($($k:ty),*) => {$(
        impl HasStatus for $k {
            fn status(&self) -> Option<&ResourceStatus> {
                self.status.as_ref()
            }
        }
    )*};
}
has_status!(
    InferencePolicy,
    InferenceTenant,
    InferenceProvider,
    InferenceSettings
);

fn entries(snap: &Resources) -> Vec<Entry> {
    let mut v = Vec::new();
    for o in &snap.policies {
        v.push(entry(o, "InferencePolicy", Some(&o.spec.target_refs)));
    }
    for o in &snap.tenants {
        v.push(entry(o, "InferenceTenant", None));
    }
    for o in &snap.providers {
        v.push(entry(o, "InferenceProvider", None));
    }
    for o in &snap.settings {
        v.push(entry(o, "InferenceSettings", Some(&o.spec.target_refs)));
    }
    v.sort_by(|a, b| a.object.id.cmp(&b.object.id));
    v
}

fn live<K: Resource + Clone>(v: &[K]) -> Vec<K> {
    v.iter()
        .filter(|o| o.meta().deletion_timestamp.is_none())
        .cloned()
        .collect()
}

/// The resources compilation sees: deleted objects are already out.
fn resources(snap: &Resources) -> Resources {
    Resources {
        namespace: snap.namespace.clone(),
        policies: live(&snap.policies),
        tenants: live(&snap.tenants),
        providers: live(&snap.providers),
        settings: live(&snap.settings),
        pools: snap.pools.clone(),
        secrets: BTreeMap::new(),
    }
}

/// Reconciles one namespace. `now` is RFC 3339 for condition times.
pub async fn reconcile(ctx: &Context, snap: &Snapshot, now: &str) -> Result<Outcomes, Error> {
    let started = std::time::Instant::now();
    let result = run(ctx, snap, now).await;
    let secs = started.elapsed().as_secs_f64();
    ctx.metrics.reconciled(result.is_ok(), secs);
    if result.is_err() {
        ctx.metrics.error("api");
    }
    result
}

async fn run(ctx: &Context, snap: &Snapshot, now: &str) -> Result<Outcomes, Error> {
    let ns = snap.resources.namespace.as_str();
    let entries = entries(&snap.resources);
    add_finalizers(ctx, ns, &entries).await?;
    let mut res = resources(&snap.resources);
    read_secrets(ctx, &mut res).await?;
    let outcomes = apply_targets(ctx, &res, &snap.present).await;
    delete_stale(ctx, ns, &outcomes).await?;
    // Only where Kvasir serves a target: a namespace with pools alone gets
    // no indexer configuration written into it.
    if !outcomes.targets.is_empty() {
        write_pools(ctx, &res).await;
    }
    let mut first_err = write_statuses(ctx, ns, &entries, &outcomes, now)
        .await
        .err();
    if let Err(e) = release_finalizers(ctx, ns, &entries, &outcomes).await {
        first_err.get_or_insert(e);
    }
    let failed = outcomes.targets.iter().find_map(|(t, o)| match o {
        Outcome::Failed(msg) => Some(format!("{t}: {msg}")),
        _ => None,
    });
    match (first_err, failed) {
        (Some(e), _) => Err(e),
        (None, Some(msg)) => Err(Error::Apply(msg)),
        (None, None) => Ok(outcomes),
    }
}

/// Merge patches name the controller's field manager too, so that
/// `managedFields` says who wrote the finalizers and the status (without
/// it the API server records `unknown`).
fn merge_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    }
}

fn dynamic(ctx: &Context, ns: &str, ar: &ApiResource) -> Api<DynamicObject> {
    Api::namespaced_with(ctx.client.clone(), ns, ar)
}

/// Merge patches carry the `resourceVersion` read: the API server then
/// refuses (409) a patch over a newer object, so another writer's
/// finalizer is never dropped.
async fn set_finalizers(
    ctx: &Context,
    ns: &str,
    e: &Entry,
    list: Vec<String>,
) -> Result<(), Error> {
    let api = dynamic(ctx, ns, &e.resource);
    let patch = json!({"metadata": {"resourceVersion": e.resource_version, "finalizers": list}});
    api.patch(&e.object.id.name, &merge_params(), &Patch::Merge(&patch))
        .await
        .map_err(api_err(format!("finalizer of {}", e.object.id)))?;
    Ok(())
}

async fn add_finalizers(ctx: &Context, ns: &str, entries: &[Entry]) -> Result<(), Error> {
    for e in entries
        .iter()
        .filter(|e| !e.object.deleting && !e.object.finalized)
    {
        let mut list = e.finalizers.clone();
        list.push(FINALIZER.to_owned());
        set_finalizers(ctx, ns, e, list).await?;
    }
    Ok(())
}

async fn release_finalizers(
    ctx: &Context,
    ns: &str,
    entries: &[Entry],
    outcomes: &Outcomes,
) -> Result<(), Error> {
    for e in entries
        .iter()
        .filter(|e| e.object.deleting && e.object.finalized)
    {
        if !plan::may_release(&e.object, outcomes) {
            tracing::info!(object = %e.object.id, namespace = ns, "deleted, but still in the configuration in force; keeping the finalizer");
            continue;
        }
        let list = e
            .finalizers
            .iter()
            .filter(|f| *f != FINALIZER)
            .cloned()
            .collect();
        set_finalizers(ctx, ns, e, list).await?;
    }
    Ok(())
}

/// Reads only the Secrets tenants name; a missing one is left out, and
/// compilation reports it on the tenant.
async fn read_secrets(ctx: &Context, res: &mut Resources) -> Result<(), Error> {
    let api: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(ctx.client.clone(), &res.namespace);
    for name in res.secret_names() {
        let got = api
            .get_opt(&name)
            .await
            .map_err(api_err(format!("Secret {name}")))?;
        match got {
            Some(s) => {
                res.secrets.insert(name, secret_values(&s));
            }
            None => ctx.metrics.error("secret"),
        }
    }
    Ok(())
}

fn eep_resource() -> ApiResource {
    let gvk = GroupVersionKind::gvk("gateway.envoyproxy.io", "v1alpha1", "EnvoyExtensionPolicy");
    ApiResource::from_gvk_with_plural(&gvk, "envoyextensionpolicies")
}

async fn apply_targets(ctx: &Context, res: &Resources, present: &BTreeSet<TargetRef>) -> Outcomes {
    let mut out = Outcomes {
        namespace: res.namespace.clone(),
        ..Outcomes::default()
    };
    for target in kvasir_api::targets(res) {
        let outcome = match kvasir_api::compile(res, &target, &ctx.settings.options) {
            Ok(c) if !present.contains(&target) => {
                out.warnings.extend(c.warnings.iter().cloned());
                ctx.metrics.error("target");
                tracing::warn!(namespace = %res.namespace, %target, "target does not exist; nothing applied for it");
                Outcome::TargetNotFound
            }
            Ok(c) => {
                out.warnings.extend(c.warnings.iter().cloned());
                apply_target(ctx, &res.namespace, &target, &c.bytes).await
            }
            Err(findings) => {
                ctx.metrics.error("invalid");
                let first = findings
                    .iter()
                    .find(|f| f.severity == kvasir_policy::Severity::Error);
                if let Some(f) = first {
                    tracing::warn!(namespace = %res.namespace, %target, "not programmed, the last good configuration stays: {f}");
                }
                Outcome::Invalid(findings)
            }
        };
        out.targets.insert(target, outcome);
    }
    out
}

async fn apply_target(ctx: &Context, ns: &str, target: &TargetRef, config: &[u8]) -> Outcome {
    // The same function `kvasirctl compile --output envoyextensionpolicy`
    // prints through, so both write the same bytes.
    let bytes = match eep::to_json(ns, target, config, &ctx.settings.wasm) {
        Ok(b) => b,
        Err(e) => return Outcome::Failed(format!("cannot build the policy: {e}")),
    };
    let raw = match String::from_utf8(bytes).map(RawValue::from_string) {
        Ok(Ok(raw)) => raw,
        _ => return Outcome::Failed("the policy is not JSON text".into()),
    };
    let name = eep::name(target);
    let api = dynamic(ctx, ns, &eep_resource());
    let pp = PatchParams::apply(FIELD_MANAGER);
    match api.patch(&name, &pp, &Patch::Apply(&raw)).await {
        Ok(applied) => {
            let unix = jiff::Timestamp::now().as_millisecond() as f64 / 1000.0;
            ctx.metrics
                .programmed(ns, &target.to_string(), config.len(), unix);
            // The object the API server returns carries the status Envoy
            // Gateway wrote on it: read back, so that a policy it refuses
            // is not reported as in force.
            let gateway = serde_json::to_value(&applied)
                .map(|v| plan::gateway_verdict(&v))
                .unwrap_or(GatewayVerdict::NotReported);
            if matches!(
                gateway,
                GatewayVerdict::NotAccepted { .. } | GatewayVerdict::Overridden { .. }
            ) {
                ctx.metrics.error("gateway");
                tracing::warn!(namespace = ns, %target, policy = %name, ?gateway, "Envoy Gateway does not run the policy as written");
            } else {
                tracing::info!(namespace = ns, %target, policy = %name, bytes = config.len(), ?gateway, "programmed");
            }
            Outcome::Applied {
                policy: name,
                hash: eep::sha256_hex(config),
                gateway,
            }
        }
        Err(kube::Error::Api(s)) if s.is_conflict() => {
            ctx.metrics.error("conflict");
            tracing::warn!(namespace = ns, %target, "apply conflict: {}", s.message);
            Outcome::Conflicted(format!(
                "EnvoyExtensionPolicy {name} has fields another manager owns; remove that manager's copy (the controller does not force): {}",
                s.message
            ))
        }
        Err(e) => Outcome::Failed(format!("applying EnvoyExtensionPolicy {name}: {e}")),
    }
}

/// The target of a policy this controller wrote: its `spec.targetRefs`
/// (the label may hold a shortened name), else its labels.
fn target_of(o: &DynamicObject) -> Option<TargetRef> {
    if let Some(t) = eep::target_of(&o.data) {
        return Some(t);
    }
    let labels = o.labels();
    let kind = match labels.get(eep::TARGET_KIND_LABEL)?.as_str() {
        "Gateway" => TargetKind::Gateway,
        "HTTPRoute" => TargetKind::HttpRoute,
        _ => return None,
    };
    Some(TargetRef::new(
        kind,
        labels.get(eep::TARGET_NAME_LABEL)?.clone(),
    ))
}

/// Deletes the policies this controller wrote for targets no settings or
/// policy names any more (their filter must not outlive them).
async fn delete_stale(ctx: &Context, ns: &str, outcomes: &Outcomes) -> Result<(), Error> {
    let api = dynamic(ctx, ns, &eep_resource());
    let lp = ListParams::default().labels(&format!("{MANAGED_BY_LABEL}={FIELD_MANAGER}"));
    let list = api
        .list(&lp)
        .await
        .map_err(api_err("listing EnvoyExtensionPolicies"))?;
    // A target that does not exist keeps no policy: one written while it
    // existed is deleted with it.
    let wanted: BTreeSet<&TargetRef> = outcomes
        .targets
        .iter()
        .filter(|(_, o)| !matches!(o, Outcome::TargetNotFound))
        .map(|(t, _)| t)
        .collect();
    for o in list.items {
        let Some(target) = target_of(&o) else {
            continue;
        };
        if wanted.contains(&target) {
            continue;
        }
        let name = o.name_any();
        match api.delete(&name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_not_found() => {}
            Err(e) => return Err(api_err(format!("deleting EnvoyExtensionPolicy {name}"))(e)),
        }
        ctx.metrics.target_removed(ns, &target.to_string());
        tracing::info!(namespace = ns, %target, policy = %name, "target gone; policy deleted");
    }
    Ok(())
}

/// Writes the indexer's pools file and, when it changed, rolls the indexer
/// Deployment of that name if the namespace runs one.
/// Failures here do not stop the filter's configuration: they are logged,
/// counted and retried on the next reconcile.
async fn write_pools(ctx: &Context, res: &Resources) {
    let Some(cm) = &ctx.settings.pools_configmap else {
        return;
    };
    let ns = &res.namespace;
    let pools = match kvasir_api::indexer::indexer_pools(res) {
        Ok(p) => p,
        Err(findings) => {
            ctx.metrics.error("invalid");
            for f in findings {
                tracing::warn!(namespace = %ns, "indexer pools: {f}");
            }
            return;
        }
    };
    let hash = pools.sha256();
    let written = ctx
        .pools_written
        .lock()
        .ok()
        .and_then(|m| m.get(ns).cloned());
    if written.as_deref() == Some(hash.as_str()) {
        return;
    }
    let pp = PatchParams::apply(FIELD_MANAGER);
    let body = json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": cm, "namespace": ns, "labels": {MANAGED_BY_LABEL: FIELD_MANAGER}},
        "data": {POOLS_KEY: pools.to_yaml()},
    });
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(ctx.client.clone(), ns);
    if let Err(e) = cms.patch(cm, &pp, &Patch::Apply(&body)).await {
        ctx.metrics.error("api");
        tracing::warn!(namespace = %ns, "writing ConfigMap {cm}: {e}");
        return;
    }
    if let Some(dep) = &ctx.settings.indexer_deployment {
        // A merge patch, not an apply: an apply would try to create the
        // Deployment where none runs, and then there is nothing to roll.
        let body = json!({"spec": {"template": {"metadata": {"annotations": {POOLS_HASH_ANNOTATION: hash}}}}});
        let mp = merge_params();
        let deps: Api<k8s_openapi::api::apps::v1::Deployment> =
            Api::namespaced(ctx.client.clone(), ns);
        match deps.patch(dep, &mp, &Patch::Merge(&body)).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.is_not_found() => {
                tracing::debug!(namespace = %ns, "no Deployment {dep} here to roll");
            }
            Err(e) => {
                ctx.metrics.error("api");
                tracing::warn!(namespace = %ns, "rolling Deployment {dep}: {e}");
                return;
            }
        }
    }
    if let Ok(mut m) = ctx.pools_written.lock() {
        m.insert(ns.clone(), hash);
    }
}

async fn write_statuses(
    ctx: &Context,
    ns: &str,
    entries: &[Entry],
    outcomes: &Outcomes,
    now: &str,
) -> Result<(), Error> {
    let mut first = None;
    for e in entries.iter().filter(|e| !e.object.deleting) {
        let conditions = plan::conditions(&e.object, outcomes, now);
        let ancestors = plan::ancestors(&e.object, outcomes, now);
        if !plan::status_changed(&e.object.conditions, &conditions)
            && !plan::ancestors_changed(&e.object.ancestors, &ancestors)
        {
            continue;
        }
        let api = dynamic(ctx, ns, &e.resource);
        // A merge patch replaces both lists whole; kinds without targets
        // carry no `ancestors`.
        let patch = if e.object.targets.is_some() {
            json!({"status": {"conditions": conditions, "ancestors": ancestors}})
        } else {
            json!({"status": {"conditions": conditions}})
        };
        let r = api
            .patch_status(&e.object.id.name, &merge_params(), &Patch::Merge(&patch))
            .await;
        match r {
            Ok(_) => {}
            // Deleted meanwhile: its watch event brings another reconcile.
            Err(kube::Error::Api(s)) if s.is_not_found() => {}
            Err(err) => {
                first.get_or_insert(api_err(format!("status of {}", e.object.id))(err));
            }
        }
    }
    first.map_or(Ok(()), Err)
}
