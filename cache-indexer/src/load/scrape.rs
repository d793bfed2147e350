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
        } else {
            http(e.to_string())
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

/// Whether `e` (or an error under it) is a refused connection. A timeout,
/// a reset or a bad status is not: a busy or restarting engine may cause
/// those, and they keep the count of failures in a row.
pub fn refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        let io = err.downcast_ref::<std::io::Error>();
        if io.is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused) {
            return true;
        }
        cur = err.source();
    }
    false
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
