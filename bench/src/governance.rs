//! The governance benchmarks' figures, computed
//! from the runs' records: per-tenant TTFT around a noisy neighbour's
//! burst, tokens served against token budgets, SLO goodput past
//! saturation, and mean TTFT against the perfect-balance yardstick below
//! it. `bench/governance.py` makes the runs and writes `scenarios.json`
//! saying which run is which; [`crate::governance_report`] renders these.

use serde::{Deserialize, Serialize};

use crate::bound::EngineModel;
use crate::floor;
use crate::record::{Outcome, Record};
use crate::stats::{nonfinite, Dist};
use crate::RunMeta;

/// A run by label: how the report names it, and its file name (without
/// extension) in the results directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Labeled {
    /// E.g. `flow control on`.
    pub label: String,
    /// E.g. `trace-2.00-kvasir-fc`.
    pub run: String,
}

/// The noisy-neighbour scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NoisySpec {
    /// The tenant that bursts.
    pub burst_tenant: String,
    /// Its rate during the burst over its usual rate.
    pub factor: f64,
    /// The burst's window, simulated seconds: the requests compared are
    /// those sent in it.
    pub from_s: f64,
    /// End of the window.
    pub to_s: f64,
    /// Per configuration: the run with the burst and the one without.
    pub pairs: Vec<NoisyPair>,
    /// Label of the pair the target is checked on.
    pub subject: String,
}

/// One configuration of the noisy-neighbour scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NoisyPair {
    /// E.g. `flow control on`.
    pub label: String,
    /// The run with the burst.
    pub burst: String,
    /// The run without it (the same requests less the burst's).
    pub baseline: String,
}

/// The budgets scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BudgetsSpec {
    /// The run.
    pub run: String,
    /// Simulated seconds of arrivals.
    pub duration_s: f64,
    /// Simulated seconds per wall second are 1 here, so this is the
    /// budgets' window too (60 s).
    pub window_s: f64,
    /// Each tenant's budget and demand.
    pub tenants: Vec<BudgetTenant>,
}

/// A tenant of the budgets scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BudgetTenant {
    /// Tenant name.
    pub name: String,
    /// Its `tokensPerMinute` (prompt, cached at weight 1, plus completion).
    pub tokens_per_minute: u64,
    /// What it sends, over its budget (2 = twice the budget).
    pub demand: f64,
    /// Whether its requests carry `max_tokens` (else the budget reserves
    /// a learned estimate).
    pub max_tokens: bool,
}

/// The saturation scenario: goodput past saturation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SaturationSpec {
    /// Trace load.
    pub load: f64,
    /// TTFT a request must meet to count, simulated ms.
    pub slo_ms: f64,
    /// The runs compared.
    pub runs: Vec<Labeled>,
    /// Label of the run the target is checked on.
    pub subject: String,
    /// Label of the run it is checked against (round-robin).
    pub baseline: String,
}

/// A below-saturation load: mean TTFT against the yardstick.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BelowSpec {
    /// Trace load.
    pub load: f64,
    /// The runs compared.
    pub runs: Vec<Labeled>,
    /// Label of the run the target is checked on.
    pub subject: String,
}

/// What `bench/governance.py` ran, in `scenarios.json`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Scenarios {
    /// The command line quoted in the report.
    pub command: String,
    /// Facts of the setup, one sentence each.
    #[serde(default)]
    pub setup: Vec<String>,
    /// Noisy neighbour, if run.
    #[serde(default)]
    pub noisy: Option<NoisySpec>,
    /// Budgets, if run.
    #[serde(default)]
    pub budgets: Option<BudgetsSpec>,
    /// Saturation, if run.
    #[serde(default)]
    pub saturation: Option<SaturationSpec>,
    /// Below saturation, per load.
    #[serde(default)]
    pub below: Vec<BelowSpec>,
}

/// Whether a request was refused by the gateway (rate-limited or shed):
/// 429, or 503 for a shed with no endpoint ready.
pub fn refused(r: &Record) -> bool {
    r.outcome == Outcome::HttpError && (r.status == 429 || r.status == 503)
}

/// TTFT of the records `keep` selects, a request that never answered
/// counted as infinitely slow; and how many there were.
fn ttfts(records: &[Record], keep: impl Fn(&Record) -> bool) -> (Dist, usize) {
    let v: Vec<f64> = records
        .iter()
        .filter(|r| keep(r))
        .map(|r| {
            if r.outcome == Outcome::Ok && r.ttft_ms.is_finite() {
                r.ttft_ms
            } else {
                f64::INFINITY
            }
        })
        .collect();
    let n = v.len();
    (Dist::of(v), n)
}

