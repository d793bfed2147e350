//! The pools' families: per endpoint (KV-event ingest, sync state, load,
//! failure tracking, pick history), per pool (saturation, configuration,
//! tokenization, picks, reports) and the `Session` streams.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType::{self, Counter, Gauge};

use super::{family, flag};
use crate::events::{IngestStatsSnapshot, SyncState};
use crate::health::HealthView;
use crate::load::{pool_saturation, LoadView};
use crate::metrics::{Counter as Count, PickDecision};
use crate::pool::{Endpoint, Pool};
use crate::pools::Pools;
use crate::tokenize::TokenizeMode;
use crate::types::IndexSource;

/// Reads [`Pools`] at each scrape.
#[derive(Debug)]
pub(super) struct PoolsCollector(pub(super) Arc<Pools>);

/// One endpoint's state, read once per scrape.
struct Row<'a> {
    pool: &'a str,
    endpoint: Arc<Endpoint>,
    load: LoadView,
    stats: Option<IngestStatsSnapshot>,
    state: Option<SyncState>,
    blocks: usize,
    history_blocks: Option<usize>,
    health: HealthView,
}

impl Row<'_> {
    fn labels(&self) -> [(&str, &str); 2] {
        [
            ("pool", self.pool),
            ("endpoint", &self.endpoint.spec.address),
        ]
    }
}

type Ingest = fn(&IngestStatsSnapshot) -> u64;
const INGEST: [(&str, &str, Ingest); 18] = [
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
    (
        "kvasir_indexer_kv_event_source_lookups_total",
        "Requests for the engine's /kv_event_sources (endpoints without an events address of their own).",
        |s| s.source_lookups,
    ),
    (
        "kvasir_indexer_kv_event_source_failures_total",
        "Requests for the engine's /kv_event_sources that gave nothing to subscribe to (unreachable, malformed, KV events off, no such route); the sync state is no_source until one does.",
        |s| s.source_failures,
    ),
    (
        "kvasir_indexer_kv_event_source_changes_total",
        "Times the engine advertised other KV-event sockets than those followed (a new engine process) and the subscriber moved to them.",
        |s| s.source_changes,
    ),
];

/// Integral or fractional: integers keep their exact text.
#[derive(Clone, Copy)]
enum Value {
    Int(u64),
    Real(f64),
}

