//! A pool's reports: the filter says a request got its first token or is
//! done. They release the pick's load, count outcomes for the failure
//! tracking, and give the prediction accuracy (predicted against reported
//! cached tokens). A report carrying a stored response's id records which
//! endpoint holds it ([`crate::responses`]). Reports of budgeted requests
//! settle, release or cancel the tenant's reservation ([`crate::budgets`]);
//! USAGE reports do only that (no load or in-flight accounting).

use std::sync::Arc;
use std::time::Instant;

use kvasir_budget::Usage;
use kvasir_proto::v1 as pb;

use crate::budgets::{self, ReportOp};
use crate::health::Verdict;
use crate::load::Phase;
use crate::pool::{invalid, Pool, ServiceError};
use crate::responses::check_id;
use crate::types::EndpointId;

impl Pool {
    /// Accounts a report.
    pub fn report(&self, req: &pb::ReportRequest) -> Result<pb::ReportResponse, ServiceError> {
        if req.request_id.is_empty() {
            return Err(invalid("request_id", "must not be empty"));
        }
        let reported = pb::ReportPhase::try_from(req.phase).unwrap_or(pb::ReportPhase::Unspecified);
        let done = matches!(
            reported,
            pb::ReportPhase::Done | pb::ReportPhase::Unspecified
        );
        if done && req.admission == pb::Admission::Local as i32 {
            // Noted before the budget and the load are touched: a pick
            // still to finish under this id ends itself (crate::abandoned).
            self.abandoned
                .note(&req.request_id, std::time::Instant::now());
        }
        self.report_budget(req, reported);
        let phase = match reported {
            // Usage while streaming settles the tenant's budget only.
            pb::ReportPhase::Usage => return Ok(pb::ReportResponse { matched: false }),
            pb::ReportPhase::FirstToken => Phase::FirstToken,
            pb::ReportPhase::Done | pb::ReportPhase::Unspecified => Phase::Done,
        };
        let m = self.load.report(&req.request_id, phase);
        self.flow_settle(req, phase == Phase::Done);
        // A first token or an end frees room a waiting pick may take.
        self.capacity_freed();
        if !req.response_id.is_empty() {
            self.record_response(req, m.endpoint);
        }
        if m.matched {
            self.metrics.reports_matched.inc();
        } else {
            self.metrics.reports_unmatched.inc();
        }
        if phase == Phase::Done {
            let outcome = pb::Outcome::try_from(req.outcome).unwrap_or(pb::Outcome::Unspecified);
            let i = match outcome {
                pb::Outcome::Success | pb::Outcome::Unspecified => 0,
                pb::Outcome::Error => 1,
                pb::Outcome::Cancelled => 2,
                pb::Outcome::Timeout => 3,
                pb::Outcome::Rejected => 4,
                pb::Outcome::ClientError => 5,
            };
            self.metrics.reports_by_outcome[i].inc();
            self.count_outcome(&req.endpoint, m.endpoint, outcome);
            // Prediction accuracy, only where the picked endpoint served.
            let served_by_pick = m.endpoint.is_some_and(|id| {
                req.endpoint.is_empty() || EndpointId::from_address(&req.endpoint) == id
            });
            if let (true, Some(p), true) = (served_by_pick, m.predicted_cached, i == 0) {
                self.metrics.predicted_cached_tokens.add(u64::from(p));
                self.metrics
                    .reported_cached_tokens
                    .add(u64::from(req.cached_tokens));
            }
        }
        Ok(pb::ReportResponse { matched: m.matched })
    }

    /// Applies the report to the tenant's budget reservation, if any:
    /// USAGE and FIRST_TOKEN with usage settle it (monotone), DONE
    /// releases it with the final usage (training the key's output
    /// estimate on a success), OUTCOME_REJECTED cancels it. The reservation
    /// is found by request id (the memory store), or by `budget_key` where
    /// the store is shared; a replica that holds nothing for it counts the
    /// report as unmatched when it names a key.
    fn report_budget(&self, req: &pb::ReportRequest, phase: pb::ReportPhase) {
        let usage = Usage {
            prompt_tokens: u64::from(req.prompt_tokens),
            cached_tokens: u64::from(req.cached_tokens),
            completion_tokens: u64::from(req.completion_tokens),
        };
        let has_usage = req.prompt_tokens > 0 || req.completion_tokens > 0;
        let op = match phase {
            pb::ReportPhase::Usage | pb::ReportPhase::FirstToken if has_usage => {
                ReportOp::Settle(usage)
            }
            pb::ReportPhase::Usage | pb::ReportPhase::FirstToken => return,
            pb::ReportPhase::Done | pb::ReportPhase::Unspecified => {
                match pb::Outcome::try_from(req.outcome).unwrap_or(pb::Outcome::Unspecified) {
                    pb::Outcome::Rejected => ReportOp::Cancel,
                    o => ReportOp::Release {
                        usage: has_usage.then_some(usage),
                        train: has_usage
                            && matches!(o, pb::Outcome::Success | pb::Outcome::Unspecified),
                        local: req.admission == pb::Admission::Local as i32,
                    },
                }
            }
        };
        let rep = budgets::Report {
            key: (!req.budget_key.is_empty()).then(|| req.budget_key.clone()),
            request_id: req.request_id.clone(),
            op,
        };
        let b = Arc::clone(&self.budgets);
        budgets::run_detached(async move {
            b.report(&rep).await;
        });
    }

    /// Records that the report's endpoint (or, when it names none, the
    /// picked one) holds the response the report names, for the report's
    /// tenant. A malformed id is
    /// skipped, not refused: the rest of the report still counts.
    fn record_response(&self, req: &pb::ReportRequest, picked: Option<EndpointId>) {
        if let Err(why) = check_id(&req.response_id) {
            tracing::debug!(pool = %self.name, request_id = %req.request_id, %why, "report: response_id skipped");
            return;
        }
        let endpoint = if req.endpoint.is_empty() {
            let Some(id) = picked else {
                tracing::debug!(pool = %self.name, request_id = %req.request_id, "report: response_id without an endpoint or a pick; skipped");
                return;
            };
            match self.endpoints().iter().find(|e| e.id == id) {
                Some(e) => e.spec.address.clone(),
                None => return,
            }
        } else {
            req.endpoint.clone()
        };
        self.responses
            .record(&req.response_id, &endpoint, &req.tenant);
    }

    /// Counts a DONE report's outcome for the endpoint that served it (the
    /// report's, when it names one of the pool's, else the picked one).
    ///
    /// When another member served, the picked endpoint did not: Envoy
    /// retried the request away from it (refused or reset before any
    /// response) or could not reach it. That is a failure of the picked
    /// endpoint even though the request succeeded; without it an engine
    /// that resets every request would look idle, keep being picked first
    /// and cost every request a retry (Envoy's override-host ignores
    /// outlier ejection).
    fn count_outcome(&self, served: &str, picked: Option<EndpointId>, outcome: pb::Outcome) {
        let Some(verdict) = Verdict::of(outcome) else {
            return;
        };
        let named = (!served.is_empty())
            .then(|| EndpointId::from_address(served))
            .filter(|id| self.endpoints().iter().any(|e| e.id == *id));
        let now = Instant::now();
        if let (Some(n), Some(p)) = (named, picked) {
            if n != p {
                self.failures.record(p, Verdict::Failure, now);
            }
        }
        if let Some(id) = named.or(picked) {
            self.failures.record(id, verdict, now);
        }
    }
}
