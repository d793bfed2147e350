//! Tests of [`super`]: Responses API bodies, their chat messages, and the
//! paths of requests on a stored response.

use super::super::{parse_body, BodyError, RequestPrompt};
use super::*;

fn parsed(body: &str) -> ParsedRequest<'_> {
    parse_body(ApiKind::Responses, body.as_bytes()).unwrap()
}

fn chat(body: &str) -> Vec<(String, String)> {
    let RequestPrompt::Chat(ms) = parsed(body).prompt else {
        panic!("not chat")
    };
    ms.iter()
        .map(|m| (m.role.to_string(), m.template_text()))
        .collect()
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter()
        .map(|(r, c)| (r.to_string(), c.to_string()))
        .collect()
}

fn err(body: &str) -> BodyError {
    parse_body(ApiKind::Responses, body.as_bytes()).unwrap_err()
}

#[test]
fn string_input_with_instructions() {
    assert_eq!(
        chat(r#"{"model":"m","instructions":"be terse","input":"hi"}"#),
        pairs(&[("system", "be terse"), ("user", "hi")])
    );
    // Empty instructions add nothing, as in vLLM.
    assert_eq!(
        chat(r#"{"model":"m","instructions":"","input":"hi"}"#),
        pairs(&[("user", "hi")])
    );
    let r = parsed(
        r#"{"model":"m","input":"hi","stream":true,"max_output_tokens":1e2,"store":false,
            "previous_response_id":"resp_1","cache_salt":"s","tools":[{"deep":[[1]]}]}"#,
    );
    assert_eq!(r.api, ApiKind::Responses);
    assert!(r.stream && !r.store);
    assert_eq!(r.max_tokens, 100);
    assert_eq!(r.response_id.as_deref(), Some("resp_1"));
    assert_eq!(r.cache_salt.as_deref(), Some("s"));
    let r = parsed(r#"{"model":"m","input":"hi","previous_response_id":null}"#);
    assert!(r.store && !r.stream);
    assert_eq!(r.response_id, None);
}

#[test]
fn items_become_messages_as_vllm_builds_them() {
    let m = chat(
        r#"{"model":"m","instructions":"sys","input":[
          {"role":"developer","content":"dev"},
          {"type":"message","role":"user","content":[{"type":"input_text","text":"a"},
             {"type":"input_image","image_url":"u"},{"type":"input_text","text":"b"}]},
          {"type":"reasoning","summary":[],"content":[{"type":"reasoning_text","text":"think"}]},
          {"type":"message","role":"assistant","status":"completed",
             "content":[{"type":"output_text","text":"first","annotations":[]},
                        {"type":"output_text","text":"second","annotations":[]}]},
          {"type":"function_call","call_id":"c1","name":"f","arguments":"{}"},
          {"type":"function_call_output","call_id":"c1","output":"42"},
          {"type":"function_call","call_id":"c2","name":"f","arguments":"{}"},
          {"type":"reasoning","summary":[{"type":"summary_text","text":"s"}]},
          {"role":"assistant","content":"done"},
          {"type":"item_reference","id":"x"},
          {"role":"user","content":"next"}]}"#,
    );
    assert_eq!(
        m,
        pairs(&[
            ("system", "sys"),
            ("developer", "dev"),
            ("user", "a\nb"),
            // Reasoning, then the message's first part, then a tool call
            // all land in one assistant message.
            ("assistant", "first"),
            ("tool", "42"),
            // A tool call starts an assistant message; the reasoning and
            // the text after it fill that message in.
            ("assistant", "done"),
            ("user", "next"),
        ])
    );
}

#[test]
fn a_second_reasoning_or_text_starts_a_new_assistant_message() {
    let m = chat(
        r#"{"model":"m","input":[
          {"type":"reasoning","summary":[]},{"type":"reasoning","summary":[]},
          {"role":"assistant","content":"a"},{"role":"assistant","content":"b"},
          {"type":"message","role":"assistant","content":[]}]}"#,
    );
    assert_eq!(
        m,
        pairs(&[
            ("assistant", ""),
            ("assistant", "a"),
            ("assistant", "b"),
            ("assistant", "")
        ])
    );
}

