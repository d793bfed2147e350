//! The watches and the work loop. Every change to a watched object marks
//! its namespace dirty; the leader reconciles dirty namespaces one at a
//! time (a namespace is the unit: its targets share tenants, pools and
//! providers), retries failed ones with backoff, and resyncs every
//! namespace periodically. A replica that does not lead keeps its caches
//! warm and writes nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt as _, Stream, StreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::api::DynamicObject;
use kube::core::{ApiResource, GroupVersionKind, PartialObjectMeta};
use kube::runtime::reflector::{self, Store};
use kube::runtime::utils::Backoff;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource, ResourceExt};
use kvasir_api::eep::{FIELD_MANAGER, MANAGED_BY_LABEL};
use kvasir_api::routes::{Gateway, HttpRoute};
use kvasir_api::{
    InferencePolicy, InferencePool, InferenceProvider, InferenceSettings, InferenceTenant,
    TargetKind, TargetRef,
};
use serde::de::DeserializeOwned;
use tokio::sync::{mpsc, watch};

use crate::reconcile::{self, Context, Snapshot};

/// How the loop paces itself.
#[derive(Debug, Clone)]
pub struct Timing {
    /// Changes arriving within this window are reconciled together.
    pub debounce: Duration,
    /// Every namespace is reconciled at least this often (a conflicting
    /// owner that went away, a Secret edited while no watch event came).
    pub resync: Duration,
    /// First retry delay after a failed reconcile; doubles up to `max`.
    pub retry_min: Duration,
    /// Longest retry delay.
    pub retry_max: Duration,
}

impl Default for Timing {
    fn default() -> Timing {
        Timing {
            debounce: Duration::from_millis(200),
            resync: Duration::from_secs(300),
            retry_min: Duration::from_secs(1),
            retry_max: Duration::from_secs(60),
        }
    }
}

/// The caches of every watched kind.
#[derive(Clone)]
pub struct Stores {
    policies: Store<InferencePolicy>,
    tenants: Store<InferenceTenant>,
    providers: Store<InferenceProvider>,
    settings: Store<InferenceSettings>,
    pools: Store<InferencePool>,
    gateways: Store<PartialObjectMeta<Gateway>>,
    routes: Store<PartialObjectMeta<HttpRoute>>,
}

fn names_in<K: Resource + Clone>(store: &Store<K>, ns: &str) -> Vec<String>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    store
        .state()
        .iter()
        .filter(|o| o.meta().namespace.as_deref() == Some(ns))
        .filter_map(|o| o.meta().name.clone())
        .collect()
}

fn in_ns<K: Resource + Clone>(store: &Store<K>, ns: &str) -> Vec<K>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    let mut v: Vec<K> = store
        .state()
        .iter()
        .filter(|o| o.meta().namespace.as_deref() == Some(ns))
        .map(|o| (**o).clone())
        .collect();
    v.sort_by(|a, b| a.meta().name.cmp(&b.meta().name));
    v
}

impl Stores {
    /// A namespace's objects as cached now.
    pub fn snapshot(&self, ns: &str) -> Snapshot {
        let gateways = names_in(&self.gateways, ns)
            .into_iter()
            .map(|n| TargetRef::new(TargetKind::Gateway, n));
        let routes = names_in(&self.routes, ns)
            .into_iter()
            .map(|n| TargetRef::new(TargetKind::HttpRoute, n));
        Snapshot {
            resources: kvasir_api::Resources {
                namespace: ns.to_owned(),
                policies: in_ns(&self.policies, ns),
                tenants: in_ns(&self.tenants, ns),
                providers: in_ns(&self.providers, ns),
                settings: in_ns(&self.settings, ns),
                pools: in_ns(&self.pools, ns),
                secrets: Default::default(),
            },
            present: gateways.chain(routes).collect(),
        }
    }

