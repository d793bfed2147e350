use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::histograms::TextWriter;
use super::*;
use crate::load::{parse_sample, EngineLoad, LoadConfig, LoadTracker};
use crate::metrics::Histogram;
use crate::pool::Pool;
use crate::scoring::Weights;
use crate::tokenize::RequestTokenizer;
use crate::types::{EndpointSpec, IndexSource};

#[test]
fn histogram_renders_cumulative_buckets() {
    let h = Histogram::default();
    h.observe(Duration::from_micros(5));
    h.observe(Duration::from_micros(300));
    h.observe(Duration::from_secs(5));
    let mut text = String::new();
    let mut w = TextWriter { out: &mut text };
    w.header("x_seconds", "histogram", "test");
    w.histogram(&h, "x_seconds", &[("pool", "p")]);
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
    let mut text = String::new();
    let mut w = TextWriter { out: &mut text };
    w.sample("m", &[("a", "x\"y\\z\nw")], 1.5);
    w.sample("n", &[], f64::INFINITY);
    assert_eq!(text, "m{a=\"x\\\"y\\\\z\\nw\"} 1.5\nn +Inf\n");
    let s = parse_sample(text.lines().next().unwrap()).unwrap();
    assert_eq!(s.labels[0].1, "x\"y\\z\nw");
}

/// Families written through the library, as a test sees them.
#[derive(Debug)]
struct Fixed;

impl prometheus_client::collector::Collector for Fixed {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        family(&mut enc, "c_total", MetricType::Counter, "a counter")?.sample(&[], 3u64)?;
        let mut m = family(&mut enc, "g", MetricType::Gauge, "a gauge")?;
        m.sample(&[("a", "x\"y\\z\nw"), ("b", "1")], 1.5)?;
        m.sample(&[("a", "plain"), ("b", "2")], 7u64)
    }
}

#[test]
fn library_families_keep_the_0_0_4_layout() {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Fixed));
    let mut text = String::new();
    prometheus_client::encoding::text::encode_registry(&mut text, &registry).unwrap();
    let want = "# HELP c_total a counter\n# TYPE c_total counter\nc_total 3\n\
                # HELP g a gauge\n# TYPE g gauge\n\
                g{a=\"x\\\"y\\\\z\\nw\",b=\"1\"} 1.5\ng{a=\"plain\",b=\"2\"} 7\n";
    assert_eq!(text, want);
    let s = parse_sample(text.lines().nth(5).unwrap()).unwrap();
    assert_eq!(s.labels[0].1, "x\"y\\z\nw");
}

fn pools() -> Arc<Pools> {
    let make = |name: &str, source| {
        let pool = Pool::new(
            name,
            "m",
            4,
            RequestTokenizer::Approx,
            LoadTracker::new(LoadConfig::default()),
            Weights::default(),
        )
        .with_index(source, 1000);
        let specs = (0..2).map(EndpointSpec::loopback).collect();
        pool.set_endpoints(specs, |_| None);
        let e = pool.endpoints()[0].id;
        pool.load
            .record_scrape(e, Some(EngineLoad::default()), Instant::now());
        Arc::new(pool)
    };
    Arc::new(Pools::new(vec![
        make("a", IndexSource::Events),
        make("b", IndexSource::Picks),
    ]))
}

