//! The controller's two HTTP ports.
//!
//! - `http` ([`router`]): `/healthz`, `/readyz`, and the filter module that
//!   Envoy Gateway downloads (the URL in the `EnvoyExtensionPolicy`'s
//!   `code.http.url`), at its content-addressed path
//!   `/kvasir_filter-<sha256>.wasm` and at the fixed `/kvasir_filter.wasm`.
//! - `metrics` ([`metrics_router`]): `/metrics`, kept on its own port so
//!   that a scrape config or NetworkPolicy can open it alone.
//!
//! HEAD works wherever GET does; another method on a known path gets 405,
//! an unknown path 404. No route takes a request body: one over
//! [`kvasir_httpedge::MAX_REQUEST_BODY_BYTES`] is answered 413 on either
//! port, read no further than that.

use std::fmt;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::header::{
    CACHE_CONTROL, CONNECTION, CONTENT_TYPE, ETAG, IF_NONE_MATCH, RETRY_AFTER,
};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use kvasir_httpedge::limit_body;
use sha2::{Digest, Sha256};

use crate::metrics::Metrics;

/// The fixed path of the filter module on the `http` port: whatever
/// module this replica has. Kept for policies written with a plain URL;
/// during a rollout it may answer another module than the digest a policy
/// names, which [`content_addressed_path`] cannot.
pub const WASM_PATH: &str = "/kvasir_filter.wasm";

/// The content-addressed path of a module: `/kvasir_filter-<sha256>.wasm`
/// ([`kvasir_api::eep::module_file_name`]). A replica answers it only for
/// the module it has, never with other bytes. Any other digest is a 503
/// with `Connection: close` and `Retry-After: 1`: during a rollout the
/// Service mixes replicas of two versions, and Envoy Gateway's fetcher
/// retries a 5xx (not a 404) with backoff, on a new connection that may
/// reach a replica holding that module.
pub fn content_addressed_path(sha256: &str) -> String {
    format!("/{}", kvasir_api::eep::module_file_name(sha256))
}

/// Content type of `/metrics`: OpenMetrics 1.0, which is what
/// [`Metrics::render`] writes.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The filter module Envoy Gateway downloads (`EnvoyExtensionPolicy`
/// `code.http.url`): its bytes and their hex sha256, read once at start.
pub struct WasmModule {
    /// The module's bytes, served as they are.
    pub bytes: Vec<u8>,
    /// Lowercase hex sha256 of `bytes`: the policy's `sha256` and the `ETag`.
    pub sha256: String,
}

impl WasmModule {
    /// Reads the module at `path` and hashes it.
    pub fn load(path: &Path) -> std::io::Result<WasmModule> {
        let bytes = std::fs::read(path)?;
        let sha256 = format!("{:x}", Sha256::digest(&bytes));
        Ok(WasmModule { bytes, sha256 })
    }
}

// By hand: a derived Debug would print the whole module.
impl fmt::Debug for WasmModule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WasmModule")
            .field("len", &self.bytes.len())
            .field("sha256", &self.sha256)
            .finish()
    }
}

/// What the `http` port's handlers read.
#[derive(Clone, Debug)]
pub struct HttpState {
    /// The controller's metrics (unused by these routes today, but shared so
    /// that handlers can count what they serve).
    pub metrics: Arc<Metrics>,
    /// True once the watches have listed everything once.
    pub ready: tokio::sync::watch::Receiver<bool>,
    /// The filter module, when one is configured.
    pub wasm: Option<Arc<WasmModule>>,
}

/// The `http` port: `GET /healthz` (200 `ok` while the process serves),
/// `GET /readyz` (200 once `ready` is true, else 503 with a short reason),
/// `GET /kvasir_filter.wasm` and `GET /kvasir_filter-<sha256>.wasm` (the
/// module as `application/wasm` with its sha256 as a quoted `ETag`; 404
/// when none is configured, or for another digest). Anything else 404.
pub fn router(state: HttpState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route(WASM_PATH, get(wasm))
        .fallback(content_addressed)
        .with_state(state)
}

