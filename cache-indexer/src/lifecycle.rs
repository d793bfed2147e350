//! Start-up and shutdown of the gRPC side.
//!
//! * **Warm-up.** A pool is *warm* once its endpoint set is known (static,
//!   or discovery's first list) and one scrape round over it has finished.
//!   Before that the load view is empty, and an answer from it would say
//!   `NO_ENDPOINTS` / saturation 1, which a policy reads as a full pool:
//!   so `Pick` and `PoolState` of a cold pool, and `Session` until every
//!   pool is warm, answer `UNAVAILABLE` (the filter fails open without
//!   learning anything), and gRPC health stays `NOT_SERVING`.
//! * **Shutdown.** When the indexer's token is cancelled: health goes
//!   `NOT_SERVING` (`""` and `kvasir.v1.Indexer`), every open `Session`
//!   stops reading, answers the picks it holds and ends with `UNAVAILABLE`
//!   "shutting down" (the filter reopens it, on another replica if Envoy
//!   has one), new calls are refused with `UNAVAILABLE`, the listener
//!   closes, and in-flight calls get the grace period; then the server is
//!   dropped whatever is still open.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvasir_proto::v1 as pb;
use tokio_util::sync::CancellationToken;

use crate::auth::AuthMetrics;
use crate::metrics::Counter;
use crate::pools::Pools;
use crate::service::IndexerService;

/// A pool's warm-up state.
#[derive(Debug, Default)]
pub struct Warmup {
    known: AtomicBool,
    scraped: AtomicBool,
}

impl Warmup {
    /// Its endpoint set is known (static pools from the start; discovered
    /// ones at the first list).
    pub fn mark_known(&self) {
        self.known.store(true, Ordering::Release);
    }
    /// Whether the endpoint set is known.
    pub fn known(&self) -> bool {
        self.known.load(Ordering::Acquire)
    }
    /// A scrape round that began with the set known has finished.
    pub fn mark_scraped(&self) {
        self.scraped.store(true, Ordering::Release);
    }
    /// Whether the pool is warm.
    pub fn warm(&self) -> bool {
        self.scraped.load(Ordering::Acquire)
    }
}

/// Calls refused by the gRPC lifecycle, and auth refusals.
#[derive(Debug, Default)]
pub struct LifecycleMetrics {
    /// Calls refused while a pool was warming up.
    pub refused_warming_up: Counter,
    /// Calls refused after shutdown began.
    pub refused_shutting_down: Counter,
    /// Session streams ended by the shutdown.
    pub sessions_shut_down: Counter,
    /// Unauthenticated calls.
    pub auth: Arc<AuthMetrics>,
}

/// Warm-up of every pool and the shutdown token, shared by the gRPC
/// service, the scrape loops, the readiness loop and `/readyz`.
#[derive(Debug)]
pub struct Lifecycle {
    cancel: CancellationToken,
    pools: HashMap<String, Arc<Warmup>>,
    /// What was refused.
    pub metrics: LifecycleMetrics,
}

impl Lifecycle {
    /// One warm-up per pool, all cold; shutdown when `cancel` is cancelled.
    pub fn new(pools: &Pools, cancel: CancellationToken) -> Self {
        Lifecycle {
            cancel,
            pools: pools
                .iter()
                .map(|p| (p.name.clone(), Arc::default()))
                .collect(),
            metrics: LifecycleMetrics::default(),
        }
    }

    /// A pool's warm-up (a cold default for an unknown name).
    pub fn warmup(&self, pool: &str) -> Arc<Warmup> {
        self.pools.get(pool).cloned().unwrap_or_default()
    }

    /// Whether every pool is warm.
    pub fn all_warm(&self) -> bool {
        self.pools.values().all(|w| w.warm())
    }

    /// Names of pools not warm yet, sorted.
    pub fn cold_pools(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .pools
            .iter()
            .filter(|(_, w)| !w.warm())
            .map(|(n, _)| n.clone())
            .collect();
        v.sort();
        v
    }

