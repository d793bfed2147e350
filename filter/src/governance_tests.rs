//! The governance pieces that need no request flow: replies, headers, the
//! usage cadence, the pick's budget fields and answers, and the usage a
//! stream shows so far.

use kvasir_policy::{ApiKind, BudgetConfig};
use kvasir_proto::v1::{Decision, LimitedBy, PickRequest, PickResponse, PickedEndpoint};
use prost::Message;
use serde_json::{json, Value};

use super::*;
use crate::pick::{pick_outcome, pick_request, FailOpen, NoPick, PickInput};
use crate::request::parse_body;
use crate::response::ResponseTracker;

const MS: u64 = 1_000_000;

fn status(limited_by: &str, retry_after_ms: u64) -> BudgetStatus {
    // Both, as an indexer writes them while the words are on the wire.
    BudgetStatus {
        limited_by: limited_by.into(),
        refused_by: LimitedBy::from_label(limited_by) as i32,
        retry_after_ms,
        limit_requests: 60,
        remaining_requests: 0,
        reset_requests_ms: 1_000,
        limit_tokens: 6_000,
        remaining_tokens: 250,
        reset_tokens_ms: 57_500,
    }
}

fn body(r: &LocalReply) -> Value {
    serde_json::from_slice(&r.body).unwrap()
}

