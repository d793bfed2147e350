//! The filter's side of tenant budgets and flow control (the indexer
//! decides both at the pick): the 429 replies of a rate-limited or shed
//! pick in the API's own error shape, OpenAI's `x-ratelimit-*` headers
//! from a pick's [`BudgetStatus`], and when a streaming response reports
//! its usage so far ([`UsageCadence`]).
//!
//! OpenAI answers a rate limit with 429 and
//! `{"error":{"message":"Rate limit reached for <model> in organization
//! <org> on tokens per min (TPM): Limit ..., Used ..., Requested ....
//! Please try again in 1.5s. ...","type":"tokens","param":null,
//! "code":"rate_limit_exceeded"}}` (`type` is `requests` for a request
//! limit), and a request that can never fit with "Request too large for
//! ... The input or output tokens must be reduced in order to run
//! successfully." and no retry time. Anthropic answers
//! `{"type":"error","error":{"type":"rate_limit_error","message":...}}`.
//! Both send `retry-after` in whole seconds.

use kvasir_budget::{go_duration, retry_after_secs, LimitState, RateLimitHeaders};
use kvasir_proto::v1::{BudgetStatus, LimitedBy};
use serde_json::json;

use crate::pick::{ShedCause, Usage};
use crate::reply::{error_reply, LocalReply, Shape, REPLY_MARKER};

/// Content events between two `USAGE` reports of a streaming response.
pub const USAGE_EVERY_EVENTS: u64 = 64;
/// Most time between two `USAGE` reports while the stream makes progress
/// (ns).
pub const USAGE_EVERY_NS: u64 = 1_000_000_000;

/// `Retry-After` of a shed request (s): the queue may have room at once.
pub const SHED_RETRY_AFTER_S: u64 = 1;

/// The `x-ratelimit-*` headers of a budget's status: the request and the
/// token dimensions that have a limit (nonzero), resets written as Go
/// durations; none when the tenant has no rate limit (only concurrency).
pub fn rate_limit_headers(status: &BudgetStatus) -> Vec<(&'static str, String)> {
    let state = |limit: u64, remaining: u64, reset_ms: u64| {
        (limit > 0).then_some(LimitState {
            limit,
            remaining,
            reset_ms,
        })
    };
    RateLimitHeaders {
        requests: state(
            status.limit_requests,
            status.remaining_requests,
            status.reset_requests_ms,
        ),
        tokens: state(
            status.limit_tokens,
            status.remaining_tokens,
            status.reset_tokens_ms,
        ),
    }
    .headers()
}

/// What a refusal's `limited_by` names: OpenAI's error `type`, the limit
/// in words, and its figures when the status carries that limit's own.
fn limit_words(status: &BudgetStatus) -> (&'static str, &'static str, Option<(u64, u64)>) {
    let tokens = Some((status.limit_tokens, status.remaining_tokens)).filter(|(l, _)| *l > 0);
    let requests = Some((status.limit_requests, status.remaining_requests)).filter(|(l, _)| *l > 0);
    match status.resolved_refused_by() {
        LimitedBy::Requests => ("requests", "requests per min (RPM)", requests),
        LimitedBy::Tokens => ("tokens", "tokens per min (TPM)", tokens),
        LimitedBy::PromptTokens => ("tokens", "input tokens per min", None),
        LimitedBy::CompletionTokens => ("tokens", "output tokens per min", None),
        LimitedBy::Concurrent => ("requests", "concurrent requests", None),
        LimitedBy::TooLarge => ("tokens", "tokens per min (TPM)", None),
        LimitedBy::Store | LimitedBy::Unspecified => ("requests", "its budget", None),
    }
}

