//! # kvasir-httpedge
//!
//! What Kvasir's server-side HTTP ports share. Today: the body limit of a
//! port whose routes take no request body (the cache-indexer's `/metrics`,
//! `/healthz` and `/readyz`; the controller's `http` and `metrics` ports).
//!
//! A crate of its own because the two binaries have no other server-side
//! crate in common: `kvasir-policy` and `kvasir-proto` build for the wasm
//! filter, where axum has no place.
//!
//! ```
//! use axum::{routing::get, Router};
//!
//! let app: Router = Router::new()
//!     .route("/healthz", get(|| async { "ok" }))
//!     .layer(axum::middleware::from_fn(kvasir_httpedge::limit_body));
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

/// Largest request body a port reads. Every route is a GET, so any body is
/// useless; up to this much is read and dropped, beyond it the request is
/// answered 413 without reading on. (Headers are bounded by hyper: 100 of
/// them in at most about 400 KiB, else 431.)
pub const MAX_REQUEST_BODY_BYTES: usize = 64 << 10;

/// Middleware (`axum::middleware::from_fn(limit_body)`): answers 413 for a
/// body over [`MAX_REQUEST_BODY_BYTES`], declared (`Content-Length`) or sent
/// (chunked), reading at most that much of it, and 400 for a body that
/// cannot be read; otherwise passes the request on with its body dropped.
pub async fn limit_body(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let too_large = || {
        (
            StatusCode::PAYLOAD_TOO_LARGE,
            [(header::CONNECTION, "close")],
            format!("request body over {MAX_REQUEST_BODY_BYTES} bytes: this port reads none\n"),
        )
            .into_response()
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_REQUEST_BODY_BYTES as u64) {
        return too_large();
    }
    let (parts, body) = req.into_parts();
    let mut data = body.into_data_stream();
    let mut read = 0usize;
    while let Some(chunk) = data.next().await {
        match chunk {
            Ok(c) => {
                read += c.len();
                if read > MAX_REQUEST_BODY_BYTES {
                    return too_large();
                }
            }
            Err(_) => {
                return (
                    StatusCode::BAD_REQUEST,
                    "the request body could not be read\n",
                )
                    .into_response()
            }
        }
    }
    next.run(axum::extract::Request::from_parts(
        parts,
        axum::body::Body::empty(),
    ))
    .await
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::extract::Request;
    use axum::routing::post;
    use axum::Router;
    use tower::ServiceExt;

    use super::*;

    /// A route that answers with the length of the body it was given.
    fn app() -> Router {
        Router::new()
            .route(
                "/",
                post(|body: axum::body::Bytes| async move { body.len().to_string() }),
            )
            .layer(axum::middleware::from_fn(limit_body))
    }

    async fn send(req: Request) -> (StatusCode, Option<String>, String) {
        let resp = app().oneshot(req).await.unwrap();
        let status = resp.status();
        let connection = resp
            .headers()
            .get(header::CONNECTION)
            .map(|v| v.to_str().unwrap().to_owned());
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        (
            status,
            connection,
            String::from_utf8(bytes.to_vec()).unwrap(),
        )
    }

    #[tokio::test]
    async fn a_body_at_the_limit_is_read_and_dropped() {
        let req = Request::post("/")
            .body(Body::from(vec![b'x'; MAX_REQUEST_BODY_BYTES]))
            .unwrap();
        assert_eq!(send(req).await, (StatusCode::OK, None, "0".into()));
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_413_declared_or_streamed() {
        let want = (
            StatusCode::PAYLOAD_TOO_LARGE,
            Some("close".to_owned()),
            format!("request body over {MAX_REQUEST_BODY_BYTES} bytes: this port reads none\n"),
        );
        let declared = Request::post("/")
            .header(header::CONTENT_LENGTH, MAX_REQUEST_BODY_BYTES + 1)
            .body(Body::empty())
            .unwrap();
        assert_eq!(send(declared).await, want);
        let chunks = futures::stream::iter(
            [vec![b'x'; MAX_REQUEST_BODY_BYTES], vec![b'y']].map(Ok::<_, std::convert::Infallible>),
        );
        let streamed = Request::post("/").body(Body::from_stream(chunks)).unwrap();
        assert_eq!(send(streamed).await, want);
    }

    #[tokio::test]
    async fn a_body_that_cannot_be_read_is_400() {
        let chunks = futures::stream::iter([Ok(vec![b'x']), Err(std::io::Error::other("reset"))]);
        let req = Request::post("/").body(Body::from_stream(chunks)).unwrap();
        let (status, _, text) = send(req).await;
        assert_eq!(
            (status, text.as_str()),
            (
                StatusCode::BAD_REQUEST,
                "the request body could not be read\n"
            )
        );
    }
}
