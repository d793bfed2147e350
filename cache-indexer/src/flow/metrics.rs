//! Flow control's counters and its queue-wait histogram (per pool; the
//! queue's lengths per tenant are read from the queue at scrape time, so
//! only tenants with picks waiting carry a label), and per tenant what the
//! reserve did and how long released picks waited ([`TenantCounts`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::metrics::Counter;

/// Tenants counted by name per pool at most; the rest are counted under
/// [`OTHER_TENANTS`] (tenants come from the policy, but a request's tenant
/// header must not grow the page without bound).
pub const MAX_TENANTS: usize = 256;

/// The tenant label of the tenants past [`MAX_TENANTS`].
pub const OTHER_TENANTS: &str = "_other";

/// Bucket bounds (seconds) of the queue-wait histogram: 1 ms .. 30 s (the
/// default maximum wait is 10 s).
pub const WAIT_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
];

/// Why a pick was shed: the contract's enum, counted by
/// [`ShedCause::position`] and labelled by [`ShedCause::as_label`] (its
/// `cause` label values), so the filter and the indexer share one table.
pub use kvasir_proto::v1::ShedCause;

/// A fixed-bucket histogram of queue waits.
#[derive(Debug)]
pub struct WaitHistogram {
    buckets: [AtomicU64; WAIT_BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Default for WaitHistogram {
    fn default() -> Self {
        WaitHistogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl WaitHistogram {
    /// Records one wait.
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = WAIT_BUCKETS.iter().position(|b| s <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Observations per bucket of [`WAIT_BUCKETS`] (not cumulative).
    pub fn buckets(&self) -> [u64; WAIT_BUCKETS.len()] {
        std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed))
    }

    /// Sum of the observations, seconds.
    pub fn sum_seconds(&self) -> f64 {
        self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9
    }
}

/// One pool's flow-control counters.
#[derive(Debug, Default)]
pub struct FlowMetrics {
    /// Picks that waited in the queue (pushed).
    pub queued: Counter,
    /// Tokens (prompt plus output estimate) of those picks.
    pub queued_tokens: Counter,
    /// Queued picks released to be placed.
    pub released: Counter,
    /// Tokens of the released picks.
    pub released_tokens: Counter,
    /// Picks shed, by [`ShedCause::position`].
    pub shed: [Counter; ShedCause::KNOWN.len()],
    /// Tokens of the shed picks, by cause.
    pub shed_tokens: [Counter; ShedCause::KNOWN.len()],
    /// Queued picks whose caller went away before they left the queue.
    pub cancelled: Counter,
    /// How long released picks waited.
    pub wait: WaitHistogram,
    /// Per tenant: the reserve's picks and the released picks' waits.
    tenants: Mutex<HashMap<String, TenantCounts>>,
}

/// One tenant's flow-control counts in a pool.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TenantCounts {
    /// Picks that waited only because of the reserve: the pool had room by
    /// the threshold, none below the tenant's bound (it was over its share).
    pub reserve_held: u64,
    /// Picks of the tenant while over its share that went anyway (let
    /// through or released below its bound).
    pub reserve_passed: u64,
    /// Its queued picks released.
    pub released: u64,
    /// Their waits, nanoseconds.
    pub wait_ns: u64,
}

impl FlowMetrics {
    /// A pick of `tenant` waited only because of the reserve.
    pub fn reserve_held(&self, tenant: &str) {
        self.tenant(tenant, |c| c.reserve_held += 1);
    }

    /// A pick of `tenant`, over its share, went below its bound.
    pub fn reserve_passed(&self, tenant: &str) {
        self.tenant(tenant, |c| c.reserve_passed += 1);
    }

    /// A queued pick of `tenant` was released after `waited`.
    pub fn tenant_released(&self, tenant: &str, waited: Duration) {
        let ns = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        self.tenant(tenant, |c| {
            c.released += 1;
            c.wait_ns = c.wait_ns.saturating_add(ns);
        });
    }

    /// Every tenant's counts, sorted by tenant.
    pub fn tenant_counts(&self) -> Vec<(String, TenantCounts)> {
        let mut out: Vec<(String, TenantCounts)> = self
            .tenants
            .lock()
            .iter()
            .map(|(t, c)| (t.clone(), *c))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    fn tenant(&self, tenant: &str, f: impl FnOnce(&mut TenantCounts)) {
        let mut g = self.tenants.lock();
        if let Some(c) = g.get_mut(tenant) {
            return f(c);
        }
        let name = if g.len() < MAX_TENANTS {
            tenant
        } else {
            OTHER_TENANTS
        };
        f(g.entry(name.to_owned()).or_default());
    }

    /// Counts a shed pick of `tokens`.
    /// (Every shed names its cause: UNSPECIFIED is not counted.)
    pub fn count_shed(&self, cause: ShedCause, tokens: u64) {
        if let Some(i) = cause.position() {
            self.shed[i].inc();
            self.shed_tokens[i].add(tokens);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_index_their_own_slot_and_waits_land_in_buckets() {
        for (i, c) in ShedCause::KNOWN.into_iter().enumerate() {
            let m = FlowMetrics::default();
            m.count_shed(c, 3);
            let counted: Vec<u64> = m.shed.iter().map(Counter::get).collect();
            assert_eq!(counted.iter().sum::<u64>(), 1);
            assert_eq!(counted[i], 1, "{c:?}");
            assert_eq!(m.shed_tokens[i].get(), 3);
        }
        let h = WaitHistogram::default();
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_secs(60));
        assert_eq!(h.count(), 2);
        assert_eq!(h.buckets()[1], 1, "3 ms is in the 5 ms bucket");
        assert_eq!(h.buckets().iter().sum::<u64>(), 1, "60 s only in +Inf");
        assert!((h.sum_seconds() - 60.003).abs() < 1e-6);
    }

    #[test]
    fn tenants_past_the_bound_are_counted_together() {
        let m = FlowMetrics::default();
        for i in 0..MAX_TENANTS + 3 {
            m.reserve_held(&format!("t{i}"));
        }
        m.reserve_passed("t0");
        m.tenant_released("t0", Duration::from_millis(250));
        let counts = m.tenant_counts();
        assert_eq!(counts.len(), MAX_TENANTS + 1);
        let other = counts.iter().find(|(t, _)| t == OTHER_TENANTS).unwrap();
        assert_eq!(other.1.reserve_held, 3);
        let t0 = counts.iter().find(|(t, _)| t == "t0").unwrap().1;
        assert_eq!(
            t0,
            TenantCounts {
                reserve_held: 1,
                reserve_passed: 1,
                released: 1,
                wait_ns: 250_000_000,
            }
        );
    }
}
