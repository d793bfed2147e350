//! The filter's side of `kvasir.v1.Indexer`: building `Pick` and `Report`
//! messages (prost), and turning a `Pick` answer, or its failure, into
//! what the filter does next.
//!
//! Nothing the indexer says is trusted blindly: an endpoint list that is
//! not `ip:port` entries is treated as a bad response (fail open) rather
//! than copied into a header.

use kvasir_policy::BudgetConfig;
pub use kvasir_proto::v1::Admission;
use kvasir_proto::v1::{
    pick_request, Budget, BudgetStatus, Chat, ChatMessage, Decision, Hints, Outcome, PickRequest,
    PickResponse, ReportPhase, ReportRequest, TokenIds,
};
use prost::Message;

use crate::request::{ParsedRequest, Prompt, RequestPrompt};

/// The gRPC service name (`dispatch_grpc_call`'s `service`).
pub const SERVICE: &str = kvasir_proto::INDEXER_SERVICE;
/// The `Pick` method.
pub const PICK: &str = "Pick";
/// The `Report` method.
pub const REPORT: &str = "Report";
/// The `PoolState` method.
pub const POOL_STATE: &str = "PoolState";

/// What a `Pick` needs besides the parsed body.
#[derive(Debug, Clone, Copy)]
pub struct PickInput<'a> {
    /// The pool's name at the indexer.
    pub pool: &'a str,
    /// The model the engine will see (after any rewrite).
    pub model: &'a str,
    /// The resolved tenant.
    pub tenant: &'a str,
    /// The request id ("" when none).
    pub request_id: &'a str,
    /// Scheduling priority from the policy.
    pub priority: i32,
    /// Most endpoints to return.
    pub max_endpoints: u32,
    /// The tenant's budget, when it has one (sent keyed by `tenant`).
    pub budget: Option<&'a BudgetConfig>,
    /// The tenant's fair-share weight in a saturated pool.
    pub weight: u32,
    /// How long the pick may wait in the pool's flow-control queue (ms).
    pub max_wait_ms: u32,
}

/// The `Budget` a pick carries for `key` (the tenant's name): the
/// compiled limits (0 for none) and the request's own completion cap.
pub fn budget_message(key: &str, b: &BudgetConfig, max_tokens: u64) -> Budget {
    Budget {
        key: key.to_string(),
        tokens_per_minute: b.tokens_per_minute.unwrap_or(0),
        prompt_tokens_per_minute: b.prompt_tokens_per_minute.unwrap_or(0),
        completion_tokens_per_minute: b.completion_tokens_per_minute.unwrap_or(0),
        requests_per_minute: b.requests_per_minute.unwrap_or(0),
        max_concurrent: b.max_concurrent.unwrap_or(0),
        cached_token_weight_permille: u32::from(b.cached_token_weight_permille),
        default_output_tokens: b.default_output_tokens,
        max_tokens: u32::try_from(max_tokens).unwrap_or(u32::MAX),
    }
}

/// The encoded `PickRequest`, or `None` when the request cannot be picked
/// for (a batch of prompts, or no prompt and no stored response): the
/// request then goes to Envoy's own load balancing. A request bound to a
/// stored response carries its id (`response_id`), and its prompt when it
/// has one.
pub fn pick_request(req: &ParsedRequest<'_>, input: &PickInput<'_>) -> Option<Vec<u8>> {
    let response_id = req.response_id.as_deref().unwrap_or_default();
    let prompt = match &req.prompt {
        RequestPrompt::Chat(ms) if !ms.is_empty() => Some(pick_request::Prompt::Chat(Chat {
            messages: ms
                .iter()
                .map(|m| ChatMessage {
                    role: m.role.to_string(),
                    content: m.template_text(),
                })
                .collect(),
        })),
        RequestPrompt::Completion(Prompt::Text(t)) => {
            Some(pick_request::Prompt::Text(t.to_string()))
        }
        RequestPrompt::Completion(Prompt::Ids(ids)) => {
            Some(pick_request::Prompt::TokenIds(TokenIds {
                ids: ids.clone(),
            }))
        }
        RequestPrompt::Completion(Prompt::Batch(..)) => return None,
        RequestPrompt::Chat(_) | RequestPrompt::None => None,
    };
    if prompt.is_none() && response_id.is_empty() {
        return None;
    }
    let msg = PickRequest {
        pool: input.pool.to_string(),
        model: input.model.to_string(),
        tenant: input.tenant.to_string(),
        request_id: input.request_id.to_string(),
        prompt,
        hints: Some(Hints {
            priority: input.priority,
            expected_output_tokens: u32::try_from(req.max_tokens).unwrap_or(u32::MAX),
            cache_salt: req.cache_salt.as_deref().unwrap_or_default().to_string(),
        }),
        max_endpoints: input.max_endpoints,
        response_id: response_id.to_string(),
        budget: input
            .budget
            .filter(|_| !input.tenant.is_empty())
            .map(|b| budget_message(input.tenant, b, req.max_tokens)),
        max_wait_ms: input.max_wait_ms,
        weight: input.weight,
        subset: None,
    };
    Some(msg.encode_to_vec())
}

