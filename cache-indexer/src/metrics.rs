//! The indexer's own Prometheus metrics: lock-free counters and histograms
//! updated on the hot path, and the text exposition `/metrics` serves.
//!
//! A tiny hand-rolled registry instead of a metrics crate: the set is fixed
//! (per pool, per endpoint, per decision / tokenize mode), updates are one
//! relaxed atomic add, and most values (index sizes, subscriber counters,
//! scraped load) are read from their owners at render time rather than
//! mirrored. Every metric is described in the cache-indexer README.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::scoring::Decision;
use crate::tokenize::TokenizeMode;

/// Bucket bounds (seconds) of latency histograms: 10 us .. 1 s, dense
/// around the pick targets (0.5 ms at 4k tokens, 2 ms at 32k).
pub const LATENCY_BUCKETS: [f64; 16] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.000_75, 0.001, 0.002, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 1.0,
];

/// A fixed-bucket histogram of durations.
#[derive(Debug)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    /// Records one duration.
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = LATENCY_BUCKETS.iter().position(|b| s <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(
            u64::try_from(d.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Writes the `_bucket`, `_sum` and `_count` samples.
    pub fn render(&self, w: &mut TextWriter, name: &str, labels: &[(&str, &str)]) {
        let mut cumulative = 0;
        for (i, bound) in LATENCY_BUCKETS.iter().enumerate() {
            cumulative += self.buckets[i].load(Ordering::Relaxed);
            let le = format!("{bound}");
            let mut l = labels.to_vec();
            l.push(("le", &le));
            w.sample(&format!("{name}_bucket"), &l, cumulative as f64);
        }
        let count = self.count();
        let mut l = labels.to_vec();
        l.push(("le", "+Inf"));
        w.sample(&format!("{name}_bucket"), &l, count as f64);
        w.sample(
            &format!("{name}_sum"),
            labels,
            self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
        );
        w.sample(&format!("{name}_count"), labels, count as f64);
    }
}

/// A relaxed atomic counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    /// Adds one.
    pub fn inc(&self) {
        self.add(1);
    }
    /// The value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Hot-path metrics of one pool.
#[derive(Debug, Default)]
pub struct PoolMetrics {
    /// Picks answered, by [`Decision::index`].
    pub picks: [Counter; 5],
    /// Picks refused as invalid (INVALID_ARGUMENT).
    pub pick_invalid: Counter,
    /// Pick latency inside the service (tokenize + match + score).
    pub pick_latency: Histogram,
    /// Tokenization latency by [`TokenizeMode::index`].
    pub tokenize_latency: [Histogram; 4],
    /// Tokenizations that failed for a reason other than the request
    /// (render timeouts...): the pick went on by load.
    pub tokenize_failures: Counter,
    /// Picks whose prompt was tokenized only up to where no engine (nor a
    /// pick in prefill) holds its blocks: the rest cannot be a hit.
    pub tokenize_stopped: Counter,
    /// Picks whose tokenization the pool's `tokenizeBudget` stopped.
    pub tokenize_limited: Counter,
    /// Estimated prompt tokens those picks did not tokenize.
    pub tokens_not_tokenized: Counter,
    /// Stopped picks whose whole chain was not computed afterwards because
    /// enough completions were already running.
    pub chain_completions_skipped: Counter,
    /// Reports that matched an in-flight pick.
    pub reports_matched: Counter,
    /// Reports for unknown request ids.
    pub reports_unmatched: Counter,
    /// DONE reports by outcome: success, error, cancelled, timeout, rejected,
    /// client_error.
    pub reports_by_outcome: [Counter; 6],
    /// In-flight picks dropped by the lost-report timeout.
    pub in_flight_expired: Counter,
    /// Predicted cached tokens of picks whose DONE report came from the
    /// picked endpoint.
    pub predicted_cached_tokens: Counter,
    /// Cached tokens those reports gave (usage.prompt_tokens_details).
    pub reported_cached_tokens: Counter,
}

impl PoolMetrics {
    /// Counts a pick.
    pub fn count_pick(&self, d: Decision) {
        self.picks[d.index()].inc();
    }
    /// Records a tokenization.
    pub fn observe_tokenize(&self, m: TokenizeMode, d: Duration) {
        self.tokenize_latency[m.index()].observe(d);
    }
}

/// `Session` stream metrics of one indexer (all pools).
#[derive(Debug, Default)]
pub struct SessionMetrics {
    opened: Counter,
    closed: Counter,
    /// Picks received on sessions.
    pub picks: Counter,
    /// Reports received on sessions.
    pub reports: Counter,
    /// Of those reports, the ones refused (unknown pool, no request id).
    pub failed_reports: Counter,
    /// Session requests with no call in them.
    pub invalid: Counter,
}

impl SessionMetrics {
    /// A stream opened.
    pub fn opened(&self) {
        self.opened.inc();
    }
    /// A stream's caller side ended.
    pub fn closed(&self) {
        self.closed.inc();
    }
    /// Streams open now.
    pub fn open(&self) -> u64 {
        self.opened.get().saturating_sub(self.closed.get())
    }
}

/// Builds Prometheus text exposition (format 0.0.4).
#[derive(Debug, Default)]
pub struct TextWriter {
    out: String,
}

impl TextWriter {
    /// An empty page.
    pub fn new() -> Self {
        Self::default()
    }

    /// `# HELP` and `# TYPE` lines; call once per metric, before its samples.
    pub fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    /// One sample line.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                self.out.push_str(k);
                self.out.push_str("=\"");
                escape_into(&mut self.out, v);
                self.out.push('"');
            }
            self.out.push('}');
        }
        self.out.push(' ');
        if value.is_nan() {
            self.out.push_str("NaN");
        } else if value.is_infinite() {
            self.out.push_str(if value > 0.0 { "+Inf" } else { "-Inf" });
        } else {
            let _ = write!(self.out, "{value}");
        }
        self.out.push('\n');
    }

    /// The page.
    pub fn finish(self) -> String {
        self.out
    }
}