#[test]
fn bad_bodies() {
    assert_eq!(
        (err(r#"{"model":"m"}"#).code, err(r#"{"model":"m"}"#).param),
        ("missing_input", Some("input"))
    );
    assert_eq!(err(r#"{"input":"hi"}"#).code, "missing_model");
    for (body, param) in [
        (r#"{"model":"m","input":5}"#, "input"),
        (r#"{"model":"m","input":["hi"]}"#, "input"),
        (r#"{"model":"m","input":[[{"role":"user"}]]}"#, "input"),
        (
            r#"{"model":"m","input":[{"role":5,"content":"x"}]}"#,
            "input",
        ),
        (
            r#"{"model":"m","input":"x","instructions":["a"]}"#,
            "instructions",
        ),
        (r#"{"model":"m","input":"x","store":"no"}"#, "store"),
        (
            r#"{"model":"m","input":"x","max_output_tokens":1.5}"#,
            "max_output_tokens",
        ),
        (
            r#"{"model":"m","input":"x","previous_response_id":7}"#,
            "previous_response_id",
        ),
    ] {
        let e = err(body);
        assert_eq!((e.code, e.param), ("invalid_type", Some(param)), "{body}");
    }
    let e =
        err(r#"{"model":"m","input":"x","previous_response_id":"a","previous_response_id":"b"}"#);
    assert!(e.message.contains("duplicate"), "{}", e.message);
}

#[test]
fn stored_response_paths() {
    let id = |m, p| stored_response_request(m, p).map(|(op, id)| (op, id.into_owned()));
    assert_eq!(
        id("GET", "/v1/responses/resp_1"),
        Some((StoredOp::Retrieve, "resp_1".into()))
    );
    assert_eq!(
        id("GET", "/v1/responses/resp_1?stream=true&starting_after=2"),
        Some((StoredOp::Retrieve, "resp_1".into()))
    );
    assert_eq!(
        id("POST", "/v1/responses/resp_1/cancel"),
        Some((StoredOp::Cancel, "resp_1".into()))
    );
    assert_eq!(
        id("GET", "/v1/responses/resp%5F1%2"),
        Some((StoredOp::Retrieve, "resp_1%2".into()))
    );
    // Not UTF-8 once decoded: kept as sent.
    assert_eq!(
        id("GET", "/v1/responses/a%FF"),
        Some((StoredOp::Retrieve, "a%FF".into()))
    );
    for (m, p) in [
        ("POST", "/v1/responses/resp_1"),
        ("GET", "/v1/responses/resp_1/cancel"),
        ("DELETE", "/v1/responses/resp_1"),
        ("GET", "/v1/responses/"),
        ("GET", "/v1/responses"),
        ("GET", "/v1/responses/a/b"),
        // Exact paths only: vLLM's router does not serve these.
        ("GET", "/v1/responses/resp_1/"),
        ("GET", "/v1/responses/resp_1/?stream=true"),
        ("POST", "/v1/responses/resp_1/cancel/"),
        ("GET", "/v1/responses/resp_1/input_items"),
        ("DELETE", "/v1/responses/resp_1/"),
        ("GET", "/v1/responses//"),
        ("POST", "/v1/responses//cancel"),
        ("GET", "/v1/responsesx/a"),
    ] {
        assert_eq!(id(m, p), None, "{m} {p}");
    }
}

#[test]
fn a_stored_response_request_has_no_prompt() {
    let r = ParsedRequest::stored_response(Cow::Borrowed("resp_9"));
    assert_eq!(
        (r.api, r.model.as_ref(), r.response_id.as_deref()),
        (ApiKind::Responses, "", Some("resp_9"))
    );
    assert_eq!(r.prompt, RequestPrompt::None);
    assert_eq!(r.estimated_prompt_tokens(), 0);
}