    /// Whether shutdown has begun.
    pub fn shutting_down(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// `Err(UNAVAILABLE)` when a call for `pool` must not be served now:
    /// shutting down, or the pool is cold. Unknown pools pass (the service
    /// names them INVALID_ARGUMENT).
    fn gate(&self, pool: &str) -> Result<(), tonic::Status> {
        if self.shutting_down() {
            self.metrics.refused_shutting_down.inc();
            return Err(tonic::Status::unavailable("indexer shutting down"));
        }
        match self.pools.get(pool) {
            Some(w) if !w.warm() => {
                self.metrics.refused_warming_up.inc();
                Err(tonic::Status::unavailable(format!(
                    "pool `{pool}`: warming up (its endpoints have not been scraped yet)"
                )))
            }
            _ => Ok(()),
        }
    }

    /// `Err(UNAVAILABLE)` unless a new `Session` may open: not shutting
    /// down and every pool warm.
    fn gate_session(&self) -> Result<(), tonic::Status> {
        if self.shutting_down() {
            self.metrics.refused_shutting_down.inc();
            return Err(tonic::Status::unavailable("indexer shutting down"));
        }
        let cold = self.cold_pools();
        if !cold.is_empty() {
            self.metrics.refused_warming_up.inc();
            return Err(tonic::Status::unavailable(format!(
                "warming up: pools {cold:?} have not scraped their endpoints yet"
            )));
        }
        Ok(())
    }
}

/// `kvasir.v1.Indexer` with the lifecycle in front: refuses what must not
/// be served now, and ends `Session` streams at shutdown.
#[derive(Debug, Clone)]
pub struct GatedIndexer {
    inner: IndexerService,
    life: Arc<Lifecycle>,
}

impl GatedIndexer {
    /// `inner` behind `life`.
    pub fn new(inner: IndexerService, life: Arc<Lifecycle>) -> Self {
        GatedIndexer { inner, life }
    }
}

type Inner = IndexerService;

#[tonic::async_trait]
impl pb::indexer_server::Indexer for GatedIndexer {
    async fn pick(
        &self,
        request: tonic::Request<pb::PickRequest>,
    ) -> Result<tonic::Response<pb::PickResponse>, tonic::Status> {
        self.life.gate(&request.get_ref().pool)?;
        <Inner as pb::indexer_server::Indexer>::pick(&self.inner, request).await
    }

    /// Reports are applied even while shutting down: they only release.
    async fn report(
        &self,
        request: tonic::Request<pb::ReportRequest>,
    ) -> Result<tonic::Response<pb::ReportResponse>, tonic::Status> {
        <Inner as pb::indexer_server::Indexer>::report(&self.inner, request).await
    }

    async fn pool_state(
        &self,
        request: tonic::Request<pb::PoolStateRequest>,
    ) -> Result<tonic::Response<pb::PoolStateResponse>, tonic::Status> {
        self.life.gate(&request.get_ref().pool)?;
        <Inner as pb::indexer_server::Indexer>::pool_state(&self.inner, request).await
    }

    type SessionStream = crate::session::SessionStream;

    async fn session(
        &self,
        request: tonic::Request<tonic::Streaming<pb::SessionRequest>>,
    ) -> Result<tonic::Response<Self::SessionStream>, tonic::Status> {
        self.life.gate_session()?;
        let cancel = self.life.cancel.clone();
        let inbound = Box::pin(
            request
                .into_inner()
                .take_until(cancel.clone().cancelled_owned()),
        );
        let answers = crate::session::serve(Arc::clone(self.inner.pools()), inbound);
        // After the last answer: a final UNAVAILABLE when the stream was
        // cut by the shutdown (a caller's own end stays a clean end).
        let life = Arc::clone(&self.life);
        let tail = futures::stream::once(async move {
            cancel.is_cancelled().then(|| {
                life.metrics.sessions_shut_down.inc();
                Err(tonic::Status::unavailable(
                    "indexer shutting down: reopen the stream",
                ))
            })
        })
        .filter_map(futures::future::ready);
        Ok(tonic::Response::new(Box::pin(answers.chain(tail))))
    }
}

/// Serves `router` on `incoming` until `stop` resolves, then drains: calls
/// in flight get `grace` from `cancel`, after which the server is dropped.
pub async fn serve_bounded<F>(
    router: tonic::transport::server::Router,
    incoming: tonic::transport::server::TcpIncoming,
    stop: F,
    cancel: CancellationToken,
    grace: Duration,
) where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let server = router.serve_with_incoming_shutdown(incoming, stop);
    tokio::pin!(server);
    let deadline = async {
        cancel.cancelled().await;
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        r = &mut server => {
            if let Err(e) = r {
                tracing::error!(error = %e, "gRPC server failed");
            }
        }
        () = deadline => {
            tracing::warn!(?grace, "gRPC calls still open after the shutdown grace; closing them");
        }
    }
}
