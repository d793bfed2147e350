//! The pools of one indexer, by name: what the gRPC service and the
//! `Session` streams call (pick, report, pool state), and what `/metrics`
//! and `/readyz` read.

use std::collections::HashMap;
use std::sync::Arc;

use kvasir_proto::v1 as pb;

use crate::metrics::SessionMetrics;
use crate::pool::{invalid, Pool, ServiceError};

/// The pools of one indexer, by name.
#[derive(Debug, Default, Clone)]
pub struct Pools {
    by_name: HashMap<String, Arc<Pool>>,
    ordered: Vec<Arc<Pool>>,
    sessions: Arc<SessionMetrics>,
}

impl Pools {
    /// From a list (names unique; a later duplicate is ignored).
    pub fn new(pools: Vec<Arc<Pool>>) -> Self {
        let mut by_name = HashMap::new();
        let mut ordered = Vec::new();
        for p in pools {
            if by_name.insert(p.name.clone(), Arc::clone(&p)).is_none() {
                ordered.push(p);
            }
        }
        Pools {
            by_name,
            ordered,
            sessions: Arc::default(),
        }
    }

    /// Metrics of the `Session` streams served over these pools.
    pub fn session_metrics(&self) -> &Arc<SessionMetrics> {
        &self.sessions
    }

    /// A pool by name.
    pub fn get(&self, name: &str) -> Result<&Arc<Pool>, ServiceError> {
        if name.is_empty() {
            return Err(invalid("pool", "must not be empty"));
        }
        self.by_name
            .get(name)
            .ok_or_else(|| ServiceError::UnknownPool(name.to_string()))
    }

    /// All pools, in configuration order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Pool>> {
        self.ordered.iter()
    }

    /// Whether every pool is ready, and the `pool/address` of endpoints
    /// that are not in sync.
    pub fn readiness(&self) -> (bool, Vec<String>) {
        let mut not = Vec::new();
        for p in &self.ordered {
            let (_, n) = p.readiness();
            not.extend(n.into_iter().map(|a| format!("{}/{a}", p.name)));
        }
        (not.is_empty(), not)
    }

    /// Answers a pick for the request's pool (see [`Pool::pick`]).
    pub async fn pick(&self, req: pb::PickRequest) -> Result<pb::PickResponse, ServiceError> {
        self.get(&req.pool)?.pick(req).await
    }

    /// [`Pools::pick`] holding the caller's permit while it computes (see
    /// [`crate::pick::PickPermit`]).
    pub(crate) async fn pick_with(
        &self,
        req: pb::PickRequest,
        permit: crate::pick::PickPermit,
    ) -> Result<pb::PickResponse, ServiceError> {
        self.get(&req.pool)?.pick_with(req, permit).await
    }

    /// Accounts a report for the request's pool (see [`Pool::report`]).
    pub fn report(&self, req: &pb::ReportRequest) -> Result<pb::ReportResponse, ServiceError> {
        self.get(&req.pool)?.report(req)
    }

    /// The state of the request's pool.
    pub fn pool_state(
        &self,
        req: &pb::PoolStateRequest,
    ) -> Result<pb::PoolStateResponse, ServiceError> {
        Ok(self.get(&req.pool)?.state())
    }
}
