//! The `/metrics` page: an engine [`Snapshot`] under vLLM's metric names,
//! encoded by `prometheus-client`.
//!
//! vLLM serves the Prometheus text format 0.0.4 (Python
//! `prometheus_client`); `prometheus-client` writes OpenMetrics text. The
//! two agree on samples, and the page stays 0.0.4 by handling where they
//! differ explicitly:
//!
//! - no `# EOF` line: only [`encode_registry`] is called, never `encode`;
//! - no `# UNIT` lines: no metric is registered with a unit;
//! - counters: the encoder appends `_total` to the samples of a counter
//!   family, so each is described under vLLM's name minus `_total` (the
//!   samples come out exactly as vLLM's), and the `# HELP`/`# TYPE` lines,
//!   which OpenMetrics writes under that family name, are renamed to the
//!   sample name, as 0.0.4 and vLLM have them;
//! - label values are escaped here: the encoder writes them verbatim.
//!
//! Histogram `le` values are written by the encoder as Python's client
//! writes them (`1.0`, `0.001`, `+Inf`), the bounds being vLLM's.

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode_registry;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::metrics::{Histogram, Snapshot, StaticInfo};

/// The content type of the page: the one vLLM serves.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Renders the page: Prometheus text exposition format 0.0.4.
pub fn render(snap: &Snapshot, info: &StaticInfo, requests_failed: u64) -> String {
    let labels = vec![
        ("engine", "0".to_owned()),
        ("model_name", escape(&info.model)),
    ];
    page(
        labels,
        EnginePage {
            snap: snap.clone(),
            info: info.clone(),
            requests_failed,
        },
    )
}