    /// Every namespace that holds a watched object.
    pub fn namespaces(&self) -> BTreeSet<String> {
        fn add<K: Resource + Clone>(s: &Store<K>, out: &mut BTreeSet<String>)
        where
            K::DynamicType: Eq + std::hash::Hash + Clone,
        {
            out.extend(s.state().iter().filter_map(|o| o.meta().namespace.clone()));
        }
        let mut out = BTreeSet::new();
        add(&self.policies, &mut out);
        add(&self.tenants, &mut out);
        add(&self.providers, &mut out);
        add(&self.settings, &mut out);
        add(&self.pools, &mut out);
        out
    }

    /// Whether some tenant of `ns` names the Secret `name`.
    fn secret_used(&self, ns: &str, name: &str) -> bool {
        self.tenants.state().iter().any(|t| {
            t.meta().namespace.as_deref() == Some(ns)
                && t.spec
                    .identity
                    .api_keys
                    .as_ref()
                    .is_some_and(|k| k.secret_ref.name == name)
        })
    }

    async fn wait_until_ready(&self) -> bool {
        self.policies.wait_until_ready().await.is_ok()
            && self.tenants.wait_until_ready().await.is_ok()
            && self.providers.wait_until_ready().await.is_ok()
            && self.settings.wait_until_ready().await.is_ok()
            && self.pools.wait_until_ready().await.is_ok()
            && self.gateways.wait_until_ready().await.is_ok()
            && self.routes.wait_until_ready().await.is_ok()
    }
}

type Touches = std::pin::Pin<Box<dyn Stream<Item = String> + Send>>;

fn apis<K>(client: &Client, namespaces: &[String]) -> Vec<Api<K>>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
    K::DynamicType: Default,
{
    if namespaces.is_empty() {
        vec![Api::all(client.clone())]
    } else {
        namespaces
            .iter()
            .map(|ns| Api::namespaced(client.clone(), ns))
            .collect()
    }
}

/// A reflected watch of `K` in `namespaces` (all when empty): its store,
/// and the namespaces its events touch.
fn reflect<K>(client: &Client, namespaces: &[String]) -> (Store<K>, Touches)
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static,
{
    let (reader, writer) = reflector::store();
    let streams = apis::<K>(client, namespaces).into_iter().map(|api| {
        watcher(api, watcher::Config::default())
            .backoff(WatchBackoff::default())
            .boxed()
    });
    let merged = futures::stream::select_all(streams);
    let touched = reflector::reflector(writer, merged)
        .touched_objects()
        .filter_map(|r| async move {
            match r {
                Ok(o) => o.meta().namespace.clone(),
                Err(e) => {
                    tracing::warn!("watch {}: {e}", K::kind(&()));
                    None
                }
            }
        });
    (reader, touched.boxed())
}

/// A metadata-only reflected watch of `K` (whether an object exists is
/// all that is read): its store, and the namespaces its events touch.
fn reflect_meta<K>(client: &Client, namespaces: &[String]) -> (Store<PartialObjectMeta<K>>, Touches)
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + Sync
        + 'static,
{
    let (reader, writer) = reflector::store::<PartialObjectMeta<K>>();
    let streams = apis::<PartialObjectMeta<K>>(client, namespaces)
        .into_iter()
        .map(|api| {
            watcher(api, watcher::Config::default())
                .backoff(WatchBackoff::default())
                .boxed()
        });
    let merged = futures::stream::select_all(streams);
    let touched = reflector::reflector(writer, merged)
        .touched_objects()
        .filter_map(|r| async move {
            match r {
                Ok(o) => o.metadata.namespace.clone(),
                Err(e) => {
                    tracing::warn!("watch {}: {e}", K::kind(&()));
                    None
                }
            }
        });
    (reader, touched.boxed())
}