type EndpointStat = fn(&Row<'_>) -> Value;
const ENDPOINT: [(&str, MetricType, &str, EndpointStat); 16] = [
    ("kvasir_indexer_indexed_blocks", Gauge, "Blocks the pool's prefix index holds for the endpoint (KV events, or the pick history with index picks).", |r| Value::Int(r.blocks as u64)),
    ("kvasir_indexer_endpoint_healthy", Gauge, "1 when the endpoint's /metrics scrapes succeed (picks use it), else 0.", |r| Value::Int(flag(r.load.healthy).into())),
    ("kvasir_indexer_endpoint_saturation", Gauge, "Endpoint saturation 0..1 from KV usage and waiting queue (1 = saturated or unhealthy).", |r| Value::Real(r.load.saturation)),
    ("kvasir_indexer_endpoint_saturated", Gauge, "1 when the endpoint is saturated (KV usage or waiting queue at its threshold; picks leave out KV-full ones, and every saturated one with saturation.leaveOutQueued).", |r| Value::Int(flag(r.load.saturated).into())),
    ("kvasir_indexer_endpoint_running", Gauge, "vllm:num_requests_running at the last scrape.", |r| Value::Int(r.load.engine.running.into())),
    ("kvasir_indexer_endpoint_waiting", Gauge, "vllm:num_requests_waiting at the last scrape.", |r| Value::Int(r.load.engine.waiting.into())),
    ("kvasir_indexer_endpoint_kv_usage", Gauge, "vllm:kv_cache_usage_perc at the last scrape (0..1).", |r| Value::Real(r.load.engine.kv_usage)),
    ("kvasir_indexer_endpoint_in_flight", Gauge, "Requests this indexer picked for the endpoint not yet reported done.", |r| Value::Int(r.load.in_flight.into())),
    ("kvasir_indexer_endpoint_queued_prefill_tokens", Gauge, "Prefill tokens of in-flight picks before their first token.", |r| Value::Int(r.load.queued_prefill_tokens)),
    ("kvasir_indexer_scrape_failures_total", Counter, "Failed /metrics scrapes of the endpoint.", |r| Value::Int(r.load.scrape_failures)),
    ("kvasir_indexer_endpoint_refused_marks_total", Counter, "Times the endpoint was marked unhealthy at once because its /metrics connection was refused (nobody listening), without waiting for unhealthyAfter failed scrapes.", |r| Value::Int(r.load.refused_marks)),
    ("kvasir_indexer_endpoint_failing", Gauge, "1 while the endpoint's recent requests mostly failed (DONE reports with ERROR or TIMEOUT): picks rank it after the others, and probe it after failures.coolDownMs.", |r| Value::Int(flag(r.health.failing).into())),
    ("kvasir_indexer_endpoint_error_ratio", Gauge, "Share of errors among the endpoint's recent outcomes (decayed with failures.halfLifeMs; 0 with none).", |r| Value::Real(r.health.error_ratio)),
    ("kvasir_indexer_endpoint_request_successes_total", Counter, "DONE reports with SUCCESS (or no outcome) for requests the endpoint served.", |r| Value::Int(r.health.successes)),
    ("kvasir_indexer_endpoint_request_failures_total", Counter, "DONE reports with ERROR or TIMEOUT for requests the endpoint served.", |r| Value::Int(r.health.failures)),
    ("kvasir_indexer_endpoint_ejections_total", Counter, "Times the endpoint turned failing (ranked after the others).", |r| Value::Int(r.health.ejections)),
];

type PoolStat = fn(&Pool) -> &Count;
const POOL_COUNTERS: [(&str, &str, PoolStat); 6] = [
    ("kvasir_indexer_tokenize_failures_total", "Tokenizations that failed (e.g. render timeouts); those picks went by load alone.", |p| &p.metrics.tokenize_failures),
    ("kvasir_indexer_tokenize_stopped_total", "Picks whose prompt was tokenized only as far as its cached prefix (no engine holds the rest).", |p| &p.metrics.tokenize_stopped),
    ("kvasir_indexer_tokenize_limited_total", "Picks whose tokenization stopped at the pool's tokenizeBudget (bytes, or a pre-token piece too long): the head was matched, the rest estimated.", |p| &p.metrics.tokenize_limited),
    ("kvasir_indexer_tokens_not_tokenized_total", "Estimated prompt tokens stopped or limited picks left untokenized (counted in their prompt length as an estimate).", |p| &p.metrics.tokens_not_tokenized),
    ("kvasir_indexer_chain_completions_skipped_total", "Stopped picks whose whole block chain was not computed afterwards (too many completions running); requests sharing their fresh part do not see it while they are in prefill.", |p| &p.metrics.chain_completions_skipped),
    ("kvasir_indexer_pick_invalid_total", "Picks refused with INVALID_ARGUMENT.", |p| &p.metrics.pick_invalid),
];

const SYNC_STATES: [(SyncState, &str); 6] = [
    (SyncState::Connecting, "connecting"),
    (SyncState::InSync, "in_sync"),
    (SyncState::Replaying, "replaying"),
    (SyncState::Resyncing, "resyncing"),
    (SyncState::Disconnected, "disconnected"),
    (SyncState::NoSource, "no_source"),
];

const OUTCOMES: [&str; 6] = [
    "success",
    "error",
    "cancelled",
    "timeout",
    "rejected",
    "client_error",
];

impl Collector for PoolsCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let pools: Vec<&Arc<Pool>> = self.0.iter().collect();
        let (rows, saturation) = rows(&pools);
        endpoint_families(&mut enc, &rows)?;
        pool_families(&mut enc, &pools, &saturation)?;
        session_families(&mut enc, &self.0)
    }
}

/// Every endpoint's row, and each pool's saturation and endpoint count
/// from the same views.
fn rows<'a>(pools: &[&'a Arc<Pool>]) -> (Vec<Row<'a>>, Vec<(f64, usize)>) {
    let now = Instant::now();
    let mut rows = Vec::new();
    let mut saturation = Vec::new();
    for p in pools {
        let eps = p.endpoints();
        let views = p.load.views(eps.iter().map(|e| e.id), now);
        saturation.push((pool_saturation(&views), eps.len()));
        for (e, v) in eps.iter().zip(views) {
            rows.push(Row {
                pool: &p.name,
                endpoint: Arc::clone(e),
                load: v,
                stats: e.subscriber.as_ref().map(|s| s.stats().snapshot()),
                state: e.sync_state(),
                blocks: p.indexed_blocks(e.id),
                history_blocks: p.history_blocks(e.id),
                health: p.failures.view(e.id, now),
            });
        }
    }
    (rows, saturation)
}

