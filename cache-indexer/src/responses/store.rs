//! Where response records live: [`MemoryStore`], this process's bounded
//! LRU map (every pool has one, in front of any shared store), and the
//! [`ResponseStore`] trait a shared store implements
//! ([`super::redis::RedisStore`]) so that replicas see each other's records.

use std::num::NonZeroUsize;
use std::time::Duration;

use futures::future::BoxFuture;
use lru::LruCache;
use parking_lot::Mutex;

/// That `endpoint` produced a stored response for tenant `owner`, as of
/// `recorded_unix_ms` (wall clock, so that replicas can compare it with
/// when they saw the engine restart).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The engine's HTTP address, as the pool names it.
    pub endpoint: String,
    /// When the report carrying the id was received, Unix ms.
    pub recorded_unix_ms: u64,
    /// The tenant whose request made it (empty where no tenant is
    /// resolved); `None` for a record written without one, which no
    /// tenant may use.
    pub owner: Option<String>,
}

impl Record {
    /// The value a shared store keeps: `"<ms> <address> <owner>"` (the
    /// owner last, since it is the only part that may hold spaces).
    pub fn encode(&self) -> String {
        match &self.owner {
            Some(o) => format!("{} {} {o}", self.recorded_unix_ms, self.endpoint),
            None => format!("{} {}", self.recorded_unix_ms, self.endpoint),
        }
    }

    /// A value [`Record::encode`] wrote; `None` for anything else (a
    /// foreign or corrupted key is a miss, not an error).
    pub fn decode(s: &str) -> Option<Record> {
        let (ms, rest) = s.split_once(' ')?;
        let recorded_unix_ms = ms.parse().ok()?;
        let (endpoint, owner) = match rest.split_once(' ') {
            Some((e, o)) => (e, Some(o.to_string())),
            None => (rest, None),
        };
        (!endpoint.is_empty()).then(|| Record {
            endpoint: endpoint.to_string(),
            recorded_unix_ms,
            owner,
        })
    }

    /// Whether `tenant` may use the response: only the tenant that stored
    /// it.
    pub fn owned_by(&self, tenant: &str) -> bool {
        self.owner.as_deref() == Some(tenant)
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
    /// Keeps `record` under `key` for `ttl`, unless `key` is held already
    /// (the first record of a response stands: it names its owner).
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
    /// The id was held for another owner: nothing was written.
    pub kept_owner: bool,
}

/// What [`MemoryStore::lookup`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Held {
    /// A live record.
    Found(Record),
    /// Nothing under that id.
    Absent,
    /// A record older than the TTL (now dropped).
    Expired(Record),
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

    /// Keeps `record` under `id`, unless a live record holds `id` already;
    /// returns what made room and how many expired entries were dropped on
    /// the way.
    pub fn insert(&self, id: &str, record: Record, ttl: Duration, now_ms: u64) -> (Pushed, usize) {
        let mut map = self.map.lock();
        let mut expired = 0;
        while expired < EXPIRED_DROPPED_PER_PUT
            && map.peek_lru().is_some_and(|(_, r)| r.expired(ttl, now_ms))
        {
            map.pop_lru();
            expired += 1;
        }
        if let Some(held) = map.peek(id).filter(|h| !h.expired(ttl, now_ms)) {
            // The first record of a response stands, as in a shared store:
            // it names the engine and the tenant that made it. A later one
            // (the same request's other reports, or a record naming
            // another owner, which no served request can produce) changes
            // nothing.
            let kept_owner = held.owner != record.owner;
            return (
                Pushed {
                    evicted: false,
                    kept_owner,
                },
                expired,
            );
        }
        let evicted = match map.push(id.to_string(), record) {
            Some((old, _)) => old != id,
            None => false,
        };
        (
            Pushed {
                evicted,
                kept_owner: false,
            },
            expired,
        )
    }

    /// The record under `id`; an expired one is dropped.
    pub fn lookup(&self, id: &str, ttl: Duration, now_ms: u64) -> Held {
        let mut map = self.map.lock();
        match map.get(id) {
            None => Held::Absent,
            Some(r) if r.expired(ttl, now_ms) => {
                let r = r.clone();
                map.pop(id);
                Held::Expired(r)
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
            owner: Some("acme".into()),
        }
    }

    #[test]
    fn records_round_trip_and_foreign_values_are_misses() {
        let r = rec(1_700_000_000_123);
        assert_eq!(Record::decode(&r.encode()), Some(r));
        for owner in [Some(""), Some("a b"), None] {
            let r = Record {
                owner: owner.map(str::to_string),
                ..rec(5)
            };
            assert_eq!(Record::decode(&r.encode()), Some(r));
        }
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
        assert!(!s.insert("a", rec(2), ttl, 2).0.evicted, "the first stands");
        assert_eq!(s.lookup("a", ttl, 2), Held::Found(rec(1)), "and is used");
        assert!(s.insert("c", rec(3), ttl, 3).0.evicted);
        assert_eq!(s.lookup("b", ttl, 3), Held::Absent);
        assert_eq!(s.lookup("a", ttl, 3), Held::Found(rec(1)));
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn expired_entries_are_dropped_on_lookup_and_on_insert() {
        let s = MemoryStore::new(10);
        let ttl = Duration::from_millis(100);
        s.insert("a", rec(0), ttl, 0);
        assert_eq!(s.lookup("a", ttl, 99), Held::Found(rec(0)));
        assert_eq!(s.lookup("a", ttl, 100), Held::Expired(rec(0)));
        assert!(s.is_empty());
        s.insert("b", rec(0), ttl, 0);
        let (_, expired) = s.insert("c", rec(500), ttl, 500);
        assert_eq!((expired, s.len()), (1, 1));
    }
}

#[cfg(test)]
mod owner_tests {
    use super::*;

    fn rec(ms: u64, owner: Option<&str>) -> Record {
        Record {
            endpoint: "127.0.0.1:8000".into(),
            recorded_unix_ms: ms,
            owner: owner.map(str::to_string),
        }
    }

    #[test]
    fn only_its_owner_may_use_a_record() {
        let r = rec(1, Some("acme"));
        assert!(r.owned_by("acme"));
        assert!(!r.owned_by("beta"));
        assert!(!r.owned_by(""));
        assert!(rec(1, Some("")).owned_by(""));
        assert!(
            !rec(1, None).owned_by(""),
            "a record without an owner is no one's"
        );
    }

    #[test]
    fn a_live_record_keeps_its_owner() {
        let s = MemoryStore::new(4);
        let ttl = Duration::from_millis(100);
        s.insert("r", rec(0, Some("acme")), ttl, 0);
        let (pushed, _) = s.insert("r", rec(10, Some("beta")), ttl, 10);
        assert!(pushed.kept_owner);
        assert_eq!(s.lookup("r", ttl, 10), Held::Found(rec(0, Some("acme"))));
        // The same owner's repeat keeps it too; after expiry anyone's
        // record is new.
        assert!(!s.insert("r", rec(20, Some("acme")), ttl, 20).0.kept_owner);
        assert_eq!(s.lookup("r", ttl, 20), Held::Found(rec(0, Some("acme"))));
        assert!(!s.insert("r", rec(500, Some("beta")), ttl, 500).0.kept_owner);
        assert_eq!(s.lookup("r", ttl, 500), Held::Found(rec(500, Some("beta"))));
    }
}