fn headers(r: &LocalReply) -> Vec<(&str, &str)> {
    r.headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

#[test]
fn headers_only_for_limited_dimensions() {
    let all = rate_limit_headers(&status("", 0));
    assert_eq!(
        all,
        vec![
            ("x-ratelimit-limit-requests", "60".to_string()),
            ("x-ratelimit-remaining-requests", "0".to_string()),
            ("x-ratelimit-reset-requests", "1s".to_string()),
            ("x-ratelimit-limit-tokens", "6000".to_string()),
            ("x-ratelimit-remaining-tokens", "250".to_string()),
            ("x-ratelimit-reset-tokens", "57.5s".to_string()),
        ]
    );
    let tokens_only = BudgetStatus {
        limit_requests: 0,
        ..status("", 0)
    };
    let h = rate_limit_headers(&tokens_only);
    assert_eq!(h.len(), 3);
    assert!(h.iter().all(|(k, _)| k.ends_with("-tokens")));
    // Only a concurrency limit: nothing to tell.
    assert!(rate_limit_headers(&BudgetStatus::default()).is_empty());
}

#[test]
fn openai_rate_limit_429_is_openais_shape() {
    let r = rate_limited_reply(Shape::OpenAi, "acme", Some(&status("tokens", 1_362)));
    assert_eq!(r.status, 429);
    assert_eq!(
        body(&r),
        json!({"error": {
            "message": "Rate limit reached for tenant `acme` on tokens per min (TPM): Limit 6000, Remaining 250. Please try again in 1.362s.",
            "type": "tokens",
            "param": null,
            "code": "rate_limit_exceeded",
        }})
    );
    assert_eq!(
        headers(&r),
        vec![
            ("content-type", "application/json"),
            (REPLY_MARKER, "filter"),
            ("retry-after", "2"),
            ("x-ratelimit-limit-requests", "60"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "1s"),
            ("x-ratelimit-limit-tokens", "6000"),
            ("x-ratelimit-remaining-tokens", "250"),
            ("x-ratelimit-reset-tokens", "57.5s"),
        ]
    );
    let r = rate_limited_reply(Shape::OpenAi, "acme", Some(&status("requests", 20_000)));
    let b = body(&r);
    assert_eq!(b["error"]["type"], "requests");
    assert_eq!(
        b["error"]["message"],
        "Rate limit reached for tenant `acme` on requests per min (RPM): Limit 60, Remaining 0. Please try again in 20s."
    );
    assert!(headers(&r).contains(&("retry-after", "20")));
    // A prompt-token limit: the status's token figures are another
    // budget's, so none are quoted.
    let r = rate_limited_reply(Shape::OpenAi, "acme", Some(&status("prompt_tokens", 400)));
    assert_eq!(
        body(&r)["error"]["message"],
        "Rate limit reached for tenant `acme` on input tokens per min: Please try again in 400ms."
    );
    assert!(headers(&r).contains(&("retry-after", "1")));
    // A concurrency limit is a request limit.
    let r = rate_limited_reply(Shape::OpenAi, "acme", Some(&status("concurrent", 1_000)));
    assert_eq!(body(&r)["error"]["type"], "requests");
}

#[test]
fn anthropic_rate_limit_429_is_anthropics_shape() {
    let r = rate_limited_reply(
        Shape::Anthropic,
        "acme",
        Some(&status("completion_tokens", 2_500)),
    );
    assert_eq!(r.status, 429);
    assert_eq!(
        body(&r),
        json!({"type": "error", "error": {
            "type": "rate_limit_error",
            "message": "This request would exceed the rate limit for tenant `acme` on output tokens per min: Please try again in 2.5s.",
        }})
    );
    let h = headers(&r);
    assert_eq!(h[2], ("retry-after", "3"));
    assert_eq!(h.len(), 9, "retry-after and six x-ratelimit headers");
}

#[test]
fn a_request_that_never_fits_gets_no_retry_after() {
    let r = rate_limited_reply(Shape::OpenAi, "acme", Some(&status("too_large", 0)));
    let b = body(&r);
    assert_eq!(b["error"]["code"], "rate_limit_exceeded");
    assert_eq!(b["error"]["type"], "tokens");
    assert!(b["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("Request too large for tenant `acme` on tokens per min (TPM)"));
    assert!(!headers(&r).iter().any(|(k, _)| *k == "retry-after"));
    assert!(headers(&r).contains(&("x-ratelimit-limit-tokens", "6000")));
    // No status at all (an indexer that sent none): retry in a second.
    let r = rate_limited_reply(Shape::OpenAi, "acme", None);
    assert_eq!(
        headers(&r),
        vec![
            ("content-type", "application/json"),
            (REPLY_MARKER, "filter"),
            ("retry-after", "1")
        ]
    );
}

#[test]
fn shed_429_says_why_and_retries_in_a_second() {
    let r = queue_shed_reply(Shape::OpenAi, "main", ShedCause::MaxWait, 1_500, None);
    assert_eq!(r.status, 429);
    assert_eq!(
        body(&r),
        json!({"error": {
            "message": "The pool `main` is saturated and the request waited 1500 ms for room, its longest. Please try again later.",
            "type": "rate_limit_error",
            "param": null,
            "code": "shed",
        }})
    );
    assert_eq!(
        headers(&r),
        vec![
            ("content-type", "application/json"),
            (REPLY_MARKER, "filter"),
            ("retry-after", "1")
        ]
    );
    let r = queue_shed_reply(
        Shape::Anthropic,
        "main",
        ShedCause::PoolFull,
        0,
        Some(&status("", 0)),
    );
    assert_eq!(
        body(&r),
        json!({"type": "error", "error": {
            "type": "rate_limit_error",
            "message": "The pool `main` is saturated and its queue is full. Please try again later.",
        }})
    );
    assert!(headers(&r).contains(&("x-ratelimit-remaining-tokens", "250")));
    assert_eq!(ShedCause::from_label("tenant_full"), ShedCause::TenantFull);
    assert_eq!(ShedCause::from_label("no_wait").as_label(), "no_wait");
    assert_eq!(
        ShedCause::from_label("from the future"),
        ShedCause::Unspecified
    );
}

fn usage(completion: u64) -> Usage {
    Usage {
        prompt_tokens: 10,
        cached_tokens: 0,
        completion_tokens: completion,
    }
}

#[test]
fn usage_is_due_every_64_content_events() {
    let mut c = UsageCadence::default();
    assert!(!c.due(1, usage(1), 0), "the first token starts the clock");
    assert!(!c.due(64, usage(64), MS));
    assert!(c.due(65, usage(65), 2 * MS), "64 events since the start");
    assert!(!c.due(128, usage(128), 3 * MS));
    assert!(c.due(129, usage(129), 4 * MS));
    assert!(c.due(1_000, usage(1_000), 5 * MS), "a burst is one report");
    assert!(!c.due(1_001, usage(1_001), 6 * MS));
}

#[test]
fn usage_is_due_after_a_second_with_progress() {
    let mut c = UsageCadence::default();
    assert!(!c.due(1, usage(1), 0));
    assert!(!c.due(5, usage(5), USAGE_EVERY_NS - 1));
    assert!(c.due(6, usage(6), USAGE_EVERY_NS));
    // A second later with nothing new: nothing to say.
    assert!(!c.due(6, usage(6), 3 * USAGE_EVERY_NS));
    // New usage after the wait: at once.
    assert!(c.due(7, usage(7), 3 * USAGE_EVERY_NS + 1));
    assert!(!c.due(8, usage(8), 3 * USAGE_EVERY_NS + 2));
}

fn budget() -> BudgetConfig {
    BudgetConfig {
        tokens_per_minute: Some(6_000),
        prompt_tokens_per_minute: None,
        completion_tokens_per_minute: Some(2_000),
        requests_per_minute: Some(60),
        max_concurrent: Some(4),
        cached_token_weight_permille: 250,
        default_output_tokens: 512,
    }
}

fn input<'a>(b: Option<&'a BudgetConfig>) -> PickInput<'a> {
    PickInput {
        pool: "main",
        model: "qwen",
        tenant: "acme",
        request_id: "r1",
        priority: 0,
        max_endpoints: 3,
        budget: b,
        weight: 3,
        max_wait_ms: 2_000,
    }
}

fn picked(api: ApiKind, body: &str, b: Option<&BudgetConfig>) -> PickRequest {
    let r = parse_body(api, body.as_bytes()).unwrap();
    PickRequest::decode(pick_request(&r, &input(b)).unwrap().as_slice()).unwrap()
}

#[test]
fn picks_carry_the_budget_only_for_budgeted_tenants() {
    let chat =
        r#"{"model":"m","max_completion_tokens":300,"messages":[{"role":"user","content":"hi"}]}"#;
    let b = budget();
    let p = picked(ApiKind::Chat, chat, Some(&b));
    assert_eq!((p.weight, p.max_wait_ms), (3, 2_000));
    let got = p.budget.unwrap();
    assert_eq!(
        got,
        kvasir_proto::v1::Budget {
            key: "acme".into(),
            tokens_per_minute: 6_000,
            prompt_tokens_per_minute: 0,
            completion_tokens_per_minute: 2_000,
            requests_per_minute: 60,
            max_concurrent: 4,
            cached_token_weight_permille: 250,
            default_output_tokens: 512,
            max_tokens: 300,
        }
    );
    let p = picked(ApiKind::Chat, chat, None);
    assert_eq!(p.budget, None);
    assert_eq!((p.weight, p.max_wait_ms), (3, 2_000));
    // Each API's own completion cap; 0 when absent.
    let resp = r#"{"model":"m","input":"hi","max_output_tokens":77}"#;
    assert_eq!(
        picked(ApiKind::Responses, resp, Some(&b))
            .budget
            .unwrap()
            .max_tokens,
        77
    );
    let msgs = r#"{"model":"m","max_tokens":9,"messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(
        picked(ApiKind::AnthropicMessages, msgs, Some(&b))
            .budget
            .unwrap()
            .max_tokens,
        9
    );
    let none = r#"{"model":"m","prompt":"hi"}"#;
    assert_eq!(
        picked(ApiKind::Completions, none, Some(&b))
            .budget
            .unwrap()
            .max_tokens,
        0
    );
    // No tenant, no key: not budgeted.
    let r = parse_body(ApiKind::Chat, chat.as_bytes()).unwrap();
    let anon = PickInput {
        tenant: "",
        ..input(Some(&b))
    };
    let p = PickRequest::decode(pick_request(&r, &anon).unwrap().as_slice()).unwrap();
    assert_eq!(p.budget, None);
}