/// The EnvoyExtensionPolicies this controller wrote (by label), metadata
/// only: a deleted one, an edit by someone else, or a status Envoy Gateway
/// wrote marks its namespace, so the policy is recreated and the verdict
/// read back within a reconcile, not at the next resync.
fn policy_touches(client: &Client, namespaces: &[String]) -> Touches {
    let gvk = GroupVersionKind::gvk("gateway.envoyproxy.io", "v1alpha1", "EnvoyExtensionPolicy");
    let ar = ApiResource::from_gvk_with_plural(&gvk, "envoyextensionpolicies");
    let apis: Vec<Api<PartialObjectMeta<DynamicObject>>> = if namespaces.is_empty() {
        vec![Api::all_with(client.clone(), &ar)]
    } else {
        namespaces
            .iter()
            .map(|ns| Api::namespaced_with(client.clone(), ns, &ar))
            .collect()
    };
    let cfg = watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={FIELD_MANAGER}"));
    let streams = apis.into_iter().map(|api| {
        watcher(api, cfg.clone())
            .backoff(WatchBackoff::default())
            .boxed()
    });
    futures::stream::select_all(streams)
        .touched_objects()
        .filter_map(|r| async move {
            match r {
                Ok(o) => o.metadata.namespace.clone(),
                Err(e) => {
                    tracing::warn!("watch EnvoyExtensionPolicy: {e}");
                    None
                }
            }
        })
        .boxed()
}

/// Secrets: metadata only (the controller GETs the few it needs), and
/// only changes to Secrets a tenant names mark a namespace.
fn secret_touches(client: &Client, namespaces: &[String], stores: Stores) -> Touches {
    let streams = apis::<PartialObjectMeta<Secret>>(client, namespaces)
        .into_iter()
        .map(|api| {
            watcher(api, watcher::Config::default())
                .backoff(WatchBackoff::default())
                .boxed()
        });
    futures::stream::select_all(streams)
        .touched_objects()
        .filter_map(move |r| {
            let stores = stores.clone();
            async move {
                let o = r.ok()?;
                let ns = o.namespace()?;
                stores.secret_used(&ns, &o.name_any()).then_some(ns)
            }
        })
        .boxed()
}

/// Starts every watch. The returned stream yields each touched namespace;
/// it must be polled for the caches to fill.
pub fn watch_all(client: &Client, namespaces: &[String]) -> (Stores, Touches) {
    let (policies, a) = reflect::<InferencePolicy>(client, namespaces);
    let (tenants, b) = reflect::<InferenceTenant>(client, namespaces);
    let (providers, c) = reflect::<InferenceProvider>(client, namespaces);
    let (settings, d) = reflect::<InferenceSettings>(client, namespaces);
    let (pools, e) = reflect::<InferencePool>(client, namespaces);
    let (gateways, g) = reflect_meta::<Gateway>(client, namespaces);
    let (routes, h) = reflect_meta::<HttpRoute>(client, namespaces);
    let stores = Stores {
        policies,
        tenants,
        providers,
        settings,
        pools,
        gateways,
        routes,
    };
    let f = secret_touches(client, namespaces, stores.clone());
    let i = policy_touches(client, namespaces);
    let all = futures::stream::select_all([a, b, c, d, e, f, g, h, i]);
    (stores, all.boxed())
}

fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .map_or_else(|_| jiff::Timestamp::now().to_string(), |t| t.to_string())
}