/// Why a pick did not produce an endpoint list (each is a fail-open stat).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailOpen {
    /// The call could not be dispatched (unknown cluster, ...).
    Dispatch,
    /// gRPC UNAVAILABLE (14): the indexer is down, refused, or the call
    /// timed out (Envoy reports a timeout as 14 too).
    Unavailable,
    /// gRPC DEADLINE_EXCEEDED (4).
    Timeout,
    /// Another gRPC status.
    GrpcError,
    /// The answer did not decode or named something that is not `ip:port`.
    BadResponse,
    /// The indexer has no healthy endpoint.
    NoEndpoints,
    /// The prompt cannot be picked for (a batch).
    Unsupported,
}

impl FailOpen {
    /// The stat name segment.
    pub fn as_str(self) -> &'static str {
        match self {
            FailOpen::Dispatch => "dispatch",
            FailOpen::Unavailable => "unavailable",
            FailOpen::Timeout => "timeout",
            FailOpen::GrpcError => "grpc_error",
            FailOpen::BadResponse => "bad_response",
            FailOpen::NoEndpoints => "no_endpoints",
            FailOpen::Unsupported => "unsupported",
        }
    }

    /// The fail-open reason of a non-OK gRPC status.
    pub fn of_status(status: u32) -> FailOpen {
        match status {
            14 => FailOpen::Unavailable,
            4 => FailOpen::Timeout,
            _ => FailOpen::GrpcError,
        }
    }
}

/// Why flow control shed a pick: the contract's enum, whose
/// [`ShedCause::as_label`] is the `shed.<cause>` stat segment (UNSPECIFIED,
/// a cause this filter does not know, is `other`).
pub use kvasir_proto::v1::ShedCause;

/// Why a pick gave no endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoPick {
    /// Envoy's load balancing picks instead (counted as a fail-open).
    FailOpen(FailOpen),
    /// The request names a stored response that no live engine is known to
    /// hold: the client gets vLLM's 404 for an unknown id.
    UnknownResponse,
    /// The tenant's budget cannot take the request now (the outcome's
    /// `budget` says which limit): the client gets 429.
    RateLimited,
    /// The pool is saturated and the pick could not wait, or waited its
    /// longest: the client gets 429.
    Shed(ShedCause),
}

impl From<FailOpen> for NoPick {
    fn from(why: FailOpen) -> NoPick {
        NoPick::FailOpen(why)
    }
}

/// A usable pick.
#[derive(Debug, Clone, PartialEq)]
pub struct Picked {
    /// The `x-gateway-destination-endpoint` value: `ip:port,ip:port,...`.
    pub header: String,
    /// The first endpoint.
    pub first: String,
    /// Tokens the first endpoint is expected to find cached.
    pub predicted_cached_tokens: u32,
    /// Why the indexer chose the first endpoint.
    pub decision: Decision,
    /// Whether every endpoint was saturated.
    pub all_saturated: bool,
    /// The vLLM `priority` to write into the body (the pool's
    /// `enginePriority`), when the answer carried one.
    pub engine_priority: Option<i32>,
}

