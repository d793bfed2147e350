//! Discovery: an `InferencePool` (`inference.networking.k8s.io/v1`) ->
//! the engine endpoints the indexer subscribes to.
//!
//! Two layers, so the rules are testable without a cluster:
//! - [`endpoints_for`]: pure; pool + pods + defaults -> sorted
//!   [`EndpointSpec`](crate::types::EndpointSpec)s and the pods skipped, with why.
//! - [`watch_pool`]: watches the pool and its pods through the API server
//!   and keeps a `tokio::sync::watch` channel holding the current set.
//! - [`kv_event_sources`]: where an engine publishes its KV events, read from
//!   the engine itself (vLLM's `GET /kv_event_sources`) for endpoints given
//!   without an events address; the subscriber asks it.
//!
//! RBAC the indexer's ServiceAccount needs in the pool's namespace: `get`,
//! `list`, `watch` on `inferencepools.inference.networking.k8s.io` and on
//! `pods`.

mod endpoints;
pub mod kv_event_sources;
mod pool;
mod watch;

pub use endpoints::{
    endpoints_for, DiscoveryDefaults, SkipKind, SkipReason, ANNOTATION_EVENTS_PORT,
    ANNOTATION_REPLAY_PORT, ANNOTATION_TOPIC,
};
pub use kv_event_sources::{EngineSource, ResolvedSource, SourceError};
pub use pool::{
    EndpointPickerRef, InferencePool, InferencePoolSpec, PoolPort, PoolSelector, API_VERSION,
    GROUP, KIND, PLURAL, VERSION,
};
pub use watch::watch_pool;

/// Why discovery cannot produce endpoints.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The pool (or the InferencePool CRD itself) does not exist.
    #[error(
        "InferencePool {namespace}/{name} not found (is the name right, and is the \
         inference.networking.k8s.io/v1 CRD installed?)"
    )]
    PoolNotFound {
        /// Namespace looked in.
        namespace: String,
        /// Pool name looked for.
        name: String,
    },
    /// RBAC denies a request discovery needs.
    #[error(
        "forbidden to {verb} {resource} in namespace {namespace}: {message} (the indexer's \
         ServiceAccount needs get/list/watch on inferencepools.inference.networking.k8s.io \
         and pods)"
    )]
    Forbidden {
        /// `get`, `list` or `watch`.
        verb: &'static str,
        /// `inferencepools` or `pods`.
        resource: &'static str,
        /// Namespace of the request.
        namespace: String,
        /// The API server's message.
        message: String,
    },
    /// The pool's selector cannot be used.
    #[error("InferencePool {namespace}/{name} has an unusable selector: {reason}")]
    BadSelector {
        /// Pool namespace.
        namespace: String,
        /// Pool name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The pool's target ports cannot be used.
    #[error("InferencePool {namespace}/{name} has unusable targetPorts: {reason}")]
    BadTargetPorts {
        /// Pool namespace.
        namespace: String,
        /// Pool name.
        name: String,
        /// What is wrong with them.
        reason: String,
    },
    /// Any other failed API request.
    #[error(
        "Kubernetes API request to {verb} {resource} in namespace {namespace} failed: {source}"
    )]
    Api {
        /// `get`, `list` or `watch`.
        verb: &'static str,
        /// `inferencepools` or `pods`.
        resource: &'static str,
        /// Namespace of the request.
        namespace: String,
        /// kube's error.
        #[source]
        source: Box<kube::Error>,
    },
    /// A watch stream finished, which kube's watcher never does on its own.
    #[error("the {what} watch stream ended unexpectedly")]
    WatchEnded {
        /// `inferencepools` or `pods`.
        what: &'static str,
    },
}

impl DiscoveryError {
    /// Classify a kube error from a request for `resource` (named `name`).
    fn from_kube(
        e: kube::Error,
        verb: &'static str,
        resource: &'static str,
        namespace: &str,
        name: &str,
    ) -> Self {
        match &e {
            kube::Error::Api(s) if s.code == 404 => DiscoveryError::PoolNotFound {
                namespace: namespace.to_string(),
                name: name.to_string(),
            },
            kube::Error::Api(s) if s.code == 403 || s.code == 401 => DiscoveryError::Forbidden {
                verb,
                resource,
                namespace: namespace.to_string(),
                message: s.message.clone(),
            },
            _ => DiscoveryError::Api {
                verb,
                resource,
                namespace: namespace.to_string(),
                source: Box::new(e),
            },
        }
    }

    /// Classify a watcher error (only called for 401/403).
    fn from_watcher(
        e: kube::runtime::watcher::Error,
        resource: &'static str,
        namespace: &str,
    ) -> Self {
        use kube::runtime::watcher::Error as W;
        let (verb, message) = match &e {
            W::InitialListFailed(k) => ("list", kube_message(k)),
            W::WatchStartFailed(k) | W::WatchFailed(k) => ("watch", kube_message(k)),
            W::WatchError(s) => ("watch", s.message.clone()),
            other => ("watch", other.to_string()),
        };
        DiscoveryError::Forbidden {
            verb,
            resource,
            namespace: namespace.to_string(),
            message,
        }
    }
}

fn kube_message(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => s.message.clone(),
        other => other.to_string(),
    }
}
