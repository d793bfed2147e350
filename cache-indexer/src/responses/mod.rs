//! Responses API affinity: which engine holds a stored response.
//!
//! vLLM keeps a stored response (`POST /v1/responses` with its store on)
//! only in the memory of the engine that produced it; a follow-up naming it
//! (`previous_response_id`, `GET /v1/responses/{id}`, `.../cancel`) that
//! reaches another engine gets 404. The filter reports the id with the
//! request that produced it (`ReportRequest.response_id`, with the serving
//! `endpoint`); a pick naming it (`PickRequest.response_id`) is answered
//! with that endpoint, or with none (`UNKNOWN_RESPONSE`) when no live
//! engine of the pool is known to hold it.
//!
//! A stored response belongs to the tenant whose request made it (the
//! report's `tenant`): a pick naming it for another tenant is answered
//! UNKNOWN_RESPONSE, after the same wait as an id nobody recorded, so that
//! neither the answer nor its timing tells that the id exists. The first
//! record of an id stands; a record for another owner never replaces it.
//!
//! Each pool keeps its records in a bounded in-process LRU map
//! ([`MemoryStore`]); with a shared store ([`RedisStore`]) every record is
//! also written there and a pick that misses locally reads it, so replicas
//! answer alike. A record is valid while it is younger than the TTL, its
//! endpoint is in the pool, and the endpoint has neither restarted (seen on
//! its KV-event stream) nor left the pool since it was recorded. A pick for
//! an id nobody recorded waits up to the grace for the report carrying it,
//! which can race the client's follow-up (another Envoy worker's stream,
//! another replica).

pub mod config;
pub(crate) mod exposition;
mod redis;
mod store;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

pub use self::redis::RedisStore;
pub use store::{Held, MemoryStore, Pushed, Record, ResponseStore, StoreError};

use crate::endpoint::Endpoint;
use crate::metrics::Counter;
use crate::types::EndpointId;

/// Default of [`AffinityConfig::ttl`]: an hour, a long pause in a
/// conversation; vLLM itself keeps a response until the engine stops.
pub const DEFAULT_TTL: Duration = Duration::from_secs(3600);
/// Default of [`AffinityConfig::max_entries`], per pool.
pub const DEFAULT_MAX_ENTRIES: usize = 100_000;
/// Default of [`AffinityConfig::grace`].
pub const DEFAULT_GRACE: Duration = Duration::from_millis(250);
/// Default of [`AffinityConfig::store_timeout`].
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_millis(50);
/// Longest response id accepted: vLLM's are `resp_` and a uuid's hex; the
/// bound keeps a caller from filling memory or the store with huge keys.
pub const MAX_RESPONSE_ID_BYTES: usize = 256;
/// How often a waiting pick asks the shared store again (reports to other
/// replicas reach this one only through it).
const SHARED_POLL: Duration = Duration::from_millis(20);
/// Write-throughs in flight at once per pool; past it a record stays local
/// (counted as a store fallback) rather than piling up tasks on a slow
/// store.
const MAX_PENDING_WRITES: usize = 1024;

/// The knobs of one pool's affinity.
#[derive(Debug, Clone, PartialEq)]
pub struct AffinityConfig {
    /// A record older than this is forgotten.
    pub ttl: Duration,
    /// Records kept in process per pool; the least recently used go first.
    pub max_entries: usize,
    /// Longest a pick for an id nobody recorded waits for its report.
    pub grace: Duration,
    /// Bound of one shared-store call.
    pub store_timeout: Duration,
    /// Prefix of the shared store's keys (then `<pool>:<response id>`).
    pub key_prefix: String,
}

impl Default for AffinityConfig {
    fn default() -> Self {
        AffinityConfig {
            ttl: DEFAULT_TTL,
            max_entries: DEFAULT_MAX_ENTRIES,
            grace: DEFAULT_GRACE,
            store_timeout: DEFAULT_STORE_TIMEOUT,
            key_prefix: "kvasir:responses:".into(),
        }
    }
}