fn endpoint_families(enc: &mut DescriptorEncoder<'_>, rows: &[Row<'_>]) -> fmt::Result {
    for (name, help, f) in INGEST {
        let mut m = family(enc, name, Counter, help)?;
        for r in rows {
            if let Some(s) = &r.stats {
                m.sample(&r.labels(), f(s))?;
            }
        }
    }
    let name = "kvasir_indexer_sync_state";
    let help = "KV-event stream state per endpoint (1 for the current state).";
    let mut m = family(enc, name, Gauge, help)?;
    for r in rows {
        if let Some(state) = r.state {
            for (s, label) in SYNC_STATES {
                let [pool, endpoint] = r.labels();
                m.sample(&[pool, endpoint, ("state", label)], flag(state == s))?;
            }
        }
    }
    for (name, kind, help, f) in ENDPOINT {
        let mut m = family(enc, name, kind, help)?;
        for r in rows {
            match f(r) {
                Value::Int(v) => m.sample(&r.labels(), v)?,
                Value::Real(v) => m.sample(&r.labels(), v)?,
            }
        }
    }
    let name = "kvasir_indexer_scrape_age_seconds";
    let help = "Seconds since the endpoint's last successful scrape (absent before the first).";
    let mut m = family(enc, name, Gauge, help)?;
    for r in rows {
        if let Some(age) = r.load.last_scrape_age {
            m.sample(&r.labels(), age.as_secs_f64())?;
        }
    }
    let name = "kvasir_indexer_pick_history_blocks";
    let help = "Blocks of this replica's own pick history per endpoint (index picks, or approx tokenizer).";
    let mut m = family(enc, name, Gauge, help)?;
    for r in rows {
        if let Some(n) = r.history_blocks {
            m.sample(&r.labels(), n as u64)?;
        }
    }
    Ok(())
}

fn pool_families(
    enc: &mut DescriptorEncoder<'_>,
    pools: &[&Arc<Pool>],
    saturation: &[(f64, usize)],
) -> fmt::Result {
    let name = "kvasir_indexer_pool_saturation";
    let help = "Pool saturation: mean of healthy endpoints' saturation (1 when none is healthy).";
    let mut m = family(enc, name, Gauge, help)?;
    for (p, (sat, _)) in pools.iter().zip(saturation) {
        m.sample(&[("pool", &p.name)], *sat)?;
    }
    let name = "kvasir_indexer_pool_endpoints";
    let help = "Endpoints configured or discovered in the pool.";
    let mut m = family(enc, name, Gauge, help)?;
    for (p, (_, n)) in pools.iter().zip(saturation) {
        m.sample(&[("pool", &p.name)], *n as u64)?;
    }
    let name = "kvasir_indexer_index_source";
    let help =
        "Where the pool's prefix index comes from (1 for the configured one): events or picks.";
    let mut m = family(enc, name, Gauge, help)?;
    for p in pools {
        for source in IndexSource::ALL {
            let labels = [("pool", p.name.as_str()), ("source", source.as_str())];
            m.sample(&labels, flag(p.index_source == source))?;
        }
    }
    let name = "kvasir_indexer_tokenize_mode";
    let help = "The pool's tokenizer mode (1 for the configured one).";
    let mut m = family(enc, name, Gauge, help)?;
    for p in pools {
        let configured = p.tokenizer.mode();
        for mode in [
            TokenizeMode::Tokenizer,
            TokenizeMode::Render,
            TokenizeMode::Approx,
        ] {
            let labels = [("pool", p.name.as_str()), ("mode", mode.as_label())];
            m.sample(&labels, flag(configured == mode))?;
        }
    }
    for (name, help, f) in POOL_COUNTERS {
        let mut m = family(enc, name, Counter, help)?;
        for p in pools {
            m.sample(&[("pool", &p.name)], f(p).get())?;
        }
    }
    let name = "kvasir_indexer_picks_total";
    let help = "Picks answered, by decision (prefix, load, no_index, all_saturated, no_endpoints, response, unknown_response).";
    let mut m = family(enc, name, Counter, help)?;
    for p in pools {
        for (i, d) in PickDecision::KNOWN.into_iter().enumerate() {
            let labels = [("pool", p.name.as_str()), ("decision", d.as_label())];
            m.sample(&labels, p.metrics.picks[i].get())?;
        }
    }
    report_families(enc, pools)
}