/// A `Pick` answer's outcome, with the pool saturation it carried (none
/// when the answer had no endpoint: "no healthy endpoint known", e.g. an
/// indexer before its first scrape, is not a full pool and must not feed
/// `poolState` policies).
#[derive(Debug, Clone, PartialEq)]
pub struct PickOutcome {
    /// The endpoints, or why there are none.
    pub result: Result<Picked, NoPick>,
    /// Pool saturation 0..1, when the answer carried one.
    pub saturation: Option<f64>,
    /// The tenant's budget after the pick, when the pick carried one.
    pub budget: Option<BudgetStatus>,
    /// Milliseconds the pick waited in the pool's flow-control queue.
    pub queued_ms: u32,
    /// The prompt's length as the indexer counted it (0 when unknown).
    pub prompt_tokens: u32,
}

impl PickOutcome {
    /// A pick that produced no answer to learn from: fail open, no saturation.
    pub fn failed(why: FailOpen) -> PickOutcome {
        PickOutcome {
            result: Err(NoPick::FailOpen(why)),
            saturation: None,
            budget: None,
            queued_ms: 0,
            prompt_tokens: 0,
        }
    }
}

/// Whether `s` is an `ip:port` (IPv4, or bracketed IPv6) and nothing else.
pub fn is_endpoint_address(s: &str) -> bool {
    s.parse::<std::net::SocketAddr>().is_ok()
}

/// Interprets a `Pick` answer: gRPC status and the response bytes.
pub fn pick_outcome(status: u32, body: Option<&[u8]>) -> PickOutcome {
    if status != 0 {
        return PickOutcome::failed(FailOpen::of_status(status));
    }
    let Some(resp) = body.and_then(|b| PickResponse::decode(b).ok()) else {
        return PickOutcome::failed(FailOpen::BadResponse);
    };
    pick_outcome_of(resp)
}

/// Interprets a decoded `Pick` answer (unary or from a `Session` stream).
pub fn pick_outcome_of(resp: PickResponse) -> PickOutcome {
    let saturation = resp
        .pool_saturation
        .is_finite()
        .then_some(resp.pool_saturation.clamp(0.0, 1.0));
    let refused = |result: NoPick, saturation: Option<f64>| PickOutcome {
        result: Err(result),
        saturation,
        budget: resp.budget.clone(),
        queued_ms: resp.queued_ms,
        prompt_tokens: resp.prompt_tokens,
    };
    let decision = resp.resolved_decision();
    if decision == Decision::UnknownResponse {
        return refused(NoPick::UnknownResponse, None);
    }
    if decision == Decision::RateLimited {
        // Refused before placement: its saturation says nothing.
        return refused(NoPick::RateLimited, None);
    }
    if decision == Decision::Shed {
        // A shed pick saw the pool saturated: that is learnt.
        return refused(NoPick::Shed(resp.resolved_cause()), saturation);
    }
    if resp.endpoints.is_empty() {
        // Its saturation (1 by the indexer's rule for "none healthy") says
        // nothing about load: not learnt.
        return PickOutcome::failed(FailOpen::NoEndpoints);
    }
    if !resp
        .endpoints
        .iter()
        .all(|e| is_endpoint_address(&e.address))
    {
        return PickOutcome {
            result: Err(FailOpen::BadResponse.into()),
            saturation,
            budget: None,
            queued_ms: resp.queued_ms,
            prompt_tokens: 0,
        };
    }
    let header = resp
        .endpoints
        .iter()
        .map(|e| e.address.as_str())
        .collect::<Vec<_>>()
        .join(",");
    PickOutcome {
        result: Ok(Picked {
            header,
            first: resp.endpoints[0].address.clone(),
            predicted_cached_tokens: resp.endpoints[0].predicted_cached_tokens,
            decision,
            all_saturated: decision == Decision::AllSaturated,
            engine_priority: resp.engine_priority,
        }),
        saturation,
        budget: resp.budget,
        queued_ms: resp.queued_ms,
        prompt_tokens: resp.prompt_tokens,
    }
}

/// Token counts from a response's `usage`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens (cached included).
    pub prompt_tokens: u64,
    /// Of which the engine found cached.
    pub cached_tokens: u64,
    /// Completion tokens.
    pub completion_tokens: u64,
}

