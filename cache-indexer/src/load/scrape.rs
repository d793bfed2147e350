//! Fetching the engines' `/metrics` pages into a [`LoadTracker`].

use std::time::{Duration, Instant};

use super::engine_metrics::{parse_vllm_metrics, EngineLoad, MetricsParseError};
use super::tracker::LoadTracker;
use crate::types::EndpointId;

/// Why one scrape failed (logged at debug, counted in metrics).
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// Nobody listens at the address (connection refused): the engine is
    /// gone, not slow.
    #[error("GET {url}: connection refused")]
    Refused {
        /// The metrics URL.
        url: String,
    },
    /// The connection was reset or closed before an answer: an engine
    /// going down (its listener closing while connections come in) or a
    /// network fault; a probe asks again.
    #[error("GET {url}: {message}")]
    Reset {
        /// The metrics URL.
        url: String,
        /// What happened.
        message: String,
    },
    /// Connection, timeout, or a non-2xx status.
    #[error("GET {url}: {message}")]
    Http {
        /// The metrics URL.
        url: String,
        /// What happened.
        message: String,
    },
    /// The page is not usable.
    #[error("GET {url}: {source}")]
    Parse {
        /// The metrics URL.
        url: String,
        /// Why.
        #[source]
        source: MetricsParseError,
    },
}

/// Fetches and parses one endpoint's metrics.
pub async fn scrape(
    client: &reqwest::Client,
    url: &str,
    timeout: Duration,
) -> Result<EngineLoad, ScrapeError> {
    let http = |message: String| ScrapeError::Http {
        url: url.to_string(),
        message,
    };
    let resp = client.get(url).timeout(timeout).send().await.map_err(|e| {
        if refused(&e) {
            ScrapeError::Refused {
                url: url.to_string(),
            }
        } else if io_kind(&e, is_reset) {
            ScrapeError::Reset {
                url: url.to_string(),
                message: with_sources(&e),
            }
        } else {
            http(with_sources(&e))
        }
    })?;
    if !resp.status().is_success() {
        return Err(http(format!("status {}", resp.status())));
    }
    let text = resp.text().await.map_err(|e| http(e.to_string()))?;
    parse_vllm_metrics(&text).map_err(|source| ScrapeError::Parse {
        url: url.to_string(),
        source,
    })
}

/// `e` and the errors under it ("error sending request" alone says
/// little).
fn with_sources(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(err) = cur {
        out.push_str(": ");
        out.push_str(&err.to_string());
        cur = err.source();
    }
    out
}

/// Whether `e` (or an error under it) is a refused connection. A timeout,
/// a reset or a bad status is not: a busy or restarting engine may cause
/// those, and they keep the count of failures in a row.
pub fn refused(e: &(dyn std::error::Error + 'static)) -> bool {
    io_kind(e, |k| k == std::io::ErrorKind::ConnectionRefused)
}

/// Whether an I/O error of a kind `want` accepts is `e` or under it.
fn io_kind(e: &(dyn std::error::Error + 'static), want: fn(std::io::ErrorKind) -> bool) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| want(io.kind()))
        {
            return true;
        }
        cur = err.source();
    }
    false
}

/// A connection cut under the request.
fn is_reset(k: std::io::ErrorKind) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        k,
        ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof
    )
}

/// Scrapes every target concurrently and records the results; returns the
/// failures (already counted in the tracker). A refused connection turns
/// its endpoint unhealthy at once ([`LoadTracker::record_refused`]); other
/// failures count toward `unhealthyAfter`.
pub async fn scrape_all(
    tracker: &LoadTracker,
    client: &reqwest::Client,
    targets: &[(EndpointId, String)],
    timeout: Duration,
) -> Vec<(EndpointId, ScrapeError)> {
    let results = futures::future::join_all(
        targets
            .iter()
            .map(|(id, url)| async move { (*id, scrape(client, url, timeout).await) }),
    )
    .await;
    let now = Instant::now();
    let mut failures = Vec::new();
    for (id, r) in results {
        match r {
            Ok(load) => tracker.record_scrape(id, Some(load), now),
            Err(e @ ScrapeError::Refused { .. }) => {
                tracker.record_refused(id);
                failures.push((id, e));
            }
            Err(e) => {
                tracker.record_scrape(id, None, now);
                failures.push((id, e));
            }
        }
    }
    failures
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn nobody_listening_is_refused_a_silent_engine_is_not() {
        let client = reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("client");
        let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}/metrics", closed.local_addr().expect("addr"));
        drop(closed);
        let e = scrape(&client, &url, Duration::from_secs(2))
            .await
            .unwrap_err();
        assert!(matches!(e, ScrapeError::Refused { .. }), "{e:?}");
        // Accepts connections and never answers: a busy engine, maybe.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!("http://{}/metrics", silent.local_addr().expect("addr"));
        let accept = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = silent.accept().await {
                held.push(s);
            }
        });
        let e = scrape(&client, &url, Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(matches!(e, ScrapeError::Http { .. }), "{e:?}");
        accept.abort();
    }
}
