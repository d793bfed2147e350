//! The `sharedLoad:` section: indexer replicas that see each other's
//! in-flight picks and queued prefill through Redis (see
//! [`crate::shared_load`]). Off without a `redisUrl`: each replica then
//! counts only its own picks.
//!
//! ```yaml
//! sharedLoad:
//!   redisUrl: redis://redis.kvasir:6379
//!   intervalMs: 25        # publish own load, read the others', one round trip
//!   ttlMs: 1000           # a replica whose entry stops changing this long is dead;
//!                         # read load is used at most this long after the read
//!   timeoutMs: 50         # bound of one round trip, connect included
//!   retryMs: 1000         # after a failure, Redis is left alone this long
//!   keyPrefix: "kvasir:load:"
//!   replicaId: indexer-0  # default: $HOSTNAME, process id and start time
//!   placements: true      # share recent placements (conversation starts,
//!                         # prompt ends) too; false: each replica its own
//!   wakeOnChange: false   # also a round as soon as own load changes, and
//!                         # at once on another replica's change (pub/sub)
//!   shareReports: true    # reports that matched no pick here go to the
//!                         # other replicas, which apply them to theirs
//! ```

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::config::error::{invalid, ConfigError};
use crate::shared_load::Settings;

/// Fastest allowed round interval.
pub const MIN_SHARED_LOAD_INTERVAL_MS: u64 = 5;
/// Slowest allowed round interval: slower, and the scraped engine counts
/// (at most a second old) already say more than the peers' picks would.
pub const MAX_SHARED_LOAD_INTERVAL_MS: u64 = 1_000;
/// The TTL must cover this many intervals: a live replica heartbeats every
/// `ttl / 3`, and one slow round must not make it look dead.
pub const MIN_TTL_INTERVALS: u64 = 4;
/// Longest allowed TTL: a dead replica's load would steer picks that long.
pub const MAX_SHARED_LOAD_TTL_MS: u64 = 60_000;
/// Longest allowed round-trip bound.
pub const MAX_SHARED_LOAD_TIMEOUT_MS: u64 = 5_000;
/// Longest replica id.
pub const MAX_REPLICA_ID_BYTES: usize = 128;

/// The `sharedLoad:` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct SharedLoadConfig {
    /// `redis://host:port[/db]`; none: load is not shared.
    #[serde(alias = "redis_url")]
    pub redis_url: Option<String>,
    /// How often a replica publishes its load and reads the others', ms.
    #[serde(alias = "interval_ms")]
    pub interval_ms: u64,
    /// How long a replica's entry may stay unchanged before it counts as
    /// dead, and how long read load is used without a newer read, ms.
    #[serde(alias = "ttl_ms")]
    pub ttl_ms: u64,
    /// Bound of one round trip (connect included), ms.
    #[serde(alias = "timeout_ms")]
    pub timeout_ms: u64,
    /// After a failed round, how long Redis is not tried, ms.
    #[serde(alias = "retry_ms")]
    pub retry_ms: u64,
    /// Prefix of the keys (then the pool's name).
    #[serde(alias = "key_prefix")]
    pub key_prefix: String,
    /// This replica's field in each pool's hash; unique per replica.
    #[serde(alias = "replica_id")]
    pub replica_id: Option<String>,
    /// Whether recent placements (the `placement` term's counts and which
    /// prompts continue a conversation) are shared too.
    pub placements: bool,
    /// Whether a replica also runs a round as soon as its own load changes
    /// (a pick, a report) and publishes that it did, so the others read it
    /// at once instead of at their next interval.
    pub wake_on_change: bool,
    /// Whether reports that matched none of this replica's picks are passed
    /// to the others (a pick answered by one replica whose reports reached
    /// another), so the pick ends where it was made. On by default: without
    /// it such a pick counts as queued prefill on every replica until the
    /// prefill horizon.
    pub share_reports: bool,
}

impl Default for SharedLoadConfig {
    fn default() -> Self {
        SharedLoadConfig {
            redis_url: None,
            interval_ms: 25,
            ttl_ms: 1_000,
            timeout_ms: 50,
            retry_ms: 1_000,
            key_prefix: "kvasir:load:".into(),
            replica_id: None,
            placements: true,
            wake_on_change: false,
            share_reports: true,
        }
    }
}

