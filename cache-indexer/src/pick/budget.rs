//! Budget admission of a pick: reserve the request's tokens
//! against its tenant's budget before it is placed or queued.
//!
//! The reservation is the prompt as tokenized (pseudo-tokens in `approx`
//! mode), the best predicted cached tokens among the endpoints the prefix
//! index matched (0 when not looked up: the whole prompt at full price
//! until usage says otherwise), and the output estimate (`max_tokens`, else
//! the key's learned figure). A pick without a budget reserves nothing. A
//! budgeted pick needs a budget key and a request id (reports settle the
//! reservation by it): without them it is INVALID_ARGUMENT
//! ([`super::prompt::check_budget`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvasir_proto::budget::budget_status;
use kvasir_proto::v1 as pb;

use super::matching::Matched;
use super::prompt::Call;
use super::tokenize::PickTokens;
use crate::budgets::{self, Ask, Budgets, Reserved};
use crate::pool::Pool;
use crate::scoring::predicted_cached_tokens;
use crate::tokenize::TokenizeMode;

/// The answer to a pick the budget refused.
fn rate_limited(
    prompt_tokens: u32,
    mode: TokenizeMode,
    status: pb::BudgetStatus,
) -> pb::PickResponse {
    let mut answer = pb::PickResponse {
        prompt_tokens,
        budget: Some(status),
        ..Default::default()
    };
    answer.set_decision_and_reason(pb::Decision::RateLimited);
    answer.set_tokenize_mode(mode);
    answer
}

/// What admission reserved for a pick. Dropped before the pick was
/// answered (its caller went away while it waited in the flow-control
/// queue), it gives the reservation back: no report will ever end it.
#[derive(Debug, Default)]
pub(crate) struct Admission {
    /// The reservation, while the pick has not been answered with it.
    held: Option<Held>,
    /// The budget's status after the reservation.
    status: Option<pb::BudgetStatus>,
    /// Set once the answer carries the reservation: the reports end it.
    answered: AtomicBool,
}

/// A reservation to give back if its pick is never answered.
#[derive(Debug)]
struct Held {
    budgets: Arc<Budgets>,
    key: String,
    request_id: String,
}

impl Held {
    fn cancel(self) {
        let Held {
            budgets,
            key,
            request_id,
        } = self;
        budgets::run_detached(async move {
            budgets.cancel(Some(&key), &request_id).await;
        });
    }
}

impl Admission {
    fn reserved(held: Held, status: pb::BudgetStatus) -> Admission {
        Admission {
            held: Some(held),
            status: Some(status),
            answered: AtomicBool::new(false),
        }
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        if self.answered.load(Ordering::Relaxed) {
            return;
        }
        if let Some(h) = self.held.take() {
            h.cancel();
        }
    }
}

impl Pool {
    /// Reserves `call`'s tokens against its budget; a refusal is the answer
    /// to send (decision RATE_LIMITED).
    pub(crate) async fn admit(
        &self,
        call: &Call,
        tokens: &PickTokens,
        matched: &Matched<'_>,
    ) -> Result<Admission, pb::PickResponse> {
        let prompt_tokens =
            u32::try_from(tokens.estimated_len.unwrap_or(tokens.ids.len())).unwrap_or(u32::MAX);
        let cached = self.best_cached(prompt_tokens, matched);
        self.admit_counted(call, prompt_tokens, cached, tokens.mode)
            .await
    }

