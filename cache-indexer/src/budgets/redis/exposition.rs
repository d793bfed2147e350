//! The shared budget store's families (see [`crate::budgets::redis`]):
//! calls to Redis that failed, by op and error; budgeted picks decided
//! without it, by `onStoreDown` mode and decision; reports the local
//! fallback settled. No `pool` label (budgets are one set per process).
//! Written whatever the configuration, zeros with `store: memory` (mode
//! `local`, the default), so the page's families do not depend on it.

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType::Counter;

use crate::budgets::redis::{OnStoreDown, DOWN_DECISIONS, STORE_ERRORS, STORE_OPS};
use crate::exposition::family;
use crate::pools::Pools;

/// Reads the process's budgets (the first pool's) at each scrape.
#[derive(Debug)]
pub(crate) struct BudgetStoreCollector(pub(crate) Arc<Pools>);

impl Collector for BudgetStoreCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> fmt::Result {
        let budgets = self.0.iter().next().map(|p| Arc::clone(&p.budgets));
        let shared = budgets.as_deref().and_then(|b| b.shared());
        let enc = &mut enc;
        let name = "kvasir_indexer_budget_store_errors_total";
        let help = "Calls to the shared budget store (Redis) that failed, by op (reserve, settle, release, cancel) and error (down: not tried during the retry delay after a failure; timeout; failed: unreachable or refused; malformed: an answer not understood).";
        let mut f = family(enc, name, Counter, help)?;
        for (o, op) in STORE_OPS.iter().enumerate() {
            for (e, error) in STORE_ERRORS.iter().enumerate() {
                let n = shared.map_or(0, |s| s.stats().errors[o][e].get());
                f.sample(&[("op", op), ("error", error)], n)?;
            }
        }
        let name = "kvasir_indexer_budget_store_down_picks_total";
        let help = "Budgeted picks decided without the shared budget store, by budgets.onStoreDown mode (local: this replica's budgets, limits divided by the replicas; open; closed) and decision (admitted, limited).";
        let mut f = family(enc, name, Counter, help)?;
        let mode = shared.map_or(OnStoreDown::default(), |s| s.on_store_down());
        for (i, decision) in DOWN_DECISIONS.iter().enumerate() {
            let n = shared.map_or(0, |s| s.stats().down_picks[i].get());
            f.sample(&[("mode", mode.as_str()), ("decision", decision)], n)?;
        }
        let name = "kvasir_indexer_budget_store_deferred_total";
        let help = "Calls to the shared budget store kept to be made once Redis answers again: the undoing of reserves given up on (timed out or failed after they may have been sent: what they open is cancelled, or they open nothing) and the ends (release, cancel) of requests reserved in Redis whose report could not reach it; by result (given_up: kept; undone: answered by Redis, sent in front of a later call; dropped: the bounded list was full, or Redis refused it).";
        let mut f = family(enc, name, Counter, help)?;
        let a = shared.map(|s| s.store().abandoned());
        for (result, n) in [
            ("given_up", a.map_or(0, |a| a.given_up.get())),
            ("undone", a.map_or(0, |a| a.answered.get())),
            ("dropped", a.map_or(0, |a| a.dropped.get())),
        ] {
            f.sample(&[("result", result)], n)?;
        }
        let name = "kvasir_indexer_budget_store_local_reports_total";
        let help = "Reports of budgeted requests the shared store did not know (down, or admitted locally while it was) that this replica's local budgets settled.";
        let n = shared.map_or(0, |s| s.stats().local_reports.get());
        family(enc, name, Counter, help)?.sample(&[], n)
    }
}
