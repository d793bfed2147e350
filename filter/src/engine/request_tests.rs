//! Requests the engine answers itself or passes on: tenants that are
//! unknown or missing (401) and tenant headers, bad bodies (400, 413),
//! buffering, reject and shed replies in each API's shape, providers,
//! route rewrites and `include_usage` injection, and paths that are not
//! inference.

use super::*;

#[test]
fn unknown_and_missing_tenants_get_401_in_the_apis_shape() {
    let (shared, stats) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared.clone());
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer wrong"), ("x-tenant", "acme")],
        &chat("qwen", false),
    );
    assert_eq!(headers(&mut flow, &mut h), Verdict::Pause);
    let (status, b) = reply_json(&h);
    assert_eq!(status, 401);
    assert_eq!(b["error"]["type"], "authentication_error");
    assert_eq!(b["error"]["code"], "invalid_api_key");
    assert_eq!(
        stats.counter("kvasir.tenant.unknown.model.unknown.requests.unauthorized"),
        1
    );
    // Later callbacks after a local reply touch nothing.
    h.cb = Cb::ReqBody;
    assert_eq!(flow.on_request_body(&mut h, 10, true), Verdict::Pause);
    h.cb = Cb::RespHeaders;
    assert_eq!(flow.on_response_headers(&mut h, false), Verdict::Continue);
    h.cb = Cb::Log;
    flow.on_log(&mut h);

    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/messages",
        &[],
        r#"{"model":"qwen","max_tokens":1,"messages":[{"role":"user","content":"x"}]}"#,
    );
    headers(&mut flow, &mut h);
    let (status, b) = reply_json(&h);
    assert_eq!(status, 401);
    assert_eq!(
        b,
        json!({"type": "error", "error": {"type": "authentication_error", "message": "missing credentials"}})
    );
}

#[test]
fn header_tenant_source_and_rejected_tenant_header() {
    let (shared, _) = config(json!({"header": "x-tenant"}), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("x-tenant", "beta")],
        &chat("qwen", false),
    );
    headers(&mut flow, &mut h);
    body(&mut flow, &mut h);
    let pick = PickRequest::decode(h.calls[0].2.as_slice()).unwrap();
    assert_eq!(pick.tenant, "beta");

    let (shared, _) = config(json!({"apiKey": {}, "onTenantHeader": "reject"}), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme"), ("x-tenant", "beta")],
        &chat("qwen", false),
    );
    headers(&mut flow, &mut h);
    assert_eq!(reply_json(&h).0, 403);
}

#[test]
fn bad_bodies_get_400_and_413() {
    let (shared, stats) = config(api_key(), json!({"bodyLimitBytes": 200}));
    let auth = [("authorization", "Bearer key-acme")];
    for (b, code) in [
        ("{not json", "invalid_json"),
        ("", "invalid_json"),
        (
            r#"{"messages":[{"role":"user","content":"x"}]}"#,
            "missing_model",
        ),
        (r#"{"model":7,"messages":[]}"#, "invalid_type"),
        ("\u{1}\u{2}binary", "invalid_json"),
    ] {
        let mut flow = Flow::new(shared.clone());
        let mut h = Fake::new("/v1/chat/completions", &auth, b);
        headers(&mut flow, &mut h);
        assert_eq!(body(&mut flow, &mut h), Verdict::Pause);
        let (status, j) = reply_json(&h);
        assert_eq!(
            (status, j["error"]["code"].as_str()),
            (400, Some(code)),
            "{b}"
        );
    }
    assert_eq!(
        stats.counter("kvasir.tenant.acme.model.unknown.requests.invalid"),
        5
    );
    let mut flow = Flow::new(shared.clone());
    let mut h = Fake::new("/v1/chat/completions", &auth, &"x".repeat(201));
    headers(&mut flow, &mut h);
    assert_eq!(body(&mut flow, &mut h), Verdict::Pause);
    assert_eq!(reply_json(&h).0, 413);
    // A header-only POST has no body callback: refused at headers.
    let mut flow = Flow::new(shared);
    let mut h = Fake::new("/v1/chat/completions", &auth, "");
    h.cb = Cb::ReqHeaders;
    assert_eq!(flow.on_request_headers(&mut h, true), Verdict::Pause);
    assert_eq!(reply_json(&h).0, 400);
}

#[test]
fn streaming_body_is_buffered_until_the_end() {
    let (shared, _) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme")],
        &chat("qwen", false),
    );
    headers(&mut flow, &mut h);
    h.cb = Cb::ReqBody;
    assert_eq!(flow.on_request_body(&mut h, 5, false), Verdict::Pause);
    assert!(h.calls.is_empty());
    let n = h.body.len();
    assert_eq!(flow.on_request_body(&mut h, n, true), Verdict::Pause);
    assert_eq!(h.calls.len(), 1);
}

