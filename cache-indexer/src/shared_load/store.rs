//! The connection the sync task uses, after the pattern of the responses
//! store ([`crate::responses::RedisStore`]): every call, the connect
//! included, bounded by the timeout; after a failure Redis is left alone
//! for the retry delay and the connection is dropped, the next round after
//! it connects anew. One task owns it, so no connect lock is needed.

use std::time::{Duration, Instant};

use redis::aio::MultiplexedConnection;
use redis::AsyncConnectionConfig;

/// Why a round with Redis failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// Left alone after an earlier failure (the retry delay).
    #[error("redis left alone after a failure")]
    Down,
    /// The call or the connect took longer than the timeout.
    #[error("redis timed out")]
    Timeout,
    /// Redis refused or the connection broke.
    #[error("redis: {0}")]
    Failed(String),
}

/// A lazily opened, bounded connection.
pub(crate) struct Store {
    client: redis::Client,
    timeout: Duration,
    retry_after: Duration,
    conn: Option<MultiplexedConnection>,
    down_until: Option<Instant>,
}

impl Store {
    pub(crate) fn new(client: redis::Client, timeout: Duration, retry_after: Duration) -> Self {
        Store {
            client,
            timeout,
            retry_after,
            conn: None,
            down_until: None,
        }
    }

    /// Whether a round now would be skipped (the retry delay).
    pub(crate) fn resting(&self, now: Instant) -> bool {
        self.down_until.is_some_and(|t| now < t)
    }

    async fn connection(&mut self) -> Result<MultiplexedConnection, StoreError> {
        if self.resting(Instant::now()) {
            return Err(StoreError::Down);
        }
        if let Some(c) = &self.conn {
            return Ok(c.clone());
        }
        let cfg = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        let connect = self
            .client
            .get_multiplexed_async_connection_with_config(&cfg);
        match tokio::time::timeout(self.timeout, connect).await {
            Ok(Ok(c)) => {
                self.conn = Some(c.clone());
                Ok(c)
            }
            Ok(Err(e)) => Err(self.failed(StoreError::Failed(e.to_string()))),
            Err(_) => Err(self.failed(StoreError::Timeout)),
        }
    }

    fn failed(&mut self, e: StoreError) -> StoreError {
        self.conn = None;
        self.down_until = Some(Instant::now() + self.retry_after);
        e
    }

    /// Runs `pipe` in one round trip.
    pub(crate) async fn query<T: redis::FromRedisValue>(
        &mut self,
        pipe: &redis::Pipeline,
    ) -> Result<T, StoreError> {
        let mut conn = self.connection().await?;
        match tokio::time::timeout(self.timeout, pipe.query_async::<T>(&mut conn)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.failed(StoreError::Failed(e.to_string()))),
            Err(_) => Err(self.failed(StoreError::Timeout)),
        }
    }
}