/// One tenant's TTFT with and without the burst.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NoisyRow {
    /// The configuration (pair label).
    pub config: String,
    /// Tenant.
    pub tenant: String,
    /// Requests it sent in the window, without / with the burst.
    pub sent: (usize, usize),
    /// TTFT of those requests without the burst.
    pub base: Dist,
    /// With the burst.
    pub burst: Dist,
    /// Refused (429 / 503) with the burst.
    pub refused: usize,
}

impl NoisyRow {
    /// p99 with the burst over p99 without.
    pub fn p99_ratio(&self) -> f64 {
        self.burst.p99 / self.base.p99
    }
    /// p50 with the burst over p50 without.
    pub fn p50_ratio(&self) -> f64 {
        self.burst.p50 / self.base.p50
    }
}

/// Every tenant's row of one pair, the bursting tenant's included (its
/// figures cover its extra requests too).
pub fn noisy_rows(
    spec: &NoisySpec,
    pair: &str,
    base: &[Record],
    burst: &[Record],
) -> Vec<NoisyRow> {
    let in_window = |r: &Record| r.sent_s >= spec.from_s && r.sent_s < spec.to_s;
    let mut tenants: Vec<&str> = burst.iter().map(|r| r.tenant.as_str()).collect();
    tenants.sort_unstable();
    tenants.dedup();
    tenants
        .into_iter()
        .map(|t| {
            let (b, nb) = ttfts(base, |r| r.tenant == t && in_window(r));
            let (x, nx) = ttfts(burst, |r| r.tenant == t && in_window(r));
            NoisyRow {
                config: pair.into(),
                tenant: t.into(),
                sent: (nb, nx),
                base: b,
                burst: x,
                refused: burst
                    .iter()
                    .filter(|r| r.tenant == t && in_window(r) && refused(r))
                    .count(),
            }
        })
        .collect()
}

/// One tenant's tokens against its budget.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BudgetRow {
    /// Tenant, budget and demand.
    pub tenant: BudgetTenant,
    /// Requests sent.
    pub sent: usize,
    /// Served to the end.
    pub ok: usize,
    /// Answered 429.
    pub limited: usize,
    /// Prompt + completion tokens of the served requests, whole run.
    pub served_tokens: u64,
    /// What the budget lets through over the run: one full window (the
    /// bucket starts full) plus the refill, `limit x (1 + D / window)`.
    pub allowed_tokens: f64,
    /// When the tenant was first limited (its bucket ran dry), simulated
    /// seconds; none if never.
    #[serde(with = "nonfinite")]
    pub dry_at_s: f64,
    /// Served tokens of requests sent from then on.
    pub steady_tokens: u64,
    /// The budget's refill over that span.
    pub steady_allowed: f64,
}

impl BudgetRow {
    /// Served over allowed, whole run (first window counted).
    #[must_use]
    pub fn whole_ratio(&self) -> f64 {
        self.served_tokens as f64 / self.allowed_tokens
    }
    /// Served over allowed, after the first window.
    #[must_use]
    pub fn steady_ratio(&self) -> f64 {
        self.steady_tokens as f64 / self.steady_allowed
    }
}

/// Every tenant's tokens served against its budget: over the whole run,
/// and from its first 429 on (its bucket was empty then, so from there
/// only the refill, plus reservations given back, can be admitted).
pub fn budget_rows(spec: &BudgetsSpec, records: &[Record]) -> Vec<BudgetRow> {
    spec.tenants
        .iter()
        .map(|t| {
            let mine: Vec<&Record> = records.iter().filter(|r| r.tenant == t.name).collect();
            let tokens = |r: &&&Record| r.prompt_tokens + r.completion_tokens;
            let ok: Vec<&&Record> = mine.iter().filter(|r| r.outcome == Outcome::Ok).collect();
            let per_s = t.tokens_per_minute as f64 / spec.window_s;
            let dry = mine
                .iter()
                .filter(|r| r.outcome == Outcome::HttpError && r.status == 429)
                .map(|r| r.sent_s)
                .fold(f64::INFINITY, f64::min);
            BudgetRow {
                tenant: t.clone(),
                sent: mine.len(),
                ok: ok.len(),
                limited: mine
                    .iter()
                    .filter(|r| r.outcome == Outcome::HttpError && r.status == 429)
                    .count(),
                served_tokens: ok.iter().map(tokens).sum(),
                allowed_tokens: t.tokens_per_minute as f64 + per_s * spec.duration_s,
                dry_at_s: if dry.is_finite() { dry } else { f64::NAN },
                steady_tokens: ok.iter().filter(|r| r.sent_s >= dry).map(tokens).sum(),
                steady_allowed: if dry.is_finite() {
                    per_s * (spec.duration_s - dry).max(0.0)
                } else {
                    f64::NAN
                },
            }
        })
        .collect()
}

