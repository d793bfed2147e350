//! The Responses API and Anthropic's count_tokens through the engine:
//! picks bound to a stored response, the unknown-id answer, the engine's
//! id reported at once, usage charged once, and policies on the new kinds.

use kvasir_proto::v1::{Admission, Outcome, ReportPhase};

use super::*;

fn body_cb(flow: &mut Flow, h: &mut Fake) -> Verdict {
    body(flow, h)
}

fn responses_body(extra: Value) -> String {
    let mut b = json!({"model": "qwen", "instructions": "sys", "input": "hello"});
    if let (Some(b), Some(e)) = (b.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    b.to_string()
}

fn decode_pick(h: &mut Fake) -> PickRequest {
    let (_, method, msg, _) = h.calls.pop().expect("a pick");
    assert_eq!(method, "Pick");
    PickRequest::decode(msg.as_slice()).unwrap()
}

fn reports(h: &Fake) -> Vec<ReportRequest> {
    h.detached
        .iter()
        .map(|(_, _, m)| ReportRequest::decode(m.as_slice()).unwrap())
        .collect()
}

fn answer(decision: PickDecision, addrs: &[&str]) -> Vec<u8> {
    PickResponse {
        endpoints: addrs
            .iter()
            .map(|a| PickedEndpoint {
                address: a.to_string(),
                ..Default::default()
            })
            .collect(),
        decision: decision as i32,
        ..Default::default()
    }
    .encode_to_vec()
}

const STREAM: [&str; 3] = [
    "event: response.created\ndata: {\"response\":{\"id\":\"resp_new\",\"usage\":null},\"type\":\"response.created\"}\n\n",
    "event: response.output_text.delta\ndata: {\"delta\":\"hi\",\"type\":\"response.output_text.delta\"}\n\n",
    "event: response.completed\ndata: {\"response\":{\"id\":\"resp_new\",\"usage\":{\"input_tokens\":20,\"input_tokens_details\":{\"cached_tokens\":16},\"output_tokens\":2}},\"type\":\"response.completed\"}\n\n",
];

#[test]
fn a_follow_up_is_picked_by_its_response_and_its_id_reported_at_once() {
    let (shared, stats) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let body = responses_body(json!({"previous_response_id": "resp_old", "stream": true}));
    let mut h = Fake::new(
        "/v1/responses",
        &[("authorization", "Bearer key-acme")],
        &body,
    );
    // Reports may be deferred: the id report still goes at once.
    h.defers = true;
    headers(&mut flow, &mut h);
    assert_eq!(body_cb(&mut flow, &mut h), Verdict::Pause);
    // No include_usage for the Responses API: its usage always comes.
    assert_eq!(h.body_json(), serde_json::from_str::<Value>(&body).unwrap());
    let pick = decode_pick(&mut h);
    assert_eq!(pick.response_id, "resp_old");
    let Some(pick_request::Prompt::Chat(c)) = pick.prompt else {
        panic!()
    };
    assert_eq!(
        c.messages
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect::<Vec<_>>(),
        [("system", "sys"), ("user", "hello")]
    );
    grpc(
        &mut flow,
        &mut h,
        7,
        0,
        Some(answer(PickDecision::Response, &["127.0.0.1:9001"])),
    );
    assert!(h.resumed);
    // The holder twice: a retry stays on it.
    assert_eq!(
        h.header("x-gateway-destination-endpoint"),
        Some("127.0.0.1:9001,127.0.0.1:9001")
    );
    // The first chunk carries the id: reported before the chunk goes on.
    h.resp_headers = vec![
        (":status".into(), "200".into()),
        ("content-type".into(), "text/event-stream".into()),
    ];
    h.cb = Cb::RespHeaders;
    flow.on_response_headers(&mut h, false);
    h.cb = Cb::RespBody;
    h.resp_chunk = STREAM[0].as_bytes().to_vec();
    flow.on_response_body(&mut h, STREAM[0].len(), false);
    let sent = reports(&h);
    assert_eq!(sent.len(), 1);
    assert_eq!(
        (
            sent[0].response_id.as_str(),
            sent[0].phase,
            sent[0].endpoint.as_str()
        ),
        ("resp_new", ReportPhase::FirstToken as i32, "127.0.0.1:9001")
    );
    for c in &STREAM[1..] {
        h.resp_chunk = c.as_bytes().to_vec();
        flow.on_response_body(&mut h, c.len(), c == &STREAM[2]);
    }
    h.cb = Cb::Log;
    flow.on_log(&mut h);
    let sent = reports(&h);
    assert_eq!(sent.len(), 2, "no second first-token report");
    assert_eq!(
        (
            sent[1].response_id.as_str(),
            sent[1].phase,
            sent[1].cached_tokens
        ),
        ("resp_new", ReportPhase::Done as i32, 16)
    );
    assert_eq!(stats.counter(&format!("{P}.prompt_tokens.cached")), 16);
    assert_eq!(stats.counter(&format!("{P}.prompt_tokens.uncached")), 4);
    assert_eq!(stats.counter(&format!("{P}.completion_tokens")), 2);
}

#[test]
fn store_false_never_reports_an_id() {
    let (shared, stats) = config(api_key(), json!({"reportFirstToken": true}));
    let mut flow = Flow::new(shared);
    let body = responses_body(json!({"store": false}));
    let mut h = Fake::new(
        "/v1/responses",
        &[("authorization", "Bearer key-acme")],
        &body,
    );
    headers(&mut flow, &mut h);
    body_cb(&mut flow, &mut h);
    assert_eq!(decode_pick(&mut h).response_id, "");
    grpc(
        &mut flow,
        &mut h,
        7,
        0,
        Some(pick_answer(&["127.0.0.1:9001"], 0.1)),
    );
    respond(
        &mut flow,
        &mut h,
        200,
        "application/json",
        &[
            r#"{"id":"resp_x","object":"response","usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":0},"output_tokens":1}}"#,
        ],
    );
    let sent = reports(&h);
    assert_eq!(sent.len(), 2, "first token and done");
    assert!(sent.iter().all(|r| r.response_id.is_empty()));
    assert_eq!(stats.counter(&format!("{P}.prompt_tokens.uncached")), 9);
}

#[test]
fn a_json_response_reports_its_id_with_the_first_chunk() {
    let (shared, _) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/responses",
        &[("authorization", "Bearer key-acme")],
        &responses_body(json!({})),
    );
    h.defers = true;
    headers(&mut flow, &mut h);
    body_cb(&mut flow, &mut h);
    grpc(
        &mut flow,
        &mut h,
        7,
        0,
        Some(pick_answer(&["127.0.0.1:9001"], 0.1)),
    );
    h.resp_headers = vec![
        (":status".into(), "200".into()),
        ("content-type".into(), "application/json".into()),
    ];
    h.cb = Cb::RespHeaders;
    flow.on_response_headers(&mut h, false);
    h.cb = Cb::RespBody;
    let chunk = br#"{"id":"resp_j","object":"response","status":"completed"#;
    h.resp_chunk = chunk.to_vec();
    flow.on_response_body(&mut h, chunk.len(), false);
    assert_eq!(reports(&h)[0].response_id, "resp_j");
}

