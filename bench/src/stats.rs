//! Percentiles and per-run summaries (pure).

use serde::{Deserialize, Serialize};

use crate::record::{Outcome, Record};

/// TTFT under which a request counts toward goodput, ms.
pub const GOODPUT_TTFT_MS: f64 = 2_000.0;

/// The `q`-quantile (0..=1) of `v` by linear interpolation between closest
/// ranks; NaN for an empty slice. `v` must be sorted; infinities are fine
/// (a request that never answered sorts last).
pub fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let pos = q.clamp(0.0, 1.0) * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    if lo == hi || v[lo] == v[hi] {
        return v[lo];
    }
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// Serde for floats that may be infinite or NaN (JSON has neither): finite
/// values as numbers, infinities as the strings `"inf"` / `"-inf"`, NaN as
/// `null`.
pub mod nonfinite {
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes `v`.
    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else if v.is_nan() {
            s.serialize_none()
        } else if *v > 0.0 {
            s.serialize_str("inf")
        } else {
            s.serialize_str("-inf")
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Repr {
        Num(f64),
        Text(String),
        Null(()),
    }

    /// Reads what [`serialize`] wrote.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        match Option::<Repr>::deserialize(d)? {
            Some(Repr::Num(v)) => Ok(v),
            Some(Repr::Text(t)) if t == "inf" => Ok(f64::INFINITY),
            Some(Repr::Text(t)) if t == "-inf" => Ok(f64::NEG_INFINITY),
            Some(Repr::Text(t)) => Err(serde::de::Error::custom(format!("not a number: `{t}`"))),
            Some(Repr::Null(())) | None => Ok(f64::NAN),
        }
    }
}

/// p50 / p90 / p99 and mean of one latency.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Dist {
    /// Median.
    #[serde(with = "nonfinite")]
    pub p50: f64,
    /// 90th percentile.
    #[serde(with = "nonfinite")]
    pub p90: f64,
    /// 99th percentile.
    #[serde(with = "nonfinite")]
    pub p99: f64,
    /// Mean (infinite when any request never answered).
    #[serde(with = "nonfinite")]
    pub mean: f64,
}

impl Dist {
    /// Of values in any order.
    pub fn of(mut v: Vec<f64>) -> Dist {
        v.sort_by(f64::total_cmp);
        Dist::of_sorted(&v)
    }

    /// Of already sorted values.
    pub fn of_sorted(v: &[f64]) -> Dist {
        let mean = if v.is_empty() {
            f64::NAN
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        };
        Dist {
            p50: quantile(v, 0.5),
            p90: quantile(v, 0.9),
            p99: quantile(v, 0.99),
            mean,
        }
    }
}

/// What one run (one mode, workload and load) measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests sent.
    pub requests: usize,
    /// Requests that completed with a 2xx.
    pub ok: usize,
    /// Error answers and failed streams.
    pub failed: usize,
    /// Requests still running at the deadline.
    pub timeouts: usize,
    /// TTFT, ms; requests without a first token count as infinitely slow.
    pub ttft: Dist,
    /// Per-request mean inter-token gap, ms, over completed requests with
    /// at least two tokens.
    pub itl: Dist,
    /// End to end, ms; unfinished requests count as infinitely slow.
    pub e2e: Dist,
    /// Simulated seconds from the first send to the last completion.
    #[serde(with = "nonfinite")]
    pub duration_s: f64,
    /// Completed requests per simulated second.
    #[serde(with = "nonfinite")]
    pub throughput_rps: f64,
    /// Completion tokens per simulated second.
    #[serde(with = "nonfinite")]
    pub output_tokens_per_s: f64,
    /// Cached prompt tokens / prompt tokens, over completed requests.
    #[serde(with = "nonfinite")]
    pub cache_hit_rate: f64,
    /// Completed requests with TTFT <= [`GOODPUT_TTFT_MS`] per simulated
    /// second.
    #[serde(with = "nonfinite")]
    pub goodput_rps: f64,
    /// Share of all sent requests meeting the TTFT bound.
    #[serde(with = "nonfinite")]
    pub goodput_share: f64,
    /// Requests served per endpoint, by address (sorted).
    pub per_endpoint: Vec<(String, usize)>,
    /// The fastest TTFT of the run, ms: about an engine's fixed cost of
    /// one prefill step, the floor no routing goes below (NaN in results
    /// written before it was recorded).
    #[serde(default = "nan", with = "nonfinite")]
    pub fastest_ttft_ms: f64,
}

fn nan() -> f64 {
    f64::NAN
}

