//! Budgets shared by every indexer replica through Redis (
//! "Across replicas" and "With the store unreachable" in
//! `budget/README.md`).
//!
//! Each reserve and each report is one atomic script call
//! ([`script::BudgetStore`]), so a tenant's budget is one budget however
//! many replicas admit against it, and a report settles on whichever
//! replica it reaches (`ReportRequest.budget_key` names the key). The
//! output estimate of requests without `max_tokens` is learned per
//! replica, from the releases it sees.
//!
//! With Redis unreachable (every call bounded by `timeoutMs`, then Redis
//! left alone for `retryMs`) a pick is decided by `onStoreDown`:
//!
//! * `local`: this replica's own in-process budgets, each limit divided by
//!   the replica count (at least 1 per limit), so the replicas together
//!   stay within the budget if Envoy spreads a tenant evenly;
//! * `open`: admitted without a budget;
//! * `closed`: refused, `limited_by` "store", retry after `retryMs`.
//!
//! A report the store does not know (Redis down, or a request reserved in
//! the local fallback) goes to the local budgets. Counted in
//! [`StoreStats`]. A reserve given up on (timed out while Redis was
//! stalled) may still run when Redis resumes: it is undone then
//! ([`abandon`]), so it does not hold the tenant's slots.

pub mod abandon;
pub(crate) mod exposition;
pub mod script;

use std::any::Any;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use kvasir_budget::{OutputEstimate, Request};
use lru::LruCache;
use parking_lot::Mutex;

use self::script::{BudgetStore, BudgetStoreError};
use super::memory::MemoryStore;
use super::{Ask, BudgetMetrics, Report, ReportOp, Reported, Reserved, Store, MAX_KEYS, MAX_OPEN};
use crate::load::PeerStats;
use crate::metrics::Counter;

/// What a replica does with a budgeted pick while Redis is unreachable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreDown {
    /// Its own budgets, each limit divided by the replica count.
    #[default]
    Local,
    /// Admit without a budget.
    Open,
    /// Refuse (429, `limited_by` "store").
    Closed,
}

impl OnStoreDown {
    /// The config word, also the `mode` label.
    pub fn as_str(self) -> &'static str {
        match self {
            OnStoreDown::Local => "local",
            OnStoreDown::Open => "open",
            OnStoreDown::Closed => "closed",
        }
    }
}

/// The ops in [`StoreStats::errors`] order.
pub const STORE_OPS: [&str; 4] = ["reserve", "settle", "release", "cancel"];
/// The errors in [`StoreStats::errors`] order.
pub const STORE_ERRORS: [&str; 4] = ["down", "timeout", "failed", "malformed"];
/// The decisions in [`StoreStats::down_picks`] order.
pub const DOWN_DECISIONS: [&str; 2] = ["admitted", "limited"];

/// What the shared store did, for `/metrics`.
#[derive(Debug, Default)]
pub struct StoreStats {
    /// Calls that failed, by op ([`STORE_OPS`]) and error
    /// ([`STORE_ERRORS`]); `down` is a call not tried in the retry delay.
    pub errors: [[Counter; 4]; 4],
    /// Budgeted picks decided without the store, by decision
    /// ([`DOWN_DECISIONS`]); the mode is [`RedisBudgets::on_store_down`].
    pub down_picks: [Counter; 2],
    /// Reports the store did not know that the local budgets settled.
    pub local_reports: Counter,
}

impl StoreStats {
    fn error(&self, op: usize, e: &BudgetStoreError) {
        let i = match e {
            BudgetStoreError::Down => 0,
            BudgetStoreError::Timeout => 1,
            BudgetStoreError::Failed(_) => 2,
            BudgetStoreError::Malformed(_) => 3,
        };
        self.errors[op][i].inc();
    }

    /// Failed calls of one op and error (zero for unknown words).
    pub fn errors_of(&self, op: &str, error: &str) -> u64 {
        let o = STORE_OPS.iter().position(|x| *x == op);
        let e = STORE_ERRORS.iter().position(|x| *x == error);
        match (o, e) {
            (Some(o), Some(e)) => self.errors[o][e].get(),
            _ => 0,
        }
    }
}

/// How the shared budgets are reached and what they do without Redis.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    /// `redis://host:port[/db]`.
    pub url: String,
    /// Bound of one call, connect included.
    pub timeout: Duration,
    /// After a failure, how long Redis is left alone.
    pub retry_after: Duration,
    /// Prefix of the keys (then `budget:<key>`).
    pub key_prefix: String,
    /// What picks get while Redis is unreachable.
    pub on_store_down: OnStoreDown,
    /// Replicas the `local` fallback divides limits by; `None`: the live
    /// count last noted ([`RedisBudgets::note_live_replicas`]), 1 before.
    pub replicas: Option<u32>,
}

