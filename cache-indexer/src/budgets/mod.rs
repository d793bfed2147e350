//! Tenants' token budgets: the state behind each budget key,
//! shared by every pool of the process, and the operations the pick path
//! (reserve, cancel) and the reports (settle, release, cancel) apply to it.
//! The arithmetic is `kvasir-budget`'s; this module keeps its state and
//! counts what it did.
//!
//! The limits come with each pick (`PickRequest.budget`), so the indexer
//! knows no tenants: a key's limits are replaced whenever a pick carries
//! different ones. Where the state lives is the store:
//!
//! * **memory** (the default): in this process ([`memory`]). Exact with one
//!   indexer replica; bounded by [`MAX_KEYS`] keys and [`MAX_OPEN`] open
//!   reservations.
//! * **redis**: shared by replicas through atomic scripts ([`redis`]),
//!   with a local fallback while Redis is unreachable.
//!
//! Both implement [`Store`]. Every operation returns a future so that a
//! store behind a network round trip fits; the memory store never awaits,
//! so its futures are ready on their first poll and [`run_detached`]
//! applies them at once.
//!
//! Beside the state: the `budgets:` section of the config file
//! ([`config`]), the counters ([`BudgetMetrics`]) and their `/metrics`
//! families (`exposition`; the Redis store's own in `redis`).

pub mod config;
pub(crate) mod exposition;
mod memory;
mod metrics;
pub mod redis;

use std::any::Any;
use std::fmt::Debug;
use std::future::Future;
use std::time::Instant;

use futures::future::BoxFuture;
use futures::FutureExt;
use kvasir_budget::{Cost, Limits, RateLimitHeaders, Refusal, Usage};

pub use metrics::{
    limited_by, BudgetMetrics, TenantCounts, MAX_TENANT_LABELS, OTHER_TENANT, REPORT_OPS,
};

/// Budget keys (tenants) the memory store tracks at once. Past it, keys
/// with nothing in flight and unused for a window are dropped to make room;
/// if none is, a new key's picks are admitted untracked (counted).
pub const MAX_KEYS: usize = 10_000;

/// Open reservations the memory store tracks at once (the load tracker's
/// in-flight bound). Past it the oldest is dropped as if expired: it keeps
/// its charge (counted as evicted).
pub const MAX_OPEN: usize = 65_536;

/// A key with nothing in flight is forgotten after this long unused (its
/// buckets are whole again long before; the learned output estimate goes
/// with it).
pub const IDLE_MS: u64 = 5 * 60_000;

/// What a pick asks of its tenant's budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ask {
    /// The budget key (the tenant).
    pub key: String,
    /// The pick's request id: reports settle the reservation by it.
    pub request_id: String,
    /// The limits the pick's config gives the key.
    pub limits: Limits,
    /// Completion tokens reserved without `max_tokens` before the key's
    /// completions are learned.
    pub default_output_tokens: u64,
    /// The request's completion cap, when it sets one.
    pub max_tokens: Option<u64>,
    /// Prompt tokens as tokenized.
    pub prompt_tokens: u64,
    /// Prompt tokens the pool is expected to hold (best match).
    pub cached_tokens: u64,
    /// After this long without its end reported, the reservation expires
    /// (the pool's in-flight timeout).
    pub max_age_ms: u64,
}

/// What the store answered a reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reserved {
    /// Admitted; `held` is what it reserved and `headers` the budget after.
    Admitted {
        /// The cost taken (for a repeated pick, what the first one took).
        held: Cost,
        /// The budget's `x-ratelimit-*` values after the reservation.
        headers: RateLimitHeaders,
        /// The request id already held a reservation under this key (the
        /// same request picked again): nothing more was taken.
        repeated: bool,
    },
    /// Refused: nothing was taken.
    Limited {
        /// Which limit and when to retry.
        refusal: Refusal,
        /// The budget's values now.
        headers: RateLimitHeaders,
    },
    /// Admitted without a budget: the store has no room to track the key.
    Untracked,
    /// Refused because the shared store is unreachable (`onStoreDown:
    /// closed`): `limited_by` "store".
    StoreUnavailable {
        /// When Redis is tried again.
        retry_after_ms: u64,
    },
}