/// Every family the page had before `prometheus-client` wrote it, with
/// its type: names, types and label names are what dashboards, alerts
/// and the e2e tests read.
const FAMILIES: [(&str, &str); 116] = [
    ("kvasir_indexer_all_blocks_cleared_total", "counter"),
    ("kvasir_indexer_blocks_removed_total", "counter"),
    ("kvasir_indexer_blocks_stored_total", "counter"),
    ("kvasir_indexer_budget_keys", "gauge"),
    ("kvasir_indexer_budget_limited_total", "counter"),
    ("kvasir_indexer_budget_open_reservations", "gauge"),
    ("kvasir_indexer_budget_reports_total", "counter"),
    ("kvasir_indexer_budget_requests_total", "counter"),
    (
        "kvasir_indexer_budget_reservations_dropped_total",
        "counter",
    ),
    ("kvasir_indexer_budget_store", "gauge"),
    ("kvasir_indexer_budget_store_deferred_total", "counter"),
    ("kvasir_indexer_budget_store_down_picks_total", "counter"),
    ("kvasir_indexer_budget_store_errors_total", "counter"),
    ("kvasir_indexer_budget_store_local_reports_total", "counter"),
    ("kvasir_indexer_budget_tokens_limited_total", "counter"),
    ("kvasir_indexer_budget_tokens_overrun_total", "counter"),
    ("kvasir_indexer_budget_tokens_refunded_total", "counter"),
    ("kvasir_indexer_budget_tokens_reserved_total", "counter"),
    ("kvasir_indexer_budget_tokens_settled_total", "counter"),
    ("kvasir_indexer_budget_untracked_total", "counter"),
    ("kvasir_indexer_cached_tokens_total", "counter"),
    ("kvasir_indexer_chain_completions_skipped_total", "counter"),
    ("kvasir_indexer_decode_errors_total", "counter"),
    ("kvasir_indexer_endpoint_ejections_total", "counter"),
    ("kvasir_indexer_endpoint_error_ratio", "gauge"),
    ("kvasir_indexer_endpoint_failing", "gauge"),
    ("kvasir_indexer_endpoint_healthy", "gauge"),
    ("kvasir_indexer_endpoint_in_flight", "gauge"),
    ("kvasir_indexer_endpoint_kv_usage", "gauge"),
    ("kvasir_indexer_endpoint_queued_prefill_tokens", "gauge"),
    ("kvasir_indexer_endpoint_refused_marks_total", "counter"),
    ("kvasir_indexer_endpoint_request_failures_total", "counter"),
    ("kvasir_indexer_endpoint_request_successes_total", "counter"),
    ("kvasir_indexer_endpoint_running", "gauge"),
    ("kvasir_indexer_endpoint_saturated", "gauge"),
    ("kvasir_indexer_endpoint_saturation", "gauge"),
    ("kvasir_indexer_endpoint_waiting", "gauge"),
    ("kvasir_indexer_engine_restarts_total", "counter"),
    ("kvasir_indexer_event_batches_applied_total", "counter"),
    ("kvasir_indexer_event_duplicates_total", "counter"),
    ("kvasir_indexer_event_gaps_total", "counter"),
    ("kvasir_indexer_event_messages_total", "counter"),
    ("kvasir_indexer_events_applied_total", "counter"),
    ("kvasir_indexer_events_skipped_total", "counter"),
    ("kvasir_indexer_flow_cancelled_total", "counter"),
    ("kvasir_indexer_flow_control_enabled", "gauge"),
    ("kvasir_indexer_flow_in_transit", "gauge"),
    ("kvasir_indexer_flow_queue_length", "gauge"),
    ("kvasir_indexer_flow_queue_tenant_length", "gauge"),
    ("kvasir_indexer_flow_queue_tenant_tokens", "gauge"),
    ("kvasir_indexer_flow_queue_wait_seconds", "histogram"),
    ("kvasir_indexer_flow_queued_tokens_total", "counter"),
    ("kvasir_indexer_flow_queued_total", "counter"),
    ("kvasir_indexer_flow_released_tokens_total", "counter"),
    ("kvasir_indexer_flow_released_total", "counter"),
    ("kvasir_indexer_flow_reserve_total", "counter"),
    ("kvasir_indexer_flow_shed_tokens_total", "counter"),
    ("kvasir_indexer_flow_shed_total", "counter"),
    (
        "kvasir_indexer_flow_tenant_queue_wait_seconds_total",
        "counter",
    ),
    ("kvasir_indexer_flow_tenant_released_total", "counter"),
    ("kvasir_indexer_grpc_unauthenticated_total", "counter"),
    ("kvasir_indexer_grpc_unavailable_total", "counter"),
    ("kvasir_indexer_in_flight_expired_total", "counter"),
    ("kvasir_indexer_in_flight_unconfirmed", "gauge"),
    (
        "kvasir_indexer_in_flight_unconfirmed_expired_total",
        "counter",
    ),
    ("kvasir_indexer_index_source", "gauge"),
    ("kvasir_indexer_indexed_blocks", "gauge"),
    ("kvasir_indexer_kv_event_source_changes_total", "counter"),
    ("kvasir_indexer_kv_event_source_failures_total", "counter"),
    ("kvasir_indexer_kv_event_source_lookups_total", "counter"),
    ("kvasir_indexer_pick_duration_seconds", "histogram"),
    ("kvasir_indexer_pick_history_blocks", "gauge"),
    ("kvasir_indexer_pick_invalid_total", "counter"),
    ("kvasir_indexer_picks_total", "counter"),
    ("kvasir_indexer_picker_requests_total", "counter"),
    ("kvasir_indexer_picks_abandoned_total", "counter"),
    ("kvasir_indexer_picks_unaccounted_total", "counter"),
    ("kvasir_indexer_pool_endpoints", "gauge"),
    ("kvasir_indexer_pool_saturation", "gauge"),
    ("kvasir_indexer_pool_warm", "gauge"),
    ("kvasir_indexer_replay_failures_total", "counter"),
    ("kvasir_indexer_replayed_batches_total", "counter"),
    ("kvasir_indexer_replays_total", "counter"),
    ("kvasir_indexer_report_outcomes_total", "counter"),
    ("kvasir_indexer_reports_total", "counter"),
    ("kvasir_indexer_response_lookups_total", "counter"),
    ("kvasir_indexer_response_waits_total", "counter"),
    ("kvasir_indexer_responses_dropped_total", "counter"),
    ("kvasir_indexer_responses_entries", "gauge"),
    ("kvasir_indexer_responses_owner_kept_total", "counter"),
    ("kvasir_indexer_responses_recorded_total", "counter"),
    ("kvasir_indexer_responses_store", "gauge"),
    ("kvasir_indexer_responses_store_fallbacks_total", "counter"),
    ("kvasir_indexer_resyncs_total", "counter"),
    ("kvasir_indexer_scrape_age_seconds", "gauge"),
    ("kvasir_indexer_scrape_failures_total", "counter"),
    ("kvasir_indexer_session_calls_total", "counter"),
    ("kvasir_indexer_sessions_open", "gauge"),
    ("kvasir_indexer_sessions_shut_down_total", "counter"),
    ("kvasir_indexer_sessions_total", "counter"),
    ("kvasir_indexer_shared_load_local_only", "gauge"),
    ("kvasir_indexer_shared_load_peer_in_flight", "gauge"),
    (
        "kvasir_indexer_shared_load_peer_queued_prefill_tokens",
        "gauge",
    ),
    ("kvasir_indexer_shared_load_peer_pending_chains", "gauge"),
    (
        "kvasir_indexer_shared_load_peer_placements_total",
        "counter",
    ),
    ("kvasir_indexer_shared_load_peers", "gauge"),
    ("kvasir_indexer_shared_load_read_age_seconds", "gauge"),
    (
        "kvasir_indexer_shared_load_refused_entries_total",
        "counter",
    ),
    ("kvasir_indexer_shared_load_rounds_total", "counter"),
    ("kvasir_indexer_sync_state", "gauge"),
    ("kvasir_indexer_tokenize_duration_seconds", "histogram"),
    ("kvasir_indexer_tokenize_failures_total", "counter"),
    ("kvasir_indexer_tokenize_limited_total", "counter"),
    ("kvasir_indexer_tokenize_mode", "gauge"),
    ("kvasir_indexer_tokenize_stopped_total", "counter"),
    ("kvasir_indexer_tokens_not_tokenized_total", "counter"),
];