/// What a `Report` says.
#[derive(Debug, Clone, Copy)]
pub struct ReportInput<'a> {
    /// The indexer pool.
    pub pool: &'a str,
    /// The request id given to `Pick`.
    pub request_id: &'a str,
    /// The endpoint that served ("" when unknown).
    pub endpoint: &'a str,
    /// Usage, if the response carried it.
    pub usage: Option<Usage>,
    /// Time to first token (ms, 0 unknown).
    pub ttft_ms: f64,
    /// End to end (ms, 0 unknown).
    pub e2e_ms: f64,
    /// How it ended.
    pub outcome: Outcome,
    /// Which point of the request's life.
    pub phase: ReportPhase,
    /// The id the engine gave a stored Responses API response ("" when
    /// none, not known yet, or the request set `store: false`).
    pub response_id: &'a str,
    /// The pick's budget key ("" for a request without a budget), so any
    /// indexer replica can settle the tenant's reservation.
    pub budget_key: &'a str,
    /// The resolved tenant: the owner of a stored response the report
    /// names.
    pub tenant: &'a str,
    /// Who admitted the request (the pick's answer, or the filter itself).
    pub admission: Admission,
}

/// The encoded `ReportRequest`.
pub fn report_request(r: &ReportInput<'_>) -> Vec<u8> {
    let u = r.usage.unwrap_or_default();
    let c = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    ReportRequest {
        pool: r.pool.to_string(),
        request_id: r.request_id.to_string(),
        endpoint: r.endpoint.to_string(),
        prompt_tokens: c(u.prompt_tokens),
        cached_tokens: c(u.cached_tokens),
        completion_tokens: c(u.completion_tokens),
        ttft_ms: r.ttft_ms,
        e2e_ms: r.e2e_ms,
        outcome: r.outcome as i32,
        phase: r.phase as i32,
        response_id: r.response_id.to_string(),
        budget_key: r.budget_key.to_string(),
        tenant: r.tenant.to_string(),
        admission: r.admission as i32,
    }
    .encode_to_vec()
}

/// The encoded `PoolStateRequest` for `pool`.
pub fn pool_state_request(pool: &str) -> Vec<u8> {
    kvasir_proto::v1::PoolStateRequest {
        pool: pool.to_string(),
    }
    .encode_to_vec()
}