/// `GET`/`HEAD /kvasir_filter-<sha256>.wasm`: this replica's module, or a
/// retryable 503 for another digest ([`content_addressed_path`]);
/// everything else that no route took: 404.
async fn content_addressed(
    State(state): State<HttpState>,
    method: axum::http::Method,
    uri: axum::http::Uri,
    headers: HeaderMap,
) -> Response {
    let wanted = uri
        .path()
        .strip_prefix("/kvasir_filter-")
        .and_then(|rest| rest.strip_suffix(".wasm"));
    let Some(wanted) = wanted else {
        return StatusCode::NOT_FOUND.into_response();
    };
    if method != axum::http::Method::GET && method != axum::http::Method::HEAD {
        return StatusCode::METHOD_NOT_ALLOWED.into_response();
    }
    match &state.wasm {
        Some(m) if m.sha256 == wanted => {
            let mut r = wasm(State(state.clone()), headers).await;
            // This URL never names other bytes: caches may keep it.
            r.headers_mut().insert(
                CACHE_CONTROL,
                HeaderValue::from_static("public, max-age=31536000, immutable"),
            );
            if method == axum::http::Method::HEAD {
                *r.body_mut() = axum::body::Body::empty();
            }
            r
        }
        held => {
            let msg = match held {
                Some(m) => format!(
                    "this replica holds the module {} only; another may hold this one\n",
                    content_addressed_path(&m.sha256)
                ),
                None => "this replica holds no filter module; another may\n".to_owned(),
            };
            (
                StatusCode::SERVICE_UNAVAILABLE,
                [
                    (CONNECTION, HeaderValue::from_static("close")),
                    (RETRY_AFTER, HeaderValue::from_static("1")),
                ],
                msg,
            )
                .into_response()
        }
    }
}

/// The `metrics` port: `GET /metrics` in OpenMetrics text
/// ([`OPENMETRICS_CONTENT_TYPE`]). Anything else 404.
pub fn metrics_router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route("/metrics", get(render_metrics))
        .with_state(metrics)
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets the
/// requests in flight finish. Request bodies are limited
/// ([`kvasir_httpedge::limit_body`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let router = router.layer(axum::middleware::from_fn(limit_body));
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(state): State<HttpState>) -> Response {
    if *state.ready.borrow() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: the watches have not listed everything yet\n",
        )
            .into_response()
    }
}

async fn wasm(State(state): State<HttpState>, headers: HeaderMap) -> Response {
    let Some(module) = state.wasm else {
        return (StatusCode::NOT_FOUND, "no filter module configured\n").into_response();
    };
    let etag = format!("\"{}\"", module.sha256);
    // The hash is hex from `load`, but the field is public: a value that is
    // not a valid header only loses the ETag, not the module.
    let etag_header = HeaderValue::from_str(&etag).ok();
    let mut response = if etag_header.is_some() && if_none_match(&headers, &etag) {
        StatusCode::NOT_MODIFIED.into_response()
    } else {
        // Shares the module with the response instead of copying it for
        // every download.
        let body = Bytes::from_owner(ModuleBytes(module));
        (
            [(CONTENT_TYPE, HeaderValue::from_static("application/wasm"))],
            body,
        )
            .into_response()
    };
    let response_headers = response.headers_mut();
    if let Some(value) = etag_header {
        response_headers.insert(ETAG, value);
    }
    // The URL stays the same across controller versions while the module
    // changes, so caches must revalidate (cheaply, with the ETag).
    response_headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}

/// Whether `If-None-Match` names `etag` (strong or weak) or is `*`.
fn if_none_match(headers: &HeaderMap, etag: &str) -> bool {
    headers
        .get_all(IF_NONE_MATCH)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(str::trim)
        .any(|tag| tag == "*" || tag.strip_prefix("W/").unwrap_or(tag) == etag)
}

/// The module as a [`Bytes`] owner.
struct ModuleBytes(Arc<WasmModule>);

impl AsRef<[u8]> for ModuleBytes {
    fn as_ref(&self) -> &[u8] {
        &self.0.bytes
    }
}

