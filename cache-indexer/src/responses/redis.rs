//! [`RedisStore`]: response records in a Redis server the replicas share
//! (`SET key value NX PX ttl`, `GET key`).
//!
//! Never in the way of a pick: every call, the connect included, is bounded
//! by the store timeout, and after a failure the store answers
//! [`StoreError::Down`] at once for the retry delay instead of trying again
//! on every pick (a Redis that is down would otherwise cost each pick for an
//! id this replica does not hold a timeout). One multiplexed connection
//! carries every call; a failed one is dropped and the next call after the
//! retry delay connects anew.

use std::time::Duration;

use futures::future::BoxFuture;

use super::store::{Record, ResponseStore, StoreError};
use crate::redis_link::{LinkError, RedisLink};

/// A Redis server holding response records.
pub struct RedisStore {
    /// While it is down, each replica answers from its own records.
    link: RedisLink,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.link.url())
            .field("timeout", &self.link.timeout())
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store at `url` (`redis://host:port[/db]`); connects on first use.
    /// `timeout` bounds each call, `retry_after` is how long a failed store
    /// is left alone.
    pub fn new(url: &str, timeout: Duration, retry_after: Duration) -> Result<Self, StoreError> {
        let link = RedisLink::open(url, timeout, retry_after, "responses store")
            .map_err(|e| StoreError::Failed(e.to_string()))?;
        Ok(RedisStore { link })
    }

    async fn run<T: redis::FromRedisValue>(&self, cmd: redis::Cmd) -> Result<T, StoreError> {
        let mut conn = self.link.connection().await?;
        let timeout = self.link.timeout();
        match tokio::time::timeout(timeout, cmd.query_async::<T>(&mut conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.link.failed(StoreError::Failed(e.to_string()))),
            Err(_) => Err(self.link.failed(StoreError::Timeout)),
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
            // NX: the first record of a response stands (it names the
            // response's owner); a repeated report of the same response
            // finds it there.
            let mut cmd = redis::cmd("SET");
            cmd.arg(key)
                .arg(record.encode())
                .arg("NX")
                .arg("PX")
                .arg(ms);
            self.run::<Option<String>>(cmd).await.map(|_| ())
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

impl From<LinkError> for StoreError {
    fn from(e: LinkError) -> Self {
        match e {
            LinkError::Down => StoreError::Down,
            LinkError::Timeout => StoreError::Timeout,
            LinkError::Failed(m) => StoreError::Failed(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

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
            owner: Some("acme".into()),
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
