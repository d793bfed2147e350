//! The `responses:` section: how the indexer remembers which engine holds
//! each stored Responses API response (see [`crate::responses`]). One
//! section for all pools; each pool keeps its own records.
//!
//! ```yaml
//! responses:
//!   ttlS: 3600              # a record is forgotten after this long
//!   maxEntries: 100000      # records kept in process per pool (LRU)
//!   graceMs: 250            # a pick for an unrecorded id waits this long
//!   store: redis            # memory (default: this replica only) | redis
//!   redisUrl: redis://redis.kvasir:6379
//!   redisTimeoutMs: 50      # bound of one Redis call
//!   redisRetryMs: 1000      # after a failure, Redis is left alone this long
//!   keyPrefix: "kvasir:responses:"
//! ```

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::error::{invalid, ConfigError};
use crate::responses::{AffinityConfig, RedisStore, ResponseStore};

/// Longest allowed TTL: a week (records past vLLM's own lifetime of a
/// stored response, its engine's, would only route to engines that lost
/// them).
pub const MAX_RESPONSES_TTL_S: u64 = 7 * 24 * 3600;
/// Longest allowed grace: a pick waits at most this long for a report,
/// and the filter's pick timeout must cover it.
pub const MAX_RESPONSES_GRACE_MS: u64 = 5_000;
/// Longest allowed Redis call bound.
pub const MAX_REDIS_TIMEOUT_MS: u64 = 5_000;

/// Where the records are shared.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// This process only: nothing outside it; replicas do not share.
    #[default]
    Memory,
    /// A Redis server every replica uses (`redisUrl`).
    Redis,
}

/// The `responses:` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ResponsesConfig {
    /// A record older than this is forgotten, seconds.
    #[serde(alias = "ttl_s")]
    pub ttl_s: u64,
    /// Records kept in process per pool; the least recently used go first.
    #[serde(alias = "max_entries")]
    pub max_entries: usize,
    /// Longest a pick for an id nobody recorded yet waits for the report
    /// carrying it, ms (0: answer at once).
    #[serde(alias = "grace_ms")]
    pub grace_ms: u64,
    /// Where records are shared.
    pub store: StoreKind,
    /// `redis://host:port[/db]`, with `store: redis`.
    #[serde(alias = "redis_url")]
    pub redis_url: Option<String>,
    /// Bound of one Redis call (connect included), ms.
    #[serde(alias = "redis_timeout_ms")]
    pub redis_timeout_ms: u64,
    /// After a failed Redis call, how long Redis is not tried, ms.
    #[serde(alias = "redis_retry_ms")]
    pub redis_retry_ms: u64,
    /// Prefix of the Redis keys (then `<pool>:<response id>`).
    #[serde(alias = "key_prefix")]
    pub key_prefix: String,
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        let d = AffinityConfig::default();
        ResponsesConfig {
            ttl_s: d.ttl.as_secs(),
            max_entries: d.max_entries,
            grace_ms: millis(d.grace),
            store: StoreKind::Memory,
            redis_url: None,
            redis_timeout_ms: millis(d.store_timeout),
            redis_retry_ms: 1_000,
            key_prefix: d.key_prefix,
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl ResponsesConfig {
    /// Checks ranges and that `store: redis` has a usable URL.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=MAX_RESPONSES_TTL_S).contains(&self.ttl_s) {
            return Err(invalid(
                "responses.ttlS",
                format!("must be 1..={MAX_RESPONSES_TTL_S}, got {}", self.ttl_s),
            ));
        }
        if self.max_entries == 0 {
            return Err(invalid("responses.maxEntries", "must be at least 1"));
        }
        if self.grace_ms > MAX_RESPONSES_GRACE_MS {
            return Err(invalid(
                "responses.graceMs",
                format!(
                    "must be 0..={MAX_RESPONSES_GRACE_MS}, got {}",
                    self.grace_ms
                ),
            ));
        }
        if !(1..=MAX_REDIS_TIMEOUT_MS).contains(&self.redis_timeout_ms) {
            return Err(invalid(
                "responses.redisTimeoutMs",
                format!(
                    "must be 1..={MAX_REDIS_TIMEOUT_MS}, got {}",
                    self.redis_timeout_ms
                ),
            ));
        }
        if self.redis_retry_ms == 0 {
            return Err(invalid("responses.redisRetryMs", "must be at least 1"));
        }
        match (self.store, &self.redis_url) {
            (StoreKind::Redis, None) => Err(invalid(
                "responses.redisUrl",
                "required with store: redis (redis://host:port)",
            )),
            (StoreKind::Redis, Some(url)) => check_redis_url(url),
            (StoreKind::Memory, _) => Ok(()),
        }
    }

    /// The per-pool settings.
    pub fn affinity(&self) -> AffinityConfig {
        AffinityConfig {
            ttl: Duration::from_secs(self.ttl_s),
            max_entries: self.max_entries,
            grace: Duration::from_millis(self.grace_ms),
            store_timeout: Duration::from_millis(self.redis_timeout_ms),
            key_prefix: self.key_prefix.clone(),
        }
    }

    /// The shared store (none with `store: memory`). Does not connect:
    /// the first call does, so an indexer starts while Redis is down.
    pub fn shared_store(&self) -> Result<Option<Arc<dyn ResponseStore>>, ConfigError> {
        let (StoreKind::Redis, Some(url)) = (self.store, &self.redis_url) else {
            return Ok(None);
        };
        let store = RedisStore::new(
            url,
            Duration::from_millis(self.redis_timeout_ms),
            Duration::from_millis(self.redis_retry_ms),
        )
        .map_err(|e| invalid("responses.redisUrl", e.to_string()))?;
        Ok(Some(Arc::new(store)))
    }
}