fn answer(decision: Decision, addrs: &[&str], cause: &str) -> Vec<u8> {
    PickResponse {
        endpoints: addrs
            .iter()
            .map(|a| PickedEndpoint {
                address: a.to_string(),
                ..Default::default()
            })
            .collect(),
        pool_saturation: 1.0,
        decision: decision as i32,
        budget: Some(status("", 0)),
        queued_ms: 250,
        shed_cause: cause.into(),
        ..Default::default()
    }
    .encode_to_vec()
}

#[test]
fn refused_answers_are_their_own_outcomes() {
    let o = pick_outcome(0, Some(&answer(Decision::RateLimited, &[], "")));
    assert_eq!(o.result, Err(NoPick::RateLimited));
    assert_eq!(o.saturation, None, "refused before placement");
    assert_eq!(o.budget, Some(status("", 0)));
    let o = pick_outcome(0, Some(&answer(Decision::Shed, &[], "max_wait")));
    assert_eq!(o.result, Err(NoPick::Shed(ShedCause::MaxWait)));
    assert_eq!((o.saturation, o.queued_ms), (Some(1.0), 250));
    // Admitted after a wait: endpoints, status and the wait.
    let o = pick_outcome(0, Some(&answer(Decision::Load, &["10.0.0.1:1"], "")));
    assert_eq!(o.result.unwrap().header, "10.0.0.1:1");
    assert_eq!((o.queued_ms, o.budget.is_some()), (250, true));
    // An empty answer of another decision still fails open.
    let o = pick_outcome(0, Some(&answer(Decision::NoEndpoints, &[], "")));
    assert_eq!(o.result, Err(NoPick::FailOpen(FailOpen::NoEndpoints)));
}

