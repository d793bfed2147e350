//! Budgets between the wire and the ledger, each way converted here once:
//!
//! * a pick's budget ([`v1::Budget`]) into the ledger's [`Limits`]: what the
//!   indexer reserves against, and what the filter holds a request it admits
//!   itself to (its share of the same limits), so both sides read the limits
//!   the same way;
//! * a budget's state ([`v1::BudgetStatus`]) from the ledger's figures: the
//!   indexer's answers and the filter's own refusals.

use kvasir_budget::{CachedWeight, Limits, RateLimitHeaders, Refusal};

use crate::v1;

/// The ledger's limits of a pick's budget: a limit of 0 is not limited; a
/// cached-token weight past 1000 thousandths counts as 1000.
impl From<&v1::Budget> for Limits {
    fn from(b: &v1::Budget) -> Limits {
        let some = |v: u64| (v > 0).then_some(v);
        Limits {
            requests_per_minute: some(b.requests_per_minute),
            prompt_tokens_per_minute: some(b.prompt_tokens_per_minute),
            completion_tokens_per_minute: some(b.completion_tokens_per_minute),
            total_tokens_per_minute: some(b.tokens_per_minute),
            max_concurrent: (b.max_concurrent > 0).then_some(b.max_concurrent),
            cached_token_weight: CachedWeight::from_permille(
                u16::try_from(b.cached_token_weight_permille).unwrap_or(u16::MAX),
            ),
        }
    }
}

/// The status of a budget's headers and, when refused, why.
pub fn budget_status(h: &RateLimitHeaders, refusal: Option<&Refusal>) -> v1::BudgetStatus {
    let mut s = v1::BudgetStatus::default();
    if let Some(r) = h.requests {
        s.limit_requests = r.limit;
        s.remaining_requests = r.remaining;
        s.reset_requests_ms = r.reset_ms;
    }
    if let Some(t) = h.tokens {
        s.limit_tokens = t.limit;
        s.remaining_tokens = t.remaining;
        s.reset_tokens_ms = t.reset_ms;
    }
    if let Some(r) = refusal {
        s.set_limited_by(v1::LimitedBy::from(r));
        s.retry_after_ms = match r {
            Refusal::Limited { retry_after_ms, .. } => *retry_after_ms,
            // A slot frees when some request ends: try again in a second.
            Refusal::Concurrency { .. } => 1_000,
            Refusal::TooLarge { .. } => 0,
        };
    }
    s
}

#[cfg(test)]
mod tests {
    use kvasir_budget::{Dimension, LimitState};

    use super::*;

    #[test]
    fn limits_of_a_wire_budget() {
        let l = Limits::from(&v1::Budget {
            key: "a".into(),
            tokens_per_minute: 10,
            requests_per_minute: 0,
            max_concurrent: 3,
            cached_token_weight_permille: 250,
            ..Default::default()
        });
        assert_eq!(l.total_tokens_per_minute, Some(10));
        assert_eq!(l.requests_per_minute, None);
        assert_eq!(l.max_concurrent, Some(3));
        assert_eq!(l.cached_token_weight.permille(), 250);
    }

    #[test]
    fn status_of_a_refusal() {
        let h = RateLimitHeaders {
            requests: Some(LimitState {
                limit: 2,
                remaining: 0,
                reset_ms: 60_000,
            }),
            tokens: None,
        };
        let r = Refusal::Limited {
            dimension: Dimension::Requests,
            retry_after_ms: 30_000,
        };
        let s = budget_status(&h, Some(&r));
        assert_eq!(s.limited_by, "requests");
        assert_eq!(s.refused_by(), v1::LimitedBy::Requests);
        assert_eq!(s.retry_after_ms, 30_000);
        assert_eq!(
            (s.limit_requests, s.remaining_requests, s.reset_requests_ms),
            (2, 0, 60_000)
        );
        assert_eq!(s.limit_tokens, 0);
        let s = budget_status(&h, Some(&Refusal::Concurrency { limit: 1 }));
        assert_eq!(
            (s.limited_by.as_str(), s.retry_after_ms),
            ("concurrent", 1000)
        );
        assert!(budget_status(&h, None).limited_by.is_empty());
    }
}