#[test]
fn an_error_answer_reports_no_id() {
    let (shared, _) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/responses",
        &[("authorization", "Bearer key-acme")],
        &responses_body(json!({})),
    );
    headers(&mut flow, &mut h);
    body_cb(&mut flow, &mut h);
    grpc(
        &mut flow,
        &mut h,
        7,
        0,
        Some(pick_answer(&["127.0.0.1:9001"], 0.1)),
    );
    respond(
        &mut flow,
        &mut h,
        400,
        "application/json",
        &[r#"{"id":"not-a-response","error":{"message":"bad","code":400}}"#],
    );
    let sent = reports(&h);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].response_id, "");
}

#[test]
fn an_unknown_response_is_answered_as_vllm_answers_it() {
    let (shared, stats) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/responses",
        &[("authorization", "Bearer key-acme")],
        &responses_body(json!({"previous_response_id": "resp_gone"})),
    );
    headers(&mut flow, &mut h);
    body_cb(&mut flow, &mut h);
    grpc(
        &mut flow,
        &mut h,
        7,
        0,
        Some(answer(PickDecision::UnknownResponse, &[])),
    );
    assert!(!h.resumed);
    assert_eq!(
        reply_json(&h),
        (
            404,
            json!({"error": {"message": "Response with id 'resp_gone' not found.",
                "type": "invalid_request_error", "param": "response_id", "code": 404}})
        )
    );
    assert_eq!(stats.counter("kvasir.pool.main.pick.unknown_response"), 1);
    assert_eq!(stats.counter("kvasir.pool.main.failopen"), 0);
    h.cb = Cb::Log;
    flow.on_log(&mut h);
    assert!(h.detached.is_empty(), "nothing was forwarded");
}

