//! Where response records live: [`MemoryStore`], this process's bounded
//! LRU map (every pool has one, in front of any shared store), and the
//! [`ResponseStore`] trait a shared store implements
//! ([`super::redis::RedisStore`]) so that replicas see each other's records.

use std::num::NonZeroUsize;
use std::time::Duration;

use futures::future::BoxFuture;
use lru::LruCache;
use parking_lot::Mutex;

/// That `endpoint` produced a stored response, as of `recorded_unix_ms`
/// (wall clock, so that replicas can compare it with when they saw the
/// engine restart).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The engine's HTTP address, as the pool names it.
    pub endpoint: String,
    /// When the report carrying the id was received, Unix ms.
    pub recorded_unix_ms: u64,
}

impl Record {
    /// The value a shared store keeps: `"<ms> <address>"`.
    pub fn encode(&self) -> String {
        format!("{} {}", self.recorded_unix_ms, self.endpoint)
    }

    /// A value [`Record::encode`] wrote; `None` for anything else (a
    /// foreign or corrupted key is a miss, not an error).
    pub fn decode(s: &str) -> Option<Record> {
        let (ms, endpoint) = s.split_once(' ')?;
        let recorded_unix_ms = ms.parse().ok()?;
        (!endpoint.is_empty()).then(|| Record {
            endpoint: endpoint.to_string(),
            recorded_unix_ms,
        })
    }

    /// Whether the record is older than `ttl` at `now_unix_ms`.
    pub fn expired(&self, ttl: Duration, now_unix_ms: u64) -> bool {
        let age = now_unix_ms.saturating_sub(self.recorded_unix_ms);
        u128::from(age) >= ttl.as_millis()
    }
}

/// Why a shared store did not answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// It failed recently and is not tried again until its retry delay
    /// has passed.
    #[error("store unavailable (retrying later)")]
    Down,
    /// The call did not finish within the store timeout.
    #[error("store call timed out")]
    Timeout,
    /// The store refused or the connection failed.
    #[error("store error: {0}")]
    Failed(String),
}

/// A store of response records shared by the indexer's replicas.
/// Implementations bound every call themselves; callers bound it again.
pub trait ResponseStore: Send + Sync + std::fmt::Debug {
    /// Keeps `record` under `key` for `ttl`.
    fn put<'a>(
        &'a self,
        key: &'a str,
        record: &'a Record,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>>;

    /// The record under `key`, if any.
    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Record>, StoreError>>;

    /// The store's kind for logs and docs (`memory`, `redis`).
    fn kind(&self) -> &'static str;
}

/// What [`MemoryStore::put`] pushed out.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pushed {
    /// The least recently used entry made room (the memory bound).
    pub evicted: bool,
}

/// What [`MemoryStore::lookup`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// A live record.
    Found(Record),
    /// Nothing under that id.
    Absent,
    /// A record older than the TTL (now dropped).
    Expired,
}

/// A bounded in-process map of response id to record: least recently used
/// entries go first once it is full.
#[derive(Debug)]
pub struct MemoryStore {
    map: Mutex<LruCache<String, Record>>,
}

/// Expired entries dropped from the cold end per insert: keeps dead
/// entries from lingering without a sweep over the whole map.
const EXPIRED_DROPPED_PER_PUT: usize = 8;

impl MemoryStore {
    /// A store holding at most `max_entries` (at least one).
    pub fn new(max_entries: usize) -> Self {
        let cap = NonZeroUsize::new(max_entries).unwrap_or(NonZeroUsize::MIN);
        MemoryStore {
            map: Mutex::new(LruCache::new(cap)),
        }
    }

    /// Keeps `record` under `id`; returns what made room and how many
    /// expired entries were dropped on the way.
    pub fn insert(&self, id: &str, record: Record, ttl: Duration, now_ms: u64) -> (Pushed, usize) {
        let mut map = self.map.lock();
        let mut expired = 0;
        while expired < EXPIRED_DROPPED_PER_PUT
            && map.peek_lru().is_some_and(|(_, r)| r.expired(ttl, now_ms))
        {
            map.pop_lru();
            expired += 1;
        }
        let evicted = match map.push(id.to_string(), record) {
            Some((old, _)) => old != id,
            None => false,
        };
        (Pushed { evicted }, expired)
    }

    /// The record under `id`; an expired one is dropped.
    pub fn lookup(&self, id: &str, ttl: Duration, now_ms: u64) -> Held {
        let mut map = self.map.lock();
        match map.get(id) {
            None => Held::Absent,
            Some(r) if r.expired(ttl, now_ms) => {
                map.pop(id);
                Held::Expired
            }
            Some(r) => Held::Found(r.clone()),
        }
    }

    /// Entries held (expired ones not yet dropped included).
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl ResponseStore for MemoryStore {
    fn put<'a>(
        &'a self,
        key: &'a str,
        record: &'a Record,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        let now = record.recorded_unix_ms;
        self.insert(key, record.clone(), ttl, now);
        Box::pin(std::future::ready(Ok(())))
    }

    fn get<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        // Expiry is the caller's (it knows the TTL); the trait's view is
        // what is held.
        let r = self.map.lock().get(key).cloned();
        Box::pin(std::future::ready(Ok(r)))
    }

    fn kind(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ms: u64) -> Record {
        Record {
            endpoint: "127.0.0.1:8000".into(),
            recorded_unix_ms: ms,
        }
    }

    #[test]
    fn records_round_trip_and_foreign_values_are_misses() {
        let r = rec(1_700_000_000_123);
        assert_eq!(Record::decode(&r.encode()), Some(r));
        for bad in ["", "12", "x 127.0.0.1:1", "12 ", "-1 a"] {
            assert_eq!(Record::decode(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_least_recently_used_entry_makes_room() {
        let s = MemoryStore::new(2);
        let ttl = Duration::from_secs(60);
        assert!(!s.insert("a", rec(1), ttl, 1).0.evicted);
        assert!(!s.insert("b", rec(1), ttl, 1).0.evicted);
        assert!(!s.insert("a", rec(2), ttl, 2).0.evicted, "an update");
        assert!(s.insert("c", rec(3), ttl, 3).0.evicted);
        assert_eq!(s.lookup("b", ttl, 3), Held::Absent);
        assert_eq!(s.lookup("a", ttl, 3), Held::Found(rec(2)));
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn expired_entries_are_dropped_on_lookup_and_on_insert() {
        let s = MemoryStore::new(10);
        let ttl = Duration::from_millis(100);
        s.insert("a", rec(0), ttl, 0);
        assert_eq!(s.lookup("a", ttl, 99), Held::Found(rec(0)));
        assert_eq!(s.lookup("a", ttl, 100), Held::Expired);
        assert!(s.is_empty());
        s.insert("b", rec(0), ttl, 0);
        let (_, expired) = s.insert("c", rec(500), ttl, 500);
        assert_eq!((expired, s.len()), (1, 1));
    }
}