/// Runs until `shutdown`: feeds the caches, sets `ready` once every watch
/// has listed, and reconciles while `leading` is true.
pub async fn run(
    ctx: Arc<Context>,
    namespaces: Vec<String>,
    timing: Timing,
    mut leading: watch::Receiver<bool>,
    ready: watch::Sender<bool>,
    shutdown: impl Future<Output = ()>,
) {
    let (stores, mut touches) = watch_all(&ctx.client, &namespaces);
    let (retry_tx, mut retry_rx) = mpsc::unbounded_channel::<String>();
    let mut dirty: BTreeSet<String> = BTreeSet::new();
    let mut failures: BTreeMap<String, u32> = BTreeMap::new();
    let mut resync = tokio::time::interval(timing.resync);
    let ready_wait = {
        let stores = stores.clone();
        async move { stores.wait_until_ready().await }
    };
    tokio::pin!(ready_wait, shutdown);
    let mut is_ready = false;
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            Some(ns) = touches.next() => { dirty.insert(ns); }
            Some(ns) = retry_rx.recv() => { dirty.insert(ns); }
            ok = &mut ready_wait, if !is_ready => {
                is_ready = true;
                let _ = ready.send(ok);
                dirty.extend(stores.namespaces());
            }
            _ = resync.tick() => dirty.extend(stores.namespaces()),
            changed = leading.changed() => {
                if changed.is_err() { break; }
                // A new leader starts from the caches, not from events it
                // saw while following.
                dirty.extend(stores.namespaces());
            }
        }
        if !is_ready || !*leading.borrow() || dirty.is_empty() {
            continue;
        }
        // Let a burst of events settle into one reconcile.
        tokio::time::sleep(timing.debounce).await;
        while let Some(Some(ns)) = touches.next().now_or_never() {
            dirty.insert(ns);
        }
        for ns in std::mem::take(&mut dirty) {
            if !*leading.borrow() {
                dirty.insert(ns);
                continue;
            }
            let snap = stores.snapshot(&ns);
            let mut lost = leading.clone();
            let now = now_rfc3339();
            // Leadership lost mid-reconcile: stop before the next write
            // (each write on its own is atomic and repeatable), and leave
            // the namespace to the new leader.
            let result = tokio::select! {
                r = reconcile::reconcile(&ctx, &snap, &now) => r,
                _ = lost.wait_for(|l| !*l) => {
                    dirty.insert(ns);
                    continue;
                }
            };
            match result {
                Ok(_) => {
                    failures.remove(&ns);
                }
                Err(e) => {
                    let n = failures.entry(ns.clone()).or_insert(0);
                    *n += 1;
                    let delay = backoff(&timing, *n);
                    tracing::warn!(namespace = %ns, "reconcile failed (retry in {delay:?}): {e}");
                    let tx = retry_tx.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        let _ = tx.send(ns);
                    });
                }
            }
        }
    }
}

/// The watches' backoff after an error: 500 ms, doubling, at most 5 s;
/// back to 500 ms at the first event that arrives (kube's stream resets it
/// on any success). kube's default grows to 30 s and is not reset by the
/// errors that follow an outage, so after a minute without the API server
/// the watches came back in two of its longest steps (the reconnect, then
/// the relist its expired resource version forces): an edit made just
/// after the server returned waited about 35 s. A handful of namespaced
/// watches relisting every 5 s at worst is little load on a server that
/// is back.
#[derive(Debug, Clone)]
pub struct WatchBackoff {
    next: Duration,
}

impl WatchBackoff {
    const MIN: Duration = Duration::from_millis(500);
    const MAX: Duration = Duration::from_secs(5);
}

impl Default for WatchBackoff {
    fn default() -> Self {
        Self { next: Self::MIN }
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let d = self.next;
        self.next = (d * 2).min(Self::MAX);
        Some(d)
    }
}

impl Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.next = Self::MIN;
    }
}

/// `retry_min * 2^(n-1)`, at most `retry_max`.
pub fn backoff(t: &Timing, failures: u32) -> Duration {
    let factor = 2u32.saturating_pow(failures.saturating_sub(1).min(16));
    t.retry_min.saturating_mul(factor).min(t.retry_max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watch_backoff_caps_at_5_s_and_resets() {
        let mut b = WatchBackoff::default();
        let steps: Vec<u64> = b.by_ref().take(6).map(|d| d.as_millis() as u64).collect();
        assert_eq!(steps, [500, 1000, 2000, 4000, 5000, 5000]);
        b.reset();
        assert_eq!(b.next(), Some(Duration::from_millis(500)));
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let t = Timing::default();
        assert_eq!(backoff(&t, 1), Duration::from_secs(1));
        assert_eq!(backoff(&t, 3), Duration::from_secs(4));
        assert_eq!(backoff(&t, 40), Duration::from_secs(60));
    }
}
