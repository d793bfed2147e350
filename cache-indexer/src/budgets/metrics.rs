//! What the budgets did, per tenant (the budget key) and in all: read by
//! `/metrics` ([`crate::exposition`]). Tenant labels are bounded: the first
//! [`MAX_TENANT_LABELS`] keys get their own series, later ones are summed
//! under [`OTHER_TENANT`]. Series are never dropped (counters stay
//! monotone), so the bound is on the page, not on time.

use std::collections::HashMap;

use kvasir_budget::{Dimension, Refusal};
use kvasir_proto::v1::LimitedBy;
use parking_lot::Mutex;

use super::{Ask, Report, Reported, Reserved};
use crate::metrics::Counter;

/// Tenants with their own series on `/metrics`.
pub const MAX_TENANT_LABELS: usize = 1_000;

/// The tenant label of keys past [`MAX_TENANT_LABELS`].
pub const OTHER_TENANT: &str = "_other";

/// The `limited_by` label of a refusal ([`LimitedBy::as_label`], the
/// word `BudgetStatus.limited_by` carries).
pub fn limited_by(r: &Refusal) -> &'static str {
    LimitedBy::from(r).as_label()
}

/// One tenant's counts (a snapshot, or the live values under the lock).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TenantCounts {
    /// Picks admitted (repeated picks of one request count once).
    pub admitted: u64,
    /// Picks refused.
    pub limited: u64,
    /// Refusals by [`LimitedBy::position`] (the ledger's refusals: the
    /// STORE slot stays 0).
    pub limited_by: [u64; LimitedBy::KNOWN.len()],
    /// Total tokens (weighted prompt + completion) reserved at admission.
    pub tokens_reserved: u64,
    /// Total tokens of released requests' final usage.
    pub tokens_settled: u64,
    /// Total tokens given back (unused reservation, cancels).
    pub tokens_refunded: u64,
    /// Total tokens taken beyond reservations (usage above the estimate).
    pub tokens_overrun: u64,
    /// Tokens of refused picks: prompt plus `max_tokens` (else the key's
    /// default output estimate; the learned one is the store's).
    pub tokens_limited: u64,
}

/// Budget counters of one indexer.
#[derive(Debug, Default)]
pub struct BudgetMetrics {
    tenants: Mutex<HashMap<String, TenantCounts>>,
    /// Reservations dropped after the max age without their end reported
    /// (they kept their charge).
    pub expired: Counter,
    /// Reservations dropped to stay within the open bound.
    pub evicted: Counter,
    /// Picks admitted without a budget: no room to track their key.
    pub untracked: Counter,
    /// Reports by op (settle, release, cancel) that matched a reservation.
    pub reports_matched: [Counter; 3],
    /// Reports naming a budget key that matched nothing here (already
    /// ended, expired, refused, or reserved on another replica).
    pub reports_unmatched: [Counter; 3],
}

/// The ops in [`BudgetMetrics::reports_matched`] order.
pub const REPORT_OPS: [&str; 3] = ["settle", "release", "cancel"];

fn op_index(r: &Report) -> usize {
    match r.op.as_str() {
        "settle" => 0,
        "release" => 1,
        _ => 2,
    }
}

impl BudgetMetrics {
    fn with_tenant(&self, key: &str, f: impl FnOnce(&mut TenantCounts)) {
        let mut t = self.tenants.lock();
        if let Some(c) = t.get_mut(key) {
            f(c);
            return;
        }
        let label = if t.len() < MAX_TENANT_LABELS {
            key
        } else {
            OTHER_TENANT
        };
        f(t.entry(label.to_owned()).or_default());
    }

    pub(super) fn count_reserve(&self, ask: &Ask, r: &Reserved) {
        let key = ask.key.as_str();
        match r {
            Reserved::Admitted { repeated: true, .. } => {}
            Reserved::Admitted { held, .. } => self.with_tenant(key, |c| {
                c.admitted += 1;
                c.tokens_reserved += held.get(Dimension::TotalTokens);
            }),
            Reserved::Limited { refusal, .. } => self.with_tenant(key, |c| {
                c.limited += 1;
                let output = ask.max_tokens.unwrap_or(ask.default_output_tokens);
                c.tokens_limited = c
                    .tokens_limited
                    .saturating_add(ask.prompt_tokens.saturating_add(output));
                if let Some(i) = LimitedBy::from(refusal).position() {
                    c.limited_by[i] += 1;
                }
            }),
            Reserved::Untracked => self.untracked.inc(),
            // Counted by the shared store (`RedisBudgets::stats`).
            Reserved::StoreUnavailable { .. } => {}
        }
    }

    pub(super) fn count_report(&self, rep: &Report, r: &Reported) {
        let i = op_index(rep);
        let Some(key) = &r.key else {
            if rep.key.is_some() {
                self.reports_unmatched[i].inc();
            }
            return;
        };
        self.reports_matched[i].inc();
        let total = Dimension::TotalTokens;
        self.with_tenant(key, |c| {
            c.tokens_overrun += r.charged.get(total);
            c.tokens_refunded += r.refunded.get(total);
            c.tokens_settled += r.settled.map_or(0, |s| s.get(total));
        });
    }

    /// Every tenant's counts, sorted by tenant.
    pub fn tenants(&self) -> Vec<(String, TenantCounts)> {
        let mut v: Vec<_> = self
            .tenants
            .lock()
            .iter()
            .map(|(k, c)| (k.clone(), *c))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// One tenant's counts (zeros when never counted).
    pub fn tenant(&self, key: &str) -> TenantCounts {
        self.tenants.lock().get(key).copied().unwrap_or_default()
    }
}