/// Encodes what `collector` writes, every sample carrying `labels` first.
fn page(labels: Vec<(&'static str, String)>, collector: impl Collector) -> String {
    let mut registry = Registry::with_labels(
        labels
            .into_iter()
            .map(|(k, v)| (Cow::Borrowed(k), Cow::Owned(v))),
    );
    registry.register_collector(Box::new(collector));
    let mut text = String::with_capacity(8192);
    // Writing into a String cannot fail.
    let _ = encode_registry(&mut text, &registry);
    counters_described_by_sample_name(&text)
}

/// Renames each counter family's `# HELP` and `# TYPE` lines from the
/// OpenMetrics family name (`vllm:prompt_tokens`) to its sample name
/// (`vllm:prompt_tokens_total`), which 0.0.4 parsers match samples by.
fn counters_described_by_sample_name(text: &str) -> String {
    let counters: HashSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(text.len() + 16 * counters.len());
    for line in text.lines() {
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let (name, rest) = line.strip_prefix(p)?.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{p}{name}_total {rest}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// A label value as the text format needs it.
fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// One scrape's worth of engine state.
#[derive(Debug)]
struct EnginePage {
    snap: Snapshot,
    info: StaticInfo,
    requests_failed: u64,
}

impl Collector for EnginePage {
    fn encode(&self, mut e: DescriptorEncoder) -> fmt::Result {
        let (snap, info, s) = (&self.snap, &self.info, &self.snap.stats);
        let e = &mut e;
        gauge(
            e,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            snap.running,
        )?;
        gauge(
            e,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            snap.waiting,
        )?;
        gauge(
            e,
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            snap.kv_usage,
        )?;
        counter(
            e,
            "vllm:prefix_cache_queries_total",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        )?;
        counter(
            e,
            "vllm:prefix_cache_hits_total",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        )?;
        counter(
            e,
            "vllm:prompt_tokens_total",
            "Number of prefill tokens processed.",
            s.prompt_tokens,
        )?;
        counter(
            e,
            "vllm:generation_tokens_total",
            "Number of generation tokens processed.",
            s.generation_tokens,
        )?;
        counter(
            e,
            "vllm:num_preemptions_total",
            "Cumulative number of preemption from the engine.",
            s.preemptions,
        )?;
        let mut m = e.encode_descriptor(
            family_of_counter("vllm:request_success_total"),
            "Count of successfully processed requests.",
            None,
            MetricType::Counter,
        )?;
        for (reason, v) in [
            ("length", s.finished_length),
            ("stop", s.finished_stop),
            ("abort", s.aborted),
        ] {
            ConstCounter::new(v).encode(m.encode_family(&[("finished_reason", reason)])?)?;
        }
        histogram(
            e,
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &s.ttft,
        )?;
        histogram(
            e,
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &s.itl,
        )?;
        histogram(
            e,
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &s.e2e,
        )?;
        let cache_config = [
            ("block_size", info.block_size.to_string()),
            ("num_gpu_blocks", info.num_gpu_blocks.to_string()),
            (
                "enable_prefix_caching",
                // Python's bool spelling, as vLLM's info gauge has it.
                if info.enable_prefix_caching {
                    "True"
                } else {
                    "False"
                }
                .to_owned(),
            ),
            ("cache_dtype", "auto".to_owned()),
        ];
        labelled_gauge(
            e,
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            &cache_config,
            1,
        )?;
        // Simulator-only facts live outside vllm's namespace so nobody
        // mistakes them for vLLM's.
        gauge(
            e,
            "vllm_sim:time_scale",
            "Wall-clock seconds per simulated second (0 = as fast as possible).",
            info.time_scale,
        )?;
        labelled_gauge(
            e,
            "vllm_sim:latency_profile_info",
            "The latency profile in use.",
            &[("profile", escape(&info.profile))],
            1,
        )?;
        gauge(
            e,
            "vllm_sim:cached_blocks",
            "Blocks holding a cached prefix hash.",
            snap.cached_blocks,
        )?;
        counter(
            e,
            "vllm_sim:virtual_seconds_total",
            "Simulated GPU time elapsed.",
            snap.virtual_time,
        )?;
        counter(
            e,
            "vllm_sim:prompt_tokens_computed_total",
            "Prompt tokens actually prefilled (uncached, incl. recomputation).",
            s.prompt_tokens_computed,
        )?;
        counter(
            e,
            "vllm_sim:prefill_seconds_total",
            "Simulated GPU time spent on prefill (the prefill terms of each step's cost); over elapsed simulated time it is the prefill utilisation.",
            s.prefill_seconds,
        )?;
        counter(
            e,
            "vllm_sim:requests_failed_total",
            "Requests failed by fault injection.",
            self.requests_failed,
        )
    }
}

/// The family a counter sample name belongs to: the encoder adds `_total`
/// back to every sample.
fn family_of_counter(sample_name: &'static str) -> &'static str {
    sample_name.strip_suffix("_total").unwrap_or(sample_name)
}

fn gauge<V>(e: &mut DescriptorEncoder, name: &'static str, help: &str, v: V) -> fmt::Result
where
    ConstGauge<V>: EncodeMetric,
{
    let g = ConstGauge::new(v);
    g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
}

fn labelled_gauge(
    e: &mut DescriptorEncoder,
    name: &'static str,
    help: &str,
    labels: &impl EncodeLabelSet,
    v: i64,
) -> fmt::Result {
    let mut m = e.encode_descriptor(name, help, None, MetricType::Gauge)?;
    ConstGauge::new(v).encode(m.encode_family(labels)?)
}

/// A counter under vLLM's sample name (which ends in `_total`).
fn counter<V>(e: &mut DescriptorEncoder, name: &'static str, help: &str, v: V) -> fmt::Result
where
    ConstCounter<V>: EncodeMetric,
{
    let c = ConstCounter::new(v);
    c.encode(e.encode_descriptor(family_of_counter(name), help, None, c.metric_type())?)
}

fn histogram(
    e: &mut DescriptorEncoder,
    name: &'static str,
    help: &str,
    h: &Histogram,
) -> fmt::Result {
    let mut buckets: Vec<(f64, u64)> = h
        .bounds()
        .iter()
        .copied()
        .zip(h.counts().iter().copied())
        .collect();
    // The encoder writes an upper bound of f64::MAX as `+Inf`; observations
    // above the last bound are counted there only.
    let above = h.count() - buckets.iter().map(|(_, n)| n).sum::<u64>();
    buckets.push((f64::MAX, above));
    e.encode_descriptor(name, help, None, MetricType::Histogram)?
        .encode_histogram::<NoLabelSet>(h.sum(), h.count(), &buckets, None)
}

#[cfg(test)]
#[path = "exposition_tests.rs"]
mod tests;
