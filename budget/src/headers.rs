//! OpenAI's rate-limit response headers and `Retry-After`, computed from a
//! budget.
//!
//! OpenAI sends, on every response of a rate-limited organization:
//! `x-ratelimit-limit-requests` / `-tokens` (the per-minute limits),
//! `x-ratelimit-remaining-requests` / `-tokens` (what may be used now) and
//! `x-ratelimit-reset-requests` / `-tokens` (the time until the limit is
//! wholly available again, written like Go's `time.Duration`: `6m0s`,
//! `1s`, `120ms`, `1.5s`). Its single token figure maps here to the total
//! budget when one is set, else to whichever of the prompt and completion
//! budgets is most used.

use crate::bucket::Bucket;
use crate::ledger::TenantBudget;
use crate::limits::Dimension;

/// One limit's three header values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitState {
    /// The per-minute limit.
    pub limit: u64,
    /// Whole units available now.
    pub remaining: u64,
    /// Milliseconds until the budget is full again.
    pub reset_ms: u64,
}

impl LimitState {
    fn of(b: &Bucket, limit: u64) -> LimitState {
        LimitState {
            limit,
            remaining: b.remaining(),
            reset_ms: b.reset_ms(limit),
        }
    }
}

/// The `x-ratelimit-*` values of one tenant at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateLimitHeaders {
    /// The request budget, when limited.
    pub requests: Option<LimitState>,
    /// The token budget reported, when one is limited.
    pub tokens: Option<LimitState>,
}

impl RateLimitHeaders {
    /// The values of `budget` at `now_ms`.
    pub fn of(budget: &TenantBudget, now_ms: u64) -> RateLimitHeaders {
        let state = |d: Dimension| {
            let limit = budget.limits().per_minute(d)?;
            Some(LimitState::of(&budget.bucket(now_ms, d)?, limit))
        };
        let tokens = state(Dimension::TotalTokens).or_else(|| {
            [Dimension::PromptTokens, Dimension::CompletionTokens]
                .into_iter()
                .filter_map(state)
                // Least remaining share first: compare r1/l1 < r2/l2
                // without division.
                .min_by(|a, b| {
                    (u128::from(a.remaining) * u128::from(b.limit))
                        .cmp(&(u128::from(b.remaining) * u128::from(a.limit)))
                })
        });
        RateLimitHeaders {
            requests: state(Dimension::Requests),
            tokens,
        }
    }

    /// Whether there is anything to send (the tenant has a rate limit).
    pub fn is_empty(&self) -> bool {
        self.requests.is_none() && self.tokens.is_none()
    }

    /// The header names and values, requests first.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::with_capacity(6);
        if let Some(r) = self.requests {
            out.push(("x-ratelimit-limit-requests", r.limit.to_string()));
            out.push(("x-ratelimit-remaining-requests", r.remaining.to_string()));
            out.push(("x-ratelimit-reset-requests", go_duration(r.reset_ms)));
        }
        if let Some(t) = self.tokens {
            out.push(("x-ratelimit-limit-tokens", t.limit.to_string()));
            out.push(("x-ratelimit-remaining-tokens", t.remaining.to_string()));
            out.push(("x-ratelimit-reset-tokens", go_duration(t.reset_ms)));
        }
        out
    }
}

/// A duration in milliseconds written as Go's `time.Duration` writes it
/// (the form of OpenAI's `x-ratelimit-reset-*`): `0s`, `120ms`, `1s`,
/// `1.5s`, `6m0s`, `1h0m0.25s`.
pub fn go_duration(ms: u64) -> String {
    if ms == 0 {
        return "0s".to_owned();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, rest) = (ms / 3_600_000, ms % 3_600_000);
    let (m, rest) = (rest / 60_000, rest % 60_000);
    let (s, frac) = (rest / 1000, rest % 1000);
    let mut secs = s.to_string();
    if frac > 0 {
        let f = format!("{frac:03}");
        secs.push('.');
        secs.push_str(f.trim_end_matches('0'));
    }
    match (h, m) {
        (0, 0) => format!("{secs}s"),
        (0, m) => format!("{m}m{secs}s"),
        (h, m) => format!("{h}h{m}m{secs}s"),
    }
}

/// `Retry-After` in whole seconds (HTTP allows no fraction): rounded up,
/// so a client that waits that long finds the budget available, and at
/// least 1, so a client never retries at once in a loop.
pub fn retry_after_secs(retry_after_ms: u64) -> u64 {
    retry_after_ms.div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::{Limits, Request};

    #[test]
    fn go_durations_as_openai_writes_them() {
        assert_eq!(go_duration(0), "0s");
        assert_eq!(go_duration(120), "120ms");
        assert_eq!(go_duration(1000), "1s");
        assert_eq!(go_duration(1500), "1.5s");
        assert_eq!(go_duration(1250), "1.25s");
        assert_eq!(go_duration(1001), "1.001s");
        assert_eq!(go_duration(360_000), "6m0s");
        assert_eq!(go_duration(90_500), "1m30.5s");
        assert_eq!(go_duration(3_600_000), "1h0m0s");
        assert_eq!(go_duration(3_723_000), "1h2m3s");
    }

    #[test]
    fn retry_after_rounds_up_and_is_at_least_one() {
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(1000), 1);
        assert_eq!(retry_after_secs(1001), 2);
    }

    #[test]
    fn headers_of_a_budget() {
        let mut b = TenantBudget::new(Limits {
            requests_per_minute: Some(60),
            total_tokens_per_minute: Some(6000),
            ..Limits::default()
        });
        b.reserve(
            0,
            &Request {
                prompt_tokens: 500,
                cached_tokens: 0,
                output_tokens: 100,
            },
        )
        .unwrap();
        let h = RateLimitHeaders::of(&b, 0).headers();
        let get = |n: &str| h.iter().find(|(k, _)| *k == n).map(|(_, v)| v.as_str());
        assert_eq!(get("x-ratelimit-limit-requests"), Some("60"));
        assert_eq!(get("x-ratelimit-remaining-requests"), Some("59"));
        assert_eq!(get("x-ratelimit-reset-requests"), Some("1s"));
        assert_eq!(get("x-ratelimit-limit-tokens"), Some("6000"));
        assert_eq!(get("x-ratelimit-remaining-tokens"), Some("5400"));
        assert_eq!(get("x-ratelimit-reset-tokens"), Some("6s"));
    }

    #[test]
    fn without_a_total_the_most_used_token_budget_is_reported() {
        let mut b = TenantBudget::new(Limits {
            prompt_tokens_per_minute: Some(1000),
            completion_tokens_per_minute: Some(100),
            ..Limits::default()
        });
        b.reserve(
            0,
            &Request {
                prompt_tokens: 100,
                cached_tokens: 0,
                output_tokens: 50,
            },
        )
        .unwrap();
        let h = RateLimitHeaders::of(&b, 0);
        assert_eq!(h.tokens.map(|t| t.limit), Some(100));
        assert!(h.requests.is_none());
        assert!(RateLimitHeaders::of(&TenantBudget::default(), 0).is_empty());
    }
}
