//! Kvasir's routing benchmark: the load generator and the report.
//!
//! The load generator replays a workload open-loop through a proxy as real
//! streaming requests and records every request ([`record`]); the report
//! turns the runs of several routing modes and load levels into tables,
//! target checks and plots ([`report`], [`targets`], [`plot`]), read from
//! and written to a results directory ([`results`]). The pure parts (trace
//! parsing, workload planning, statistics, the pooled-cache bound) have
//! their tests beside them; the processes a run needs (simulators, indexer,
//! Envoy) are started by `bench/routing.py`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod bound;
pub mod chat;
pub mod client;
pub mod compare;
pub mod floor;
pub mod governance;
pub mod governance_report;
pub mod overhead;
pub mod plot;
pub mod queue;
pub mod record;
pub mod replay;
pub mod report;
pub mod results;
pub mod run;
pub mod stats;
pub mod streams;
pub mod targets;
pub mod tenants;
pub mod trace;
pub mod workloads;

use serde::{Deserialize, Serialize};

/// A run's description and results, written next to its CSV.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunMeta {
    /// `trace`, `chat` or a [`workloads::Shape`]'s name.
    pub workload: String,
    /// Routing mode label, e.g. `round-robin`.
    pub mode: String,
    /// Load factor relative to the calibrated reference load (1.0 = the
    /// load where round-robin runs at about 70% prefill utilisation).
    pub load: f64,
    /// What the load factor means for this workload: trace speed-up, or
    /// conversations (sessions) started per simulated second.
    pub rate: f64,
    /// Simulators' time scale (wall seconds per simulated second).
    pub time_scale: f64,
    /// Wall seconds the run took.
    pub wall_s: f64,
    /// Engine utilisation over the second half of the arrival window.
    pub engines: run::EngineUse,
    /// The measured results.
    pub summary: stats::Summary,
    /// Mean TTFT of the last quarter of requests (by send time) over that
    /// of the first quarter: well above 1 when the queue keeps growing.
    #[serde(with = "stats::nonfinite")]
    pub ttft_growth: f64,
    /// Free-form facts from the orchestrator (fail-open count etc.).
    #[serde(default)]
    pub notes: serde_json::Map<String, serde_json::Value>,
}

/// Mean TTFT of the last quarter of `records` by send time over the first
/// quarter's (unfinished requests are left out of both).
pub fn ttft_growth(records: &[record::Record]) -> f64 {
    let mut v: Vec<(f64, f64)> = records
        .iter()
        .filter(|r| r.outcome == record::Outcome::Ok && r.ttft_ms.is_finite())
        .map(|r| (r.sent_s, r.ttft_ms))
        .collect();
    if v.len() < 8 {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let q = v.len() / 4;
    let mean = |s: &[(f64, f64)]| s.iter().map(|x| x.1).sum::<f64>() / s.len() as f64;
    mean(&v[v.len() - q..]) / mean(&v[..q])
}