/// Budgets in Redis, with the local fallback.
#[derive(Debug)]
pub struct RedisBudgets {
    store: BudgetStore,
    on_down: OnStoreDown,
    replicas: Option<u32>,
    live_replicas: AtomicU32,
    local: MemoryStore,
    /// Each key's learned completion length, per replica.
    estimates: Mutex<LruCache<String, OutputEstimate>>,
    stats: StoreStats,
}

impl RedisBudgets {
    /// Budgets at `s.url`; connects on first use.
    pub fn new(s: &RedisSettings) -> Result<Self, BudgetStoreError> {
        let store = BudgetStore::new(&s.url, s.timeout, s.retry_after, &s.key_prefix)?;
        Ok(RedisBudgets {
            store,
            on_down: s.on_store_down,
            replicas: s.replicas,
            live_replicas: AtomicU32::new(1),
            local: MemoryStore::new(MAX_KEYS, MAX_OPEN),
            estimates: Mutex::new(LruCache::new(
                NonZeroUsize::new(MAX_KEYS).unwrap_or(NonZeroUsize::MIN),
            )),
            stats: StoreStats::default(),
        })
    }

    /// The script store.
    pub fn store(&self) -> &BudgetStore {
        &self.store
    }

    /// What the store did.
    pub fn stats(&self) -> &StoreStats {
        &self.stats
    }

    /// The `onStoreDown` mode.
    pub fn on_store_down(&self) -> OnStoreDown {
        self.on_down
    }

    /// Records how many replicas are live (this one included; `sharedLoad`
    /// knows), for the `local` fallback when `replicas` is not configured.
    pub fn note_live_replicas(&self, n: u32) {
        self.live_replicas.store(n.max(1), Ordering::Relaxed);
    }

    /// Notes the live replica count from `sharedLoad`'s view of its peers,
    /// only while that view is fresh: during an outage of the same Redis it
    /// goes stale, and the count from before the outage is the one to
    /// divide by.
    pub fn note_peers(&self, s: &PeerStats) {
        if s.enabled && !s.local_only && s.read_age.is_some() {
            let n = u32::try_from(s.peers.saturating_add(1)).unwrap_or(u32::MAX);
            self.note_live_replicas(n);
        }
    }

    /// Replicas the fallback divides each limit by.
    pub fn replicas(&self) -> u32 {
        self.replicas
            .unwrap_or_else(|| self.live_replicas.load(Ordering::Relaxed))
            .max(1)
    }

    /// Reserves `ask` in Redis, or decides it by `onStoreDown`.
    pub(super) async fn reserve(&self, now: u64, ask: &Ask, metrics: &BudgetMetrics) -> Reserved {
        let req = Request {
            prompt_tokens: ask.prompt_tokens,
            cached_tokens: ask.cached_tokens.min(ask.prompt_tokens),
            output_tokens: self.estimate(ask),
        };
        let r = self
            .store
            .reserve(
                &ask.key,
                &ask.limits,
                &ask.request_id,
                &req,
                Some(ask.max_age_ms),
                None,
            )
            .await;
        match r {
            Ok(r) => match r.outcome {
                Ok(held) => Reserved::Admitted {
                    held,
                    headers: r.states.headers(),
                    repeated: r.repeated,
                },
                Err(refusal) => Reserved::Limited {
                    refusal,
                    headers: r.states.headers(),
                },
            },
            Err(e) => {
                self.stats.error(0, &e);
                self.without_store(now, ask, metrics)
            }
        }
    }

    fn estimate(&self, ask: &Ask) -> u64 {
        if let Some(m) = ask.max_tokens {
            return m;
        }
        let mut e = self.estimates.lock();
        e.get_or_insert(ask.key.clone(), || {
            OutputEstimate::new(ask.default_output_tokens)
        })
        .estimate(None)
    }

