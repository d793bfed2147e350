//! What a request's flow does when its pick gives no answer to route by
//! (it failed open): a request bound to a stored response is refused, since
//! only the indexer knows which engine holds the response and for which
//! tenant; a budgeted request is admitted against this Envoy's share of its
//! tenant's budget ([`crate::local_budget`]) or refused with a 429; anything
//! else goes on to Envoy's own load balancing.

use kvasir_budget::Usage as BudgetUsage;
use kvasir_proto::budget::budget_status;
use kvasir_proto::v1::{LimitedBy, Outcome, ReportPhase};

use super::respond::Dispatch;
use super::{Flow, Host, Phase, Verdict};
use crate::governance::rate_limited_reply;
use crate::local_budget::{self, LocalVerdict};
use crate::pick::{FailOpen, Usage};
use crate::reply::error_reply;
use crate::stats::pool_stat;

/// The code of the 503 a stored-response request gets without a pick.
pub const RESPONSES_UNAVAILABLE: &str = "responses_unavailable";

impl Flow {
    /// The pick failed open (`why`): counts it, then decides whether the
    /// request may go on. `Continue` when it may (the caller resumes it, or
    /// lets it go on), `Pause` when it was answered here.
    pub(super) fn without_pick(&mut self, host: &mut dyn Host, why: FailOpen) -> Verdict {
        self.fail_open(why);
        if self.response_id.is_some() {
            return self.refuse_unbound(host);
        }
        self.admit_locally(host)
    }

    /// A request on a stored response with no pick to route it: 503, never
    /// an engine chosen by Envoy (it could hold another tenant's response
    /// under that id, or none).
    fn refuse_unbound(&mut self, host: &mut dyn Host) -> Verdict {
        if let Some(r) = &self.routed {
            let stat = pool_stat(&r.pool_name, "pick.response_unavailable");
            self.shared.stats.count(&stat, 1);
        }
        let reply = error_reply(
            self.shape(),
            503,
            RESPONSES_UNAVAILABLE,
            None,
            "stored responses cannot be looked up right now; retry shortly",
        );
        host.send_reply(&reply);
        self.phase = Phase::Replied;
        let now = host.now_ns();
        self.report(
            host,
            ReportPhase::Done,
            Outcome::Rejected,
            None,
            now,
            Dispatch::Deferred,
        );
        Verdict::Pause
    }

    /// Admits a budgeted request against this Envoy's share of its
    /// tenant's budget, or refuses it with a 429 in the API's shape.
    fn admit_locally(&mut self, host: &mut dyn Host) -> Verdict {
        let Some(budget) = self.budget else {
            return Verdict::Continue;
        };
        let tenant = self.tenant.clone().unwrap_or_default();
        let limits = local_budget::share_of(&budget, self.shared.config.policy.gateway_replicas());
        let request = local_budget::request_of(&budget, self.prompt_estimate, self.max_tokens);
        let now_ms = host.wall_ms();
        let verdict = match host.shared_data() {
            Some(sd) => local_budget::admit(sd, &tenant, limits, request, now_ms),
            None => LocalVerdict::Unavailable,
        };
        match verdict {
            LocalVerdict::Admitted(a) => {
                self.count("local_budget.admitted", 1);
                self.local = Some(a);
                self.admitted_locally = true;
                Verdict::Continue
            }
            LocalVerdict::Unavailable => {
                self.count("local_budget.unavailable", 1);
                self.admitted_locally = true;
                Verdict::Continue
            }
            LocalVerdict::Refused(refusal, headers) => {
                let limit = LimitedBy::from(&refusal).as_label();
                self.count(&format!("local_budget.limited.{limit}"), 1);
                let status = budget_status(&headers, Some(&refusal));
                let reply = rate_limited_reply(self.shape(), &tenant, Some(&status));
                host.send_reply(&reply);
                self.phase = Phase::Replied;
                let now = host.now_ns();
                self.report(
                    host,
                    ReportPhase::Done,
                    Outcome::Rejected,
                    None,
                    now,
                    Dispatch::Deferred,
                );
                Verdict::Pause
            }
        }
    }

    /// Ends a local admission with the request's usage, at its end.
    pub(super) fn end_local(&mut self, host: &mut dyn Host, usage: Option<Usage>) {
        let (Some(a), Some(budget)) = (self.local.take(), self.budget) else {
            return;
        };
        let limits = local_budget::share_of(&budget, self.shared.config.policy.gateway_replicas());
        let usage = usage.map(|u| BudgetUsage {
            prompt_tokens: u.prompt_tokens,
            cached_tokens: u.cached_tokens,
            completion_tokens: u.completion_tokens,
        });
        let now_ms = host.wall_ms();
        let ended = host
            .shared_data()
            .is_some_and(|sd| local_budget::end(sd, &a, limits, usage, now_ms));
        if !ended {
            self.count("local_budget.unavailable", 1);
        }
    }
}
