//! Where a pick let through by the reserve may be placed
//! (`reservePerEngine`).
//!
//! The reserve's gate ([`super::PoolFlow::arrive`], the release) lets an
//! over-share tenant's pick go while the *least* saturated engine is below
//! the tenant's bound; the ranking then placed it wherever its prefix or
//! load said, often on an engine already past the bound (its tenant's
//! prefix holder), where the other tenants' requests then queued behind it
//! (vLLM serves an engine's queue first come first served). With
//! `reservePerEngine` the pick is ranked only among the engines that are
//! themselves below its bound, so the room between the bound and the
//! threshold stays free on every engine, not only on one.

use std::sync::Arc;
use std::time::Instant;

use kvasir_flowcontrol::has_room;

use super::moves::since_scrape;
use super::{estimate, Passage, PoolFlow};
use crate::endpoint::Endpoint;
use crate::load::{LoadView, SaturationThresholds};
use crate::pool::Pool;
use crate::types::EndpointId;

impl PoolFlow {
    /// The endpoints of `loads` that `pass`'s pick may be placed on: with
    /// `reservePerEngine`, for a pick that went under the reserve's bound,
    /// the healthy ones whose own saturation is below that bound. `None`:
    /// no restriction (not over its share, the setting off, or no endpoint
    /// below the bound any more: the ranking then chooses, as without it).
    pub(crate) fn allowed_for(
        &self,
        pass: &Passage,
        loads: &[(EndpointId, LoadView)],
        thresholds: &SaturationThresholds,
        now: Instant,
    ) -> Option<Vec<EndpointId>> {
        let bound = pass
            .reserve_bound
            .filter(|_| self.config.reserve_per_engine)?;
        let mut g = self.inner.lock();
        let since = since_scrape(&mut g, loads, now);
        let scale = self.scale(thresholds);
        let out: Vec<EndpointId> = loads
            .iter()
            .zip(since)
            .filter(|((_, v), s)| {
                v.healthy && has_room(estimate::engine_saturation(v, *s, 0, &scale), bound)
            })
            .map(|((id, _), _)| *id)
            .collect();
        (!out.is_empty()).then_some(out)
    }
}

impl Pool {
    /// `endpoints` less those a pick that went under the reserve's bound
    /// may not be placed on ([`PoolFlow::allowed_for`]).
    pub(crate) fn reserve_candidates(
        &self,
        pass: &Passage,
        endpoints: Arc<Vec<Arc<Endpoint>>>,
    ) -> Arc<Vec<Arc<Endpoint>>> {
        if pass.reserve_bound.is_none() || !self.flow.config().reserve_per_engine {
            return endpoints;
        }
        let now = Instant::now();
        let views = self.load.views(endpoints.iter().map(|e| e.id), now);
        let loads: Vec<(EndpointId, LoadView)> =
            endpoints.iter().map(|e| e.id).zip(views).collect();
        let thresholds = &self.load.config().saturation;
        match self.flow.allowed_for(pass, &loads, thresholds, now) {
            Some(allowed) if allowed.len() < endpoints.len() => Arc::new(
                endpoints
                    .iter()
                    .filter(|e| allowed.contains(&e.id))
                    .cloned()
                    .collect(),
            ),
            _ => endpoints,
        }
    }
}