    /// A pick's budget decision while Redis is unreachable.
    fn without_store(&self, now: u64, ask: &Ask, metrics: &BudgetMetrics) -> Reserved {
        let r = match self.on_down {
            OnStoreDown::Local => {
                let mut local = ask.clone();
                local.limits = ask.limits.divided(self.replicas());
                self.local.reserve(now, &local, metrics)
            }
            OnStoreDown::Open => Reserved::Untracked,
            OnStoreDown::Closed => Reserved::StoreUnavailable {
                retry_after_ms: u64::try_from(self.store.retry_after().as_millis())
                    .unwrap_or(u64::MAX),
            },
        };
        let admitted = matches!(r, Reserved::Admitted { .. } | Reserved::Untracked);
        self.stats.down_picks[usize::from(!admitted)].inc();
        r
    }

    /// Applies a report in Redis (when it names its key), else, or when
    /// Redis does not know the request, in the local budgets.
    pub(super) async fn report(&self, now: u64, rep: &Report) -> Reported {
        let mut unsent = false;
        if let Some(key) = &rep.key {
            match self.report_shared(key, rep).await {
                Ok(Some(r)) => return r,
                Ok(None) => {}
                Err((op, e)) => {
                    self.stats.error(op, &e);
                    unsent = true;
                }
            }
        }
        let r = self.local.report(now, rep);
        if r.key.is_some() {
            self.stats.local_reports.inc();
        } else if let (true, Some(key)) = (unsent, &rep.key) {
            // Reserved in Redis, not here: its end goes to Redis once it
            // answers again, or the reservation would hold its slot until
            // its max age ([`abandon`]). A local admission's charge is not
            // sent twice (it is not idempotent): left out.
            let undo = match rep.op {
                ReportOp::Release {
                    usage,
                    local: false,
                    ..
                } => Some(abandon::Undo::Release(usage)),
                ReportOp::Cancel => Some(abandon::Undo::Cancel),
                _ => None,
            };
            if let Some(undo) = undo {
                self.store.abandoned().push(abandon::Abandon {
                    key: key.clone(),
                    id: rep.request_id.clone(),
                    undo,
                });
            }
        }
        r
    }

    /// `Ok(None)`: Redis has no such open reservation.
    async fn report_shared(
        &self,
        key: &str,
        rep: &Report,
    ) -> Result<Option<Reported>, (usize, BudgetStoreError)> {
        let s = &self.store;
        let id = rep.request_id.as_str();
        let matched = |r: Reported| {
            Some(Reported {
                key: Some(key.to_owned()),
                ..r
            })
        };
        match rep.op {
            ReportOp::Settle(usage) => {
                let a = s
                    .settle(key, None, id, &usage, None)
                    .await
                    .map_err(|e| (1, e))?;
                Ok(a.value.and_then(|charged| {
                    matched(Reported {
                        charged,
                        ..Reported::default()
                    })
                }))
            }
            ReportOp::Release {
                usage,
                train,
                local,
            } => {
                // A local admission's end with usage is charged even where
                // nothing was reserved under its id.
                let charge = local && usage.is_some();
                let a = s
                    .release(key, None, id, usage.as_ref(), charge, None)
                    .await
                    .map_err(|e| (2, e))?;
                let Some(end) = a.value else {
                    return Ok(None);
                };
                if let (true, Some(u)) = (train, usage) {
                    if let Some(e) = self.estimates.lock().get_mut(key) {
                        e.observe(u.completion_tokens);
                    }
                }
                Ok(matched(Reported {
                    charged: end.released.charged,
                    refunded: end.released.refunded,
                    settled: Some(end.settled),
                    unreserved: !end.reserved,
                    ..Reported::default()
                }))
            }
            ReportOp::Cancel => {
                let a = s.cancel(key, None, id, None).await.map_err(|e| (3, e))?;
                Ok(a.value.and_then(|refunded| {
                    matched(Reported {
                        refunded,
                        ..Reported::default()
                    })
                }))
            }
        }
    }
}