impl SharedLoadConfig {
    /// Checks ranges, the URL and the replica id.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let (lo, hi) = (MIN_SHARED_LOAD_INTERVAL_MS, MAX_SHARED_LOAD_INTERVAL_MS);
        if !(lo..=hi).contains(&self.interval_ms) {
            return Err(invalid(
                "sharedLoad.intervalMs",
                format!("must be {lo}..={hi}, got {}", self.interval_ms),
            ));
        }
        let lo = self.interval_ms * MIN_TTL_INTERVALS;
        if !(lo..=MAX_SHARED_LOAD_TTL_MS).contains(&self.ttl_ms) {
            return Err(invalid(
                "sharedLoad.ttlMs",
                format!(
                    "must be {lo}..={MAX_SHARED_LOAD_TTL_MS} (at least {MIN_TTL_INTERVALS} intervals), got {}",
                    self.ttl_ms
                ),
            ));
        }
        if !(1..=MAX_SHARED_LOAD_TIMEOUT_MS).contains(&self.timeout_ms) {
            return Err(invalid(
                "sharedLoad.timeoutMs",
                format!(
                    "must be 1..={MAX_SHARED_LOAD_TIMEOUT_MS}, got {}",
                    self.timeout_ms
                ),
            ));
        }
        if self.retry_ms == 0 {
            return Err(invalid("sharedLoad.retryMs", "must be at least 1"));
        }
        if let Some(id) = &self.replica_id {
            check_replica_id(id)?;
        }
        match &self.redis_url {
            Some(url) => self.client(url).map(|_| ()),
            None => Ok(()),
        }
    }

    /// The running settings; `None` when load is not shared. Does not
    /// connect: the first round does, so an indexer starts while Redis is
    /// down.
    pub fn settings(&self) -> Result<Option<Settings>, ConfigError> {
        let Some(url) = &self.redis_url else {
            return Ok(None);
        };
        Ok(Some(Settings {
            client: self.client(url)?,
            url: url.clone(),
            interval: Duration::from_millis(self.interval_ms),
            ttl: Duration::from_millis(self.ttl_ms),
            timeout: Duration::from_millis(self.timeout_ms),
            retry_after: Duration::from_millis(self.retry_ms),
            key_prefix: self.key_prefix.clone(),
            replica_id: self.replica_id.clone().unwrap_or_else(default_replica_id),
            placements: self.placements,
            wake_on_change: self.wake_on_change,
            share_reports: self.share_reports,
        }))
    }

    fn client(&self, url: &str) -> Result<redis::Client, ConfigError> {
        // TLS (`rediss://`) and unix sockets are not built in: refuse them
        // here rather than at the first round.
        if !url.starts_with("redis://") {
            return Err(invalid(
                "sharedLoad.redisUrl",
                format!("not a redis://host:port URL: `{url}`"),
            ));
        }
        redis::Client::open(url)
            .map_err(|e| invalid("sharedLoad.redisUrl", format!("`{url}`: {e}")))
    }
}

fn check_replica_id(id: &str) -> Result<(), ConfigError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_REPLICA_ID_BYTES
        && id.chars().all(|c| c.is_ascii_graphic());
    if ok {
        Ok(())
    } else {
        Err(invalid(
            "sharedLoad.replicaId",
            format!("must be 1..={MAX_REPLICA_ID_BYTES} printable ASCII characters, no spaces, got `{id}`"),
        ))
    }
}

/// The pod name (Kubernetes sets `HOSTNAME`), the process id and the start
/// time: unique across replicas and across restarts of one pod.
fn default_replica_id() -> String {
    let host: String = std::env::var("HOSTNAME")
        .unwrap_or_default()
        .chars()
        .filter(char::is_ascii_graphic)
        .take(64)
        .collect();
    let host = if host.is_empty() {
        "indexer".into()
    } else {
        host
    };
    let started = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros());
    format!("{host}-{}-{started:x}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(yaml: &str) -> SharedLoadConfig {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn off_by_default() {
        let c = SharedLoadConfig::default();
        c.validate().unwrap();
        assert!(c.settings().unwrap().is_none());
    }

    #[test]
    fn a_redis_url_turns_it_on() {
        let c = parse("redisUrl: redis://127.0.0.1:6379\nreplica_id: a-1");
        c.validate().unwrap();
        let s = c.settings().unwrap().unwrap();
        assert_eq!(s.replica_id, "a-1");
        assert_eq!(s.interval, Duration::from_millis(25));
        assert!(s.placements, "placements are shared by default");
        let off = parse("redisUrl: redis://127.0.0.1:6379\nplacements: false");
        assert!(!off.settings().unwrap().unwrap().placements);
        let id = parse("redisUrl: redis://127.0.0.1:6379")
            .settings()
            .unwrap()
            .unwrap()
            .replica_id;
        assert!(check_replica_id(&id).is_ok(), "{id}");
    }

    #[test]
    fn bad_values_name_their_key() {
        for (yaml, key) in [
            ("redisUrl: http://x:1", "sharedLoad.redisUrl"),
            ("redisUrl: 'redis://'", "sharedLoad.redisUrl"),
            ("intervalMs: 0", "sharedLoad.intervalMs"),
            ("intervalMs: 5000", "sharedLoad.intervalMs"),
            ("intervalMs: 100\nttlMs: 399", "sharedLoad.ttlMs"),
            ("ttlMs: 600000", "sharedLoad.ttlMs"),
            ("timeoutMs: 0", "sharedLoad.timeoutMs"),
            ("retryMs: 0", "sharedLoad.retryMs"),
            ("replicaId: ''", "sharedLoad.replicaId"),
            ("replicaId: 'a b'", "sharedLoad.replicaId"),
        ] {
            let e = parse(yaml).validate().unwrap_err().to_string();
            assert!(e.starts_with(key), "{yaml}: {e}");
        }
        assert!(serde_yaml::from_str::<SharedLoadConfig>("url: x").is_err());
    }
}