fn check_redis_url(url: &str) -> Result<(), ConfigError> {
    // TLS (`rediss://`) and unix sockets are not built in: refuse them
    // here rather than at the first pick.
    if !url.starts_with("redis://") {
        return Err(invalid(
            "responses.redisUrl",
            format!("not a redis://host:port URL: `{url}`"),
        ));
    }
    RedisStore::new(url, Duration::from_millis(1), Duration::from_millis(1))
        .map(|_| ())
        .map_err(|e| invalid("responses.redisUrl", format!("`{url}`: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> ResponsesConfig {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn defaults_are_memory_with_bounds() {
        let c = ResponsesConfig::default();
        assert_eq!(
            (c.ttl_s, c.max_entries, c.grace_ms, c.store),
            (3600, 100_000, 250, StoreKind::Memory)
        );
        c.validate().unwrap();
        assert!(c.shared_store().unwrap().is_none());
    }

    #[test]
    fn redis_needs_a_redis_url() {
        let c = parse("store: redis");
        let e = c.validate().unwrap_err().to_string();
        assert!(e.starts_with("responses.redisUrl: required"), "{e}");
        let c = parse("store: redis\nredisUrl: http://x:1");
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("not a redis://"), "{e}");
        let c = parse("store: redis\nredis_url: redis://127.0.0.1:6379");
        c.validate().unwrap();
        assert_eq!(c.shared_store().unwrap().unwrap().kind(), "redis");
    }

    #[test]
    fn out_of_range_values_name_their_key() {
        for (yaml, key) in [
            ("ttlS: 0", "responses.ttlS"),
            ("maxEntries: 0", "responses.maxEntries"),
            ("graceMs: 60000", "responses.graceMs"),
            ("redisTimeoutMs: 0", "responses.redisTimeoutMs"),
            ("redisRetryMs: 0", "responses.redisRetryMs"),
        ] {
            let e = parse(yaml).validate().unwrap_err().to_string();
            assert!(e.starts_with(key), "{yaml}: {e}");
        }
        assert!(serde_yaml::from_str::<ResponsesConfig>("ttl: 1").is_err());
    }
}
