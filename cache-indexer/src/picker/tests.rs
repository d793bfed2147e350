//! The exchange, message by message: what the picker answers Envoy in each
//! body mode, and what it asks the pool.

use std::rc::Rc;
use std::sync::Arc;

use kvasir_filter::pick::pick_outcome_of;
use kvasir_filter::settings::PluginConfig;
use kvasir_filter::shared::Shared;
use kvasir_proto::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use kvasir_proto::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use kvasir_proto::envoy::service::ext_proc::v3 as ep;
use kvasir_proto::v1 as pb;
use prost::Message;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::messages::{list_of, DESTINATION_KEY, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE};
use super::*;

const KEY: &str = "sk-acme";

fn hash(key: &str) -> String {
    format!("sha256:{:x}", Sha256::digest(key.as_bytes()))
}

fn plugin(settings: serde_json::Value) -> PluginConfig {
    let set = json!({
        "tenantSource": {"apiKey": {}},
        "tenants": [
            {"name": "acme", "apiKeyHashes": [hash(KEY)],
             "budget": {"requestsPerMinute": 60}}
        ],
        "pools": [{"name": "main", "models": ["m"], "cluster": "pool-main",
                   "indexerCluster": "indexer", "indexerPool": "main"}],
        "providers": [{"name": "ext", "cluster": "provider-ext", "model": "p"}],
        "policies": [
            {"name": "out", "match": {"models": ["gpt-4o"]}, "action": {"provider": {"provider": "ext"}}}
        ],
        "defaultAction": {"route": {"pool": "main"}}
    });
    let set = kvasir_policy::parse_json(&set.to_string()).unwrap();
    let doc: serde_json::Value =
        serde_json::from_slice(&kvasir_policy::compile(&set).unwrap().to_json()).unwrap();
    let bytes = serde_json::to_vec(&json!({"policy": doc, "filter": settings})).unwrap();
    PluginConfig::from_bytes(&bytes).unwrap()
}

fn exchange() -> Exchange {
    let shared = Rc::new(Shared::new(plugin(json!({})), Rc::new(NoStats)));
    Exchange::new(
        shared,
        Arc::new(Serving {
            pool: "main".into(),
            cluster: "pool-main".into(),
        }),
    )
}

fn headers(pairs: &[(&str, &str)]) -> Option<HeaderMap> {
    Some(HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_string(),
                raw_value: v.as_bytes().to_vec(),
                ..Default::default()
            })
            .collect(),
    })
}

