//! The `budgets:` section: where tenants' token budgets are kept (see
//! `kvasir-budget` and [`crate::budgets`]). The limits themselves come
//! with each pick from the filter's compiled policy; this only says where
//! their state lives and what happens when that place is unreachable.
//!
//! ```yaml
//! budgets:
//!   store: redis           # memory (default: this process) | redis (shared by replicas)
//!   redisUrl: redis://redis.kvasir:6379
//!   keyPrefix: "kvasir:"   # keys <keyPrefix>budget:<tenant>[:open]
//!   timeoutMs: 50          # bound of one Redis call, connect included
//!   retryMs: 1000          # after a failure, Redis is left alone this long
//!   onStoreDown: local     # local (limits / replicas, in process) | open | closed
//!   replicas: 2            # local's divisor; default: the live count sharedLoad sees, else 1
//! ```

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::budgets::redis::{OnStoreDown, RedisSettings};
use crate::budgets::Budgets;
use crate::config::error::{invalid, ConfigError};

/// Longest allowed Redis call bound: a budgeted pick waits at most this
/// long for its reservation.
pub const MAX_BUDGET_TIMEOUT_MS: u64 = 5_000;
/// Longest allowed retry delay.
pub const MAX_BUDGET_RETRY_MS: u64 = 600_000;
/// Most replicas the local fallback may divide by.
pub const MAX_BUDGET_REPLICAS: u32 = 1_024;
/// Longest key prefix.
pub const MAX_KEY_PREFIX_BYTES: usize = 128;

/// Where budget state is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum BudgetStoreKind {
    /// In this process: exact with one indexer replica.
    #[default]
    Memory,
    /// In Redis, shared by every replica (atomic server-side scripts).
    Redis,
}

/// The `budgets:` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct BudgetsConfig {
    /// Where budget state is kept.
    pub store: BudgetStoreKind,
    /// `redis://host:port[/db]`, with `store: redis`.
    #[serde(alias = "redis_url")]
    pub redis_url: Option<String>,
    /// Prefix of the Redis keys (then `budget:<key>`).
    #[serde(alias = "key_prefix")]
    pub key_prefix: String,
    /// Bound of one Redis call (connect included), ms.
    #[serde(alias = "timeout_ms")]
    pub timeout_ms: u64,
    /// After a failed call, how long Redis is not tried, ms.
    #[serde(alias = "retry_ms")]
    pub retry_ms: u64,
    /// What budgeted picks get while Redis is unreachable.
    #[serde(alias = "on_store_down")]
    pub on_store_down: OnStoreDown,
    /// Replicas `onStoreDown: local` divides each limit by; none: the live
    /// count `sharedLoad` sees, else 1.
    pub replicas: Option<u32>,
}

impl Default for BudgetsConfig {
    fn default() -> Self {
        BudgetsConfig {
            store: BudgetStoreKind::Memory,
            redis_url: None,
            key_prefix: "kvasir:".into(),
            timeout_ms: 50,
            retry_ms: 1_000,
            on_store_down: OnStoreDown::Local,
            replicas: None,
        }
    }
}