async fn render_metrics(State(metrics): State<Arc<Metrics>>) -> Response {
    (
        [(
            CONTENT_TYPE,
            HeaderValue::from_static(OPENMETRICS_CONTENT_TYPE),
        )],
        metrics.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_httpedge::MAX_REQUEST_BODY_BYTES;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, SystemTime, UNIX_EPOCH};
    use tokio::sync::{oneshot, watch};
    use tokio::task::JoinHandle;
    use tokio::time::timeout;

    /// Bound on a whole test, so a hung server fails it instead of CI.
    const TEST_TIMEOUT: Duration = Duration::from_secs(20);

    /// A server on 127.0.0.1:0 and what it takes to stop it.
    struct Server {
        base: String,
        stop: oneshot::Sender<()>,
        task: JoinHandle<std::io::Result<()>>,
    }

    async fn start(router: Router) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local_addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve(listener, router, async move {
            // A dropped sender stops the server too.
            let _ = stopped.await;
        }));
        Server {
            base: format!("http://{addr}"),
            stop,
            task,
        }
    }

    impl Server {
        /// Stops the server and checks that `serve` returned Ok.
        async fn stop(self) {
            let _ = self.stop.send(());
            let result = timeout(Duration::from_secs(5), self.task)
                .await
                .expect("serve did not return after shutdown")
                .expect("serve task panicked");
            result.expect("serve failed");
        }
    }

    fn client() -> reqwest::Client {
        // No proxy: an HTTP_PROXY in the environment must not capture
        // requests to 127.0.0.1.
        reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("reqwest client")
    }

    /// The status a GET of `url` is answered with.
    async fn status_of(client: &reqwest::Client, url: String) -> reqwest::StatusCode {
        let response = client.get(&url).send().await;
        response
            .unwrap_or_else(|e| panic!("GET {url}: {e}"))
            .status()
    }

    fn state(ready: watch::Receiver<bool>, wasm: Option<Arc<WasmModule>>) -> HttpState {
        HttpState {
            metrics: Arc::new(Metrics::new()),
            ready,
            wasm,
        }
    }

    /// A file under the temp dir, unique to this process and call, removed
    /// on drop so that a failing test cleans up too.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(contents: &[u8]) -> TempFile {
            static SEQ: AtomicUsize = AtomicUsize::new(0);
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            let name = format!(
                "kvasir-controller-http-{}-{nanos}-{}.wasm",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::Relaxed)
            );
            let path = std::env::temp_dir().join(name);
            std::fs::write(&path, contents).expect("write temp file");
            TempFile(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// A module-like payload: the wasm header, then bytes that are not UTF-8
    /// and a length that is not a power of two.
    fn module_bytes() -> Vec<u8> {
        let mut bytes = b"\0asm\x01\0\0\0".to_vec();
        bytes.extend((0..70_001u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
        bytes
    }

    #[test]
    fn load_hashes_the_file() {
        let file = TempFile::new(b"abc");
        let module = WasmModule::load(&file.0).expect("load");
        assert_eq!(module.bytes, b"abc");
        // FIPS 180-2's sha256("abc").
        assert_eq!(
            module.sha256,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(!format!("{module:?}").contains("97, 98"));
    }

    #[test]
    fn load_of_a_missing_file_is_an_error() {
        let file = TempFile::new(b"");
        let path = file.0.clone();
        drop(file);
        let err = WasmModule::load(&path).expect_err("missing file");
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
    }

    #[tokio::test]
    async fn healthz_answers_get_and_head() {
        timeout(TEST_TIMEOUT, async {
            let (_ready_tx, ready) = watch::channel(false);
            let server = start(router(state(ready, None))).await;
            let client = client();
            let url = format!("{}/healthz", server.base);

            let response = client.get(&url).send().await.expect("GET /healthz");
            assert_eq!(response.status(), 200);
            assert_eq!(response.text().await.expect("body"), "ok");

            let response = client.head(&url).send().await.expect("HEAD /healthz");
            assert_eq!(response.status(), 200);
            assert!(response.bytes().await.expect("body").is_empty());

            let response = client.post(&url).send().await.expect("POST /healthz");
            assert_eq!(response.status(), 405);

            assert_eq!(
                status_of(&client, format!("{}/nope", server.base)).await,
                404
            );

            // /metrics lives on the other port only.
            assert_eq!(
                status_of(&client, format!("{}/metrics", server.base)).await,
                404
            );

            drop(client);
            server.stop().await;
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test]
    async fn readyz_follows_the_watch() {
        timeout(TEST_TIMEOUT, async {
            let (ready_tx, ready) = watch::channel(false);
            let server = start(router(state(ready, None))).await;
            let client = client();
            let url = format!("{}/readyz", server.base);

            let response = client.get(&url).send().await.expect("GET /readyz");
            assert_eq!(response.status(), 503);
            let reason = response.text().await.expect("body");
            assert!(reason.contains("not ready"), "{reason:?}");

            ready_tx.send(true).expect("receiver alive");
            let response = client.get(&url).send().await.expect("GET /readyz");
            assert_eq!(response.status(), 200);

            ready_tx.send(false).expect("receiver alive");
            let response = client.get(&url).send().await.expect("GET /readyz");
            assert_eq!(response.status(), 503);

            drop(client);
            server.stop().await;
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test]
    async fn wasm_is_served_with_its_sha256_as_etag() {
        timeout(TEST_TIMEOUT, async {
            let contents = module_bytes();
            let file = TempFile::new(&contents);
            let module = Arc::new(WasmModule::load(&file.0).expect("load"));
            let sha256 = module.sha256.clone();
            assert_eq!(sha256, format!("{:x}", Sha256::digest(&contents)));
            let (_ready_tx, ready) = watch::channel(false);
            let server = start(router(state(ready, Some(module)))).await;
            let client = client();
            let url = format!("{}{WASM_PATH}", server.base);
            let quoted = format!("\"{sha256}\"");

            // Served whether or not the controller is ready: Envoy may fetch
            // it from a replica that is still listing.
            let response = client.get(&url).send().await.expect("GET wasm");
            assert_eq!(response.status(), 200);
            let headers = response.headers().clone();
            assert_eq!(headers[CONTENT_TYPE], "application/wasm");
            assert_eq!(headers[ETAG].to_str().expect("ascii"), quoted);
            let body = response.bytes().await.expect("body");
            assert_eq!(body.len(), contents.len());
            assert!(body == contents, "body differs from the file");

            let response = client.head(&url).send().await.expect("HEAD wasm");
            assert_eq!(response.status(), 200);
            assert_eq!(response.headers()[ETAG].to_str().expect("ascii"), quoted);
            assert!(response.bytes().await.expect("body").is_empty());

            let response = client
                .get(&url)
                .header(IF_NONE_MATCH, format!("\"other\", {quoted}"))
                .send()
                .await
                .expect("conditional GET");
            assert_eq!(response.status(), 304);
            assert_eq!(response.headers()[ETAG].to_str().expect("ascii"), quoted);
            assert!(response.bytes().await.expect("body").is_empty());

            let response = client
                .get(&url)
                .header(IF_NONE_MATCH, "\"stale\"")
                .send()
                .await
                .expect("conditional GET");
            assert_eq!(response.status(), 200);
            assert!(response.bytes().await.expect("body") == contents);

            drop(client);
            server.stop().await;
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test]
    async fn wasm_is_served_at_its_content_addressed_path_only_for_its_digest() {
        timeout(TEST_TIMEOUT, async {
            let contents = module_bytes();
            let file = TempFile::new(&contents);
            let module = Arc::new(WasmModule::load(&file.0).expect("load"));
            let sha256 = module.sha256.clone();
            let (_ready_tx, ready) = watch::channel(false);
            let server = start(router(state(ready, Some(module)))).await;
            let client = client();
            let url = format!("{}{}", server.base, content_addressed_path(&sha256));
            assert!(
                url.ends_with(&format!("/kvasir_filter-{sha256}.wasm")),
                "{url}"
            );

            let response = client.get(&url).send().await.expect("GET wasm");
            assert_eq!(response.status(), 200);
            assert_eq!(response.headers()[CONTENT_TYPE], "application/wasm");
            assert_eq!(
                response.headers()[ETAG].to_str().expect("ascii"),
                format!("\"{sha256}\"")
            );
            assert!(response.headers()[CACHE_CONTROL]
                .to_str()
                .expect("ascii")
                .contains("immutable"));
            assert!(response.bytes().await.expect("body") == contents);

            let response = client.head(&url).send().await.expect("HEAD wasm");
            assert_eq!(response.status(), 200);
            assert!(response.bytes().await.expect("body").is_empty());

            // Another digest (an older or newer module during a rollout):
            // never these bytes under a name that promises others, but a
            // 5xx Envoy Gateway retries, on a new connection.
            let other = format!("{}{}", server.base, content_addressed_path(&"0".repeat(64)));
            let response = client.get(&other).send().await.expect("GET other");
            assert_eq!(response.status(), 503);
            assert_eq!(response.headers()[CONNECTION], "close");
            assert_eq!(response.headers()[RETRY_AFTER], "1");
            let text = response.text().await.expect("body");
            assert!(text.contains(&sha256), "{text}");

            // The fixed path still serves the module during a rollout.
            assert_eq!(
                status_of(&client, format!("{}{WASM_PATH}", server.base)).await,
                200
            );
            let response = client.post(&url).send().await.expect("POST wasm");
            assert_eq!(response.status(), 405);
            assert_eq!(
                status_of(&client, format!("{}/kvasir_filter-.wasmx", server.base)).await,
                404
            );

            drop(client);
            server.stop().await;
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test]
    async fn wasm_without_a_module_is_404() {
        timeout(TEST_TIMEOUT, async {
            let (_ready_tx, ready) = watch::channel(true);
            let server = start(router(state(ready, None))).await;
            let client = client();
            assert_eq!(
                status_of(&client, format!("{}{WASM_PATH}", server.base)).await,
                404
            );
            drop(client);
            server.stop().await;
        })
        .await
        .expect("test timed out");
    }

    #[tokio::test]
    async fn metrics_endpoint_serves_openmetrics() {
        timeout(TEST_TIMEOUT, async {
            let metrics = Arc::new(Metrics::new());
            metrics.reconciled(true, 0.1);
            metrics.programmed("ns", "pool", 42, 7.0);
            let server = start(metrics_router(Arc::clone(&metrics))).await;
            let client = client();
            let url = format!("{}/metrics", server.base);

            let response = client.get(&url).send().await.expect("GET /metrics");
            assert_eq!(response.status(), 200);
            assert_eq!(response.headers()[CONTENT_TYPE], OPENMETRICS_CONTENT_TYPE);
            let body = response.text().await.expect("body");
            assert!(body.ends_with("# EOF\n"), "{body}");
            assert!(
                body.lines()
                    .any(|l| l == "kvasir_controller_reconciles_total{result=\"ok\"} 1"),
                "{body}"
            );
            assert!(
                body.lines()
                    .any(|l| l
                        == "kvasir_controller_config_bytes{namespace=\"ns\",target=\"pool\"} 42"),
                "{body}"
            );

            // Each scrape renders afresh.
            metrics.set_leader(true);
            let body = client
                .get(&url)
                .send()
                .await
                .expect("GET /metrics")
                .text()
                .await
                .expect("body");
            assert!(
                body.lines().any(|l| l == "kvasir_controller_leader 1"),
                "{body}"
            );

            assert_eq!(
                status_of(&client, format!("{}/healthz", server.base)).await,
                404
            );

            drop(client);
            server.stop().await;
        })
        .await
        .expect("test timed out");
    }

    /// The status code of the answer to `head` (a request's head) and then
    /// `body` written in `chunk`-byte pieces on a raw connection to `base`,
    /// stopping early when the answer comes first.
    async fn raw_status(base: &str, head: &str, body: &[u8], chunk: usize) -> u16 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = base.trim_start_matches("http://");
        let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
        conn.write_all(head.as_bytes()).await.expect("head");
        let (mut rd, mut wr) = conn.into_split();
        let body = body.to_vec();
        let writer = tokio::spawn(async move {
            for piece in body.chunks(chunk) {
                if wr.write_all(piece).await.is_err() {
                    return;
                }
            }
            // Dropping the half would half-close the connection, which
            // hyper takes for a client gone before its answer.
            std::future::pending::<()>().await;
            drop(wr);
        });
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.windows(2).any(|w| w == b"\r\n") {
            let n = rd.read(&mut buf).await.expect("read the answer");
            assert!(n > 0, "closed without an answer to {head:?}");
            got.extend_from_slice(&buf[..n]);
        }
        writer.abort();
        let line = String::from_utf8_lossy(&got);
        line.split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or_else(|| panic!("{line}"))
    }

    /// A chunked body of `n` bytes in 16 KiB chunks.
    fn chunked(n: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for piece in vec![b'x'; n].chunks(16 << 10) {
            out.extend(format!("{:x}\r\n", piece.len()).as_bytes());
            out.extend(piece);
            out.extend(b"\r\n");
        }
        out.extend(b"0\r\n\r\n");
        out
    }

    #[tokio::test]
    async fn a_request_body_over_the_limit_is_413_on_both_ports() {
        timeout(TEST_TIMEOUT, async {
            let (_ready_tx, ready) = watch::channel(true);
            let http = start(router(state(ready, None))).await;
            let metrics = start(metrics_router(Arc::new(Metrics::new()))).await;
            let over = MAX_REQUEST_BODY_BYTES + 1;
            for (base, path) in [(&http.base, "/healthz"), (&metrics.base, "/metrics")] {
                // Declared: refused before a byte of it is read.
                let head = format!("GET {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n", 1u64 << 40);
                assert_eq!(raw_status(base, &head, b"", 1).await, 413, "{path} declared");
                // Sent chunked: refused once the limit is passed.
                let head = format!("GET {path} HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n");
                assert_eq!(raw_status(base, &head, &chunked(4 * over), 4096).await, 413, "{path} chunked");
                // Within the limit: read, dropped, answered.
                let head = format!("GET {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {MAX_REQUEST_BODY_BYTES}\r\n\r\n");
                let body = vec![b'x'; MAX_REQUEST_BODY_BYTES];
                assert_eq!(raw_status(base, &head, &body, 4096).await, 200, "{path} within");
                let head = format!("GET {path} HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n");
                assert_eq!(raw_status(base, &head, &chunked(1000), 4096).await, 200, "{path} small chunked");
            }
            http.stop().await;
            metrics.stop().await;
        })
        .await
        .expect("test timed out");
    }
}