fn escape_into(out: &mut String, v: &str) {
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// One metric with a sample per pool, labelled `pool`.
fn per_pool(
    w: &mut TextWriter,
    pools: &[&std::sync::Arc<crate::service::Pool>],
    name: &str,
    kind: &str,
    help: &str,
    value: impl Fn(&crate::service::Pool) -> f64,
) {
    w.header(name, kind, help);
    for p in pools {
        w.sample(name, &[("pool", &p.name)], value(p));
    }
}

/// Everything `/metrics` shows, rendered from the pools' current state.
pub fn render(pools: &crate::service::Pools) -> String {
    use crate::events::SyncState;
    use crate::service::Endpoint;
    use std::sync::Arc;
    use std::time::Instant;

    struct Row<'a> {
        pool: &'a str,
        endpoint: Arc<Endpoint>,
        load: crate::load::LoadView,
        stats: Option<crate::events::IngestStatsSnapshot>,
        state: Option<SyncState>,
        blocks: usize,
        history_blocks: Option<usize>,
    }
    let now = Instant::now();
    let pool_list: Vec<_> = pools.iter().collect();
    let mut rows: Vec<Row<'_>> = Vec::new();
    let mut pool_sat = Vec::new();
    for p in &pool_list {
        let eps = p.endpoints();
        let views = p.load.views(eps.iter().map(|e| e.id), now);
        pool_sat.push((
            p.name.as_str(),
            crate::load::pool_saturation(&views),
            eps.len(),
        ));
        for (e, v) in eps.iter().zip(views) {
            rows.push(Row {
                pool: &p.name,
                endpoint: Arc::clone(e),
                load: v,
                stats: e.subscriber.as_ref().map(|s| s.stats().snapshot()),
                state: e.sync_state(),
                blocks: p.indexed_blocks(e.id),
                history_blocks: p.history_blocks(e.id),
            });
        }
    }
    let mut w = TextWriter::new();

    type Stat = fn(&crate::events::IngestStatsSnapshot) -> u64;
    let ingest: [(&str, &str, Stat); 15] = [
        (
            "kvasir_indexer_event_messages_total",
            "KV-event messages received on the live socket.",
            |s| s.messages,
        ),
        (
            "kvasir_indexer_event_batches_applied_total",
            "KV-event batches applied to the index (live and replayed).",
            |s| s.batches_applied,
        ),
        (
            "kvasir_indexer_events_applied_total",
            "KV events applied to the index (all kinds).",
            |s| s.events_applied,
        ),
        (
            "kvasir_indexer_blocks_stored_total",
            "Blocks newly indexed from BlockStored events.",
            |s| s.blocks_stored,
        ),
        (
            "kvasir_indexer_blocks_removed_total",
            "Blocks removed from the index by BlockRemoved events.",
            |s| s.blocks_removed,
        ),
        (
            "kvasir_indexer_all_blocks_cleared_total",
            "AllBlocksCleared events applied.",
            |s| s.all_cleared,
        ),
        (
            "kvasir_indexer_events_skipped_total",
            "Events not indexed (non-GPU medium, other block size, unknown parent).",
            |s| s.skipped_events,
        ),
        (
            "kvasir_indexer_decode_errors_total",
            "Undecodable KV-event messages (skipped).",
            |s| s.decode_errors,
        ),
        (
            "kvasir_indexer_event_duplicates_total",
            "Live batches already applied through replay (dropped).",
            |s| s.duplicates,
        ),
        (
            "kvasir_indexer_event_gaps_total",
            "Gaps detected in KV-event sequence numbers.",
            |s| s.gaps,
        ),
        (
            "kvasir_indexer_replays_total",
            "Replay requests sent to the engine's replay socket.",
            |s| s.replays,
        ),
        (
            "kvasir_indexer_replayed_batches_total",
            "Batches received through replay and applied.",
            |s| s.replayed_batches,
        ),
        (
            "kvasir_indexer_replay_failures_total",
            "Replays that timed out or failed.",
            |s| s.replay_failures,
        ),
        (
            "kvasir_indexer_resyncs_total",
            "Times an endpoint was cleared and rebuilt because replay could not cover a gap.",
            |s| s.resyncs,
        ),
        (
            "kvasir_indexer_engine_restarts_total",
            "Engine restarts detected from the event stream.",
            |s| s.restarts,
        ),
    ];
    for (name, help, f) in ingest {
        w.header(name, "counter", help);
        for r in &rows {
            if let Some(s) = &r.stats {
                w.sample(
                    name,
                    &[("pool", r.pool), ("endpoint", &r.endpoint.spec.address)],
                    f(s) as f64,
                );
            }
        }
    }
    w.header(
        "kvasir_indexer_sync_state",
        "gauge",
        "KV-event stream state per endpoint (1 for the current state).",
    );
    for r in &rows {
        if let Some(state) = r.state {
            for (s, name) in [
                (SyncState::Connecting, "connecting"),
                (SyncState::InSync, "in_sync"),
                (SyncState::Replaying, "replaying"),
                (SyncState::Resyncing, "resyncing"),
                (SyncState::Disconnected, "disconnected"),
            ] {
                w.sample(
                    "kvasir_indexer_sync_state",
                    &[
                        ("pool", r.pool),
                        ("endpoint", &r.endpoint.spec.address),
                        ("state", name),
                    ],
                    f64::from(u8::from(state == s)),
                );
            }
        }
    }

    type Gauge = fn(&Row<'_>) -> f64;
    let gauges: [(&str, &str, &str, Gauge); 10] = [
        ("kvasir_indexer_indexed_blocks", "gauge", "Blocks the pool's prefix index holds for the endpoint (KV events, or the pick history with index picks).", |r| r.blocks as f64),
        ("kvasir_indexer_endpoint_healthy", "gauge", "1 when the endpoint's /metrics scrapes succeed (picks use it), else 0.", |r| f64::from(u8::from(r.load.healthy))),
        ("kvasir_indexer_endpoint_saturation", "gauge", "Endpoint saturation 0..1 from KV usage and waiting queue (1 = saturated or unhealthy).", |r| r.load.saturation),
        ("kvasir_indexer_endpoint_saturated", "gauge", "1 when the endpoint is saturated (KV usage or waiting queue at its threshold; picks leave out KV-full ones, and every saturated one with saturation.leaveOutQueued).", |r| f64::from(u8::from(r.load.saturated))),
        ("kvasir_indexer_endpoint_running", "gauge", "vllm:num_requests_running at the last scrape.", |r| f64::from(r.load.engine.running)),
        ("kvasir_indexer_endpoint_waiting", "gauge", "vllm:num_requests_waiting at the last scrape.", |r| f64::from(r.load.engine.waiting)),
        ("kvasir_indexer_endpoint_kv_usage", "gauge", "vllm:kv_cache_usage_perc at the last scrape (0..1).", |r| r.load.engine.kv_usage),
        ("kvasir_indexer_endpoint_in_flight", "gauge", "Requests this indexer picked for the endpoint not yet reported done.", |r| f64::from(r.load.in_flight)),
        ("kvasir_indexer_endpoint_queued_prefill_tokens", "gauge", "Prefill tokens of in-flight picks before their first token.", |r| r.load.queued_prefill_tokens as f64),
        ("kvasir_indexer_scrape_failures_total", "counter", "Failed /metrics scrapes of the endpoint.", |r| r.load.scrape_failures as f64),
    ];
    for (name, kind, help, f) in gauges {
        w.header(name, kind, help);
        for r in &rows {
            w.sample(
                name,
                &[("pool", r.pool), ("endpoint", &r.endpoint.spec.address)],
                f(r),
            );
        }
    }
    w.header(
        "kvasir_indexer_scrape_age_seconds",
        "gauge",
        "Seconds since the endpoint's last successful scrape (absent before the first).",
    );
    for r in &rows {
        if let Some(age) = r.load.last_scrape_age {
            w.sample(
                "kvasir_indexer_scrape_age_seconds",
                &[("pool", r.pool), ("endpoint", &r.endpoint.spec.address)],
                age.as_secs_f64(),
            );
        }
    }

    crate::health::render_metrics(&mut w, &pool_list);
    w.header(
        "kvasir_indexer_pool_saturation",
        "gauge",
        "Pool saturation: mean of healthy endpoints' saturation (1 when none is healthy).",
    );
    for (pool, sat, _) in &pool_sat {
        w.sample("kvasir_indexer_pool_saturation", &[("pool", pool)], *sat);
    }
    w.header(
        "kvasir_indexer_pool_endpoints",
        "gauge",
        "Endpoints configured or discovered in the pool.",
    );
    for (pool, _, n) in &pool_sat {
        w.sample(
            "kvasir_indexer_pool_endpoints",
            &[("pool", pool)],
            *n as f64,
        );
    }
    w.header(
        "kvasir_indexer_index_source",
        "gauge",
        "Where the pool's prefix index comes from (1 for the configured one): events or picks.",
    );
    for p in &pool_list {
        for source in crate::types::IndexSource::ALL {
            w.sample(
                "kvasir_indexer_index_source",
                &[("pool", &p.name), ("source", source.as_str())],
                f64::from(u8::from(p.index_source == source)),
            );
        }
    }
    w.header(
        "kvasir_indexer_tokenize_mode",
        "gauge",
        "The pool's tokenizer mode (1 for the configured one).",
    );
    for p in &pool_list {
        let m = p.tokenizer.mode();
        for mode in [
            TokenizeMode::Tokenizer,
            TokenizeMode::Render,
            TokenizeMode::Approx,
        ] {
            w.sample(
                "kvasir_indexer_tokenize_mode",
                &[("pool", &p.name), ("mode", mode.as_str())],
                f64::from(u8::from(m == mode)),
            );
        }
    }
    w.header(
        "kvasir_indexer_tokenize_duration_seconds",
        "histogram",
        "Time to turn a request into token ids, by how it was done.",
    );
    for p in &pool_list {
        for mode in TokenizeMode::ALL {
            let h = &p.metrics.tokenize_latency[mode.index()];
            if h.count() > 0 || mode == p.tokenizer.mode() {
                h.render(
                    &mut w,
                    "kvasir_indexer_tokenize_duration_seconds",
                    &[("pool", &p.name), ("mode", mode.as_str())],
                );
            }
        }
    }
    per_pool(
        &mut w,
        &pool_list,
        "kvasir_indexer_tokenize_failures_total",
        "counter",
        "Tokenizations that failed (e.g. render timeouts); those picks went by load alone.",
        |p| p.metrics.tokenize_failures.get() as f64,
    );
    per_pool(
        &mut w,
        &pool_list,
        "kvasir_indexer_tokenize_stopped_total",
        "counter",
        "Picks whose prompt was tokenized only as far as its cached prefix (no engine holds the rest).",
        |p| p.metrics.tokenize_stopped.get() as f64,
    );
    per_pool(
        &mut w,
        &pool_list,
        "kvasir_indexer_tokenize_limited_total",
        "counter",
        "Picks whose tokenization stopped at the pool's tokenizeBudget (bytes, or a pre-token piece too long): the head was matched, the rest estimated.",
        |p| p.metrics.tokenize_limited.get() as f64,
    );
    per_pool(
        &mut w,
        &pool_list,
        "kvasir_indexer_tokens_not_tokenized_total",
        "counter",
        "Estimated prompt tokens stopped or limited picks left untokenized (counted in their prompt length as an estimate).",
        |p| p.metrics.tokens_not_tokenized.get() as f64,
    );
    per_pool(
        &mut w,
        &pool_list,
        "kvasir_indexer_chain_completions_skipped_total",
        "counter",
        "Stopped picks whose whole block chain was not computed afterwards (too many completions running); requests sharing their fresh part do not see it while they are in prefill.",
        |p| p.metrics.chain_completions_skipped.get() as f64,
    );
    w.header(
        "kvasir_indexer_pick_duration_seconds",
        "histogram",
        "Pick latency inside the indexer (tokenize, match, score).",
    );
    for p in &pool_list {
        p.metrics.pick_latency.render(
            &mut w,
            "kvasir_indexer_pick_duration_seconds",
            &[("pool", &p.name)],
        );
    }
    w.header(
        "kvasir_indexer_picks_total",
        "counter",
        "Picks answered, by decision (prefix, load, no_index, all_saturated, no_endpoints).",
    );
    for p in &pool_list {
        for d in Decision::ALL {
            w.sample(
                "kvasir_indexer_picks_total",
                &[("pool", &p.name), ("decision", d.as_str())],
                p.metrics.picks[d.index()].get() as f64,
            );
        }
    }
    per_pool(
        &mut w,
        &pool_list,
        "kvasir_indexer_pick_invalid_total",
        "counter",
        "Picks refused with INVALID_ARGUMENT.",
        |p| p.metrics.pick_invalid.get() as f64,
    );
    w.header(
        "kvasir_indexer_reports_total",
        "counter",
        "Reports received, by whether they matched an in-flight pick.",
    );
    for p in &pool_list {
        w.sample(
            "kvasir_indexer_reports_total",
            &[("pool", &p.name), ("matched", "true")],
            p.metrics.reports_matched.get() as f64,
        );
        w.sample(
            "kvasir_indexer_reports_total",
            &[("pool", &p.name), ("matched", "false")],
            p.metrics.reports_unmatched.get() as f64,
        );
    }
    w.header(
        "kvasir_indexer_report_outcomes_total",
        "counter",
        "DONE reports by outcome.",
    );
    for p in &pool_list {
        for (i, o) in [
            "success",
            "error",
            "cancelled",
            "timeout",
            "rejected",
            "client_error",
        ]
        .iter()
        .enumerate()
        {
            w.sample(
                "kvasir_indexer_report_outcomes_total",
                &[("pool", &p.name), ("outcome", o)],
                p.metrics.reports_by_outcome[i].get() as f64,
            );
        }
    }
    per_pool(
        &mut w,
        &pool_list,
        "kvasir_indexer_in_flight_expired_total",
        "counter",
        "In-flight picks dropped after the lost-report timeout.",
        |p| p.metrics.in_flight_expired.get() as f64,
    );
    w.header("kvasir_indexer_cached_tokens_total", "counter", "Cached prompt tokens of successful requests served by the picked endpoint: as predicted at pick time and as the engine reported (their ratio is the prediction accuracy).");
    for p in &pool_list {
        w.sample(
            "kvasir_indexer_cached_tokens_total",
            &[("pool", &p.name), ("kind", "predicted")],
            p.metrics.predicted_cached_tokens.get() as f64,
        );
        w.sample(
            "kvasir_indexer_cached_tokens_total",
            &[("pool", &p.name), ("kind", "reported")],
            p.metrics.reported_cached_tokens.get() as f64,
        );
    }
    w.header(
        "kvasir_indexer_pick_history_blocks",
        "gauge",
        "Blocks of this replica's own pick history per endpoint (index picks, or approx tokenizer).",
    );
    for r in &rows {
        if let Some(n) = r.history_blocks {
            w.sample(
                "kvasir_indexer_pick_history_blocks",
                &[("pool", r.pool), ("endpoint", &r.endpoint.spec.address)],
                n as f64,
            );
        }
    }
    let m = pools.session_metrics();
    w.header(
        "kvasir_indexer_sessions_open",
        "gauge",
        "Session streams open (the filter keeps one per Envoy VM and indexer cluster).",
    );
    w.sample("kvasir_indexer_sessions_open", &[], m.open() as f64);
    w.header(
        "kvasir_indexer_sessions_total",
        "counter",
        "Session streams ever opened.",
    );
    w.sample("kvasir_indexer_sessions_total", &[], m.opened.get() as f64);
    w.header(
        "kvasir_indexer_session_calls_total",
        "counter",
        "Calls received on session streams, by kind (pick, report, report_refused, invalid).",
    );
    for (call, c) in [
        ("pick", &m.picks),
        ("report", &m.reports),
        ("report_refused", &m.failed_reports),
        ("invalid", &m.invalid),
    ] {
        w.sample(
            "kvasir_indexer_session_calls_total",
            &[("call", call)],
            c.get() as f64,
        );
    }
    w.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::parse_sample;

    #[test]
    fn histogram_renders_cumulative_buckets() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(5));
        h.observe(Duration::from_micros(300));
        h.observe(Duration::from_secs(5));
        let mut w = TextWriter::new();
        w.header("x_seconds", "histogram", "test");
        h.render(&mut w, "x_seconds", &[("pool", "p")]);
        let text = w.finish();
        assert!(
            text.contains("x_seconds_bucket{pool=\"p\",le=\"0.00001\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("x_seconds_bucket{pool=\"p\",le=\"0.0005\"} 2\n"));
        assert!(text.contains("x_seconds_bucket{pool=\"p\",le=\"1\"} 2\n"));
        assert!(text.contains("x_seconds_bucket{pool=\"p\",le=\"+Inf\"} 3\n"));
        assert!(text.contains("x_seconds_count{pool=\"p\"} 3\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            parse_sample(line).unwrap();
        }
    }

    #[test]
    fn label_values_are_escaped() {
        let mut w = TextWriter::new();
        w.sample("m", &[("a", "x\"y\\z\nw")], 1.5);
        w.sample("n", &[], f64::INFINITY);
        let text = w.finish();
        assert_eq!(text, "m{a=\"x\\\"y\\\\z\\nw\"} 1.5\nn +Inf\n");
        let s = parse_sample(text.lines().next().unwrap()).unwrap();
        assert_eq!(s.labels[0].1, "x\"y\\z\nw");
    }
}