impl BudgetsConfig {
    /// Checks ranges and that `store: redis` has a usable URL.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=MAX_BUDGET_TIMEOUT_MS).contains(&self.timeout_ms) {
            return Err(invalid(
                "budgets.timeoutMs",
                format!(
                    "must be 1..={MAX_BUDGET_TIMEOUT_MS}, got {}",
                    self.timeout_ms
                ),
            ));
        }
        if !(1..=MAX_BUDGET_RETRY_MS).contains(&self.retry_ms) {
            return Err(invalid(
                "budgets.retryMs",
                format!("must be 1..={MAX_BUDGET_RETRY_MS}, got {}", self.retry_ms),
            ));
        }
        if let Some(n) = self.replicas {
            if !(1..=MAX_BUDGET_REPLICAS).contains(&n) {
                return Err(invalid(
                    "budgets.replicas",
                    format!("must be 1..={MAX_BUDGET_REPLICAS}, got {n}"),
                ));
            }
        }
        let p = &self.key_prefix;
        if p.len() > MAX_KEY_PREFIX_BYTES || !p.chars().all(|c| c.is_ascii_graphic()) {
            return Err(invalid(
                "budgets.keyPrefix",
                format!("must be at most {MAX_KEY_PREFIX_BYTES} printable ASCII characters, no spaces, got `{p}`"),
            ));
        }
        match (self.store, &self.redis_url) {
            (BudgetStoreKind::Redis, None) => Err(invalid(
                "budgets.redisUrl",
                "required with store: redis (redis://host:port)",
            )),
            (BudgetStoreKind::Redis, Some(url)) => self.settings(url).map(|_| ()),
            (BudgetStoreKind::Memory, _) => Ok(()),
        }
    }

    /// The budgets this section describes. Does not connect: the first
    /// budgeted pick does, so an indexer starts while Redis is down.
    pub fn build(&self) -> Result<Budgets, ConfigError> {
        match (self.store, &self.redis_url) {
            (BudgetStoreKind::Redis, Some(url)) => Budgets::redis(&self.settings(url)?)
                .map_err(|e| invalid("budgets.redisUrl", e.to_string())),
            _ => Ok(Budgets::memory()),
        }
    }

    fn settings(&self, url: &str) -> Result<RedisSettings, ConfigError> {
        // TLS (`rediss://`) and unix sockets are not built in: refuse them
        // here rather than at the first pick.
        if !url.starts_with("redis://") {
            return Err(invalid(
                "budgets.redisUrl",
                format!("not a redis://host:port URL: `{url}`"),
            ));
        }
        redis::Client::open(url)
            .map_err(|e| invalid("budgets.redisUrl", format!("`{url}`: {e}")))?;
        Ok(RedisSettings {
            url: url.to_string(),
            timeout: Duration::from_millis(self.timeout_ms),
            retry_after: Duration::from_millis(self.retry_ms),
            key_prefix: self.key_prefix.clone(),
            on_store_down: self.on_store_down,
            replicas: self.replicas,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> BudgetsConfig {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn defaults_are_memory_with_bounds() {
        let c = BudgetsConfig::default();
        assert_eq!(c, parse("{}"));
        assert_eq!(
            (c.timeout_ms, c.retry_ms, c.on_store_down, c.replicas),
            (50, 1000, OnStoreDown::Local, None)
        );
        c.validate().unwrap();
        assert_eq!(c.build().unwrap().store_kind(), "memory");
    }

    #[test]
    fn redis_settings_are_read() {
        let c = parse(
            "store: redis\nredisUrl: redis://127.0.0.1:6379\nkeyPrefix: 'x:'\ntimeoutMs: 20\nretryMs: 500\nonStoreDown: closed\nreplicas: 3",
        );
        c.validate().unwrap();
        let b = c.build().unwrap();
        assert_eq!(b.store_kind(), "redis");
        let r = b.shared().unwrap();
        assert_eq!(r.on_store_down(), OnStoreDown::Closed);
        assert_eq!(r.replicas(), 3);
        assert_eq!(r.store().timeout(), Duration::from_millis(20));
        assert_eq!(r.store().retry_after(), Duration::from_millis(500));
        assert_eq!(r.store().state_key("acme"), "x:budget:acme");
        let c = parse("store: redis\nredis_url: redis://h:1\non_store_down: open");
        c.validate().unwrap();
        assert_eq!(c.on_store_down, OnStoreDown::Open);
    }

    #[test]
    fn bad_values_name_their_key() {
        for (yaml, key) in [
            ("store: redis", "budgets.redisUrl"),
            ("store: redis\nredisUrl: http://x:1", "budgets.redisUrl"),
            ("store: redis\nredisUrl: 'redis://'", "budgets.redisUrl"),
            ("timeoutMs: 0", "budgets.timeoutMs"),
            ("timeoutMs: 60000", "budgets.timeoutMs"),
            ("retryMs: 0", "budgets.retryMs"),
            ("replicas: 0", "budgets.replicas"),
            ("replicas: 100000", "budgets.replicas"),
            ("keyPrefix: 'a b'", "budgets.keyPrefix"),
        ] {
            let e = parse(yaml).validate().unwrap_err().to_string();
            assert!(e.starts_with(key), "{yaml}: {e}");
        }
        assert!(serde_yaml::from_str::<BudgetsConfig>("onStoreDown: maybe").is_err());
        assert!(serde_yaml::from_str::<BudgetsConfig>("url: x").is_err());
    }
}
