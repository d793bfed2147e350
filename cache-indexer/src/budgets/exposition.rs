//! The tenants' budgets' families (see [`crate::budgets`]): picks admitted
//! and limited, limits hit, tokens reserved, settled, refunded and taken
//! beyond reservations per tenant; open reservations, keys, reservations
//! dropped, picks left untracked, and reports by op and result.
//!
//! Budgets are one set per process, shared by every pool, so these
//! families carry no `pool` label. The `tenant` label is the budget key,
//! bounded by [`crate::budgets::MAX_TENANT_LABELS`] (later keys are summed
//! under `_other`). Written whatever the configuration (no samples but the
//! totals until a budgeted pick), so the page's families do not depend on
//! it.

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType::{Counter, Gauge};

use crate::budgets::{Budgets, TenantCounts, REPORT_OPS};
use crate::exposition::family;
use crate::pools::Pools;
use kvasir_proto::v1::LimitedBy;

/// A per-tenant counter family: name, help, and its value.
type TenantFamily = (&'static str, &'static str, fn(&TenantCounts) -> u64);

const TOKEN_FAMILIES: [TenantFamily; 5] = [
    (
        "kvasir_indexer_budget_tokens_reserved_total",
        "Tokens (weighted prompt + completion estimate) reserved at admission, by tenant.",
        |c| c.tokens_reserved,
    ),
    (
        "kvasir_indexer_budget_tokens_settled_total",
        "Tokens (weighted prompt + completion) of ended requests' final usage, by tenant.",
        |c| c.tokens_settled,
    ),
    (
        "kvasir_indexer_budget_tokens_refunded_total",
        "Reserved tokens given back (unused at the end, or the request never served), by tenant.",
        |c| c.tokens_refunded,
    ),
    (
        "kvasir_indexer_budget_tokens_overrun_total",
        "Tokens taken beyond reservations (usage above the estimate), by tenant.",
        |c| c.tokens_overrun,
    ),
    (
        "kvasir_indexer_budget_tokens_limited_total",
        "Tokens of picks refused by the budget (prompt + max_tokens, else the default output estimate), by tenant.",
        |c| c.tokens_limited,
    ),
];

/// Reads the process's budgets (the first pool's: every pool shares them)
/// at each scrape.
#[derive(Debug)]
pub(crate) struct BudgetsCollector(pub(crate) Arc<Pools>);

impl Collector for BudgetsCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let budgets: Option<Arc<Budgets>> = self.0.iter().next().map(|p| Arc::clone(&p.budgets));
        let tenants = budgets
            .as_ref()
            .map(|b| b.metrics().tenants())
            .unwrap_or_default();
        let enc = &mut enc;
        let name = "kvasir_indexer_budget_requests_total";
        let help =
            "Budgeted picks by tenant and decision (admitted, limited: answered RATE_LIMITED).";
        let mut f = family(enc, name, Counter, help)?;
        for (t, c) in &tenants {
            f.sample(&[("tenant", t), ("decision", "admitted")], c.admitted)?;
            f.sample(&[("tenant", t), ("decision", "limited")], c.limited)?;
        }
        let name = "kvasir_indexer_budget_limited_total";
        let help = "Budgeted picks refused, by tenant and the limit that refused them (requests, prompt_tokens, completion_tokens, tokens, concurrent, too_large); limits never hit are not written.";
        let mut f = family(enc, name, Counter, help)?;
        for (t, c) in &tenants {
            for (by, n) in LimitedBy::KNOWN.into_iter().zip(c.limited_by) {
                if n > 0 {
                    f.sample(&[("tenant", t), ("limited_by", by.as_label())], n)?;
                }
            }
        }
        for (name, help, value) in TOKEN_FAMILIES {
            let mut f = family(enc, name, Counter, help)?;
            for (t, c) in &tenants {
                f.sample(&[("tenant", t)], value(c))?;
            }
        }
        let Some(b) = budgets else {
            return Ok(());
        };
        totals(enc, &b)
    }
}

/// The families without a tenant label.
fn totals(enc: &mut DescriptorEncoder<'_>, b: &Budgets) -> fmt::Result {
    let m = b.metrics();
    let name = "kvasir_indexer_budget_open_reservations";
    let help = "Budget reservations open (admitted, end not reported yet) in this process.";
    family(enc, name, Gauge, help)?.sample(&[], b.open_reservations() as u64)?;
    let name = "kvasir_indexer_budget_keys";
    let help = "Budget keys (tenants) tracked in this process.";
    family(enc, name, Gauge, help)?.sample(&[], b.keys() as u64)?;
    let name = "kvasir_indexer_budget_reservations_dropped_total";
    let help = "Open reservations dropped with their charge kept, by reason (expired: no end reported within the in-flight timeout; evicted: the open-reservation bound).";
    let mut f = family(enc, name, Counter, help)?;
    f.sample(&[("reason", "expired")], m.expired.get())?;
    f.sample(&[("reason", "evicted")], m.evicted.get())?;
    let name = "kvasir_indexer_budget_untracked_total";
    let help = "Budgeted picks admitted without a budget: no room to track their key.";
    family(enc, name, Counter, help)?.sample(&[], m.untracked.get())?;
    let name = "kvasir_indexer_budget_reports_total";
    let help = "Reports applied to budgets, by op (settle, release, cancel) and result (matched a reservation here; unmatched: named a budget key but nothing is open here for the request).";
    let mut f = family(enc, name, Counter, help)?;
    for (i, op) in REPORT_OPS.iter().enumerate() {
        f.sample(
            &[("op", op), ("result", "matched")],
            m.reports_matched[i].get(),
        )?;
        f.sample(
            &[("op", op), ("result", "unmatched")],
            m.reports_unmatched[i].get(),
        )?;
    }
    let name = "kvasir_indexer_budget_store";
    let help = "Where budget state is kept (1 for the configured store: memory or redis).";
    family(enc, name, Gauge, help)?.sample(&[("store", b.store_kind())], 1u64)
}
