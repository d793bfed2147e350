use super::*;

fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(o) => o,
        _ => panic!("not an object"),
    }
}

fn roles(m: &[ChatMessage]) -> Vec<(&str, &str)> {
    m.iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect()
}

#[test]
fn system_and_blocks_convert_as_vllm_does() {
    let req = obj(json!({
        "system": [{"type": "text", "text": "x-anthropic-billing-header: abc"}, {"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "u1"}, {"type": "text", "text": ""}, {"type": "text", "text": "u2"}]},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "z"}]},
            {"role": "system", "content": "inline"},
            {"role": "user", "content": "q"},
        ],
    }));
    let m = to_chat(&req, false).unwrap();
    assert_eq!(
        roles(&m),
        [
            ("system", "AB"),
            ("user", "u1\nu2"),
            ("assistant", ""),
            ("system", "inline"),
            ("user", "q")
        ]
    );
    let merged = to_chat(&req, true).unwrap();
    assert_eq!(
        roles(&merged),
        [
            ("system", "ABinline"),
            ("user", "u1\nu2"),
            ("assistant", ""),
            ("user", "q")
        ]
    );
}

#[test]
fn what_the_template_cannot_render_is_refused() {
    let tool = obj(
        json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}]}),
    );
    assert_eq!(
        to_chat(&tool, false).unwrap_err().status,
        StatusCode::BAD_REQUEST
    );
    let tools = obj(json!({"messages": [], "tools": [{"name": "f", "input_schema": {}}]}));
    assert!(to_chat(&tools, false).is_err());
    let thinking = obj(json!({"messages": [], "thinking": {"type": "disabled"}}));
    assert!(to_chat(&thinking, false).is_err());
    let enabled =
        obj(json!({"messages": [], "thinking": {"type": "enabled", "budget_tokens": 2048}}));
    assert!(to_chat(&enabled, false).is_ok());
}

#[test]
fn usage_splits_input_as_vllm() {
    assert_eq!(
        usage(100, 5, 64, 32, true),
        json!({"input_tokens": 4, "output_tokens": 5, "cache_creation_input_tokens": 32, "cache_read_input_tokens": 64})
    );
    assert_eq!(
        usage(100, 5, 64, 32, false),
        json!({"input_tokens": 100, "output_tokens": 5})
    );
}

#[test]
fn error_types_follow_the_status() {
    assert_eq!(error_type(StatusCode::BAD_REQUEST), "invalid_request_error");
    assert_eq!(error_type(StatusCode::NOT_FOUND), "not_found_error");
    assert_eq!(
        error_type(StatusCode::SERVICE_UNAVAILABLE),
        "overloaded_error"
    );
    assert_eq!(error_type(StatusCode::INTERNAL_SERVER_ERROR), "api_error");
    assert_eq!(error_type(StatusCode::CONFLICT), "invalid_request_error");
}

#[test]
fn bad_fields_are_schema_errors() {
    let e = validate(&obj(json!({"model": "m", "messages": []})), true).unwrap_err();
    assert_eq!(e.kind, "Bad Request");
    assert_eq!(e.param.as_deref(), Some("body.max_tokens"));
    let e = validate(
        &obj(json!({"model": "m", "messages": [{"role": "bot", "content": "x"}], "max_tokens": 0})),
        true,
    )
    .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("body.messages.0.role"));
    assert!(
        e.message.starts_with("2 validation errors"),
        "{}",
        e.message
    );
    assert!(validate(&obj(json!({"model": "m", "messages": []})), false).is_ok());
}

#[test]
fn qwen3_template_takes_inline_system_messages() {
    let dir = crate::find_tokenizer_dir(None).expect("run `make setup` for the tokenizer");
    let tok = ChatTokenizer::from_dir(dir).unwrap();
    assert!(!template_needs_system_first(&tok));
}
