//! [`RedisStore`]: response records in a Redis server the replicas share
//! (`SET key value PX ttl`, `GET key`).
//!
//! Never in the way of a pick: every call, the connect included, is bounded
//! by the store timeout, and after a failure the store answers
//! [`StoreError::Down`] at once for the retry delay instead of trying again
//! on every pick (a Redis that is down would otherwise cost each pick for an
//! id this replica does not hold a timeout). One multiplexed connection
//! carries every call; a failed one is dropped and the next call after the
//! retry delay connects anew.

use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use redis::aio::MultiplexedConnection;
use redis::AsyncConnectionConfig;

use super::store::{Record, ResponseStore, StoreError};

/// A Redis server holding response records.
pub struct RedisStore {
    client: redis::Client,
    url: String,
    timeout: Duration,
    retry_after: Duration,
    state: Mutex<Conn>,
    /// One connect at a time: picks that miss while Redis is being reached
    /// wait for that connect (bounded) rather than each opening a socket.
    connecting: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct Conn {
    conn: Option<MultiplexedConnection>,
    down_until: Option<Instant>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.url)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store at `url` (`redis://host:port[/db]`); connects on first use.
    /// `timeout` bounds each call, `retry_after` is how long a failed store
    /// is left alone.
    pub fn new(url: &str, timeout: Duration, retry_after: Duration) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(|e| StoreError::Failed(e.to_string()))?;
        Ok(RedisStore {
            client,
            url: url.to_string(),
            timeout,
            retry_after,
            state: Mutex::new(Conn::default()),
            connecting: tokio::sync::Mutex::new(()),
        })
    }

    /// The open connection, or a new one; `Down` while in the retry delay.
    async fn connection(&self) -> Result<MultiplexedConnection, StoreError> {
        if let Some(c) = self.ready()? {
            return Ok(c);
        }
        let _one = tokio::time::timeout(self.timeout, self.connecting.lock())
            .await
            .map_err(|_| StoreError::Timeout)?;
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
                tracing::info!(url = %self.url, "responses store: connected to redis");
                Ok(c)
            }
            Ok(Err(e)) => Err(self.failed(StoreError::Failed(e.to_string()))),
            Err(_) => Err(self.failed(StoreError::Timeout)),
        }
    }

    fn ready(&self) -> Result<Option<MultiplexedConnection>, StoreError> {
        let s = self.state.lock();
        if s.down_until.is_some_and(|t| Instant::now() < t) {
            return Err(StoreError::Down);
        }
        Ok(s.conn.clone())
    }

    /// Drops the connection and leaves the store alone for the retry
    /// delay; returns `e` for the caller.
    fn failed(&self, e: StoreError) -> StoreError {
        let mut s = self.state.lock();
        if s.down_until.is_none_or(|t| Instant::now() >= t) {
            tracing::warn!(url = %self.url, error = %e, retry_in = ?self.retry_after, "responses store: redis unavailable; using this replica's records only");
        }
        s.conn = None;
        s.down_until = Some(Instant::now() + self.retry_after);
        e
    }

    async fn run<T: redis::FromRedisValue>(&self, cmd: redis::Cmd) -> Result<T, StoreError> {
        let mut conn = self.connection().await?;
        match tokio::time::timeout(self.timeout, cmd.query_async::<T>(&mut conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.failed(StoreError::Failed(e.to_string()))),
            Err(_) => Err(self.failed(StoreError::Timeout)),
        }
    }
}

impl ResponseStore for RedisStore {
    fn put<'a>(
        &'a self,
        key: &'a str,
        record: &'a Record,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
            let mut cmd = redis::cmd("SET");
            cmd.arg(key).arg(record.encode()).arg("PX").arg(ms);
            self.run::<()>(cmd).await
        })
    }

    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(async move {
            let mut cmd = redis::cmd("GET");
            cmd.arg(key);
            let v: Option<String> = self.run(cmd).await?;
            Ok(v.as_deref().and_then(Record::decode))
        })
    }

    fn kind(&self) -> &'static str {
        "redis"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_unreachable_server_fails_fast_then_is_left_alone() {
        // Port 1 on loopback: nothing listens, the connect is refused.
        let s = RedisStore::new(
            "redis://127.0.0.1:1",
            Duration::from_millis(200),
            Duration::from_secs(30),
        )
        .unwrap();
        let started = Instant::now();
        assert!(matches!(
            s.get("k").await,
            Err(StoreError::Failed(_) | StoreError::Timeout)
        ));
        assert_eq!(s.get("k").await, Err(StoreError::Down));
        let rec = Record {
            endpoint: "127.0.0.1:8000".into(),
            recorded_unix_ms: 1,
        };
        assert_eq!(
            s.put("k", &rec, Duration::from_secs(1)).await,
            Err(StoreError::Down)
        );
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn a_malformed_url_is_refused() {
        let e = RedisStore::new(
            "http://x",
            Duration::from_millis(1),
            Duration::from_millis(1),
        );
        assert!(matches!(e, Err(StoreError::Failed(_))), "{e:?}");
    }
}