#[tokio::test]
async fn the_page_keeps_every_family_its_type_and_labels() {
    let pools = pools();
    let a = pools.get("a").unwrap();
    let pick = kvasir_proto::v1::PickRequest {
        pool: "a".into(),
        request_id: "r".into(),
        prompt: Some(kvasir_proto::v1::pick_request::Prompt::TokenIds(
            kvasir_proto::v1::TokenIds {
                ids: (0..40).collect(),
            },
        )),
        ..Default::default()
    };
    a.pick(pick).await.unwrap();
    let life = Arc::new(Lifecycle::new(
        &pools,
        tokio_util::sync::CancellationToken::new(),
    ));
    let text = Exposition::new(Arc::clone(&pools), life).render();
    assert!(!text.contains("# EOF"), "0.0.4 has no EOF marker");

    let mut typed = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(typed.insert(name, kind).is_none(), "TYPE twice: {name}");
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let s = parse_sample(line).unwrap_or_else(|e| panic!("`{line}`: {e}"));
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suf| s.name.strip_suffix(suf).filter(|b| typed.contains_key(b)))
            .unwrap_or(s.name);
        assert!(typed.contains_key(base), "{} before its TYPE", s.name);
    }
    assert_eq!(typed, BTreeMap::from(FAMILIES));

    for line in [
        "kvasir_indexer_picks_total{pool=\"a\",decision=\"prefix\"} 0\n",
        "kvasir_indexer_picks_total{pool=\"a\",decision=\"load\"} 1\n",
        "kvasir_indexer_picks_total{pool=\"a\",decision=\"unknown_response\"} 0\n",
        "kvasir_indexer_response_lookups_total{pool=\"b\",result=\"endpoint_restarted\"} 0\n",
        "kvasir_indexer_responses_dropped_total{pool=\"a\",reason=\"evicted\"} 0\n",
        "kvasir_indexer_responses_store_fallbacks_total{pool=\"a\",op=\"get\"} 0\n",
        "kvasir_indexer_responses_store{pool=\"a\",store=\"memory\"} 1\n",
        "kvasir_indexer_reports_total{pool=\"b\",matched=\"false\"} 0\n",
        "kvasir_indexer_report_outcomes_total{pool=\"a\",outcome=\"client_error\"} 0\n",
        "kvasir_indexer_cached_tokens_total{pool=\"a\",kind=\"predicted\"} 0\n",
        "kvasir_indexer_endpoint_in_flight{pool=\"a\",endpoint=\"127.0.0.1:8000\"} 1\n",
        "kvasir_indexer_endpoint_healthy{pool=\"a\",endpoint=\"127.0.0.1:8001\"} 0\n",
        "kvasir_indexer_index_source{pool=\"b\",source=\"picks\"} 1\n",
        "kvasir_indexer_tokenize_mode{pool=\"a\",mode=\"approx\"} 1\n",
        "kvasir_indexer_pool_endpoints{pool=\"a\"} 2\n",
        "kvasir_indexer_pool_warm{pool=\"a\"} 0\n",
        "kvasir_indexer_grpc_unauthenticated_total{reason=\"missing\"} 0\n",
        "kvasir_indexer_grpc_unavailable_total{reason=\"shutting_down\"} 0\n",
        "kvasir_indexer_picks_unaccounted_total{pool=\"b\",reason=\"pool_cap\"} 0\n",
        "kvasir_indexer_sessions_open 0\n",
        "kvasir_indexer_session_calls_total{call=\"report_refused\"} 0\n",
        "kvasir_indexer_pick_history_blocks{pool=\"b\",endpoint=\"127.0.0.1:8000\"} 0\n",
        "kvasir_indexer_pick_duration_seconds_bucket{pool=\"a\",le=\"0.00001\"} ",
        "kvasir_indexer_pick_duration_seconds_count{pool=\"a\"} 1\n",
        "kvasir_indexer_tokenize_duration_seconds_count{pool=\"a\",mode=\"token_ids\"} 1\n",
    ] {
        assert!(text.contains(line), "no `{line}` in\n{text}");
    }
}