fn report_families(enc: &mut DescriptorEncoder<'_>, pools: &[&Arc<Pool>]) -> fmt::Result {
    let name = "kvasir_indexer_reports_total";
    let help = "Reports received, by whether they matched an in-flight pick.";
    let mut m = family(enc, name, Counter, help)?;
    for p in pools {
        m.sample(
            &[("pool", &p.name), ("matched", "true")],
            p.metrics.reports_matched.get(),
        )?;
        m.sample(
            &[("pool", &p.name), ("matched", "false")],
            p.metrics.reports_unmatched.get(),
        )?;
    }
    let name = "kvasir_indexer_report_outcomes_total";
    let mut m = family(enc, name, Counter, "DONE reports by outcome.")?;
    for p in pools {
        for (i, o) in OUTCOMES.iter().enumerate() {
            let labels = [("pool", p.name.as_str()), ("outcome", o)];
            m.sample(&labels, p.metrics.reports_by_outcome[i].get())?;
        }
    }
    let name = "kvasir_indexer_picks_abandoned_total";
    let help = "Picks ended as never served right after they were answered, by why: admitted_locally (the filter gave up waiting and admitted the request itself, saying so in its report) or undelivered (the answer's stream was gone).";
    let mut m = family(enc, name, Counter, help)?;
    for p in pools {
        let a = &p.abandoned;
        m.sample(
            &[("pool", &p.name), ("why", "admitted_locally")],
            a.ended.get(),
        )?;
        m.sample(
            &[("pool", &p.name), ("why", "undelivered")],
            a.undelivered.get(),
        )?;
    }
    let name = "kvasir_indexer_picker_requests_total";
    let help = "Requests through the pool's endpoint picker (ext_proc), by what became of them: forwarded with an endpoint list, replied by the picker itself (401, 429, 503, ...), or ended otherwise (the gateway reset the exchange).";
    let mut m = family(enc, name, Counter, help)?;
    for p in pools {
        let c = &p.picker;
        let (all, fwd, rep) = (c.exchanges.get(), c.forwarded.get(), c.replied.get());
        let other = all.saturating_sub(fwd + rep);
        for (outcome, v) in [("forwarded", fwd), ("replied", rep), ("other", other)] {
            m.sample(&[("pool", &p.name), ("outcome", outcome)], v)?;
        }
    }
    let name = "kvasir_indexer_in_flight_expired_total";
    let help = "In-flight picks dropped after the lost-report timeout.";
    let mut m = family(enc, name, Counter, help)?;
    for p in pools {
        m.sample(&[("pool", &p.name)], p.metrics.in_flight_expired.get())?;
    }
    let name = "kvasir_indexer_cached_tokens_total";
    let help = "Cached prompt tokens of successful requests served by the picked endpoint: as predicted at pick time and as the engine reported (their ratio is the prediction accuracy).";
    let mut m = family(enc, name, Counter, help)?;
    for p in pools {
        let predicted = p.metrics.predicted_cached_tokens.get();
        m.sample(&[("pool", &p.name), ("kind", "predicted")], predicted)?;
        let reported = p.metrics.reported_cached_tokens.get();
        m.sample(&[("pool", &p.name), ("kind", "reported")], reported)?;
    }
    Ok(())
}

fn session_families(enc: &mut DescriptorEncoder<'_>, pools: &Pools) -> fmt::Result {
    let s = pools.session_metrics();
    let name = "kvasir_indexer_sessions_open";
    let help = "Session streams open (the filter keeps one per Envoy VM and indexer cluster).";
    family(enc, name, Gauge, help)?.sample(&[], s.open())?;
    let name = "kvasir_indexer_sessions_total";
    let help = "Session streams ever opened.";
    family(enc, name, Counter, help)?.sample(&[], s.opened_total())?;
    let name = "kvasir_indexer_session_calls_total";
    let help =
        "Calls received on session streams, by kind (pick, report, report_refused, invalid).";
    let mut m = family(enc, name, Counter, help)?;
    for (call, c) in [
        ("pick", &s.picks),
        ("report", &s.reports),
        ("report_refused", &s.failed_reports),
        ("invalid", &s.invalid),
    ] {
        m.sample(&[("call", call)], c.get())?;
    }
    Ok(())
}