/// What a report does to a reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportOp {
    /// Usage so far (USAGE, or FIRST_TOKEN with usage): monotone.
    Settle(Usage),
    /// The end (DONE): `usage` is the final usage, `None` when the report
    /// carried none (then the prompt counts as reserved and the completion
    /// as last settled); `train` feeds the completion length to the key's
    /// output estimate (successes with usage only).
    Release {
        /// The final usage.
        usage: Option<Usage>,
        /// Whether to learn from it.
        train: bool,
        /// The filter admitted the request itself (`ADMISSION_LOCAL`): with
        /// no reservation open under its id, its usage is charged to the
        /// report's key (one request plus the tokens), so a fail-open is
        /// paid for once the indexer hears of it.
        local: bool,
    },
    /// Never served (OUTCOME_REJECTED, or shed from the queue): everything
    /// held goes back.
    Cancel,
}

impl ReportOp {
    /// The label of the op in stats.
    pub fn as_str(&self) -> &'static str {
        match self {
            ReportOp::Settle(_) => "settle",
            ReportOp::Release { .. } => "release",
            ReportOp::Cancel => "cancel",
        }
    }
}

/// A report's effect on a budget.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    /// The budget key the report names (`ReportRequest.budget_key`), when
    /// it names one.
    pub key: Option<String>,
    /// The request id.
    pub request_id: String,
    /// What to do.
    pub op: ReportOp,
}

/// What a report did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reported {
    /// The key whose reservation it matched; `None`: nothing open under
    /// that request id here.
    pub key: Option<String>,
    /// Taken beyond what was held (usage above the estimate).
    pub charged: Cost,
    /// Given back.
    pub refunded: Cost,
    /// A released request's final cost.
    pub settled: Option<Cost>,
    /// Charged with no reservation open (a local admission's end).
    pub unreserved: bool,
}

/// Where budget state lives: this process ([`memory`]) or Redis shared by
/// the replicas ([`redis::RedisBudgets`]). `now_ms` is the clock of
/// [`Budgets::now_ms`].
pub trait Store: Send + Sync + Debug {
    /// `memory` or `redis`, for stats.
    fn kind(&self) -> &'static str;

    /// Reserves a pick's cost against its key's budget, or says why not.
    fn reserve<'a>(
        &'a self,
        now_ms: u64,
        ask: &'a Ask,
        metrics: &'a BudgetMetrics,
    ) -> BoxFuture<'a, Reserved>;

    /// Applies a report to the reservation of its request id.
    fn report<'a>(
        &'a self,
        now_ms: u64,
        rep: &'a Report,
        metrics: &'a BudgetMetrics,
    ) -> BoxFuture<'a, Reported>;

    /// Open reservations tracked in this process.
    fn open_reservations(&self) -> usize;

    /// Budget keys tracked in this process.
    fn keys(&self) -> usize;

    /// Notes how many replicas `sharedLoad` sees; nothing by default.
    fn note_peers(&self, _peers: &crate::load::PeerStats) {}

    /// The store as [`Any`], for a caller that reads one implementation's
    /// own figures ([`Budgets::shared`]).
    fn as_any(&self) -> &dyn Any;
}

/// Every budget this replica knows (or reaches through its store).
#[derive(Debug)]
pub struct Budgets {
    store: Box<dyn Store>,
    metrics: BudgetMetrics,
    epoch: Instant,
}

impl Default for Budgets {
    fn default() -> Self {
        Budgets::memory()
    }
}

impl Budgets {
    /// Budgets kept in this process.
    pub fn memory() -> Self {
        Budgets::memory_bounded(MAX_KEYS, MAX_OPEN)
    }