/// Summarises a run's records.
pub fn summarize(records: &[Record]) -> Summary {
    let ok: Vec<&Record> = records
        .iter()
        .filter(|r| r.outcome == Outcome::Ok)
        .collect();
    let inf_unless_ok = |r: &Record, v: f64| {
        if r.outcome == Outcome::Ok && v.is_finite() {
            v
        } else {
            f64::INFINITY
        }
    };
    let ttft = sorted(
        records
            .iter()
            .map(|r| inf_unless_ok(r, r.ttft_ms))
            .collect(),
    );
    let e2e = sorted(records.iter().map(|r| inf_unless_ok(r, r.e2e_ms)).collect());
    let itl = sorted(
        ok.iter()
            .map(|r| r.itl_ms)
            .filter(|v| v.is_finite())
            .collect(),
    );
    let start = records
        .iter()
        .map(|r| r.sent_s)
        .fold(f64::INFINITY, f64::min);
    let end = ok
        .iter()
        .map(|r| r.sent_s + r.e2e_ms / 1e3)
        .fold(f64::NEG_INFINITY, f64::max);
    let duration_s = if end > start { end - start } else { f64::NAN };
    let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
    let cached: u64 = ok.iter().map(|r| r.cached_tokens).sum();
    let out: u64 = ok.iter().map(|r| r.completion_tokens).sum();
    let good = ok.iter().filter(|r| r.ttft_ms <= GOODPUT_TTFT_MS).count();
    let mut per: std::collections::BTreeMap<String, usize> = Default::default();
    for r in &ok {
        *per.entry(r.endpoint.clone()).or_default() += 1;
    }
    Summary {
        requests: records.len(),
        ok: ok.len(),
        failed: records
            .iter()
            .filter(|r| matches!(r.outcome, Outcome::HttpError | Outcome::Error))
            .count(),
        timeouts: records
            .iter()
            .filter(|r| r.outcome == Outcome::Timeout)
            .count(),
        fastest_ttft_ms: ttft
            .first()
            .copied()
            .filter(|v| v.is_finite())
            .unwrap_or(f64::NAN),
        ttft: Dist::of_sorted(&ttft),
        itl: Dist::of_sorted(&itl),
        e2e: Dist::of_sorted(&e2e),
        duration_s,
        throughput_rps: ok.len() as f64 / duration_s,
        output_tokens_per_s: out as f64 / duration_s,
        cache_hit_rate: if prompt == 0 {
            f64::NAN
        } else {
            cached as f64 / prompt as f64
        },
        goodput_rps: good as f64 / duration_s,
        goodput_share: if records.is_empty() {
            f64::NAN
        } else {
            good as f64 / records.len() as f64
        },
        per_endpoint: per.into_iter().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(sent: f64, ttft: f64, e2e: f64, outcome: Outcome) -> Record {
        Record {
            id: 0,
            tenant: "t".into(),
            conversation: None,
            turn: 0,
            sent_s: sent,
            ttft_ms: ttft,
            itl_ms: 5.0,
            e2e_ms: e2e,
            prompt_tokens: 100,
            cached_tokens: 50,
            completion_tokens: 10,
            endpoint: "a".into(),
            status: 200,
            outcome,
            error: String::new(),
        }
    }

    #[test]
    fn non_finite_numbers_survive_json() {
        let d = Dist {
            p50: 1.5,
            p90: f64::NAN,
            p99: f64::INFINITY,
            mean: f64::NEG_INFINITY,
        };
        let j = serde_json::to_string(&d).unwrap();
        assert_eq!(j, r#"{"p50":1.5,"p90":null,"p99":"inf","mean":"-inf"}"#);
        let back: Dist = serde_json::from_str(&j).unwrap();
        assert_eq!(
            (back.p50, back.p99, back.mean),
            (1.5, f64::INFINITY, f64::NEG_INFINITY)
        );
        assert!(back.p90.is_nan());
    }

    #[test]
    fn quantiles_interpolate_and_handle_edges() {
        assert!(quantile(&[], 0.5).is_nan());
        assert_eq!(quantile(&[3.0], 0.99), 3.0);
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert!((quantile(&v, 0.5) - 50.5).abs() < 1e-9);
        assert!((quantile(&v, 0.99) - 99.01).abs() < 1e-9);
        assert_eq!(quantile(&[1.0, f64::INFINITY], 1.0), f64::INFINITY);
        assert_eq!(
            quantile(&[1.0, f64::INFINITY, f64::INFINITY], 0.5),
            f64::INFINITY
        );
    }

    #[test]
    fn summary_counts_unfinished_requests_as_infinitely_slow() {
        let rs = vec![
            rec(0.0, 100.0, 1000.0, Outcome::Ok),
            rec(1.0, 3000.0, 4000.0, Outcome::Ok),
            rec(2.0, f64::NAN, f64::NAN, Outcome::Timeout),
            rec(2.0, 10.0, 20.0, Outcome::HttpError),
        ];
        let s = summarize(&rs);
        assert_eq!((s.requests, s.ok, s.failed, s.timeouts), (4, 2, 1, 1));
        assert_eq!(s.ttft.p99, f64::INFINITY);
        assert_eq!(s.ttft.mean, f64::INFINITY);
        // Two of four never answered: the median lies between 3000 and ∞.
        assert_eq!(s.ttft.p50, f64::INFINITY);
        assert_eq!(summarize(&rs[..2]).ttft.p50, 1550.0);
        // From the first send (0 s) to the last completion (1 s + 4 s).
        assert!((s.duration_s - 5.0).abs() < 1e-9);
        assert!((s.throughput_rps - 0.4).abs() < 1e-9);
        assert!((s.cache_hit_rate - 0.5).abs() < 1e-9);
        // Only the first meets TTFT <= 2 s.
        assert!((s.goodput_rps - 0.2).abs() < 1e-9);
        assert!((s.goodput_share - 0.25).abs() < 1e-9);
        assert_eq!(s.per_endpoint, vec![("a".to_string(), 2)]);
    }
}
