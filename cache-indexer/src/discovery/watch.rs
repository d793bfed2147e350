//! The Kubernetes side: watch one pool and its pods, publish endpoint sets.

use super::endpoints::{endpoints_for, DiscoveryDefaults, SkipReason};
use super::pool::InferencePool;
use super::DiscoveryError;
use crate::types::EndpointSpec;
use futures::stream::{self, BoxStream, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use std::collections::{BTreeMap, BTreeSet};
use tokio::sync::watch;

/// Pods of one selector as last seen by a watcher, applied event by event.
///
/// Mirrors what `kube::runtime::reflector` does, kept here so discovery can
/// tell "not listed yet" (publish nothing: a half-read list would drop
/// endpoints that are fine) from "listed, and empty".
#[derive(Debug, Default)]
pub(crate) struct PodCache {
    live: BTreeMap<String, Pod>,
    relisting: Option<BTreeMap<String, Pod>>,
    synced: bool,
}

impl PodCache {
    /// Apply one watcher event; true when the live set may have changed and
    /// is complete (worth recomputing endpoints).
    pub(crate) fn apply(&mut self, event: Event<Pod>) -> bool {
        match event {
            Event::Init => {
                // A relist starts: buffer it, swap at InitDone, so pods that
                // vanished while the watch was down disappear at once.
                self.relisting = Some(BTreeMap::new());
                false
            }
            Event::InitApply(pod) => {
                let key = pod_key(&pod);
                self.relisting
                    .get_or_insert_with(BTreeMap::new)
                    .insert(key, pod);
                false
            }
            Event::InitDone => {
                self.live = self.relisting.take().unwrap_or_default();
                self.synced = true;
                true
            }
            Event::Apply(pod) => {
                self.live.insert(pod_key(&pod), pod);
                self.synced
            }
            Event::Delete(pod) => {
                self.live.remove(&pod_key(&pod));
                self.synced
            }
        }
    }

    /// Whether a full list has been seen.
    pub(crate) fn is_synced(&self) -> bool {
        self.synced
    }

    /// The pods currently known, by name.
    pub(crate) fn pods(&self) -> Vec<Pod> {
        self.live.values().cloned().collect()
    }
}

fn pod_key(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

/// What a pool watcher event means for discovery.
enum PoolChange {
    None,
    Updated(Box<InferencePool>),
    Deleted,
}

/// Tracks the single pool a name-filtered watcher reports.
#[derive(Default)]
struct PoolTracker {
    seen_in_relist: bool,
}

impl PoolTracker {
    fn apply(&mut self, event: Event<InferencePool>) -> PoolChange {
        match event {
            Event::Init => {
                self.seen_in_relist = false;
                PoolChange::None
            }
            Event::InitApply(p) => {
                self.seen_in_relist = true;
                PoolChange::Updated(Box::new(p))
            }
            // A relist that did not contain the pool: it was deleted while
            // the watch was down, and no Delete event will ever come.
            Event::InitDone if !self.seen_in_relist => PoolChange::Deleted,
            Event::InitDone => PoolChange::None,
            Event::Apply(p) => PoolChange::Updated(Box::new(p)),
            Event::Delete(_) => PoolChange::Deleted,
        }
    }
}

/// Watch the `InferencePool` `namespace/pool_name` and its pods, and keep
/// `tx` holding the pool's current endpoint set (see
/// [`endpoints_for`](super::endpoints_for)).
///
/// First GETs the pool, so a missing pool, a missing CRD, missing RBAC or
/// an unusable selector fail at once with a clear [`DiscoveryError`]. Then
/// watches the pool (by `metadata.name` field selector) and its pods (by
/// the pool's label selector, server side), recomputing the set on every
/// change; nothing is sent before the pod list has been read in full. When the pool's selector changes, the pod
/// watch restarts with the new one; when the pool is deleted, the set
/// becomes empty until the pool comes back.
///
/// Transient API errors after startup are retried with kube's default
/// backoff (and logged); a 403 on the first list of pods or pools is
/// returned as [`DiscoveryError::Forbidden`], since retrying cannot fix
/// RBAC. A pool later edited into an unusable one (the API server's CRD
/// validation makes this all but impossible) returns its
/// [`DiscoveryError::BadSelector`] / [`DiscoveryError::BadTargetPorts`]:
/// guessing which pods it meant would be worse. Returns `Ok(())` once
/// every receiver of `tx` is gone.
///
/// The first complete set is always sent, even when it equals `tx`'s
/// initial value (e.g. both empty), so `changed()` on a receiver doubles as
/// "discovery has listed the pool once"; later sets only when they differ.
pub async fn watch_pool(
    client: Client,
    namespace: &str,
    pool_name: &str,
    defaults: DiscoveryDefaults,
    tx: watch::Sender<Vec<EndpointSpec>>,
) -> Result<(), DiscoveryError> {
    let pools: Api<InferencePool> = Api::namespaced(client.clone(), namespace);
    let pods: Api<Pod> = Api::namespaced(client, namespace);

    let first = pools
        .get(pool_name)
        .await
        .map_err(|e| DiscoveryError::from_kube(e, "get", "inferencepools", namespace, pool_name))?;
    first.validate()?;
    let mut current = Some(first);

    let pool_config = watcher::Config::default().fields(&format!("metadata.name={pool_name}"));
    let mut pool_events = watcher::watcher(pools, pool_config)
        .default_backoff()
        .boxed();
    let mut pool_tracker = PoolTracker::default();
    let mut pools_synced = false;
    let mut out = Publisher {
        tx,
        sent_once: false,
        warned: BTreeSet::new(),
    };

    loop {
        // (Re)start the pod watch for the current selector.
        let selector = current
            .as_ref()
            .map(InferencePool::label_selector)
            .transpose()?;
        let mut pod_events: BoxStream<'static, Result<Event<Pod>, watcher::Error>> = match &selector
        {
            Some(sel) => {
                tracing::info!(namespace, pool = pool_name, selector = %sel, "watching pool pods");
                watcher::watcher(pods.clone(), watcher::Config::default().labels(sel))
                    // Discovery reads only metadata and status.conditions /
                    // podIP; spec and managedFields are most of a pod's
                    // bytes, and every recompute clones the cached pods.
                    .modify(|pod| {
                        pod.metadata.managed_fields = None;
                        pod.spec = None;
                        if let Some(status) = pod.status.as_mut() {
                            status.container_statuses = None;
                            status.init_container_statuses = None;
                        }
                    })
                    .default_backoff()
                    .boxed()
            }
            None => stream::pending().boxed(),
        };
        let mut cache = PodCache::default();

        'pods: loop {
            tokio::select! {
                () = out.tx.closed() => return Ok(()),
                event = pool_events.next() => {
                    let event = match event {
                        None => return Err(DiscoveryError::WatchEnded { what: "inferencepools" }),
                        Some(Err(e)) => {
                            if !pools_synced && is_forbidden(&e) {
                                return Err(DiscoveryError::from_watcher(e, "inferencepools", namespace));
                            }
                            tracing::warn!(namespace, pool = pool_name, error = %e, "InferencePool watch error; retrying");
                            continue 'pods;
                        }
                        Some(Ok(event)) => event,
                    };
                    if matches!(event, Event::InitDone) {
                        pools_synced = true;
                    }
                    match pool_tracker.apply(event) {
                        PoolChange::None => {}
                        PoolChange::Deleted => {
                            if current.take().is_some() {
                                tracing::warn!(namespace, pool = pool_name, "InferencePool deleted; no endpoints until it is back");
                                out.publish(Vec::new());
                                break 'pods;
                            }
                        }
                        PoolChange::Updated(pool) => {
                            let pool = *pool;
                            if current.as_ref().is_some_and(|c| c.spec == pool.spec) {
                                continue 'pods;
                            }
                            pool.validate()?;
                            let restart = current
                                .as_ref()
                                .is_none_or(|c| c.spec.selector != pool.spec.selector);
                            tracing::info!(namespace, pool = pool_name, restart, "InferencePool changed");
                            current = Some(pool);
                            if restart {
                                break 'pods;
                            }
                            if let Some(pool) = &current {
                                if cache.is_synced() {
                                    out.recompute(pool, &cache, &defaults);
                                }
                            }
                        }
                    }
                }
                event = pod_events.next() => {
                    let event = match event {
                        None => return Err(DiscoveryError::WatchEnded { what: "pods" }),
                        Some(Err(e)) => {
                            if !cache.is_synced() && is_forbidden(&e) {
                                return Err(DiscoveryError::from_watcher(e, "pods", namespace));
                            }
                            tracing::warn!(namespace, pool = pool_name, error = %e, "pod watch error; retrying");
                            continue 'pods;
                        }
                        Some(Ok(event)) => event,
                    };
                    if cache.apply(event) {
                        if let Some(pool) = &current {
                            out.recompute(pool, &cache, &defaults);
                        }
                    }
                }
            }
        }
    }
}

/// Sends endpoint sets on the channel: the first unconditionally, then
/// only changes; warns once per newly misconfigured pod.
struct Publisher {
    tx: watch::Sender<Vec<EndpointSpec>>,
    sent_once: bool,
    warned: BTreeSet<SkipReason>,
}

impl Publisher {
    fn recompute(&mut self, pool: &InferencePool, cache: &PodCache, defaults: &DiscoveryDefaults) {
        let (endpoints, skipped) = endpoints_for(pool, &cache.pods(), defaults);
        let bad: BTreeSet<SkipReason> = skipped
            .into_iter()
            .filter(|s| s.kind.is_misconfiguration())
            .collect();
        // Warn on each reason the first time it appears, not on every
        // event: a misannotated pod would otherwise log on every unrelated
        // change.
        for reason in bad.difference(&self.warned) {
            tracing::warn!(%reason, "skipping pod");
        }
        self.warned = bad;
        self.publish(endpoints);
    }

    fn publish(&mut self, endpoints: Vec<EndpointSpec>) {
        let n = endpoints.len();
        let changed = if self.sent_once {
            self.tx.send_if_modified(|cur| {
                if *cur == endpoints {
                    false
                } else {
                    *cur = endpoints;
                    true
                }
            })
        } else {
            self.sent_once = true;
            self.tx.send_replace(endpoints);
            true
        };
        if changed {
            tracing::info!(endpoints = n, "endpoint set published");
        }
    }
}

fn watcher_status_code(e: &watcher::Error) -> Option<u16> {
    match e {
        watcher::Error::InitialListFailed(k)
        | watcher::Error::WatchStartFailed(k)
        | watcher::Error::WatchFailed(k) => match k {
            kube::Error::Api(s) => Some(s.code),
            _ => None,
        },
        watcher::Error::WatchError(s) => Some(s.code),
        _ => None,
    }
}

fn is_forbidden(e: &watcher::Error) -> bool {
    matches!(watcher_status_code(e), Some(401 | 403))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod(name: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.to_string()),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    fn names(cache: &PodCache) -> Vec<String> {
        cache.pods().iter().map(pod_key).collect()
    }

    #[test]
    fn pod_cache_publishes_nothing_before_the_first_full_list() {
        let mut c = PodCache::default();
        assert!(!c.apply(Event::Init));
        assert!(!c.apply(Event::InitApply(pod("a"))));
        assert!(!c.is_synced());
        assert!(names(&c).is_empty(), "a half-read list is not the live set");
        assert!(c.apply(Event::InitDone));
        assert_eq!(names(&c), ["a"]);
        assert!(c.apply(Event::Apply(pod("b"))));
        assert!(c.apply(Event::Delete(pod("a"))));
        assert_eq!(names(&c), ["b"]);
    }

    #[test]
    fn pod_cache_relist_drops_pods_missed_while_disconnected() {
        let mut c = PodCache::default();
        for e in [
            Event::Init,
            Event::InitApply(pod("a")),
            Event::InitApply(pod("b")),
            Event::InitDone,
        ] {
            c.apply(e);
        }
        // Watch broke; "a" was deleted meanwhile; the relist shows only b, c.
        assert!(!c.apply(Event::Init));
        assert_eq!(
            names(&c),
            ["a", "b"],
            "old set stays until the relist is complete"
        );
        c.apply(Event::InitApply(pod("b")));
        c.apply(Event::InitApply(pod("c")));
        assert!(c.apply(Event::InitDone));
        assert_eq!(names(&c), ["b", "c"]);
    }

    #[test]
    fn pool_missing_from_a_relist_counts_as_deleted() {
        let pool = InferencePool::default();
        let mut t = PoolTracker::default();
        assert!(matches!(t.apply(Event::Init), PoolChange::None));
        assert!(matches!(
            t.apply(Event::InitApply(pool.clone())),
            PoolChange::Updated(_)
        ));
        assert!(matches!(t.apply(Event::InitDone), PoolChange::None));
        assert!(matches!(t.apply(Event::Init), PoolChange::None));
        assert!(matches!(t.apply(Event::InitDone), PoolChange::Deleted));
        assert!(matches!(
            t.apply(Event::Apply(pool.clone())),
            PoolChange::Updated(_)
        ));
        assert!(matches!(t.apply(Event::Delete(pool)), PoolChange::Deleted));
    }
}