    /// Reserves `prompt_tokens` (`cached_tokens` of them expected cached)
    /// plus the output estimate; `mode` says how the prompt was counted.
    pub(crate) async fn admit_counted(
        &self,
        call: &Call,
        prompt_tokens: u32,
        cached_tokens: u32,
        mode: TokenizeMode,
    ) -> Result<Admission, pb::PickResponse> {
        let Some(b) = &call.budget else {
            return Ok(Admission::default());
        };
        let ask = Ask {
            key: b.key.clone(),
            request_id: call.request_id.clone(),
            limits: kvasir_budget::Limits::from(b),
            default_output_tokens: u64::from(b.default_output_tokens),
            max_tokens: (b.max_tokens > 0).then_some(u64::from(b.max_tokens)),
            prompt_tokens: u64::from(prompt_tokens),
            cached_tokens: u64::from(cached_tokens),
            max_age_ms: u64::try_from(self.load.config().in_flight_timeout.as_millis())
                .unwrap_or(u64::MAX),
        };
        match self.budgets.reserve(&ask).await {
            Reserved::Admitted { headers, .. } => {
                let held = Held {
                    budgets: Arc::clone(&self.budgets),
                    key: ask.key,
                    request_id: ask.request_id,
                };
                Ok(Admission::reserved(held, budget_status(&headers, None)))
            }
            Reserved::Untracked => Ok(Admission::default()),
            // onStoreDown: closed, Redis unreachable (budgets/redis/mod.rs).
            Reserved::StoreUnavailable { retry_after_ms } => {
                let mut status = pb::BudgetStatus {
                    retry_after_ms,
                    ..Default::default()
                };
                status.set_limited_by(pb::LimitedBy::Store);
                Err(rate_limited(prompt_tokens, mode, status))
            }
            Reserved::Limited { refusal, headers } => {
                tracing::debug!(
                    pool = %self.name,
                    tenant = %call.tenant,
                    budget_key = %ask.key,
                    request_id = %call.request_id,
                    %refusal,
                    "pick rate limited"
                );
                let status = budget_status(&headers, Some(&refusal));
                Err(rate_limited(prompt_tokens, mode, status))
            }
        }
    }

    /// The most prompt tokens any matched endpoint is expected to hold.
    fn best_cached(&self, prompt_tokens: u32, matched: &Matched<'_>) -> u32 {
        match (&matched.overlap, matched.indexed) {
            (Some(o), true) => predicted_cached_tokens(
                prompt_tokens,
                u32::try_from(o.max_blocks()).unwrap_or(u32::MAX),
                self.block_size,
            ),
            _ => 0,
        }
    }

    /// Gives back what `admission` reserved (the pick was shed).
    pub(crate) fn give_back(&self, _call: &Call, mut admission: Admission) {
        if let Some(h) = admission.held.take() {
            h.cancel();
        }
    }

    /// Adds the budget's status to an admitted pick's answer; from now on
    /// the reports end the reservation.
    pub(crate) fn attach_budget(&self, answer: &mut pb::PickResponse, admission: &Admission) {
        admission.answered.store(true, Ordering::Relaxed);
        if let Some(s) = &admission.status {
            answer.budget = Some(s.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reserve(b: &Arc<Budgets>, rid: &str) -> Admission {
        let ask = Ask {
            key: "a".into(),
            request_id: rid.into(),
            limits: kvasir_budget::Limits::default(),
            default_output_tokens: 1,
            max_tokens: None,
            prompt_tokens: 1,
            cached_tokens: 0,
            max_age_ms: 60_000,
        };
        let r = futures::FutureExt::now_or_never(b.reserve(&ask)).unwrap();
        assert!(matches!(r, Reserved::Admitted { .. }), "{r:?}");
        let held = Held {
            budgets: Arc::clone(b),
            key: ask.key,
            request_id: ask.request_id,
        };
        Admission::reserved(held, pb::BudgetStatus::default())
    }

    #[test]
    fn an_admission_dropped_unanswered_gives_its_reservation_back() {
        let b = Arc::new(Budgets::memory());
        drop(reserve(&b, "gone"));
        assert_eq!(b.open_reservations(), 0);
        let a = reserve(&b, "answered");
        a.answered.store(true, Ordering::Relaxed);
        drop(a);
        assert_eq!(b.open_reservations(), 1, "the reports end it");
    }

    #[test]
    fn a_budget_needs_a_key_and_a_request_id() {
        let b = pb::Budget {
            key: "a".into(),
            ..Default::default()
        };
        assert!(super::super::prompt::check_budget("r", Some(&b)).is_ok());
        assert!(super::super::prompt::check_budget("", None).is_ok());
        assert!(super::super::prompt::check_budget("", Some(&b)).is_err());
        assert!(super::super::prompt::check_budget("r", Some(&pb::Budget::default())).is_err());
    }
}
