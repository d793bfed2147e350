//! vLLM's small instrumentation endpoints (`entrypoints/serve/instrumentator/
//! basic.py`): `/load`, `/version` and `/kv_event_sources`.

use crate::config::KvEventsSettings;
use crate::publisher::BoundEndpoints;
use crate::state::AppState;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use axum::Json;
use futures::StreamExt;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The vLLM version the simulator answers as.
pub const VLLM_VERSION: &str = "0.34.0";

/// `GET /version`.
pub async fn version() -> Json<Value> {
    Json(json!({"version": VLLM_VERSION}))
}

/// `GET /load`: requests in flight on the load-aware routes; always 0
/// unless `--enable-server-load-tracking` (as in vLLM).
pub async fn load(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"server_load": st.apis.server_load.load(Ordering::Relaxed)}))
}

/// Counts a request on a load-aware route from its start until its
/// response body is done (streams included), as vLLM's `load_aware_call`.
pub async fn track_load(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if !st.apis.load_tracking {
        return next.run(req).await;
    }
    struct Done(Arc<AppState>);
    impl Drop for Done {
        fn drop(&mut self) {
            self.0.apis.server_load.fetch_sub(1, Ordering::Relaxed);
        }
    }
    st.apis.server_load.fetch_add(1, Ordering::Relaxed);
    let done = Done(st.clone());
    let (parts, body) = next.run(req).await.into_parts();
    let body = body.into_data_stream().map(move |chunk| {
        let _held = &done;
        chunk
    });
    Response::from_parts(parts, Body::from_stream(body))
}

/// The configured endpoint with the port the socket got when it asked
/// for port 0 (vLLM would advertise port 0, which no consumer can use).
fn advertised(configured: &str, bound: &str) -> String {
    match (configured.rsplit_once(':'), bound.rsplit_once(':')) {
        (Some((base, "0")), Some((_, port))) => format!("{base}:{port}"),
        _ => configured.to_string(),
    }
}

/// The body of `GET /kv_event_sources`: vLLM's `KVEventsConfig` of each
/// data-parallel rank's publisher, keyed by rank; `{}` with events off.
pub fn kv_event_sources(ev: &KvEventsSettings, bound: &BoundEndpoints, dp_rank: u32) -> Value {
    if !ev.enabled {
        return json!({});
    }
    let endpoint = advertised(&ev.advertised_endpoint, &bound.publish);
    let replay = match (&ev.advertised_replay, &bound.replay) {
        (Some(c), Some(b)) => json!(advertised(c, b)),
        (Some(c), None) => json!(c),
        _ => Value::Null,
    };
    json!({dp_rank.to_string(): {
        "enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": endpoint, "replay_endpoint": replay,
        "buffer_steps": ev.buffer_steps, "hwm": ev.hwm,
        "max_queue_size": ev.max_queue_size, "topic": ev.topic,
    }})
}

/// `GET /kv_event_sources`.
pub async fn kv_event_sources_handler(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(st.apis.kv_event_sources.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_carry_the_publisher_config() {
        let ev = KvEventsSettings {
            enabled: true,
            endpoint: "tcp://127.0.0.1:0".into(),
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            advertised_endpoint: "tcp://*:0".into(),
            advertised_replay: Some("tcp://*:5558".into()),
            topic: "kv".into(),
            buffer_steps: 7,
            hwm: 100_000,
            max_queue_size: 100_000,
        };
        let bound = BoundEndpoints {
            publish: "tcp://127.0.0.1:41000".into(),
            replay: Some("tcp://127.0.0.1:5558".into()),
        };
        let v = kv_event_sources(&ev, &bound, 3);
        let c = &v["3"];
        assert_eq!(c["endpoint"], "tcp://*:41000");
        assert_eq!(c["replay_endpoint"], "tcp://*:5558");
        assert_eq!(c["topic"], "kv");
        assert_eq!(c["buffer_steps"], 7);
        assert_eq!(c["publisher"], "zmq");
        let off = KvEventsSettings {
            enabled: false,
            ..ev
        };
        assert_eq!(kv_event_sources(&off, &bound, 0), json!({}));
    }
}
