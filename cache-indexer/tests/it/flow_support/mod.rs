//! In-process pools of the flow-control tests (`flow_*`, `budgets`): pool
//! "p" of idle loopback engines whose index is its own picks (block size
//! 16), with the given flow control, and the pick and report calls on it.
#![allow(dead_code)]

use kvasir_cache_indexer::load::{LoadConfig, LoadTracker};
use kvasir_cache_indexer::scoring::Weights;
use kvasir_cache_indexer::tokenize::RequestTokenizer;
use kvasir_cache_indexer::types::IndexSource;
use kvasir_cache_indexer::Pool;
use kvasir_flowcontrol::FlowControlConfig;
use kvasir_proto::v1 as pb;

/// Pool "p" of `engines` idle engines with `flow` as its flow control
/// (not yet shared: callers scrape or configure it first).
pub fn flow_pool(flow: FlowControlConfig, engines: usize) -> Pool {
    let pool = Pool::new(
        "p",
        "m",
        16,
        RequestTokenizer::Approx,
        LoadTracker::new(LoadConfig::default()),
        Weights::default(),
    )
    .with_index(IndexSource::Picks, 1 << 20)
    .with_flow_control(flow);
    pool.set_idle_loopback_endpoints(engines);
    pool
}

/// A pick the pool must answer (a valid request).
pub async fn pick(pool: &Pool, r: pb::PickRequest) -> pb::PickResponse {
    pool.pick(r).await.expect("a valid pick")
}

/// A successful report of `phase` for `request_id`.
pub fn report(pool: &Pool, request_id: &str, phase: pb::ReportPhase) {
    pool.report(&pb::ReportRequest {
        pool: "p".into(),
        request_id: request_id.into(),
        phase: phase as i32,
        outcome: pb::Outcome::Success as i32,
        ..Default::default()
    })
    .expect("a valid report");
}

/// `request_id` is done.
pub fn done(pool: &Pool, request_id: &str) {
    report(pool, request_id, pb::ReportPhase::Done);
}

/// `request_id` has its first token.
pub fn first_token(pool: &Pool, request_id: &str) {
    report(pool, request_id, pb::ReportPhase::FirstToken);
}
