//! Shared load's families, per pool (see [`crate::shared_load`]): the other
//! replicas seen, their load and picks in prefill the views add, the peer
//! entries refused, how old the last read is,
//! whether picks steer by this replica's counts only, and the rounds with
//! Redis by result. Written for every pool, zeros when load is not shared,
//! so the page's families do not depend on the configuration.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType::{Counter, Gauge};

use crate::exposition::family;
use crate::load::PeerStats;
use crate::pools::Pools;

/// A gauge family: name, help, and its value from a pool's stats.
type GaugeFamily = (&'static str, &'static str, fn(&PeerStats) -> f64);

/// Reads each pool's tracker at each scrape.
#[derive(Debug)]
pub(crate) struct SharedLoadCollector(pub(crate) Arc<Pools>);

impl Collector for SharedLoadCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let now = Instant::now();
        let stats: Vec<(String, PeerStats)> = self
            .0
            .iter()
            .map(|p| (p.name.clone(), p.load.peer_stats(now)))
            .collect();
        let enc = &mut enc;
        let gauges: [GaugeFamily; 6] = [
            (
                "kvasir_indexer_shared_load_peers",
                "Other indexer replicas whose load entries are live, as of the last read.",
                |s| s.peers as f64,
            ),
            (
                "kvasir_indexer_shared_load_peer_in_flight",
                "Other replicas' in-flight picks on the pool's endpoints that this replica's picks count now.",
                |s| s.peer_in_flight as f64,
            ),
            (
                "kvasir_indexer_shared_load_peer_queued_prefill_tokens",
                "Other replicas' queued prefill tokens that this replica's picks count now.",
                |s| s.peer_queued_prefill_tokens as f64,
            ),
            (
                "kvasir_indexer_shared_load_peer_pending_chains",
                "Other replicas' picks still in prefill whose prompts this replica's picks match now (pending prefix credit).",
                |s| s.peer_pending_chains as f64,
            ),
            (
                "kvasir_indexer_shared_load_read_age_seconds",
                "Time since the last good read of the other replicas' load (-1 before the first); their load is used up to sharedLoad.ttlMs after it.",
                |s| s.read_age.map_or(-1.0, |d| d.as_secs_f64()),
            ),
            (
                "kvasir_indexer_shared_load_local_only",
                "1 while load is shared but the last good read is older than sharedLoad.ttlMs: picks count this replica's own load only.",
                |s| f64::from(u8::from(s.local_only)),
            ),
        ];
        for (name, help, value) in gauges {
            let mut f = family(enc, name, Gauge, help)?;
            for (pool, s) in &stats {
                f.sample(&[("pool", pool)], value(s))?;
            }
        }
        let name = "kvasir_indexer_shared_load_rounds_total";
        let help = "Round trips to Redis that publish this replica's load and read the others', by result (ok, failed: unreachable, timed out, refused).";
        let mut f = family(enc, name, Counter, help)?;
        for (pool, s) in &stats {
            f.sample(&[("pool", pool), ("result", "ok")], s.rounds)?;
            f.sample(&[("pool", pool), ("result", "failed")], s.failures)?;
        }
        let name = "kvasir_indexer_shared_load_peer_placements_total";
        let help = "Other replicas' conversation starts and prompt ends merged into this replica's recent placements (sharedLoad.placements), by kind.";
        let mut f = family(enc, name, Counter, help)?;
        for p in self.0.iter() {
            let (starts, ends) = p.placements.merged();
            f.sample(&[("pool", &p.name), ("kind", "start")], starts)?;
            f.sample(&[("pool", &p.name), ("kind", "end")], ends)?;
        }
        let name = "kvasir_indexer_shared_load_refused_entries_total";
        let help = "Other replicas' load or pending entries read and refused (malformed, oversized): left out, never used.";
        let mut f = family(enc, name, Counter, help)?;
        for (pool, s) in &stats {
            f.sample(&[("pool", pool)], s.refused)?;
        }
        Ok(())
    }
}