/// Why no live engine is known to hold a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lost {
    /// Never reported (within the grace), or evicted by the memory bound.
    NotRecorded,
    /// Recorded longer ago than the TTL.
    Expired,
    /// Its engine is not in the pool, or left it after the record.
    EndpointGone,
    /// Its engine restarted after the record.
    EndpointRestarted,
    /// Another tenant stored it (answered exactly as [`Lost::NotRecorded`]).
    OtherTenant,
}

impl Lost {
    /// Every reason, in metric label order.
    pub const ALL: [Lost; 5] = [
        Lost::NotRecorded,
        Lost::Expired,
        Lost::EndpointGone,
        Lost::EndpointRestarted,
        Lost::OtherTenant,
    ];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Lost::NotRecorded => "not_recorded",
            Lost::Expired => "expired",
            Lost::EndpointGone => "endpoint_gone",
            Lost::EndpointRestarted => "endpoint_restarted",
            Lost::OtherTenant => "other_tenant",
        }
    }
}

/// Counters of one pool's affinity.
#[derive(Debug, Default)]
pub struct AffinityMetrics {
    /// Response ids recorded from reports.
    pub recorded: Counter,
    /// Picks answered with the engine holding the response.
    pub hits: Counter,
    /// Picks answered UNKNOWN_RESPONSE, by [`Lost`] (in [`Lost::ALL`] order).
    pub unknown: [Counter; 5],
    /// Records dropped because they expired.
    pub expired: Counter,
    /// Records pushed out by the memory bound.
    pub evicted: Counter,
    /// Records not written because the id is held for another tenant.
    pub owner_kept: Counter,
    /// Picks that waited for a report (the id was not recorded yet).
    pub waited: Counter,
    /// Shared-store reads that failed or timed out (the pick used this
    /// replica's records only).
    pub store_get_fallbacks: Counter,
    /// Shared-store writes that failed, timed out or were skipped (the
    /// record stayed in this replica only).
    pub store_put_fallbacks: Counter,
}

impl AffinityMetrics {
    /// Counts a pick's outcome.
    pub fn count(&self, r: &Result<Arc<Endpoint>, Lost>) {
        match r {
            Ok(_) => self.hits.inc(),
            Err(l) => self.unknown[*l as usize].inc(),
        }
    }
}

/// What a lookup found, before the endpoint is checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Found {
    /// A record younger than the TTL.
    Held(Record),
    /// A record older than the TTL.
    Expired(Record),
    /// Not recorded for the tenant (the grace included).
    Lost(Lost),
}

/// One pool's response affinity.
pub struct Affinity {
    pool: String,
    cfg: AffinityConfig,
    local: MemoryStore,
    shared: Option<Arc<dyn ResponseStore>>,
    /// Bumped on every record, to wake picks waiting for one.
    recorded: tokio::sync::watch::Sender<u64>,
    /// When each endpoint last left the pool, Unix ms: its records from
    /// before then are void even if it is back (a new process, or one that
    /// was drained and may have restarted).
    left: Mutex<HashMap<EndpointId, u64>>,
    writes: Arc<AtomicUsize>,
    /// Its counters.
    pub metrics: Arc<AffinityMetrics>,
}

impl std::fmt::Debug for Affinity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Affinity")
            .field("pool", &self.pool)
            .field("cfg", &self.cfg)
            .field("shared", &self.shared)
            .finish_non_exhaustive()
    }
}

/// Now, Unix ms.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Checks a response id from a request: non-empty is the caller's test;
/// this bounds its length.
pub fn check_id(id: &str) -> Result<(), String> {
    if id.len() > MAX_RESPONSE_ID_BYTES {
        return Err(format!(
            "longer than {MAX_RESPONSE_ID_BYTES} bytes ({})",
            id.len()
        ));
    }
    Ok(())
}

