//! Engine statistics: what the engine counts, and the point-in-time view
//! `/metrics` shows (see [`crate::exposition`] for the page itself).

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

    /// Upper bounds of the buckets (without `+Inf`).
    pub fn bounds(&self) -> &'static [f64] {
        self.bounds
    }

    /// Observations per bucket (not cumulative); values above the last
    /// bound are in [`Histogram::count`] only.
    pub fn counts(&self) -> &[u64] {
        &self.counts
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
    /// `--scheduling-policy` (shown at /sim/info).
    pub scheduling_policy: &'static str,
}