fn stream(t: &mut ResponseTracker, lines: &[&str]) {
    for (i, l) in lines.iter().enumerate() {
        t.feed(format!("data: {l}\n\n").as_bytes(), (i as u64 + 1) * MS);
    }
}

#[test]
fn content_events_are_a_lower_bound_of_completion_tokens() {
    // OpenAI chat as vLLM streams it: role chunk, content, finish chunk.
    let mut t = ResponseTracker::new(0, true, 1 << 20);
    assert_eq!(t.usage_so_far(), None);
    stream(
        &mut t,
        &[
            r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"He"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"llo"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}"#,
        ],
    );
    assert_eq!(t.content_events(), 2);
    assert_eq!(
        t.usage_so_far(),
        Some(Usage {
            completion_tokens: 2,
            ..Usage::default()
        })
    );
    // Anthropic: only content_block_delta carries tokens; message_start's
    // usage gives the prompt.
    let mut t = ResponseTracker::new(0, true, 1 << 20);
    stream(
        &mut t,
        &[
            r#"{"type":"message_start","message":{"usage":{"input_tokens":30,"output_tokens":0}}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            r#"{"type":"ping"}"#,
            r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}"#,
            r#"{"type":"content_block_stop","index":0}"#,
        ],
    );
    assert_eq!(
        t.usage_so_far(),
        Some(Usage {
            prompt_tokens: 30,
            cached_tokens: 0,
            completion_tokens: 1
        })
    );
    // Responses API: only *.delta events.
    let mut t = ResponseTracker::new(0, true, 1 << 20);
    stream(
        &mut t,
        &[
            r#"{"type":"response.created","response":{"id":"resp_1","usage":null}}"#,
            r#"{"type":"response.output_text.delta","delta":"a"}"#,
            r#"{"type":"response.output_text.delta","delta":"b"}"#,
            r#"{"type":"response.output_text.done","text":"ab"}"#,
        ],
    );
    assert_eq!(t.content_events(), 2);
}

#[test]
fn continuous_usage_is_the_engines_figure() {
    let mut t = ResponseTracker::new(0, true, 1 << 20);
    stream(
        &mut t,
        &[
            r#"{"choices":[{"index":0,"delta":{"content":"a"}}],"usage":{"prompt_tokens":40,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":32}}}"#,
            r#"{"choices":[{"index":0,"delta":{"content":"b"}}],"usage":{"prompt_tokens":40,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":32}}}"#,
        ],
    );
    assert_eq!(
        t.usage_so_far(),
        Some(Usage {
            prompt_tokens: 40,
            cached_tokens: 32,
            completion_tokens: 7
        })
    );
}

#[test]
fn the_enum_wins_over_the_word_and_an_unknown_cause_is_unspecified() {
    let mut a = PickResponse::decode(answer(Decision::Shed, &[], "max_wait").as_slice()).unwrap();
    a.cause = ShedCause::TenantFull as i32;
    let o = pick_outcome(0, Some(&a.encode_to_vec()));
    assert_eq!(o.result, Err(NoPick::Shed(ShedCause::TenantFull)));
    // A cause from a newer indexer: shed all the same, counted as `other`.
    a.cause = 99;
    a.shed_cause = "from_the_future".into();
    let o = pick_outcome(0, Some(&a.encode_to_vec()));
    assert_eq!(o.result, Err(NoPick::Shed(ShedCause::Unspecified)));
    assert_eq!(ShedCause::Unspecified.as_label(), "other");
}
