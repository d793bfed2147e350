//! The tonic `kvasir.v1.Indexer` service: the gRPC edge over [`Pools`].
//! It maps a refused request ([`ServiceError`]) to `INVALID_ARGUMENT` and
//! hands `Session` streams to [`crate::session`]; everything else is the
//! pools'.

use std::sync::Arc;

use kvasir_proto::v1 as pb;

use crate::pool::ServiceError;
use crate::pools::Pools;

impl From<ServiceError> for tonic::Status {
    fn from(e: ServiceError) -> Self {
        tonic::Status::invalid_argument(e.to_string())
    }
}

/// The tonic `kvasir.v1.Indexer` service.
#[derive(Debug, Clone)]
pub struct IndexerService {
    pools: Arc<Pools>,
}

impl IndexerService {
    /// A service over `pools`.
    pub fn new(pools: Arc<Pools>) -> Self {
        IndexerService { pools }
    }

    /// The pools.
    pub fn pools(&self) -> &Arc<Pools> {
        &self.pools
    }

    /// `Pick` without gRPC (same code path, for benchmarks and in-process
    /// callers).
    pub async fn pick(&self, req: pb::PickRequest) -> Result<pb::PickResponse, ServiceError> {
        self.pools.pick(req).await
    }

    /// `Report` without gRPC.
    pub fn report(&self, req: &pb::ReportRequest) -> Result<pb::ReportResponse, ServiceError> {
        self.pools.report(req)
    }
}

#[tonic::async_trait]
impl pb::indexer_server::Indexer for IndexerService {
    async fn pick(
        &self,
        request: tonic::Request<pb::PickRequest>,
    ) -> Result<tonic::Response<pb::PickResponse>, tonic::Status> {
        let req = request.into_inner();
        Ok(tonic::Response::new(self.pools.pick(req).await?))
    }

    async fn report(
        &self,
        request: tonic::Request<pb::ReportRequest>,
    ) -> Result<tonic::Response<pb::ReportResponse>, tonic::Status> {
        let req = request.into_inner();
        Ok(tonic::Response::new(self.pools.report(&req)?))
    }

    async fn pool_state(
        &self,
        request: tonic::Request<pb::PoolStateRequest>,
    ) -> Result<tonic::Response<pb::PoolStateResponse>, tonic::Status> {
        let req = request.into_inner();
        Ok(tonic::Response::new(self.pools.pool_state(&req)?))
    }

    type SessionStream = crate::session::SessionStream;

    async fn session(
        &self,
        request: tonic::Request<tonic::Streaming<pb::SessionRequest>>,
    ) -> Result<tonic::Response<Self::SessionStream>, tonic::Status> {
        Ok(tonic::Response::new(crate::session::serve(
            Arc::clone(&self.pools),
            request.into_inner(),
        )))
    }
}
