//! The gRPC side's families: refusals (auth, warm-up, shutdown), warm-up
//! per pool, and the in-flight bounds of each pool's load tracker.

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType::{Counter, Gauge};

use super::{family, flag};
use crate::lifecycle::Lifecycle;
use crate::pools::Pools;

/// Reads the [`Lifecycle`] and the pools' bounds at each scrape.
#[derive(Debug)]
pub(super) struct LifecycleCollector {
    pub(super) pools: Arc<Pools>,
    pub(super) life: Arc<Lifecycle>,
}

impl Collector for LifecycleCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let m = &self.life.metrics;
        let name = "kvasir_indexer_grpc_unauthenticated_total";
        let help = "kvasir.v1.Indexer calls refused UNAUTHENTICATED (--grpc-token-file), by reason (missing, invalid).";
        let mut f = family(&mut enc, name, Counter, help)?;
        for (reason, c) in [("missing", &m.auth.missing), ("invalid", &m.auth.invalid)] {
            f.sample(&[("reason", reason)], c.get())?;
        }
        let name = "kvasir_indexer_grpc_unavailable_total";
        let help = "Calls answered UNAVAILABLE by the lifecycle, by reason (warming_up: no scrape yet; shutting_down).";
        let mut f = family(&mut enc, name, Counter, help)?;
        for (reason, c) in [
            ("warming_up", &m.refused_warming_up),
            ("shutting_down", &m.refused_shutting_down),
        ] {
            f.sample(&[("reason", reason)], c.get())?;
        }
        let name = "kvasir_indexer_sessions_shut_down_total";
        let help = "Session streams ended with UNAVAILABLE by a shutdown.";
        family(&mut enc, name, Counter, help)?.sample(&[], m.sessions_shut_down.get())?;
        let name = "kvasir_indexer_pool_warm";
        let help =
            "1 once the pool's endpoints are known and scraped once (picks are served), else 0.";
        let mut f = family(&mut enc, name, Gauge, help)?;
        for p in self.pools.iter() {
            f.sample(&[("pool", &p.name)], flag(self.life.warmup(&p.name).warm()))?;
        }
        bounds(&mut enc, &self.pools)
    }
}

fn bounds(enc: &mut DescriptorEncoder<'_>, pools: &Pools) -> fmt::Result {
    let stats: Vec<_> = pools.iter().map(|p| (p, p.load.bound_stats())).collect();
    let name = "kvasir_indexer_in_flight_unconfirmed";
    let help = "In-flight picks with no report yet.";
    let mut f = family(enc, name, Gauge, help)?;
    for (p, s) in &stats {
        f.sample(&[("pool", &p.name)], s.unconfirmed)?;
    }
    let name = "kvasir_indexer_in_flight_unconfirmed_expired_total";
    let help =
        "Picks dropped from the load view with no report after inFlight.unconfirmedTimeoutMs.";
    let mut f = family(enc, name, Counter, help)?;
    for (p, s) in &stats {
        f.sample(&[("pool", &p.name)], s.unconfirmed_expired)?;
    }
    let name = "kvasir_indexer_picks_unaccounted_total";
    let help = "Picks answered but left out of the load view by a cap, by reason (endpoint_cap: inFlight.maxUnconfirmedPerEndpoint; pool_cap: inFlight.maxTracked).";
    let mut f = family(enc, name, Counter, help)?;
    for (p, s) in &stats {
        for (reason, v) in [
            ("endpoint_cap", s.capped_endpoint),
            ("pool_cap", s.capped_pool),
        ] {
            f.sample(&[("pool", p.name.as_str()), ("reason", reason)], v)?;
        }
    }
    Ok(())
}