#[test]
fn unknown_response_for_a_request_naming_none_fails_open() {
    let (shared, stats) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/responses",
        &[("authorization", "Bearer key-acme")],
        &responses_body(json!({})),
    );
    headers(&mut flow, &mut h);
    body_cb(&mut flow, &mut h);
    grpc(
        &mut flow,
        &mut h,
        7,
        0,
        Some(answer(PickDecision::UnknownResponse, &[])),
    );
    assert!(h.resumed && h.replied.is_none());
    assert_eq!(stats.counter("kvasir.pool.main.pick.bad_response"), 1);
}

/// A `GET` or `cancel` of a stored response, with no body.
fn stored(method: &str, path: &str) -> (Flow, Fake, Rc<MemStats>) {
    let (shared, stats) = config(api_key(), json!({}));
    let flow = Flow::new(shared);
    let mut h = Fake::new(path, &[("authorization", "Bearer key-acme")], "");
    h.headers
        .retain(|(k, _)| k != ":method" && k != "content-length");
    h.headers.push((":method".into(), method.into()));
    (flow, h, stats)
}

#[test]
fn get_and_cancel_are_picked_at_the_headers_by_their_id() {
    for (method, path, id) in [
        ("GET", "/v1/responses/resp_1?stream=false", "resp_1"),
        ("POST", "/v1/responses/resp%5F2/cancel", "resp_2"),
    ] {
        let (mut flow, mut h, stats) = stored(method, path);
        h.cb = Cb::ReqHeaders;
        assert_eq!(
            flow.on_request_headers(&mut h, true),
            Verdict::Pause,
            "{path}"
        );
        h.cb = Cb::Idle;
        assert_eq!(h.header("x-kvasir-cluster"), Some("pool"));
        let pick = decode_pick(&mut h);
        assert_eq!((pick.response_id.as_str(), pick.prompt), (id, None));
        grpc(
            &mut flow,
            &mut h,
            7,
            0,
            Some(answer(PickDecision::Response, &["127.0.0.1:9002"])),
        );
        assert!(h.resumed);
        assert_eq!(
            h.header("x-gateway-destination-endpoint"),
            Some("127.0.0.1:9002,127.0.0.1:9002")
        );
        // The stored response repeats its usage: not charged again.
        let stored_body = format!(
            r#"{{"id":"{id}","object":"response","usage":{{"input_tokens":50,"input_tokens_details":{{"cached_tokens":0}},"output_tokens":5}}}}"#
        );
        respond(&mut flow, &mut h, 200, "application/json", &[&stored_body]);
        const U: &str = "kvasir.tenant.acme.model.unknown";
        assert_eq!(stats.counter(&format!("{U}.requests.route")), 1);
        assert_eq!(stats.counter(&format!("{U}.prompt_tokens.uncached")), 0);
        assert_eq!(stats.counter(&format!("{U}.responses.2xx")), 1);
        let sent = reports(&h);
        assert_eq!(sent.last().unwrap().prompt_tokens, 0);
        assert!(sent.iter().any(|r| r.response_id == id));
    }
}

#[test]
fn a_get_of_an_unknown_id_is_vllms_404() {
    let (mut flow, mut h, _) = stored("GET", "/v1/responses/nope");
    h.cb = Cb::ReqHeaders;
    flow.on_request_headers(&mut h, true);
    h.cb = Cb::Idle;
    grpc(
        &mut flow,
        &mut h,
        7,
        0,
        Some(answer(PickDecision::UnknownResponse, &[])),
    );
    let (status, body) = reply_json(&h);
    assert_eq!(status, 404);
    assert_eq!(
        body["error"]["message"],
        "Response with id 'nope' not found."
    );
}

#[test]
fn a_get_while_the_indexer_is_down_is_refused_not_routed() {
    // Only the indexer knows which engine holds the response and for
    // which tenant: Envoy's own choice could reach another tenant's.
    let (mut flow, mut h, stats) = stored("GET", "/v1/responses/resp_1");
    h.cb = Cb::ReqHeaders;
    flow.on_request_headers(&mut h, true);
    h.cb = Cb::Idle;
    grpc(&mut flow, &mut h, 7, 14, None);
    assert!(!h.resumed);
    let (status, body) = reply_json(&h);
    assert_eq!(status, 503);
    assert_eq!(body["error"]["code"], "responses_unavailable");
    assert_eq!(stats.counter("kvasir.pool.main.pick.unavailable"), 1);
    assert_eq!(
        stats.counter("kvasir.pool.main.pick.response_unavailable"),
        1
    );
}