fn with_headers(mut r: LocalReply, headers: Vec<(&'static str, String)>) -> LocalReply {
    r.headers
        .extend(headers.into_iter().map(|(k, v)| (k.to_string(), v)));
    r
}

/// The 429 of a pick its tenant's budget refused (`DECISION_RATE_LIMITED`),
/// in the API's shape, with `retry-after` (none when the request can never
/// fit: `too_large`) and the budget's `x-ratelimit-*` headers.
pub fn rate_limited_reply(shape: Shape, tenant: &str, status: Option<&BudgetStatus>) -> LocalReply {
    let empty = BudgetStatus::default();
    let st = status.unwrap_or(&empty);
    let (kind, what, figures) = limit_words(st);
    let too_large = st.resolved_refused_by() == LimitedBy::TooLarge;
    let retry_ms = st.retry_after_ms;
    let message = if too_large {
        format!(
            "Request too large for tenant `{tenant}` on {what}: it needs more than the tenant's \
             whole budget for a minute. The input or output tokens must be reduced in order to \
             run successfully."
        )
    } else {
        let figures = figures
            .map(|(l, r)| format!(" Limit {l}, Remaining {r}."))
            .unwrap_or_default();
        let head = match shape {
            Shape::OpenAi => "Rate limit reached for",
            Shape::Anthropic => "This request would exceed the rate limit for",
        };
        format!(
            "{head} tenant `{tenant}` on {what}:{figures} Please try again in {}.",
            go_duration(retry_ms.max(1))
        )
    };
    let body = match shape {
        Shape::OpenAi => json!({"error": {
            "message": message,
            "type": kind,
            "param": null,
            "code": "rate_limit_exceeded",
        }}),
        Shape::Anthropic => json!({"type": "error", "error": {
            "type": "rate_limit_error",
            "message": message,
        }}),
    };
    let mut headers = Vec::new();
    if !too_large {
        headers.push(("retry-after", retry_after_secs(retry_ms).to_string()));
    }
    headers.extend(rate_limit_headers(st));
    let r = LocalReply {
        status: 429,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            (REPLY_MARKER.into(), "filter".into()),
        ],
        // A json! value of strings always serializes.
        body: serde_json::to_vec(&body).unwrap_or_default(),
    };
    with_headers(r, headers)
}

/// The 429 of a pick flow control shed (`DECISION_SHED`), in the API's
/// shape (code `shed`, as a policy's shed), with `retry-after: 1` and the
/// budget's `x-ratelimit-*` headers when the pick carried a budget.
pub fn queue_shed_reply(
    shape: Shape,
    pool: &str,
    cause: ShedCause,
    queued_ms: u32,
    status: Option<&BudgetStatus>,
) -> LocalReply {
    let why = match cause {
        ShedCause::PoolFull => "its queue is full".to_string(),
        ShedCause::TenantFull => "this tenant's share of its queue is full".to_string(),
        ShedCause::NoWait => "the request could not wait for room".to_string(),
        ShedCause::MaxWait => format!("the request waited {queued_ms} ms for room, its longest"),
        ShedCause::Unspecified => "the request was shed".to_string(),
    };
    let message = format!("The pool `{pool}` is saturated and {why}. Please try again later.");
    let mut headers = vec![("retry-after", SHED_RETRY_AFTER_S.to_string())];
    headers.extend(status.map(rate_limit_headers).unwrap_or_default());
    with_headers(error_reply(shape, 429, "shed", None, &message), headers)
}

/// When a streaming response of a budgeted request reports its usage so
/// far (`REPORT_PHASE_USAGE`): every [`USAGE_EVERY_EVENTS`] content events,
/// or after [`USAGE_EVERY_NS`] with new usage, whichever comes first. The
/// clock is the caller's (the host's), so tests are deterministic.
#[derive(Debug, Clone, Default)]
pub struct UsageCadence {
    /// Content events at the last report (or at the start).
    events: u64,
    /// When the last report went (or the first token came), ns.
    at_ns: Option<u64>,
    /// The usage last reported.
    sent: Usage,
}

impl UsageCadence {
    /// Whether a report of `usage` (seen after `events` content events, at
    /// `now_ns`) is due; if so it counts as sent. The first call only
    /// starts the clock, at the first token (which has its own report).
    pub fn due(&mut self, events: u64, usage: Usage, now_ns: u64) -> bool {
        let Some(at) = self.at_ns else {
            self.at_ns = Some(now_ns);
            self.events = events;
            return false;
        };
        let by_events = events.saturating_sub(self.events) >= USAGE_EVERY_EVENTS;
        let by_time = now_ns.saturating_sub(at) >= USAGE_EVERY_NS;
        if usage == self.sent || !(by_events || by_time) {
            return false;
        }
        self.events = events;
        self.at_ns = Some(now_ns);
        self.sent = usage;
        true
    }
}

#[cfg(test)]
#[path = "governance_tests.rs"]
mod tests;
