//! The indexer's HTTP side: `/metrics` (Prometheus text), `/healthz`
//! (process alive) and `/readyz` (200 only when every endpoint's KV-event
//! stream is in sync).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::service::Pools;

/// The HTTP routes over `pools`.
pub fn router(pools: Arc<Pools>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(pools)
}

async fn metrics(State(pools): State<Arc<Pools>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        crate::metrics::render(&pools),
    )
        .into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// Ready means: every endpoint of every pool has a subscriber whose stream
/// is in sync, so the index reflects the engines. A pool with no endpoints
/// (a discovered pool with no ready pods) does not hold readiness back.
async fn readyz(State(pools): State<Arc<Pools>>) -> Response {
    let (ready, not) = pools.readiness();
    if ready {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {} not in sync\n", not.join(", ")),
        )
            .into_response()
    }
}
