//! A budget's state as the wire carries it ([`v1::BudgetStatus`]), from
//! `kvasir-budget`'s figures: one conversion for the indexer's answers and
//! the filter's own refusals (a request it admits itself when it cannot
//! ask the indexer).

use kvasir_budget::{RateLimitHeaders, Refusal};

use crate::v1;

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
