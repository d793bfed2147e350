//! An engine's own account of its load: the three vLLM gauges read from its
//! Prometheus text page (parsed by `kvasir-promtext`).

// Re-exported so `load::{parse_sample, Sample}` stay part of the indexer's
// API now that the generic parser is its own crate.
pub use kvasir_promtext::{parse_sample, Sample, SyntaxError};

/// What one scrape said.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct EngineLoad {
    /// `vllm:num_requests_running` (summed over series).
    pub running: u32,
    /// `vllm:num_requests_waiting` (summed).
    pub waiting: u32,
    /// `vllm:kv_cache_usage_perc` (mean over series), 0..1.
    pub kv_usage: f64,
}

/// Why a metrics page could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetricsParseError {
    /// A line of one of the metrics the indexer reads is not Prometheus
    /// text format.
    #[error("line {line}: {reason}")]
    Syntax {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: SyntaxError,
    },
    /// A metric the indexer needs is not there.
    #[error("no {0} in the metrics (is this a vLLM /metrics URL?)")]
    Missing(&'static str),
}

/// Reads the three load metrics from a vLLM `/metrics` page. Comment
/// lines, unknown metrics and (for robustness against exotic exporters)
/// unparsable lines of *other* metrics are ignored; a malformed line of one
/// of the three is an error. The pre-0.10 name `vllm:gpu_cache_usage_perc`
/// is accepted when the new one is absent.
pub fn parse_vllm_metrics(text: &str) -> Result<EngineLoad, MetricsParseError> {
    const RUNNING: &str = "vllm:num_requests_running";
    const WAITING: &str = "vllm:num_requests_waiting";
    const KV: &str = "vllm:kv_cache_usage_perc";
    const KV_OLD: &str = "vllm:gpu_cache_usage_perc";
    let (mut running, mut waiting) = (None::<f64>, None::<f64>);
    let (mut kv_sum, mut kv_n, mut old_sum, mut old_n) = (0.0, 0u32, 0.0, 0u32);
    for s in kvasir_promtext::samples_of(text, &[RUNNING, WAITING, KV, KV_OLD]) {
        let s = s.map_err(|e| MetricsParseError::Syntax {
            line: e.line,
            reason: e.reason,
        })?;
        if !s.value.is_finite() {
            continue;
        }
        match s.name {
            RUNNING => *running.get_or_insert(0.0) += s.value,
            WAITING => *waiting.get_or_insert(0.0) += s.value,
            KV => {
                kv_sum += s.value;
                kv_n += 1;
            }
            _ => {
                old_sum += s.value;
                old_n += 1;
            }
        }
    }
    let running = running.ok_or(MetricsParseError::Missing(RUNNING))?;
    let waiting = waiting.ok_or(MetricsParseError::Missing(WAITING))?;
    let kv_usage = match (kv_n, old_n) {
        (0, 0) => return Err(MetricsParseError::Missing(KV)),
        (0, n) => old_sum / f64::from(n),
        (n, _) => kv_sum / f64::from(n),
    };
    let count = |v: f64| v.max(0.0).round().min(f64::from(u32::MAX)) as u32;
    Ok(EngineLoad {
        running: count(running),
        waiting: count(waiting),
        kv_usage: kv_usage.clamp(0.0, 1.0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-8B"} 1.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-8B"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.25
vllm:num_requests_running_total_weird{x="y"} 100
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 7
vllm:cache_config_info{block_size="16",weird="a\"b,c}d"} 1 1700000000000
"#;

    #[test]
    fn parses_vllm_page() {
        let l = parse_vllm_metrics(VLLM).unwrap();
        assert_eq!(l.running, 5);
        assert_eq!(l.waiting, 1);
        assert!((l.kv_usage - 0.375).abs() < 1e-12);
    }

    #[test]
    fn missing_and_malformed_metrics_are_errors() {
        assert_eq!(
            parse_vllm_metrics("foo 1\n").unwrap_err(),
            MetricsParseError::Missing("vllm:num_requests_running")
        );
        let bad = "vllm:num_requests_running{a=\"b\"} x\n";
        assert!(matches!(
            parse_vllm_metrics(bad),
            Err(MetricsParseError::Syntax { line: 1, .. })
        ));
        let old = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc 0.5\n";
        assert_eq!(parse_vllm_metrics(old).unwrap().kv_usage, 0.5);
        // Garbage lines of other metrics do not break the page.
        let noisy = format!("{VLLM}\n!!!garbage\nother{{ 1\n");
        assert_eq!(parse_vllm_metrics(&noisy).unwrap().running, 5);
    }
}