#[test]
fn reject_and_shed_reply_in_shape() {
    let (shared, stats) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared.clone());
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme")],
        &chat("blocked-model", false),
    );
    headers(&mut flow, &mut h);
    body(&mut flow, &mut h);
    let (status, j) = reply_json(&h);
    assert_eq!(
        (
            status,
            j["error"]["message"].as_str(),
            j["error"]["code"].as_str()
        ),
        (403, Some("not for you"), Some("policy_rejected"))
    );
    assert_eq!(
        stats.counter("kvasir.tenant.acme.model.blocked-model.requests.reject"),
        1
    );

    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/messages",
        &[("x-api-key", "key-beta")],
        r#"{"model":"shed-model","max_tokens":1,"messages":[{"role":"user","content":"x"}]}"#,
    );
    headers(&mut flow, &mut h);
    body(&mut flow, &mut h);
    let r = h.replied.clone().unwrap();
    assert_eq!(r.status, 429);
    assert!(r.headers.contains(&("retry-after".into(), "3".into())));
    let (_, j) = reply_json(&h);
    assert_eq!(
        j,
        json!({"type": "error", "error": {"type": "rate_limit_error", "message": "busy"}})
    );
    assert_eq!(
        stats.counter("kvasir.tenant.beta.model.shed-model.requests.shed"),
        1
    );
}

#[test]
fn provider_gets_its_model_and_cluster_never_the_clients_key() {
    let (shared, stats) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[
            ("authorization", "Bearer key-acme"),
            ("x-api-key", "key-acme"),
        ],
        &chat("gpt-4o", true),
    );
    headers(&mut flow, &mut h);
    assert_eq!(body(&mut flow, &mut h), Verdict::Continue);
    assert!(h.calls.is_empty(), "no pick for a provider");
    assert_eq!(h.header("x-kvasir-cluster"), Some("ext-cluster"));
    assert_eq!(h.header(":authority"), Some("api.example.com"));
    // Envoy injects the provider's credential on its cluster; the filter
    // only makes sure the client's own key does not leave.
    assert_eq!(h.header("authorization"), None);
    assert_eq!(h.header("x-api-key"), None);
    assert_eq!(h.body_json()["model"], "ext-model");
    assert_eq!(
        h.header("content-length"),
        Some(h.body.len().to_string().as_str())
    );
    assert_eq!(h.route_cleared, 1);
    assert_eq!(
        stats.counter("kvasir.tenant.acme.model.gpt-4o.requests.provider"),
        1
    );
    respond(
        &mut flow,
        &mut h,
        200,
        "application/json",
        &[r#"{"usage":{"prompt_tokens":9,"completion_tokens":2}}"#],
    );
    assert_eq!(
        stats.counter("kvasir.tenant.acme.model.gpt-4o.completion_tokens"),
        2
    );
    assert!(
        h.detached.is_empty(),
        "providers are not reported to the indexer"
    );
}

#[test]
fn route_rewrite_and_include_usage_injection() {
    let (shared, _) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared.clone());
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme")],
        &chat("alias", true),
    );
    let before = h.body_json();
    headers(&mut flow, &mut h);
    body(&mut flow, &mut h);
    let after = h.body_json();
    assert_eq!(after["model"], "qwen");
    assert_eq!(after["stream_options"], json!({"include_usage": true}));
    assert_eq!(after["messages"], before["messages"]);
    assert_eq!(
        h.header("content-length"),
        Some(h.body.len().to_string().as_str())
    );
    let pick = PickRequest::decode(h.calls[0].2.as_slice()).unwrap();
    assert_eq!(pick.model, "qwen");
    // Not streaming: no injection; same model: no rewrite at all.
    let mut flow = Flow::new(shared);
    let original = chat("qwen", false);
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme")],
        &original,
    );
    headers(&mut flow, &mut h);
    body(&mut flow, &mut h);
    assert_eq!(h.body, original.as_bytes());
}

#[test]
fn non_inference_paths_pass_through() {
    let (shared, stats) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/models",
        &[
            ("authorization", "Bearer key-acme"),
            ("x-gateway-destination-endpoint", "1.2.3.4:5"),
        ],
        "",
    );
    h.headers[0].1 = "GET".into();
    h.headers
        .push(("x-kvasir-cluster".into(), "kvasir_indexer".into()));
    assert_eq!(headers(&mut flow, &mut h), Verdict::Continue);
    assert_eq!(h.header("x-gateway-destination-endpoint"), None);
    assert_eq!(h.header("x-kvasir-cluster"), None);
    assert_eq!(
        h.route_cleared, 1,
        "a client-chosen route must be re-selected"
    );
    assert_eq!(
        stats.counter("kvasir.tenant.acme.model.unknown.requests.passthrough"),
        1
    );
    h.cb = Cb::ReqBody;
    assert_eq!(flow.on_request_body(&mut h, 0, true), Verdict::Continue);
    h.cb = Cb::RespHeaders;
    h.resp_headers = vec![(":status".into(), "200".into())];
    assert_eq!(flow.on_response_headers(&mut h, false), Verdict::Continue);
    assert!(h.added_resp.is_empty());
}
