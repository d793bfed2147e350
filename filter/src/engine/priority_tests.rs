//! The pool's engine priority (flow control's `enginePriority`): the pick's
//! answer carries vLLM's `priority`, set in the pick's callback as the
//! `x-vllm-priority` header of every API and in the body of OpenAI chat and
//! completions requests, replacing the client's.

use serde_json::{json, Value};

use super::*;

/// A pick answer with one endpoint and, maybe, an engine priority.
fn answer(priority: Option<i32>) -> Vec<u8> {
    PickResponse {
        endpoints: vec![PickedEndpoint {
            address: "127.0.0.1:9001".into(),
            ..Default::default()
        }],
        pool_saturation: 0.5,
        decision: PickDecision::Load as i32,
        reason: "load".into(),
        engine_priority: priority,
        ..Default::default()
    }
    .encode_to_vec()
}

/// A request on `path` with `body` through headers, body and the pick's
/// answer; returns the fake (body and headers as forwarded) and the stats.
fn through(path: &str, body_text: &str, priority: Option<i32>) -> (Fake, Rc<MemStats>) {
    let (shared, stats) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let client = [
        ("authorization", "Bearer key-acme"),
        ("x-vllm-priority", "-100"),
    ];
    let mut h = Fake::new(path, &client, body_text);
    assert_eq!(headers(&mut flow, &mut h), Verdict::Pause);
    assert_eq!(body(&mut flow, &mut h), Verdict::Pause, "{path}");
    grpc(&mut flow, &mut h, 7, 0, Some(answer(priority)));
    assert!(h.resumed, "{path}");
    assert_eq!(
        h.header("x-gateway-destination-endpoint"),
        Some("127.0.0.1:9001")
    );
    (h, stats)
}

fn content_length(h: &Fake) -> usize {
    h.header("content-length").unwrap().parse().unwrap()
}

#[test]
fn the_pick_s_priority_replaces_the_client_s_in_chat_and_completions() {
    let mut sent = serde_json::from_str::<Value>(&chat("qwen", true)).unwrap();
    sent["priority"] = json!(-100);
    let (h, stats) = through("/v1/chat/completions", &sent.to_string(), Some(1));
    let got = h.body_json();
    assert_eq!(
        got["priority"], 1,
        "a tenant cannot jump the engine's queue"
    );
    assert_eq!(got["messages"], sent["messages"], "nothing else changes");
    assert_eq!(content_length(&h), h.body.len());
    assert_eq!(stats.counter("kvasir.pool.main.engine_priority"), 1);

    let completion = json!({"model": "qwen", "prompt": "hello", "max_tokens": 3}).to_string();
    let (h, _) = through("/v1/completions", &completion, Some(0));
    assert_eq!(h.body_json()["priority"], 0);
    assert_eq!(content_length(&h), h.body.len());
}

#[test]
fn the_priority_joins_the_body_rewrites_made_at_the_body() {
    // The alias route rewrites the model and adds include_usage at the
    // body; the priority comes on top of that body, at the pick.
    let (h, _) = through("/v1/chat/completions", &chat("alias", true), Some(3));
    let got = h.body_json();
    assert_eq!(got["model"], "qwen");
    assert_eq!(got["stream_options"]["include_usage"], true);
    assert_eq!(got["priority"], 3);
    assert_eq!(content_length(&h), h.body.len());
}

#[test]
fn without_an_engine_priority_the_body_is_untouched() {
    let mut sent = serde_json::from_str::<Value>(&chat("qwen", false)).unwrap();
    sent["priority"] = json!(-100);
    let text = sent.to_string();
    let (h, stats) = through("/v1/chat/completions", &text, None);
    assert_eq!(
        h.body,
        text.as_bytes(),
        "byte for byte, the client's priority kept"
    );
    assert_eq!(stats.counter("kvasir.pool.main.engine_priority"), 0);
}

#[test]
fn other_apis_keep_their_body_and_get_the_header() {
    let messages = json!({"model": "qwen", "max_tokens": 4,
                          "messages": [{"role": "user", "content": "hello"}]})
    .to_string();
    let (h, stats) = through("/v1/messages", &messages, Some(1));
    assert_eq!(h.body, messages.as_bytes());
    assert_eq!(h.header("x-vllm-priority"), Some("1"));
    assert_eq!(stats.counter("kvasir.pool.main.engine_priority"), 1);
}

#[test]
fn a_shed_or_failed_pick_writes_no_priority() {
    let (shared, _) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let text = chat("qwen", false);
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme")],
        &text,
    );
    headers(&mut flow, &mut h);
    body(&mut flow, &mut h);
    // Unavailable: fail open with the client's body.
    grpc(&mut flow, &mut h, 7, 14, None);
    assert!(h.resumed);
    assert_eq!(h.body, text.as_bytes());
}