#[test]
fn a_follow_up_while_the_indexer_is_down_is_refused_not_routed() {
    let (shared, _) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/responses",
        &[("authorization", "Bearer key-acme")],
        &responses_body(json!({"previous_response_id": "resp_1"})),
    );
    headers(&mut flow, &mut h);
    body_cb(&mut flow, &mut h);
    grpc(&mut flow, &mut h, 7, 4, None);
    assert!(!h.resumed);
    assert_eq!(reply_json(&h).0, 503);
    let sent = reports(&h);
    assert_eq!(sent.len(), 1);
    assert_eq!(sent[0].outcome, Outcome::Rejected as i32);
    assert_eq!(sent[0].admission, Admission::Local as i32);
}

#[test]
fn other_methods_on_responses_paths_pass_through() {
    let (mut flow, mut h, stats) = stored("DELETE", "/v1/responses/resp_1");
    h.cb = Cb::ReqHeaders;
    assert_eq!(flow.on_request_headers(&mut h, true), Verdict::Continue);
    assert!(h.calls.is_empty());
    assert_eq!(
        stats.counter("kvasir.tenant.acme.model.unknown.requests.passthrough"),
        1
    );
}

#[test]
fn count_tokens_goes_to_the_pool_without_a_pick() {
    let (shared, stats) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/messages/count_tokens",
        &[("authorization", "Bearer key-acme")],
        r#"{"model":"qwen","messages":[{"role":"user","content":"count"}]}"#,
    );
    headers(&mut flow, &mut h);
    assert_eq!(body_cb(&mut flow, &mut h), Verdict::Continue);
    assert_eq!(h.header("x-kvasir-cluster"), Some("pool"));
    assert!(h.calls.is_empty(), "no pick");
    assert_eq!(stats.counter("kvasir.pool.main.failopen"), 0);
    respond(
        &mut flow,
        &mut h,
        200,
        "application/json",
        &[r#"{"input_tokens":7,"context_management":{"original_input_tokens":7}}"#],
    );
    assert_eq!(stats.counter(&format!("{P}.requests.route")), 1);
    assert_eq!(stats.counter(&format!("{P}.prompt_tokens.uncached")), 0);
    assert!(h.detached.is_empty(), "nothing in flight to report");
}