/// Each call one script round trip, bounded by the store's timeout.
impl Store for RedisBudgets {
    fn kind(&self) -> &'static str {
        "redis"
    }

    fn reserve<'a>(
        &'a self,
        now_ms: u64,
        ask: &'a Ask,
        metrics: &'a BudgetMetrics,
    ) -> BoxFuture<'a, Reserved> {
        Box::pin(RedisBudgets::reserve(self, now_ms, ask, metrics))
    }

    fn report<'a>(
        &'a self,
        now_ms: u64,
        rep: &'a Report,
        _metrics: &'a BudgetMetrics,
    ) -> BoxFuture<'a, Reported> {
        Box::pin(RedisBudgets::report(self, now_ms, rep))
    }

    /// Open reservations in the local fallback (Redis holds the rest).
    fn open_reservations(&self) -> usize {
        self.local.open()
    }

    /// Keys in the local fallback.
    fn keys(&self) -> usize {
        self.local.keys()
    }

    fn note_peers(&self, peers: &PeerStats) {
        RedisBudgets::note_peers(self, peers);
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[cfg(test)]
mod stall_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_budget::Limits;

    fn ask(key: &str, id: &str, rpm: u64) -> Ask {
        Ask {
            key: key.into(),
            request_id: id.into(),
            limits: Limits {
                requests_per_minute: Some(rpm),
                ..Limits::default()
            },
            default_output_tokens: 16,
            max_tokens: None,
            prompt_tokens: 10,
            cached_tokens: 0,
            max_age_ms: 60_000,
        }
    }

    fn unreachable(mode: OnStoreDown, replicas: Option<u32>) -> RedisBudgets {
        RedisBudgets::new(&RedisSettings {
            // Port 1 on loopback: nothing listens, the connect is refused.
            url: "redis://127.0.0.1:1".into(),
            timeout: Duration::from_millis(200),
            retry_after: Duration::from_secs(30),
            key_prefix: "t:".into(),
            on_store_down: mode,
            replicas,
        })
        .unwrap()
    }

    #[test]
    fn limits_divide_without_reaching_zero() {
        let l = Limits {
            requests_per_minute: Some(10),
            total_tokens_per_minute: Some(1),
            max_concurrent: Some(5),
            ..Limits::default()
        };
        let d = l.divided(3);
        assert_eq!(d.requests_per_minute, Some(3));
        assert_eq!(d.total_tokens_per_minute, Some(1));
        assert_eq!(d.max_concurrent, Some(1));
        assert_eq!(d.prompt_tokens_per_minute, None);
        assert_eq!(l.divided(0), l);
    }

    #[tokio::test]
    async fn local_fallback_enforces_the_divided_budget_and_counts() {
        let b = unreachable(OnStoreDown::Local, Some(2));
        let m = BudgetMetrics::default();
        let mut admitted = 0;
        for i in 0..10 {
            if let Reserved::Admitted { .. } =
                b.reserve(0, &ask("t", &format!("r{i}"), 10), &m).await
            {
                admitted += 1;
            }
        }
        assert_eq!(admitted, 5);
        assert_eq!(b.stats().down_picks[0].get(), 5);
        assert_eq!(b.stats().down_picks[1].get(), 5);
        let tried =
            b.stats().errors_of("reserve", "failed") + b.stats().errors_of("reserve", "timeout");
        assert_eq!(tried, 1);
        assert_eq!(b.stats().errors_of("reserve", "down"), 9);
        // A report naming the key settles the local reservation.
        let rep = Report {
            key: Some("t".into()),
            request_id: "r0".into(),
            op: ReportOp::Cancel,
        };
        assert_eq!(b.report(1, &rep).await.key.as_deref(), Some("t"));
        assert_eq!(b.stats().local_reports.get(), 1);
        assert_eq!(b.stats().errors_of("cancel", "down"), 1);
    }

    #[tokio::test]
    async fn open_admits_and_closed_refuses_with_the_retry_delay() {
        let m = BudgetMetrics::default();
        let open = unreachable(OnStoreDown::Open, None);
        assert_eq!(
            open.reserve(0, &ask("t", "r", 1), &m).await,
            Reserved::Untracked
        );
        let closed = unreachable(OnStoreDown::Closed, None);
        assert_eq!(
            closed.reserve(0, &ask("t", "r", 1), &m).await,
            Reserved::StoreUnavailable {
                retry_after_ms: 30_000
            }
        );
        assert_eq!(closed.stats().down_picks[1].get(), 1);
    }

    #[test]
    fn the_live_count_applies_without_a_configured_one() {
        let b = unreachable(OnStoreDown::Local, None);
        assert_eq!(b.replicas(), 1);
        b.note_live_replicas(3);
        assert_eq!(b.replicas(), 3);
        b.note_live_replicas(0);
        assert_eq!(b.replicas(), 1);
        assert_eq!(unreachable(OnStoreDown::Local, Some(4)).replicas(), 4);
        // sharedLoad's view counts only while it is fresh.
        let mut s = PeerStats {
            enabled: true,
            peers: 2,
            read_age: Some(Duration::from_millis(10)),
            ..PeerStats::default()
        };
        b.note_peers(&s);
        assert_eq!(b.replicas(), 3);
        s.peers = 0;
        s.local_only = true;
        b.note_peers(&s);
        assert_eq!(b.replicas(), 3);
    }
}