/// One run's goodput past saturation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GoodputRow {
    /// Label.
    pub label: String,
    /// Requests sent.
    pub sent: usize,
    /// Served to the end.
    pub ok: usize,
    /// Served with TTFT within the SLO.
    pub good: usize,
    /// Refused by the gateway (shed).
    pub refused: usize,
    /// Good requests per simulated second of the arrival window.
    #[serde(with = "nonfinite")]
    pub good_per_s: f64,
    /// TTFT of all requests (refused and unanswered as ∞).
    pub ttft: Dist,
}

/// A run's goodput: requests served within `slo_ms`, per second of the
/// arrival window (the same requests in every run, so the same window).
pub fn goodput(label: &str, records: &[Record], slo_ms: f64) -> GoodputRow {
    let ok = records.iter().filter(|r| r.outcome == Outcome::Ok);
    let good = ok
        .clone()
        .filter(|r| r.ttft_ms.is_finite() && r.ttft_ms <= slo_ms)
        .count();
    let (lo, hi) = records
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), r| {
            (a.min(r.sent_s), b.max(r.sent_s))
        });
    let window = hi - lo;
    GoodputRow {
        label: label.into(),
        sent: records.len(),
        ok: ok.count(),
        good,
        refused: records.iter().filter(|r| refused(r)).count(),
        good_per_s: if window > 0.0 {
            good as f64 / window
        } else {
            f64::NAN
        },
        ttft: ttfts(records, |_| true).0,
    }
}

/// One run's mean TTFT against perfect balance at its own reuse.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BalanceRow {
    /// Label.
    pub label: String,
    /// Requests sent.
    pub sent: usize,
    /// Not served (refused, failed, timed out).
    pub unanswered: usize,
    /// Mean TTFT of the answered requests, ms.
    #[serde(with = "nonfinite")]
    pub mean_ms: f64,
    /// The same arrivals perfectly balanced over the engines (one central
    /// FCFS queue, [`crate::queue::balanced`]) at the run's own reuse.
    #[serde(with = "nonfinite")]
    pub balanced_ms: f64,
    /// Cached over prompt tokens of the answered requests.
    #[serde(with = "nonfinite")]
    pub hit_rate: f64,
}

impl BalanceRow {
    /// Mean TTFT over the yardstick's.
    #[must_use]
    pub fn ratio(&self) -> f64 {
        self.mean_ms / self.balanced_ms
    }
}

/// A run's mean TTFT and its perfect-balance yardstick (the routing
/// report's, [`floor::at_own_reuse`]).
pub fn balance(label: &str, meta: &RunMeta, records: &[Record], model: &EngineModel) -> BalanceRow {
    let engines = meta.engines.engines.max(1);
    let u = floor::at_own_reuse(
        (&meta.workload, &meta.mode, meta.load),
        records,
        engines,
        None,
        model,
    );
    let answered: Vec<&Record> = records
        .iter()
        .filter(|r| r.outcome == Outcome::Ok && r.ttft_ms.is_finite())
        .collect();
    let n = answered.len().max(1) as f64;
    let prompt: u64 = answered.iter().map(|r| r.prompt_tokens).sum();
    let cached: u64 = answered.iter().map(|r| r.cached_tokens).sum();
    BalanceRow {
        label: label.into(),
        sent: records.len(),
        unanswered: records.len() - answered.len(),
        mean_ms: if answered.is_empty() {
            f64::NAN
        } else {
            answered.iter().map(|r| r.ttft_ms).sum::<f64>() / n
        },
        balanced_ms: u.balanced.map_or(f64::NAN, |d| d.mean),
        hit_rate: if prompt > 0 {
            cached as f64 / prompt as f64
        } else {
            f64::NAN
        },
    }
}

#[cfg(test)]
#[path = "governance_tests.rs"]
mod tests;
