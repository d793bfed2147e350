//! Tests of [`super`]: Anthropic bodies and their chat messages.

use super::super::{parse_body, RequestPrompt};
use super::*;

fn chat(api: ApiKind, body: &str) -> Vec<(String, String)> {
    let r = parse_body(api, body.as_bytes()).unwrap();
    let RequestPrompt::Chat(ms) = r.prompt else {
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

#[test]
fn system_blocks_join_with_nothing_and_lose_the_billing_header() {
    let m = chat(
        ApiKind::AnthropicMessages,
        r#"{"model":"m","max_tokens":5,"system":[
            {"type":"text","text":"x-anthropic-billing-header: cch=1;"},
            {"type":"text","text":"You are "},{"type":"text","text":""},
            {"type":"text","text":"terse."},{"type":"image","source":{}}],
            "messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(m, pairs(&[("system", "You are terse."), ("user", "hi")]));
    // A string system keeps its text; the chat parser drops the header line.
    let m = chat(
        ApiKind::AnthropicMessages,
        r#"{"model":"m","max_tokens":5,"system":"x-anthropic-billing-header: a\nBe kind.",
            "messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(m[0], ("system".into(), "Be kind.".into()));
    let m = chat(
        ApiKind::AnthropicMessages,
        r#"{"model":"m","max_tokens":5,"system":"","messages":[{"role":"user","content":"hi"}]}"#,
    );
    assert_eq!(m, pairs(&[("user", "hi")]));
}

#[test]
fn blocks_become_content_reasoning_tool_calls_and_tool_messages() {
    let m = chat(
        ApiKind::AnthropicMessages,
        r#"{"model":"m","max_tokens":5,"messages":[
          {"role":"user","content":[{"type":"text","text":"weather?"},{"type":"text","text":"in Oslo"}]},
          {"role":"assistant","content":[{"type":"thinking","thinking":"look it up","signature":"s"},
             {"type":"tool_use","id":"t1","name":"w","input":{"city":"Oslo"}}]},
          {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"rain"}]},
          {"role":"user","content":[{"type":"tool_result","tool_use_id":"t2",
             "content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
             {"type":"text","text":"thanks"}]},
          {"role":"assistant","content":[{"type":"tool_result","content":"odd"}]},
          {"role":"system","content":"be brief"},
          {"role":"user","content":[]}]}"#,
    );
    assert_eq!(
        m,
        pairs(&[
            ("user", "weather?\nin Oslo"),
            // Thinking is reasoning and tool_use a tool call: no content.
            ("assistant", ""),
            // A user message holding only a tool result is dropped.
            ("tool", "rain"),
            ("tool", "a\nb"),
            ("user", "thanks"),
            ("assistant", "Tool result: odd"),
            ("system", "be brief"),
        ])
    );
}

#[test]
fn tool_result_images_add_a_user_message() {
    let m = chat(
        ApiKind::AnthropicMessages,
        r#"{"model":"m","max_tokens":5,"messages":[{"role":"user","content":[
            {"type":"tool_result","tool_use_id":"t","content":[{"type":"image","source":{"type":"url","url":"u"}}]},
            {"type":"image","source":{"type":"url","url":"u"}}]}]}"#,
    );
    assert_eq!(m, pairs(&[("tool", ""), ("user", ""), ("user", "")]));
}

#[test]
fn blocks_must_be_objects_with_a_type() {
    for content in [r#"["hi"]"#, r#"[1]"#, r#"[{"text":"no type"}]"#, r#"5"#] {
        let b = format!(
            r#"{{"model":"m","max_tokens":5,"messages":[{{"role":"user","content":{content}}}]}}"#
        );
        let e = parse_body(ApiKind::AnthropicMessages, b.as_bytes()).unwrap_err();
        assert_eq!(
            (e.code, e.param),
            ("invalid_type", Some("messages")),
            "{content}"
        );
    }
    // vLLM requires content.
    let e = parse_body(
        ApiKind::AnthropicMessages,
        br#"{"model":"m","max_tokens":5,"messages":[{"role":"user"}]}"#,
    )
    .unwrap_err();
    assert_eq!(e.param, Some("messages"));
    let e = parse_body(
        ApiKind::AnthropicMessages,
        br#"{"model":"m","max_tokens":5,"system":[{"type":"text","text":1}],"messages":[{"role":"user","content":"x"}]}"#,
    )
    .unwrap_err();
    assert_eq!(e.param, Some("system"));
}

#[test]
fn count_tokens_reads_the_prompt_only() {
    // No max_tokens or stream there: vLLM ignores them, so does the filter.
    let r = parse_body(
        ApiKind::AnthropicCountTokens,
        br#"{"model":"claude","max_tokens":"many","stream":"no","system":"s","cache_salt":5,
             "messages":[{"role":"user","content":"count me"}]}"#,
    )
    .unwrap();
    assert_eq!(r.api, ApiKind::AnthropicCountTokens);
    assert_eq!(r.model, "claude");
    assert_eq!((r.stream, r.max_tokens, r.cache_salt), (false, 0, None));
    let RequestPrompt::Chat(ms) = &r.prompt else {
        panic!()
    };
    assert_eq!(ms.len(), 2);
    for bad in [
        r#"{"messages":[{"role":"user","content":"x"}]}"#,
        r#"{"model":"m"}"#,
    ] {
        let e = parse_body(ApiKind::AnthropicCountTokens, bad.as_bytes()).unwrap_err();
        assert!(
            ["missing_model", "missing_messages"].contains(&e.code),
            "{bad}"
        );
    }
}

#[test]
fn messages_read_stream_limits_and_salt() {
    let r = parse_body(
        ApiKind::AnthropicMessages,
        br#"{"model":"m","max_tokens":1e3,"stream":true,"cache_salt":"salt","messages":[{"role":"user","content":"x"}]}"#,
    )
    .unwrap();
    assert_eq!(
        (r.stream, r.max_tokens, r.cache_salt.as_deref()),
        (true, 1000, Some("salt"))
    );
}
