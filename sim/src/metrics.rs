//! Engine statistics and their Prometheus exposition under vLLM's names.

use std::fmt::Write;

/// vLLM's TTFT histogram buckets (seconds).
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's inter-token latency buckets (seconds).
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's request latency buckets (seconds).
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A fixed-bucket histogram (cumulative on output).
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram with these upper bounds.
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one value.
    pub fn observe(&mut self, v: f64) {
        let v = if v.is_finite() { v.max(0.0) } else { 0.0 };
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of observations.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
    }
}

/// Everything the engine counts. Latencies are in the engine's virtual
/// seconds (the modelled GPU's time, independent of `--time-scale`).
#[derive(Debug, Clone)]
pub struct EngineStats {
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: u64,
    /// Of those, tokens found.
    pub prefix_cache_hits: u64,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// Prompt tokens actually computed (uncached, incl. recomputation).
    pub prompt_tokens_computed: u64,
    /// Simulated seconds spent on prefill (the prefill terms of each step).
    pub prefill_seconds: f64,
    /// Requests finished by length.
    pub finished_length: u64,
    /// Requests finished by stop.
    pub finished_stop: u64,
    /// Requests aborted by their client.
    pub aborted: u64,
    /// Recompute preemptions.
    pub preemptions: u64,
    /// Engine steps run.
    pub steps: u64,
    /// Time to first token.
    pub ttft: Histogram,
    /// Inter-token latency.
    pub itl: Histogram,
    /// End-to-end request latency.
    pub e2e: Histogram,
}

impl Default for EngineStats {
    fn default() -> Self {
        EngineStats {
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            prompt_tokens_computed: 0,
            prefill_seconds: 0.0,
            finished_length: 0,
            finished_stop: 0,
            aborted: 0,
            preemptions: 0,
            steps: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }
}

/// A point-in-time view of the engine for `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Counters and histograms.
    pub stats: EngineStats,
    /// Requests running.
    pub running: usize,
    /// Requests waiting.
    pub waiting: usize,
    /// Fraction of KV blocks in use.
    pub kv_usage: f64,
    /// Blocks holding a cached hash.
    pub cached_blocks: usize,
    /// Engine virtual time, seconds.
    pub virtual_time: f64,
}

/// Static facts for the info gauges.
#[derive(Debug, Clone)]
pub struct StaticInfo {
    /// Served model name.
    pub model: String,
    /// Tokens per block.
    pub block_size: usize,
    /// KV capacity.
    pub num_gpu_blocks: usize,
    /// Prefix caching on.
    pub enable_prefix_caching: bool,
    /// Latency profile name.
    pub profile: String,
    /// Wall seconds per virtual second.
    pub time_scale: f64,
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn metric(
    out: &mut String,
    kind: &str,
    name: &str,
    help: &str,
    labels: &str,
    v: impl std::fmt::Display,
) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {v}"
    );
}

/// Renders Prometheus text exposition format 0.0.4.
pub fn render(snap: &Snapshot, info: &StaticInfo, requests_failed: u64) -> String {
    let mut o = String::with_capacity(8192);
    let l = format!("engine=\"0\",model_name=\"{}\"", esc(&info.model));
    let s = &snap.stats;
    metric(
        &mut o,
        "gauge",
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        &l,
        snap.running,
    );
    metric(
        &mut o,
        "gauge",
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        &l,
        snap.waiting,
    );
    metric(
        &mut o,
        "gauge",
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        &l,
        snap.kv_usage,
    );
    metric(
        &mut o,
        "counter",
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        &l,
        s.prefix_cache_queries,
    );
    metric(
        &mut o,
        "counter",
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        &l,
        s.prefix_cache_hits,
    );
    metric(
        &mut o,
        "counter",
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        &l,
        s.prompt_tokens,
    );
    metric(
        &mut o,
        "counter",
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        &l,
        s.generation_tokens,
    );
    metric(
        &mut o,
        "counter",
        "vllm:num_preemptions_total",
        "Cumulative number of preemption from the engine.",
        &l,
        s.preemptions,
    );
    let _ = writeln!(o, "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter");
    for (reason, v) in [
        ("length", s.finished_length),
        ("stop", s.finished_stop),
        ("abort", s.aborted),
    ] {
        let _ = writeln!(
            o,
            "vllm:request_success_total{{{l},finished_reason=\"{reason}\"}} {v}"
        );
    }
    s.ttft.render(
        &mut o,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &l,
    );
    s.itl.render(
        &mut o,
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &l,
    );
    s.e2e.render(
        &mut o,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        &l,
    );
    let ci = format!(
        "{l},block_size=\"{}\",num_gpu_blocks=\"{}\",enable_prefix_caching=\"{}\",cache_dtype=\"auto\"",
        info.block_size,
        info.num_gpu_blocks,
        if info.enable_prefix_caching { "True" } else { "False" }
    );
    metric(
        &mut o,
        "gauge",
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        &ci,
        1,
    );
    // Simulator-only facts live outside vllm's namespace so nobody mistakes them for vLLM's.
    metric(
        &mut o,
        "gauge",
        "vllm_sim:time_scale",
        "Wall-clock seconds per simulated second (0 = as fast as possible).",
        &l,
        info.time_scale,
    );
    let pl = format!("{l},profile=\"{}\"", esc(&info.profile));
    metric(
        &mut o,
        "gauge",
        "vllm_sim:latency_profile_info",
        "The latency profile in use.",
        &pl,
        1,
    );
    metric(
        &mut o,
        "gauge",
        "vllm_sim:cached_blocks",
        "Blocks holding a cached prefix hash.",
        &l,
        snap.cached_blocks,
    );
    metric(
        &mut o,
        "counter",
        "vllm_sim:virtual_seconds_total",
        "Simulated GPU time elapsed.",
        &l,
        snap.virtual_time,
    );
    metric(
        &mut o,
        "counter",
        "vllm_sim:prompt_tokens_computed_total",
        "Prompt tokens actually prefilled (uncached, incl. recomputation).",
        &l,
        s.prompt_tokens_computed,
    );
    metric(
        &mut o,
        "counter",
        "vllm_sim:prefill_seconds_total",
        "Simulated GPU time spent on prefill (the prefill terms of each step's cost); over elapsed simulated time it is the prefill utilisation.",
        &l,
        s.prefill_seconds,
    );
    metric(
        &mut o,
        "counter",
        "vllm_sim:requests_failed_total",
        "Requests failed by fault injection.",
        &l,
        requests_failed,
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_cumulates() {
        let mut h = Histogram::new(&[1.0, 2.0]);
        h.observe(0.5);
        h.observe(1.5);
        h.observe(9.0);
        let mut s = String::new();
        h.render(&mut s, "x", "h", "a=\"b\"");
        assert!(s.contains("x_bucket{a=\"b\",le=\"1\"} 1"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"2\"} 2"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3"));
        assert!(s.contains("x_count{a=\"b\"} 3"));
    }
}
