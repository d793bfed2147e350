//! One Redis server a store of the indexer reaches (the Responses records,
//! the budgets): a lazily opened multiplexed connection that every call
//! shares, each step (the connect included) bounded by the store's
//! timeout, and after a failure the server left alone for the retry delay,
//! so that a Redis that is down costs a pick an immediate
//! [`LinkError::Down`] instead of a timeout each time. A failed connection
//! is dropped; the next call after the delay connects anew.

use std::fmt::Display;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redis::aio::MultiplexedConnection;
use redis::AsyncConnectionConfig;

/// Why no connection was had.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LinkError {
    /// Failed recently; not tried again until the retry delay has passed.
    Down,
    /// The connect (or the wait for another call's) took longer than the
    /// timeout.
    Timeout,
    /// The connect failed.
    Failed(String),
}

/// A bounded link to one Redis server.
pub(crate) struct RedisLink {
    client: redis::Client,
    url: String,
    timeout: Duration,
    retry_after: Duration,
    /// The store's name in logs (`responses store`, `budgets`).
    store: &'static str,
    state: Mutex<LinkState>,
    /// One connect at a time: calls that find no connection wait for that
    /// connect (bounded) rather than each opening a socket.
    connecting: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct LinkState {
    conn: Option<MultiplexedConnection>,
    down_until: Option<Instant>,
}

impl RedisLink {
    /// A link to `url` (`redis://host:port[/db]`); connects on first use.
    pub(crate) fn open(
        url: &str,
        timeout: Duration,
        retry_after: Duration,
        store: &'static str,
    ) -> Result<Self, redis::RedisError> {
        Ok(RedisLink {
            client: redis::Client::open(url)?,
            url: url.to_string(),
            timeout,
            retry_after,
            store,
            state: Mutex::new(LinkState::default()),
            connecting: tokio::sync::Mutex::new(()),
        })
    }

    /// The server's URL.
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// The bound of one call.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// How long a failed server is left alone.
    pub(crate) fn retry_after(&self) -> Duration {
        self.retry_after
    }

    /// Whether calls are answered [`LinkError::Down`] now.
    pub(crate) fn resting(&self) -> bool {
        self.state
            .lock()
            .down_until
            .is_some_and(|t| Instant::now() < t)
    }

    /// The open connection, or a new one; `Down` while in the retry delay.
    pub(crate) async fn connection(&self) -> Result<MultiplexedConnection, LinkError> {
        if let Some(c) = self.ready()? {
            return Ok(c);
        }
        let _one = tokio::time::timeout(self.timeout, self.connecting.lock())
            .await
            .map_err(|_| LinkError::Timeout)?;
        // Another call may have connected, or failed, while this one waited.
        if let Some(c) = self.ready()? {
            return Ok(c);
        }
        let cfg = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        let conn = tokio::time::timeout(
            self.timeout,
            self.client
                .get_multiplexed_async_connection_with_config(&cfg),
        )
        .await;
        match conn {
            Ok(Ok(c)) => {
                self.state.lock().conn = Some(c.clone());
                tracing::info!(store = self.store, url = %self.url, "connected to redis");
                Ok(c)
            }
            Ok(Err(e)) => Err(self.failed(LinkError::Failed(e.to_string()))),
            Err(_) => Err(self.failed(LinkError::Timeout)),
        }
    }

    fn ready(&self) -> Result<Option<MultiplexedConnection>, LinkError> {
        let s = self.state.lock();
        if s.down_until.is_some_and(|t| Instant::now() < t) {
            return Err(LinkError::Down);
        }
        Ok(s.conn.clone())
    }

    /// Drops the connection and leaves the server alone for the retry
    /// delay (logged once per outage); returns `e` for the caller.
    pub(crate) fn failed<E: Display>(&self, e: E) -> E {
        let mut s = self.state.lock();
        if s.down_until.is_none_or(|t| Instant::now() >= t) {
            tracing::warn!(store = self.store, url = %self.url, error = %e, retry_in = ?self.retry_after, "redis unavailable");
        }
        s.conn = None;
        s.down_until = Some(Instant::now() + self.retry_after);
        e
    }
}

impl Display for LinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkError::Down => f.write_str("left alone after a failure"),
            LinkError::Timeout => f.write_str("connect timed out"),
            LinkError::Failed(e) => write!(f, "connect failed: {e}"),
        }
    }
}