#[test]
fn errors_come_in_each_apis_shape() {
    let (shared, _) = config(api_key(), json!({}));
    for (path, body, anthropic) in [
        ("/v1/messages/count_tokens", r#"{"model":"qwen"}"#, true),
        ("/v1/responses", r#"{"model":"qwen"}"#, false),
        (
            "/v1/responses",
            r#"{"model":"blocked-model","input":"x"}"#,
            false,
        ),
    ] {
        let mut flow = Flow::new(shared.clone());
        let mut h = Fake::new(path, &[("authorization", "Bearer key-acme")], body);
        headers(&mut flow, &mut h);
        body_cb(&mut flow, &mut h);
        let (_, v) = reply_json(&h);
        assert_eq!(v.get("type").is_some(), anthropic, "{path} {v}");
        assert_eq!(v["error"].get("code").is_some(), !anthropic, "{path} {v}");
    }
    // Before the body too: an unknown key on a GET.
    let (mut flow, mut h, _) = stored("GET", "/v1/responses/resp_1");
    h.headers.retain(|(k, _)| k != "authorization");
    h.cb = Cb::ReqHeaders;
    flow.on_request_headers(&mut h, true);
    let (status, v) = reply_json(&h);
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (401, Some("missing_credentials"))
    );
}

#[test]
fn policies_match_the_new_apis() {
    let set = json!({
        "tenantSource": {"apiKey": {}},
        "tenants": [{"name": "acme", "apiKeyHashes": [key_hash("key-acme")]}],
        "pools": [{"name": "main", "models": ["qwen"], "cluster": "pool", "indexerCluster": "indexer"}],
        "policies": [
            {"name": "no-counting", "match": {"apis": ["anthropicCountTokens"]}, "action": {"reject": {"status": 403, "message": "no counting"}}},
            {"name": "responses", "match": {"apis": ["responses"]}, "action": {"route": {"pool": "main"}}}
        ],
        "defaultAction": {"reject": {"status": 404}}
    });
    let set = kvasir_policy::parse_json(&set.to_string()).unwrap();
    let doc: Value =
        serde_json::from_slice(&kvasir_policy::compile(&set).unwrap().to_json()).unwrap();
    let cfg =
        PluginConfig::from_bytes(&serde_json::to_vec(&json!({"policy": doc})).unwrap()).unwrap();
    let stats: Rc<dyn Stats> = Rc::new(MemStats::default());
    let shared = Rc::new(Shared::new(cfg, stats));
    let auth = [("authorization", "Bearer key-acme")];
    let mut flow = Flow::new(shared.clone());
    let mut h = Fake::new(
        "/v1/messages/count_tokens",
        &auth,
        r#"{"model":"qwen","messages":[{"role":"user","content":"x"}]}"#,
    );
    headers(&mut flow, &mut h);
    body_cb(&mut flow, &mut h);
    assert_eq!(
        reply_json(&h),
        (
            403,
            json!({"type": "error", "error": {"type": "permission_error", "message": "no counting"}})
        )
    );
    // A GET has no model: an `apis` policy still routes it.
    let mut flow = Flow::new(shared.clone());
    let mut h = Fake::new("/v1/responses/resp_1", &auth, "");
    h.headers.retain(|(k, _)| k != ":method");
    h.headers.push((":method".into(), "GET".into()));
    h.cb = Cb::ReqHeaders;
    assert_eq!(flow.on_request_headers(&mut h, true), Verdict::Pause);
    assert_eq!(h.header("x-kvasir-cluster"), Some("pool"));
    // Chat matches neither: the default.
    let mut flow = Flow::new(shared);
    let mut h = Fake::new("/v1/chat/completions", &auth, &chat("qwen", false));
    headers(&mut flow, &mut h);
    body_cb(&mut flow, &mut h);
    assert_eq!(reply_json(&h).0, 404);
}

#[test]
fn the_id_is_reported_even_when_the_pick_failed_open_or_reports_are_off() {
    for (settings, status) in [(json!({}), 14), (json!({"report": false}), 0)] {
        let (shared, _) = config(api_key(), settings.clone());
        let mut flow = Flow::new(shared);
        let mut h = Fake::new(
            "/v1/responses",
            &[("authorization", "Bearer key-acme")],
            &responses_body(json!({})),
        );
        headers(&mut flow, &mut h);
        body_cb(&mut flow, &mut h);
        let answer = (status == 0).then(|| pick_answer(&["127.0.0.1:9001"], 0.1));
        grpc(&mut flow, &mut h, 7, status, answer);
        respond(&mut flow, &mut h, 200, "text/event-stream", &STREAM);
        let sent = reports(&h);
        assert_eq!(
            (sent[0].response_id.as_str(), sent[0].endpoint.as_str()),
            ("resp_new", "127.0.0.1:9001"),
            "{settings}"
        );
        assert_eq!(sent[0].tenant, "acme", "the response is its tenant's");
        if status == 0 {
            assert_eq!(sent.len(), 1, "{settings}: only the id report");
        } else {
            // The pick's answer was not used: its end says the filter
            // admitted the request itself.
            assert_eq!(sent.len(), 2, "{settings}");
            assert_eq!(sent[1].phase, ReportPhase::Done as i32);
            assert_eq!(sent[1].admission, Admission::Local as i32);
        }
    }
}

#[test]
fn a_pick_bound_to_a_stored_response_waits_past_the_indexers_grace() {
    // The pool's own deadline applies to every other pick.
    let (shared, _) = config(api_key(), json!({}));
    let pool_timeout = shared.config.policy.pools()[0].indexer_timeout_ms;
    assert!(pool_timeout < RESPONSE_PICK_MIN_TIMEOUT_MS);
    let timeout_of = |body: String| {
        let mut flow = Flow::new(Rc::clone(&shared));
        let mut h = Fake::new(
            "/v1/responses",
            &[("authorization", "Bearer key-acme")],
            &body,
        );
        headers(&mut flow, &mut h);
        assert_eq!(body_cb(&mut flow, &mut h), Verdict::Pause);
        h.calls.pop().expect("a pick").3
    };
    assert_eq!(timeout_of(responses_body(json!({}))), pool_timeout);
    assert_eq!(
        timeout_of(responses_body(json!({"previous_response_id": "resp_old"}))),
        RESPONSE_PICK_MIN_TIMEOUT_MS
    );
    assert_eq!(pick_timeout_ms(900, true), 900);
}