    /// Budgets kept in this process, with other bounds (tests).
    pub fn memory_bounded(max_keys: usize, max_open: usize) -> Self {
        Budgets::with_store(Box::new(memory::MemoryStore::new(max_keys, max_open)))
    }

    /// Budgets in Redis shared by replicas (connects on first use).
    pub fn redis(s: &redis::RedisSettings) -> Result<Self, redis::script::BudgetStoreError> {
        Ok(Budgets::with_store(Box::new(redis::RedisBudgets::new(s)?)))
    }

    /// Budgets kept in `store`.
    pub fn with_store(store: Box<dyn Store>) -> Self {
        Budgets {
            store,
            metrics: BudgetMetrics::default(),
            epoch: Instant::now(),
        }
    }

    /// Notes how many replicas `sharedLoad` sees (the Redis store's local
    /// fallback divides limits by it); nothing in memory.
    pub fn note_peers(&self, s: &crate::load::PeerStats) {
        self.store.note_peers(s);
    }

    /// `memory` or `redis`, for stats.
    pub fn store_kind(&self) -> &'static str {
        self.store.kind()
    }

    /// The shared store, with its counters (none in memory).
    pub fn shared(&self) -> Option<&redis::RedisBudgets> {
        self.store.as_any().downcast_ref()
    }

    /// Milliseconds since these budgets were made: the clock of every
    /// reservation in this process.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// What has been counted.
    pub fn metrics(&self) -> &BudgetMetrics {
        &self.metrics
    }

    /// Open reservations tracked here.
    pub fn open_reservations(&self) -> usize {
        self.store.open_reservations()
    }

    /// Budget keys tracked here.
    pub fn keys(&self) -> usize {
        self.store.keys()
    }

    /// Reserves a pick's cost against its key's budget, or says why not.
    pub async fn reserve(&self, ask: &Ask) -> Reserved {
        let now = self.now_ms();
        let r = self.store.reserve(now, ask, &self.metrics).await;
        self.metrics.count_reserve(ask, &r);
        r
    }

    /// Applies a report to the reservation of its request id.
    pub async fn report(&self, rep: &Report) -> Reported {
        let now = self.now_ms();
        let r = self.store.report(now, rep, &self.metrics).await;
        self.metrics.count_report(rep, &r);
        r
    }

    /// Settles `request_id`'s reservation to the usage so far.
    pub async fn settle(&self, key: Option<&str>, request_id: &str, usage: Usage) -> Reported {
        self.report(&report(key, request_id, ReportOp::Settle(usage)))
            .await
    }

    /// Ends `request_id`'s reservation with its final usage.
    pub async fn release(
        &self,
        key: Option<&str>,
        request_id: &str,
        usage: Option<Usage>,
        train: bool,
    ) -> Reported {
        let op = ReportOp::Release {
            usage,
            train,
            local: false,
        };
        self.report(&report(key, request_id, op)).await
    }

    /// Gives back everything `request_id`'s reservation holds.
    pub async fn cancel(&self, key: Option<&str>, request_id: &str) -> Reported {
        self.report(&report(key, request_id, ReportOp::Cancel))
            .await
    }
}

fn report(key: Option<&str>, request_id: &str, op: ReportOp) -> Report {
    Report {
        key: key.map(str::to_owned),
        request_id: request_id.to_owned(),
        op,
    }
}

/// Runs a budget operation for a caller that does not wait for it (a
/// report, a give-back): at once when it is ready on its first poll (the
/// memory store), else on the runtime. Outside a runtime a pending one is
/// dropped (logged).
pub fn run_detached<F>(fut: F)
where
    F: Future<Output = ()> + Send + 'static,
{
    let mut fut = Box::pin(fut);
    if (&mut fut).now_or_never().is_some() {
        return;
    }
    match tokio::runtime::Handle::try_current() {
        Ok(h) => {
            h.spawn(fut);
        }
        Err(_) => tracing::warn!("budgets: an operation was dropped outside a runtime"),
    }
}

#[cfg(test)]
mod tests;