/// The pool saturation of a `PoolState` answer; none for an error, an
/// undecodable answer, or one with no healthy endpoint (nothing known
/// about load: an indexer that has not scraped yet, or engines all down,
/// is not a saturated pool).
pub fn pool_state_saturation(status: u32, body: Option<&[u8]>) -> Option<f64> {
    if status != 0 {
        return None;
    }
    let r = kvasir_proto::v1::PoolStateResponse::decode(body?).ok()?;
    if !r.endpoints.iter().any(|e| e.healthy) {
        return None;
    }
    r.pool_saturation
        .is_finite()
        .then_some(r.pool_saturation.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::parse_body;
    use kvasir_policy::ApiKind;
    use kvasir_proto::v1::PickedEndpoint;

    fn input() -> PickInput<'static> {
        PickInput {
            pool: "main",
            model: "qwen",
            tenant: "acme",
            request_id: "r1",
            priority: -1,
            max_endpoints: 3,
            budget: None,
            weight: 1,
            max_wait_ms: 0,
        }
    }

    #[test]
    fn chat_pick_carries_flattened_messages_and_hints() {
        let body = br#"{"model":"m","max_tokens":9,"cache_salt":"s","messages":[{"role":"system","content":"sys"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#;
        let r = parse_body(ApiKind::Chat, body).unwrap();
        let bytes = pick_request(&r, &input()).unwrap();
        let p = PickRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(
            (
                p.pool.as_str(),
                p.model.as_str(),
                p.tenant.as_str(),
                p.request_id.as_str()
            ),
            ("main", "qwen", "acme", "r1")
        );
        let Some(pick_request::Prompt::Chat(c)) = p.prompt else {
            panic!()
        };
        assert_eq!(c.messages[1].content, "a\nb");
        let h = p.hints.unwrap();
        assert_eq!(
            (h.priority, h.expected_output_tokens, h.cache_salt.as_str()),
            (-1, 9, "s")
        );
        assert_eq!(p.max_endpoints, 3);
    }

    #[test]
    fn completion_prompts() {
        let r = parse_body(ApiKind::Completions, br#"{"model":"m","prompt":[1,2]}"#).unwrap();
        let p = PickRequest::decode(pick_request(&r, &input()).unwrap().as_slice()).unwrap();
        assert_eq!(
            p.prompt,
            Some(pick_request::Prompt::TokenIds(TokenIds { ids: vec![1, 2] }))
        );
        let r = parse_body(ApiKind::Completions, br#"{"model":"m","prompt":"hi"}"#).unwrap();
        let p = PickRequest::decode(pick_request(&r, &input()).unwrap().as_slice()).unwrap();
        assert_eq!(p.prompt, Some(pick_request::Prompt::Text("hi".into())));
        let r = parse_body(ApiKind::Completions, br#"{"model":"m","prompt":["a","b"]}"#).unwrap();
        assert_eq!(pick_request(&r, &input()), None);
    }

    #[test]
    fn responses_picks_carry_the_response_id() {
        let r = parse_body(
            ApiKind::Responses,
            br#"{"model":"m","instructions":"x-anthropic-billing-header: 1\nsys","input":"hi","previous_response_id":"resp_7"}"#,
        )
        .unwrap();
        let p = PickRequest::decode(pick_request(&r, &input()).unwrap().as_slice()).unwrap();
        assert_eq!(p.response_id, "resp_7");
        let Some(pick_request::Prompt::Chat(c)) = p.prompt else {
            panic!()
        };
        // The chat parser's system rule holds for every API.
        assert_eq!(
            (
                c.messages[0].content.as_str(),
                c.messages[1].content.as_str()
            ),
            ("sys", "hi")
        );
        // A GET or cancel: the id and no prompt.
        let r = ParsedRequest::stored_response("resp_8".into());
        let p = PickRequest::decode(pick_request(&r, &input()).unwrap().as_slice()).unwrap();
        assert_eq!((p.response_id.as_str(), p.prompt), ("resp_8", None));
        // Nothing to pick for: no prompt (an empty item list) and no id.
        let r = parse_body(ApiKind::Responses, br#"{"model":"m","input":[]}"#).unwrap();
        assert_eq!(pick_request(&r, &input()), None);
        let r = parse_body(
            ApiKind::Responses,
            br#"{"model":"m","input":[],"previous_response_id":"r"}"#,
        )
        .unwrap();
        let p = PickRequest::decode(pick_request(&r, &input()).unwrap().as_slice()).unwrap();
        assert_eq!((p.response_id.as_str(), p.prompt), ("r", None));
    }

    #[test]
    fn unknown_response_is_its_own_outcome() {
        let o = pick_outcome(0, Some(&answer(&[], Decision::UnknownResponse, 0.0)));
        assert_eq!(
            (o.result, o.saturation),
            (Err(NoPick::UnknownResponse), None)
        );
        // Whatever else the answer holds.
        let o = pick_outcome(
            0,
            Some(&answer(&["10.0.0.1:1"], Decision::UnknownResponse, 0.0)),
        );
        assert_eq!(o.result, Err(NoPick::UnknownResponse));
        let o = pick_outcome(0, Some(&answer(&["10.0.0.1:1"], Decision::Response, 0.1)));
        assert_eq!(o.result.unwrap().header, "10.0.0.1:1");
    }

    fn answer(addrs: &[&str], decision: Decision, sat: f64) -> Vec<u8> {
        PickResponse {
            endpoints: addrs
                .iter()
                .map(|a| PickedEndpoint {
                    address: a.to_string(),
                    predicted_cached_tokens: 32,
                    ..Default::default()
                })
                .collect(),
            pool_saturation: sat,
            decision: decision as i32,
            reason: "prefix".into(),
            ..Default::default()
        }
        .encode_to_vec()
    }

    #[test]
    fn good_answer_becomes_the_header() {
        let o = pick_outcome(
            0,
            Some(&answer(
                &["10.0.0.1:8000", "[::1]:8001"],
                Decision::Prefix,
                0.25,
            )),
        );
        let p = o.result.unwrap();
        assert_eq!(p.header, "10.0.0.1:8000,[::1]:8001");
        assert_eq!(p.first, "10.0.0.1:8000");
        assert_eq!(p.predicted_cached_tokens, 32);
        assert!(!p.all_saturated);
        assert_eq!(o.saturation, Some(0.25));
    }

    #[test]
    fn failures_fail_open() {
        assert_eq!(
            pick_outcome(14, None).result,
            Err(NoPick::FailOpen(FailOpen::Unavailable))
        );
        assert_eq!(
            pick_outcome(4, None).result,
            Err(NoPick::FailOpen(FailOpen::Timeout))
        );
        assert_eq!(
            pick_outcome(3, None).result,
            Err(NoPick::FailOpen(FailOpen::GrpcError))
        );
        assert_eq!(
            pick_outcome(0, None).result,
            Err(NoPick::FailOpen(FailOpen::BadResponse))
        );
        assert_eq!(
            pick_outcome(0, Some(b"\xff\xff\xff")).result,
            Err(NoPick::FailOpen(FailOpen::BadResponse))
        );
        let o = pick_outcome(0, Some(&answer(&[], Decision::NoEndpoints, 1.0)));
        assert_eq!(
            (o.result, o.saturation),
            (Err(NoPick::FailOpen(FailOpen::NoEndpoints)), None),
            "no endpoints known is not saturation"
        );
        // An indexer must not be able to inject header syntax.
        for bad in [
            "10.0.0.1:80,evil",
            "host:80",
            "10.0.0.1",
            "10.0.0.1:80\r\nx: y",
            "",
        ] {
            assert_eq!(
                pick_outcome(0, Some(&answer(&[bad], Decision::Load, 0.0))).result,
                Err(NoPick::FailOpen(FailOpen::BadResponse)),
                "{bad}"
            );
        }
        let o = pick_outcome(0, Some(&answer(&["10.0.0.1:1"], Decision::Load, f64::NAN)));
        assert_eq!(o.saturation, None);
    }

    #[test]
    fn only_answers_with_healthy_endpoints_carry_saturation() {
        // A truly saturated pool still counts, from a pick and a poll.
        let o = pick_outcome(
            0,
            Some(&answer(&["10.0.0.1:1"], Decision::AllSaturated, 1.0)),
        );
        assert!(o.result.unwrap().all_saturated);
        assert_eq!(o.saturation, Some(1.0));
        let state = |healthy: &[bool], sat: f64| {
            kvasir_proto::v1::PoolStateResponse {
                pool: "main".into(),
                endpoints: healthy
                    .iter()
                    .map(|h| kvasir_proto::v1::EndpointState {
                        healthy: *h,
                        ..Default::default()
                    })
                    .collect(),
                pool_saturation: sat,
                ..Default::default()
            }
            .encode_to_vec()
        };
        assert_eq!(
            pool_state_saturation(0, Some(&state(&[true, false], 1.0))),
            Some(1.0)
        );
        assert_eq!(
            pool_state_saturation(0, Some(&state(&[true], 0.3))),
            Some(0.3)
        );
        // Before the first scrape (none healthy), with no endpoints, or an
        // error (a cold indexer answers UNAVAILABLE): nothing learnt.
        assert_eq!(
            pool_state_saturation(0, Some(&state(&[false, false], 1.0))),
            None
        );
        assert_eq!(pool_state_saturation(0, Some(&state(&[], 1.0))), None);
        assert_eq!(pool_state_saturation(14, Some(&state(&[true], 0.3))), None);
        assert_eq!(pick_outcome(14, None).saturation, None);
    }

    #[test]
    fn report_round_trips() {
        let b = report_request(&ReportInput {
            pool: "main",
            request_id: "r1",
            endpoint: "10.0.0.1:8000",
            usage: Some(Usage {
                prompt_tokens: 100,
                cached_tokens: 64,
                completion_tokens: 5,
            }),
            ttft_ms: 12.5,
            e2e_ms: 40.0,
            outcome: Outcome::Success,
            phase: ReportPhase::Done,
            response_id: "resp_1",
            budget_key: "acme",
            tenant: "acme",
            admission: Admission::Local,
        });
        let r = ReportRequest::decode(b.as_slice()).unwrap();
        assert_eq!(r.response_id, "resp_1");
        assert_eq!(r.budget_key, "acme");
        assert_eq!(r.tenant, "acme");
        assert_eq!(r.admission, Admission::Local as i32);
        assert_eq!(
            (r.prompt_tokens, r.cached_tokens, r.completion_tokens),
            (100, 64, 5)
        );
        assert_eq!(r.outcome, Outcome::Success as i32);
        assert_eq!(r.phase, ReportPhase::Done as i32);
    }
}
