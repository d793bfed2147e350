//! The indexer's HTTP side: `/metrics` (Prometheus text), `/healthz`
//! (process alive) and `/readyz` (200 only once every pool is warm and
//! every endpoint's KV-event stream is in sync, until shutdown). No route
//! takes a request body: one over
//! [`kvasir_httpedge::MAX_REQUEST_BODY_BYTES`] is answered 413, read no
//! further than that.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::exposition::Exposition;
use crate::lifecycle::Lifecycle;
use crate::pools::Pools;

type Shared = (Arc<Pools>, Arc<Lifecycle>, Arc<Exposition>);

/// The HTTP routes over `pools`.
pub fn router(pools: Arc<Pools>, life: Arc<Lifecycle>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state((
            Arc::clone(&pools),
            Arc::clone(&life),
            Arc::new(Exposition::new(pools, life)),
        ))
        .layer(axum::middleware::from_fn(kvasir_httpedge::limit_body))
}

async fn metrics(State((_, _, page)): State<Shared>) -> Response {
    let text = page.render();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// Ready means: not shutting down, every pool warm (endpoints known and
/// scraped once), and every endpoint of every pool has a subscriber whose
/// stream is in sync, so the index reflects the engines. A pool with no
/// endpoints (a discovered pool with no ready pods) does not hold
/// readiness back once discovery has said so.
async fn readyz(State((pools, life, _)): State<Shared>) -> Response {
    let unavailable = |why: String| (StatusCode::SERVICE_UNAVAILABLE, why).into_response();
    if life.shutting_down() {
        return unavailable("not ready: shutting down\n".into());
    }
    let cold = life.cold_pools();
    if !cold.is_empty() {
        return unavailable(format!(
            "not ready: warming up: pools {} not scraped yet\n",
            cold.join(", ")
        ));
    }
    let (ready, not) = pools.readiness();
    if ready {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        unavailable(format!("not ready: {} not in sync\n", not.join(", ")))
    }
}
