//! What the report compares, shared by its tables ([`crate::report`]) and
//! its target checks ([`crate::targets`]): the modes and loads compared,
//! everything a report is made from ([`Inputs`]) and the lookups into it,
//! and how figures are written.

use crate::bound::PooledBound;
use crate::floor::Unqueued;
use crate::RunMeta;

/// The baseline every ratio is taken against.
pub const BASELINE: &str = "round-robin";
/// Kvasir's own mode.
pub const KVASIR: &str = "kvasir";
/// The approximate-prefix mode (the Inference Extension's style).
pub const APPROX: &str = "approx-prefix";
/// The reference load factor (round-robin at about 70% prefill use).
pub const REF_LOAD: f64 = 1.0;
/// The load factor of the goodput target (twice the reference load).
pub const HIGH_LOAD: f64 = 2.0;

/// Order of modes in tables and plots.
pub fn mode_rank(m: &str) -> usize {
    match m {
        BASELINE => 0,
        "least-request" => 1,
        APPROX => 2,
        KVASIR => 3,
        _ => 4,
    }
}

/// Everything the report is made from.
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    /// All runs.
    pub runs: Vec<RunMeta>,
    /// The pooled-cache bound of the trace runs, if computed.
    pub bound: Option<PooledBound>,
    /// Kvasir's runs priced with no queueing, where computed.
    pub unqueued: Vec<Unqueued>,
    /// The command that produced the results.
    pub command: String,
    /// Setup facts, one line each.
    pub setup: Vec<String>,
}

/// The run of `mode` on `workload` at `load`, if there is one.
pub(crate) fn find<'a>(
    runs: &'a [RunMeta],
    workload: &str,
    mode: &str,
    load: f64,
) -> Option<&'a RunMeta> {
    runs.iter()
        .find(|r| r.workload == workload && r.mode == mode && (r.load - load).abs() < 1e-9)
}

/// The no-queueing pricing of that run, if it was computed.
pub(crate) fn find_unqueued<'a>(
    inp: &'a Inputs,
    workload: &str,
    mode: &str,
    load: f64,
) -> Option<&'a Unqueued> {
    inp.unqueued
        .iter()
        .find(|u| u.workload == workload && u.mode == mode && (u.load - load).abs() < 1e-9)
}

/// Formats milliseconds compactly with their unit (`∞` for requests that
/// never answered).
pub fn ms(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else if v.is_infinite() {
        "∞".into()
    } else if v >= 10_000.0 {
        format!("{:.1} s", v / 1e3)
    } else if v >= 100.0 {
        format!("{v:.0} ms")
    } else {
        format!("{v:.1} ms")
    }
}

/// `a / b`, with ∞ / ∞ (neither run answered) as no ratio at all.
pub(crate) fn ratio(a: f64, b: f64) -> f64 {
    if a.is_infinite() && b.is_infinite() {
        return f64::NAN;
    }
    a / b
}

/// A fraction as a percentage with one decimal (`-` when not finite).
pub(crate) fn pct(v: f64) -> String {
    if v.is_finite() {
        format!("{:.1}%", v * 100.0)
    } else {
        "-".into()
    }
}