impl Affinity {
    /// The affinity of pool `pool`; `shared` is the store replicas share
    /// (none: this process only).
    pub fn new(pool: &str, cfg: AffinityConfig, shared: Option<Arc<dyn ResponseStore>>) -> Self {
        Affinity {
            pool: pool.to_string(),
            local: MemoryStore::new(cfg.max_entries),
            cfg,
            shared,
            recorded: tokio::sync::watch::Sender::new(0),
            left: Mutex::new(HashMap::new()),
            writes: Arc::new(AtomicUsize::new(0)),
            metrics: Arc::default(),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &AffinityConfig {
        &self.cfg
    }

    /// The shared store's kind (`memory` when there is none).
    pub fn store_kind(&self) -> &'static str {
        self.shared.as_ref().map_or("memory", |s| s.kind())
    }

    /// Records held in process.
    pub fn entries(&self) -> usize {
        self.local.len()
    }

    fn key(&self, id: &str) -> String {
        format!("{}{}:{id}", self.cfg.key_prefix, self.pool)
    }

    /// Remembers that `endpoint` holds response `id`, stored by tenant
    /// `owner`, here and (written through in the background) in the shared
    /// store; wakes picks waiting for it.
    pub fn record(&self, id: &str, endpoint: &str, owner: &str) {
        let now = unix_ms();
        let rec = Record {
            endpoint: endpoint.to_string(),
            recorded_unix_ms: now,
            owner: Some(owner.to_string()),
        };
        let (pushed, expired) = self.local.insert(id, rec.clone(), self.cfg.ttl, now);
        self.metrics.expired.add(expired as u64);
        if pushed.kept_owner {
            self.metrics.owner_kept.inc();
            return;
        }
        self.metrics.recorded.inc();
        if pushed.evicted {
            self.metrics.evicted.inc();
        }
        self.recorded.send_modify(|n| *n = n.wrapping_add(1));
        if let Some(shared) = &self.shared {
            self.write_through(Arc::clone(shared), self.key(id), rec);
        }
    }

    fn write_through(&self, shared: Arc<dyn ResponseStore>, key: String, rec: Record) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            self.metrics.store_put_fallbacks.inc();
            return;
        };
        if self.writes.fetch_add(1, Ordering::Relaxed) >= MAX_PENDING_WRITES {
            self.writes.fetch_sub(1, Ordering::Relaxed);
            self.metrics.store_put_fallbacks.inc();
            return;
        }
        let (writes, metrics) = (Arc::clone(&self.writes), Arc::clone(&self.metrics));
        let (ttl, timeout) = (self.cfg.ttl, self.cfg.store_timeout);
        rt.spawn(async move {
            let r = tokio::time::timeout(timeout, shared.put(&key, &rec, ttl)).await;
            if !matches!(r, Ok(Ok(()))) {
                metrics.store_put_fallbacks.inc();
            }
            writes.fetch_sub(1, Ordering::Relaxed);
        });
    }

    /// Notes that an endpoint left the pool: what it held is not routed to
    /// again, even if it comes back.
    pub fn endpoint_left(&self, endpoint: EndpointId) {
        self.left.lock().insert(endpoint, unix_ms());
    }

    /// The record of `id` for `tenant`: from this process, else from the
    /// shared store; when neither has it, asks again as reports arrive (and
    /// the shared store every few ms) until the grace has passed. Another
    /// tenant's record is waited out like a missing one.
    pub async fn find(&self, id: &str, tenant: &str) -> Found {
        let deadline = Instant::now() + self.cfg.grace;
        // Subscribed before the first look, so a record landing between
        // that look and the wait still wakes it.
        let mut rx = self.recorded.subscribe();
        let (mut waited, mut fell_back, mut foreign) = (false, false, false);
        let mut limit = self.cfg.store_timeout;
        loop {
            match self.find_once(id, limit).await {
                Ok(Some(Found::Held(r) | Found::Expired(r))) if !r.owned_by(tenant) => {
                    foreign = true;
                }
                Ok(Some(f)) => return f,
                Ok(None) => {}
                Err(()) if !fell_back => {
                    fell_back = true;
                    self.metrics.store_get_fallbacks.inc();
                }
                Err(()) => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Found::Lost(if foreign {
                    Lost::OtherTenant
                } else {
                    Lost::NotRecorded
                });
            }
            if !waited {
                waited = true;
                self.metrics.waited.inc();
            }
            let wait = match self.shared {
                Some(_) => left.min(SHARED_POLL),
                None => left,
            };
            if matches!(tokio::time::timeout(wait, rx.changed()).await, Ok(Err(_))) {
                // Cannot happen while `self` lives (it owns the sender);
                // sleeping keeps the loop from spinning if it ever did.
                tokio::time::sleep(wait).await;
            }
            // Later store reads must not carry the pick past its grace.
            limit = self
                .cfg
                .store_timeout
                .min(deadline.saturating_duration_since(Instant::now()))
                .max(Duration::from_millis(1));
        }
    }

    /// One look: `Ok(None)` when not found yet, `Err(())` when the shared
    /// store could not be asked. An expired record reads as absent here
    /// (and so is waited out) when its owner is not known to be `tenant`:
    /// the owner alone learns that an id expired.
    async fn find_once(&self, id: &str, limit: Duration) -> Result<Option<Found>, ()> {
        let now = unix_ms();
        match self.local.lookup(id, self.cfg.ttl, now) {
            Held::Found(r) => return Ok(Some(Found::Held(r))),
            Held::Expired(r) => {
                self.metrics.expired.inc();
                return Ok(Some(Found::Expired(r)));
            }
            Held::Absent => {}
        }
        let Some(shared) = &self.shared else {
            return Ok(None);
        };
        match tokio::time::timeout(limit, shared.get(&self.key(id))).await {
            Ok(Ok(Some(r))) if r.expired(self.cfg.ttl, now) => Ok(Some(Found::Expired(r))),
            Ok(Ok(Some(r))) => {
                let (pushed, _) = self.local.insert(id, r.clone(), self.cfg.ttl, now);
                if pushed.evicted {
                    self.metrics.evicted.inc();
                }
                Ok(Some(Found::Held(r)))
            }
            Ok(Ok(None)) => Ok(None),
            Ok(Err(_)) | Err(_) => Err(()),
        }
    }

    /// The endpoint of `endpoints` that holds `rec`'s response: it must be
    /// in the pool (healthy or not: it is the only holder) and must not
    /// have restarted or left the pool since the record.
    pub fn holder(&self, rec: &Record, endpoints: &[Arc<Endpoint>]) -> Result<Arc<Endpoint>, Lost> {
        let e = endpoints
            .iter()
            .find(|e| e.spec.address == rec.endpoint)
            .ok_or(Lost::EndpointGone)?;
        let left = self.left.lock().get(&e.id).copied().unwrap_or(0);
        if rec.recorded_unix_ms <= left {
            return Err(Lost::EndpointGone);
        }
        let restarted = e.subscriber.as_ref().map_or(0, |s| {
            s.stats()
                .last_restart_unix_ms
                .load(std::sync::atomic::Ordering::Relaxed)
        });
        if rec.recorded_unix_ms <= restarted {
            return Err(Lost::EndpointRestarted);
        }
        Ok(Arc::clone(e))
    }

    /// The holder of response `id`, stored by `tenant`, among the pool's
    /// `endpoints` (read after the grace for an id not recorded yet, so
    /// that it sees the pool as it is then); counted.
    pub async fn resolve<E>(
        &self,
        id: &str,
        tenant: &str,
        endpoints: impl FnOnce() -> E,
    ) -> Result<Arc<Endpoint>, Lost>
    where
        E: std::ops::Deref<Target = Vec<Arc<Endpoint>>>,
    {
        let r = match self.find(id, tenant).await {
            Found::Held(rec) => self.holder(&rec, &endpoints()),
            Found::Expired(_) => Err(Lost::Expired),
            Found::Lost(l) => Err(l),
        };
        self.metrics.count(&r);
        r
    }
}

#[cfg(test)]
mod tests;
