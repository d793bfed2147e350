//! Budgets and flow control in a request's flow: what a pick's answer says
//! about the tenant's budget and the pool's queue (the `x-ratelimit-*`
//! headers kept for the response, the wait counted), and the 429 of a pick
//! the indexer refused (rate limited) or shed.

use kvasir_proto::v1::{BudgetStatus, LimitedBy, Outcome, ReportPhase};

use super::respond::Dispatch;
use super::{Flow, Host, Phase};
use crate::governance::{queue_shed_reply, rate_limit_headers, rate_limited_reply};
use crate::pick::{PickOutcome, ShedCause};
use crate::reply::LocalReply;
use crate::stats::pool_stat;

impl Flow {
    /// Notes what every pick answer says about governance: the budget's
    /// headers for the response, and the time the pick waited in the
    /// pool's queue (`queue_wait_ms`, per tenant and per pool, only for
    /// picks that waited: the histogram's count is the picks that waited,
    /// its sum their total wait).
    pub(super) fn governance_outcome(&mut self, outcome: &PickOutcome) {
        if let Some(b) = &outcome.budget {
            self.rate_limit_headers = rate_limit_headers(b);
        }
        if outcome.queued_ms == 0 {
            return;
        }
        let ms = u64::from(outcome.queued_ms);
        let stats = &self.shared.stats;
        stats.record(&format!("{}.queue_wait_ms", self.prefix()), ms);
        if let Some(r) = &self.routed {
            stats.record(&pool_stat(&r.pool_name, "queue_wait_ms"), ms);
        }
    }

    /// The tenant's budget refused the pick: 429 with `retry-after` and the
    /// budget's headers, counted (`rate_limited.<limit>` per tenant,
    /// `pick.rate_limited` per pool) and reported done as rejected.
    pub(super) fn refuse_rate_limited(
        &mut self,
        host: &mut dyn Host,
        status: Option<&BudgetStatus>,
    ) {
        let tenant = self.tenant.clone().unwrap_or_default();
        let limit = status
            .map(BudgetStatus::resolved_refused_by)
            .filter(|l| *l != LimitedBy::Unspecified)
            .map_or("other", LimitedBy::as_label);
        self.count(&format!("rate_limited.{limit}"), 1);
        let reply = rate_limited_reply(self.shape(), &tenant, status);
        self.refuse(host, "pick.rate_limited", &reply);
    }

    /// Flow control shed the pick: 429 with `retry-after: 1`, counted
    /// (`shed.<cause>` per tenant, `pick.shed` per pool) and reported done
    /// as rejected, which gives back a reservation the pick held.
    pub(super) fn refuse_shed(
        &mut self,
        host: &mut dyn Host,
        cause: ShedCause,
        queued_ms: u32,
        status: Option<&BudgetStatus>,
    ) {
        let pool = self
            .routed
            .as_ref()
            .map(|r| r.pool_name.clone())
            .unwrap_or_default();
        self.count(&format!("shed.{}", cause.as_label()), 1);
        let reply = queue_shed_reply(self.shape(), &pool, cause, queued_ms, status);
        self.refuse(host, "pick.shed", &reply);
    }

    fn refuse(&mut self, host: &mut dyn Host, pool_rest: &str, reply: &LocalReply) {
        if let Some(r) = &self.routed {
            self.shared
                .stats
                .count(&pool_stat(&r.pool_name, pool_rest), 1);
        }
        host.send_reply(reply);
        self.phase = Phase::Replied;
        let now = host.now_ns();
        // Ends the request at the indexer: a reservation the pick held (a
        // shed pick's) is cancelled. Queued like every done report.
        self.report(
            host,
            ReportPhase::Done,
            Outcome::Rejected,
            None,
            now,
            Dispatch::Deferred,
        );
    }
}
