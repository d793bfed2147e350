//! The Responses API affinity's families, per pool: records, lookups by
//! result, records dropped, waits for a report, and the shared store's
//! fallbacks.

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType::{Counter, Gauge};

use crate::exposition::family;
use crate::pools::Pools;
use crate::responses::Lost;

/// Reads each pool's [`crate::responses::Affinity`] at each scrape.
#[derive(Debug)]
pub(crate) struct ResponsesCollector(pub(crate) Arc<Pools>);

impl Collector for ResponsesCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let pools: Vec<_> = self.0.iter().collect();
        let enc = &mut enc;
        let name = "kvasir_indexer_responses_recorded_total";
        let help = "Stored-response ids recorded from reports (which endpoint holds each).";
        let mut f = family(enc, name, Counter, help)?;
        for p in &pools {
            f.sample(&[("pool", &p.name)], p.responses.metrics.recorded.get())?;
        }
        let name = "kvasir_indexer_response_lookups_total";
        let help = "Picks naming a stored response, by result: hit (routed to its endpoint), or why it was answered unknown_response (not_recorded, expired, endpoint_gone, endpoint_restarted, other_tenant: stored by another tenant, answered as not_recorded).";
        let mut f = family(enc, name, Counter, help)?;
        for p in &pools {
            let m = &p.responses.metrics;
            f.sample(&[("pool", &p.name), ("result", "hit")], m.hits.get())?;
            for l in Lost::ALL {
                let labels = [("pool", p.name.as_str()), ("result", l.as_str())];
                f.sample(&labels, m.unknown[l as usize].get())?;
            }
        }
        let name = "kvasir_indexer_responses_dropped_total";
        let help = "Stored-response records dropped, by reason (expired: past the TTL; evicted: the maxEntries bound).";
        let mut f = family(enc, name, Counter, help)?;
        for p in &pools {
            let m = &p.responses.metrics;
            f.sample(&[("pool", &p.name), ("reason", "expired")], m.expired.get())?;
            f.sample(&[("pool", &p.name), ("reason", "evicted")], m.evicted.get())?;
        }
        let name = "kvasir_indexer_responses_owner_kept_total";
        let help = "Records not written because a live record holds the id for another tenant (a stored response keeps the tenant that made it).";
        let mut f = family(enc, name, Counter, help)?;
        for p in &pools {
            f.sample(&[("pool", &p.name)], p.responses.metrics.owner_kept.get())?;
        }
        let name = "kvasir_indexer_responses_entries";
        let help = "Stored-response records held in this process.";
        let mut f = family(enc, name, Gauge, help)?;
        for p in &pools {
            f.sample(&[("pool", &p.name)], p.responses.entries() as u64)?;
        }
        let name = "kvasir_indexer_response_waits_total";
        let help =
            "Picks naming a response not recorded yet that waited (up to graceMs) for its report.";
        let mut f = family(enc, name, Counter, help)?;
        for p in &pools {
            f.sample(&[("pool", &p.name)], p.responses.metrics.waited.get())?;
        }
        let name = "kvasir_indexer_responses_store_fallbacks_total";
        let help = "Shared-store calls that failed, timed out or were skipped, by op (get: the pick used this replica's records; put: the record stayed in this replica).";
        let mut f = family(enc, name, Counter, help)?;
        for p in &pools {
            let m = &p.responses.metrics;
            let get = m.store_get_fallbacks.get();
            f.sample(&[("pool", &p.name), ("op", "get")], get)?;
            let put = m.store_put_fallbacks.get();
            f.sample(&[("pool", &p.name), ("op", "put")], put)?;
        }
        let name = "kvasir_indexer_responses_store";
        let help = "Where the pool's stored-response records are shared (1 for the configured store: memory or redis).";
        let mut f = family(enc, name, Gauge, help)?;
        for p in &pools {
            let labels = [
                ("pool", p.name.as_str()),
                ("store", p.responses.store_kind()),
            ];
            f.sample(&labels, 1u64)?;
        }
        Ok(())
    }
}