fn request_headers(path: &str, mode: BodySendMode, end: bool) -> ep::ProcessingRequest {
    let auth = format!("Bearer {KEY}");
    ep::ProcessingRequest {
        protocol_config: Some(ep::ProtocolConfiguration {
            request_body_mode: mode as i32,
            response_body_mode: mode as i32,
            ..Default::default()
        }),
        request: Some(ep::processing_request::Request::RequestHeaders(
            ep::HttpHeaders {
                headers: headers(&[
                    (":method", if end { "GET" } else { "POST" }),
                    (":path", path),
                    ("authorization", &auth),
                    ("x-request-id", "client-id"),
                    ("x-gateway-destination-endpoint", "6.6.6.6:1"),
                ]),
                end_of_stream: end,
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

fn body(b: &[u8], end: bool) -> ep::ProcessingRequest {
    ep::ProcessingRequest {
        request: Some(ep::processing_request::Request::RequestBody(ep::HttpBody {
            body: b.to_vec(),
            end_of_stream: end,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn chat(model: &str) -> Vec<u8> {
    json!({"model": model, "messages": [{"role": "user", "content": "hello there"}], "stream": true})
        .to_string()
        .into_bytes()
}

fn answer(addrs: &[&str]) -> pb::PickResponse {
    pb::PickResponse {
        endpoints: addrs
            .iter()
            .map(|a| pb::PickedEndpoint {
                address: (*a).to_string(),
                ..Default::default()
            })
            .collect(),
        decision: pb::Decision::Prefix as i32,
        reason: "prefix".into(),
        prompt_tokens: 12,
        ..Default::default()
    }
}

fn sent(step: Step) -> Vec<ep::ProcessingResponse> {
    match step {
        Step::Send(r) => r,
        Step::Pick(p) => panic!("a pick, not an answer: {p:?}"),
    }
}

fn pick_of(step: Step) -> PickCall {
    match step {
        Step::Pick(p) => p,
        Step::Send(r) => panic!("an answer, not a pick: {r:?}"),
    }
}

fn set_headers(m: &Option<ep::HeaderMutation>) -> Vec<(String, String)> {
    m.as_ref()
        .map(|m| {
            m.set_headers
                .iter()
                .map(|h| {
                    let h = h.header.as_ref().unwrap();
                    (
                        h.key.clone(),
                        String::from_utf8_lossy(&h.raw_value).into_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn destination(md: &Option<prost_types::Struct>) -> Option<String> {
    use prost_types::value::Kind;
    let lb = md.as_ref()?.fields.get(LB_NAMESPACE)?;
    let Some(Kind::StructValue(s)) = &lb.kind else {
        return None;
    };
    match &s.fields.get(DESTINATION_KEY)?.kind {
        Some(Kind::StringValue(v)) => Some(v.clone()),
        _ => None,
    }
}

fn immediate(r: &ep::ProcessingResponse) -> &ep::ImmediateResponse {
    match &r.response {
        Some(ep::processing_response::Response::ImmediateResponse(i)) => i,
        other => panic!("not an immediate response: {other:?}"),
    }
}

#[test]
fn buffered_a_chat_is_picked_at_its_body_and_sent_to_the_list() {
    let mut ex = exchange();
    let first = sent(ex.on_message(request_headers(
        "/v1/chat/completions",
        BodySendMode::Buffered,
        false,
    )));
    assert_eq!(first.len(), 1, "the headers go on at once in buffered mode");
    let Some(ep::processing_response::Response::RequestHeaders(h)) = &first[0].response else {
        panic!("{first:?}")
    };
    // The client's endpoint list is never believed.
    let removed = &h
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap()
        .remove_headers;
    assert!(
        removed.contains(&DESTINATION_KEY.to_string()),
        "{removed:?}"
    );
    let call = pick_of(ex.on_message(body(&chat("m"), true)));
    let req = pb::PickRequest::decode(call.msg.as_slice()).unwrap();
    assert_eq!((req.pool.as_str(), req.tenant.as_str()), ("main", "acme"));
    assert_ne!(req.request_id, "client-id", "the gateway's own id");
    assert_eq!(req.budget.unwrap().key, "acme");
    let out = sent(ex.picked(
        call.token,
        pick_outcome_of(answer(&["10.0.0.1:8000", "10.0.0.2:8000"])),
    ));
    assert_eq!(out.len(), 1);
    let Some(ep::processing_response::Response::RequestBody(b)) = &out[0].response else {
        panic!("{out:?}")
    };
    let set = set_headers(&b.response.as_ref().unwrap().header_mutation);
    assert!(
        set.contains(&(
            DESTINATION_KEY.to_string(),
            "10.0.0.1:8000,10.0.0.2:8000".into()
        )),
        "{set:?}"
    );
    assert_eq!(
        destination(&out[0].dynamic_metadata).as_deref(),
        Some("10.0.0.1:8000,10.0.0.2:8000"),
        "the header and the metadata say the same"
    );
    assert!(
        !set.iter().any(|(k, _)| k == "x-kvasir-cluster"),
        "the route header never goes upstream"
    );
}

#[test]
fn full_duplex_holds_the_body_until_the_pick_then_sends_headers_and_body() {
    let mut ex = exchange();
    let mode = BodySendMode::FullDuplexStreamed;
    assert!(sent(ex.on_message(request_headers("/v1/chat/completions", mode, false))).is_empty());
    let b = chat("m");
    let (a, rest) = b.split_at(10);
    assert!(sent(ex.on_message(body(a, false))).is_empty(), "held");
    let call = pick_of(ex.on_message(body(rest, true)));
    let out = sent(ex.picked(call.token, pick_outcome_of(answer(&["10.0.0.1:8000"]))));
    assert_eq!(out.len(), 2);
    assert!(matches!(
        out[0].response,
        Some(ep::processing_response::Response::RequestHeaders(_))
    ));
    assert_eq!(
        destination(&out[0].dynamic_metadata).as_deref(),
        Some("10.0.0.1:8000")
    );
    let Some(ep::processing_response::Response::RequestBody(r)) = &out[1].response else {
        panic!("{out:?}")
    };
    use ep::body_mutation::Mutation;
    let Some(Mutation::StreamedResponse(s)) = &r
        .response
        .as_ref()
        .unwrap()
        .body_mutation
        .as_ref()
        .unwrap()
        .mutation
    else {
        panic!("{r:?}")
    };
    assert!(s.end_of_stream);
    assert_eq!(s.body, b, "the whole body, sent on");
}

#[test]
fn a_large_body_goes_back_in_chunks_of_64_kib() {
    let mut ex = exchange();
    let mode = BodySendMode::FullDuplexStreamed;
    sent(ex.on_message(request_headers("/v1/chat/completions", mode, false)));
    let b = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                   "user": "u".repeat(200_000)})
    .to_string()
    .into_bytes();
    let call = pick_of(ex.on_message(body(&b, true)));
    let out = sent(ex.picked(call.token, pick_outcome_of(answer(&["10.0.0.1:8000"]))));
    use ep::body_mutation::Mutation;
    let chunks: Vec<(Vec<u8>, bool)> = out[1..]
        .iter()
        .map(|r| {
            let Some(ep::processing_response::Response::RequestBody(r)) = &r.response else {
                panic!("{r:?}")
            };
            let Some(Mutation::StreamedResponse(s)) = &r
                .response
                .as_ref()
                .unwrap()
                .body_mutation
                .as_ref()
                .unwrap()
                .mutation
            else {
                panic!("{r:?}")
            };
            (s.body.clone(), s.end_of_stream)
        })
        .collect();
    assert_eq!(chunks.len(), b.len().div_ceil(exchange::CHUNK));
    assert!(chunks.iter().all(|(c, _)| c.len() <= exchange::CHUNK));
    assert_eq!(chunks.iter().filter(|(_, last)| *last).count(), 1);
    assert!(chunks.last().unwrap().1, "the last one ends the stream");
    let joined: Vec<u8> = chunks.iter().flat_map(|(c, _)| c.clone()).collect();
    assert_eq!(joined, b, "the whole body, in order");
}

#[test]
fn a_refusal_is_an_immediate_answer_in_the_apis_shape() {
    // No key: 401 at the headers.
    let mut ex = exchange();
    let mut h = request_headers("/v1/messages", BodySendMode::Buffered, false);
    if let Some(ep::processing_request::Request::RequestHeaders(hh)) = &mut h.request {
        hh.headers
            .as_mut()
            .unwrap()
            .headers
            .retain(|v| v.key != "authorization");
    }
    let out = sent(ex.on_message(h));
    let i = immediate(&out[0]);
    assert_eq!(i.status.unwrap().code, 401);
    let reply: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
    assert_eq!(reply["type"], "error", "Anthropic's shape on /v1/messages");
    assert!(ex.replied());
    // Over budget: the pool refuses, the client gets 429 with its headers.
    let mut ex = exchange();
    sent(ex.on_message(request_headers(
        "/v1/chat/completions",
        BodySendMode::Buffered,
        false,
    )));
    let call = pick_of(ex.on_message(body(&chat("m"), true)));
    let refused = pb::PickResponse {
        decision: pb::Decision::RateLimited as i32,
        budget: Some(pb::BudgetStatus {
            limited_by: "requests".into(),
            retry_after_ms: 2_000,
            limit_requests: 60,
            ..Default::default()
        }),
        ..Default::default()
    };
    let out = sent(ex.picked(call.token, pick_outcome_of(refused)));
    let i = immediate(&out[0]);
    assert_eq!(i.status.unwrap().code, 429);
    let names: Vec<String> = set_headers(&i.headers)
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert!(names.contains(&"retry-after".to_string()), "{names:?}");
    // Its end is reported as never served.
    ex.on_end();
    let reports: Vec<pb::ReportRequest> = ex
        .take_reports()
        .iter()
        .map(|r| pb::ReportRequest::decode(r.as_slice()).unwrap())
        .collect();
    assert_eq!(reports.len(), 1);
    assert_eq!(reports[0].outcome, pb::Outcome::Rejected as i32);
}

#[test]
fn a_policy_that_sends_a_request_elsewhere_is_refused_not_served_here() {
    let mut ex = exchange();
    sent(ex.on_message(request_headers(
        "/v1/chat/completions",
        BodySendMode::Buffered,
        false,
    )));
    let out = sent(ex.on_message(body(&chat("gpt-4o"), true)));
    let i = immediate(&out[0]);
    assert_eq!(i.status.unwrap().code, 503);
    let body: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
    assert_eq!(body["error"]["code"], "policy_not_servable");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("provider-ext"));
}

#[test]
fn a_path_the_filter_passes_through_is_picked_by_load() {
    let mut ex = exchange();
    let call = pick_of(ex.on_message(request_headers("/v1/models", BodySendMode::Buffered, true)));
    let req = pb::PickRequest::decode(call.msg.as_slice()).unwrap();
    assert!(req.request_id.is_empty(), "not accounted in flight");
    let out = sent(ex.picked(call.token, pick_outcome_of(answer(&["10.0.0.3:8000"]))));
    assert_eq!(
        destination(&out[0].dynamic_metadata).as_deref(),
        Some("10.0.0.3:8000")
    );
    // No endpoint at all: 503.
    let mut ex = exchange();
    let call = pick_of(ex.on_message(request_headers("/v1/models", BodySendMode::Buffered, true)));
    let out = sent(ex.picked(call.token, pick_outcome_of(answer(&[]))));
    assert_eq!(immediate(&out[0]).status.unwrap().code, 503);
}

#[test]
fn a_streamed_request_body_cannot_be_picked_for() {
    let mut ex = exchange();
    let out = sent(ex.on_message(request_headers(
        "/v1/chat/completions",
        BodySendMode::Streamed,
        false,
    )));
    let i = immediate(&out[0]);
    assert_eq!(i.status.unwrap().code, 503);
    assert!(String::from_utf8_lossy(&i.body).contains("BUFFERED or FULL_DUPLEX_STREAMED"));
}

#[test]
fn the_subset_hint_is_kept_for_the_pick() {
    let mut ex = exchange();
    let mut h = request_headers("/v1/chat/completions", BodySendMode::Buffered, false);
    h.metadata_context = Some(Metadata {
        filter_metadata: [(
            SUBSET_NAMESPACE.to_string(),
            prost_types::Struct {
                fields: [(SUBSET_KEY.to_string(), list_of(&["10.0.0.2:8000"]))].into(),
            },
        )]
        .into(),
        ..Default::default()
    });
    sent(ex.on_message(h));
    assert_eq!(ex.subset(), Some(&["10.0.0.2:8000".to_string()][..]));
}

#[test]
fn the_response_is_watched_for_usage_and_echoed_in_full_duplex() {
    let mut ex = exchange();
    let mode = BodySendMode::FullDuplexStreamed;
    sent(ex.on_message(request_headers("/v1/chat/completions", mode, false)));
    let call = pick_of(ex.on_message(body(&chat("m"), true)));
    sent(ex.picked(call.token, pick_outcome_of(answer(&["10.0.0.1:8000"]))));
    let resp_headers = ep::ProcessingRequest {
        request: Some(ep::processing_request::Request::ResponseHeaders(
            ep::HttpHeaders {
                headers: headers(&[(":status", "200"), ("content-type", "text/event-stream")]),
                ..Default::default()
            },
        )),
        ..Default::default()
    };
    let out = sent(ex.on_message(resp_headers));
    assert!(matches!(
        out[0].response,
        Some(ep::processing_response::Response::ResponseHeaders(_))
    ));
    let chunk = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n";
    let resp_body = ep::ProcessingRequest {
        request: Some(ep::processing_request::Request::ResponseBody(
            ep::HttpBody {
                body: chunk.to_vec(),
                end_of_stream: true,
                ..Default::default()
            },
        )),
        ..Default::default()
    };
    let out = sent(ex.on_message(resp_body));
    let Some(ep::processing_response::Response::ResponseBody(r)) = &out[0].response else {
        panic!("{out:?}")
    };
    use ep::body_mutation::Mutation;
    let Some(Mutation::StreamedResponse(s)) = &r
        .response
        .as_ref()
        .unwrap()
        .body_mutation
        .as_ref()
        .unwrap()
        .mutation
    else {
        panic!("{r:?}")
    };
    assert_eq!(s.body, chunk.to_vec(), "echoed unchanged");
    ex.on_end();
    let done: Vec<pb::ReportRequest> = ex
        .take_reports()
        .iter()
        .map(|r| pb::ReportRequest::decode(r.as_slice()).unwrap())
        .filter(|r| r.phase == pb::ReportPhase::Done as i32)
        .collect();
    assert_eq!(done.len(), 1);
    assert_eq!((done[0].prompt_tokens, done[0].completion_tokens), (12, 1));
    assert_eq!(done[0].tenant, "acme");
}

/// A plugin whose policies test the pool's saturation: batch work while
/// `main` is idle, shed otherwise.
fn idle_only_plugin() -> PluginConfig {
    let set = json!({
        "tenantSource": {"apiKey": {}},
        "tenants": [{"name": "acme", "apiKeyHashes": [hash(KEY)]}],
        "pools": [{"name": "main", "models": ["m"], "cluster": "pool-main",
                   "indexerCluster": "indexer", "indexerPool": "main"}],
        "policies": [
            {"name": "while-idle", "match": {"poolState": {"pool": "main", "saturationBelow": 0.3}},
             "action": {"route": {"pool": "main"}}},
            {"name": "otherwise-wait", "match": {"models": ["m"]}, "action": {"shed": {"retryAfterS": 60}}}
        ],
        "defaultAction": {"route": {"pool": "main"}}
    });
    let set = kvasir_policy::parse_json(&set.to_string()).unwrap();
    PluginConfig::from_bytes(&kvasir_policy::compile(&set).unwrap().to_json()).unwrap()
}

fn pool_state(saturation: f64) -> pb::PoolStateResponse {
    pb::PoolStateResponse {
        pool: "main".into(),
        endpoints: vec![pb::EndpointState {
            address: "10.0.0.1:8000".into(),
            healthy: true,
            ..Default::default()
        }],
        pool_saturation: saturation,
        ..Default::default()
    }
}

/// Runs one buffered chat through a fresh exchange: whether it was picked
/// for (true) or answered at once (false: shed).
fn picked_for(shared: &Rc<Shared>) -> bool {
    let mut ex = Exchange::new(
        Rc::clone(shared),
        Arc::new(Serving {
            pool: "main".into(),
            cluster: "pool-main".into(),
        }),
    );
    sent(ex.on_message(request_headers(
        "/v1/chat/completions",
        BodySendMode::Buffered,
        false,
    )));
    match ex.on_message(body(&chat("m"), true)) {
        Step::Pick(_) => true,
        Step::Send(out) => {
            assert_eq!(immediate(&out[0]).status.unwrap().code, 429, "{out:?}");
            false
        }
    }
}

#[test]
fn a_saturation_condition_holds_on_the_polled_state_before_any_pick() {
    let shared = Rc::new(Shared::new(idle_only_plugin(), Rc::new(NoStats)));
    assert!(
        !picked_for(&shared),
        "no state learned yet: the condition does not hold (as in the filter)"
    );
    // What each worker does before its exchanges: an idle pool, with no
    // pick ever made in it, lets the batch work through.
    learn_pool_states(&shared, now_ns(), |name| {
        (name == "main").then(|| pool_state(0.1))
    });
    assert!(picked_for(&shared));
    learn_pool_states(&shared, now_ns(), |_| Some(pool_state(0.9)));
    assert!(!picked_for(&shared), "busy: shed");
    // A pool this indexer does not serve leaves the state as it was.
    learn_pool_states(&shared, now_ns(), |_| None);
    assert!(!picked_for(&shared));
}

#[test]
fn exchanges_share_one_clock_so_old_samples_age() {
    // Saturation samples are kept across exchanges and aged by `now_ns`: a
    // clock restarting with each exchange would make every sample fresh.
    use kvasir_filter::host::Host;
    let then = super::host::ExchangeHost::new().now_ns();
    std::thread::sleep(std::time::Duration::from_millis(30));
    let later = super::host::ExchangeHost::new();
    assert!(
        later.now_ns() >= then + 30_000_000,
        "{} then {}",
        then,
        later.now_ns()
    );
}
