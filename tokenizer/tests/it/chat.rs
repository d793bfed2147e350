//! Chat rendering must give the exact prompt text vLLM renders, and
//! `encode_chat` the exact ids vLLM then computes.

use crate::common;
use common::{assert_same_ids, tokenizer_dir, FAST, REFERENCE};
use kvasir_tokenizer::{ChatMessage, ChatTokenizer, TokenizerError};
use serde::Deserialize;

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new("user", "What is the capital of France?"),
        ChatMessage::new("assistant", "The capital of France is Paris."),
        ChatMessage::new("user", "And of Germany?"),
    ]
}

#[test]
fn system_user_assistant_user_renders_exactly() {
    let text = FAST.render_chat(&conversation(), true).expect("render");
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France?<|im_end|>\n\
         <|im_start|>assistant\nThe capital of France is Paris.<|im_end|>\n\
         <|im_start|>user\nAnd of Germany?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    let without = FAST.render_chat(&conversation(), false).expect("render");
    assert_eq!(format!("{without}<|im_start|>assistant\n"), text);
}

#[derive(Deserialize)]
struct Case {
    name: String,
    add_generation_prompt: bool,
    messages: Vec<ChatMessage>,
    expected: String,
}

/// `fixtures/chat_expected.json` holds the template rendered by Python
/// Jinja2 configured as transformers' `apply_chat_template` (see
/// `fixtures/gen_chat_expected.py`): reasoning stripping, tool turns,
/// system-not-first, unknown roles, CRLF and unicode.
#[test]
fn renders_like_transformers_jinja2() {
    let cases: Vec<Case> = serde_json::from_str(include_str!("../fixtures/chat_expected.json"))
        .expect("fixture parses");
    assert!(cases.len() >= 20);
    for case in &cases {
        let got = FAST
            .render_chat(&case.messages, case.add_generation_prompt)
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
        assert_eq!(
            got, case.expected,
            "{} (add_generation_prompt={})",
            case.name, case.add_generation_prompt
        );
        let ids = FAST
            .encode_chat(&case.messages, case.add_generation_prompt)
            .expect("encode_chat");
        let reference = REFERENCE.encode(&case.expected).expect("reference");
        assert_same_ids(&case.name, &case.expected, &ids, &reference);
    }
}

#[test]
fn chat_ids_start_and_end_with_single_special_tokens() {
    let ids = FAST
        .encode_chat(&conversation(), true)
        .expect("encode_chat");
    let im_start = FAST.token_to_id("<|im_start|>").expect("im_start");
    let assistant_nl = FAST.encode("assistant\n");
    assert_eq!(ids[0], im_start);
    assert_eq!(ids.iter().filter(|&&id| id == im_start).count(), 5);
    assert_eq!(
        ids.iter().filter(|&&id| id == FAST.eos_token_id()).count(),
        4
    );
    assert_eq!(ids[ids.len() - 1 - assistant_nl.len()], im_start);
    assert!(ids.ends_with(&assistant_nl));
}

#[test]
fn openai_request_messages_render() {
    let body = r#"{"model": "qwen3", "messages": [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "Part one."},
                                     {"type": "text", "text": "Part two."}]}
    ]}"#;
    #[derive(Deserialize)]
    struct Request {
        messages: Vec<ChatMessage>,
    }
    let req: Request = serde_json::from_str(body).expect("request parses");
    let text = FAST.render_chat(&req.messages, true).expect("render");
    assert_eq!(
        text,
        "<|im_start|>system\nBe terse.<|im_end|>\n\
         <|im_start|>user\nPart one.\nPart two.<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[test]
fn empty_conversation_is_an_error_not_a_panic() {
    let err = FAST
        .render_chat(&[], true)
        .expect_err("Qwen3's template indexes messages[0]");
    assert!(matches!(err, TokenizerError::Template(_)), "{err}");
    assert!(FAST.encode_chat(&[], true).is_err());
}

#[test]
fn unknown_roles_are_left_to_the_template() {
    // Qwen3's template (and so vLLM) silently skips roles it does not know.
    let msgs = [
        ChatMessage::new("user", "a"),
        ChatMessage::new("narrator", "ignored"),
    ];
    assert_eq!(
        FAST.render_chat(&msgs, false).expect("render"),
        "<|im_start|>user\na<|im_end|>\n"
    );
}

#[test]
fn template_raise_exception_becomes_an_error() {
    let dir = tokenizer_dir();
    let tokenizer = std::fs::read_to_string(dir.join("tokenizer.json")).expect("read");
    let config = serde_json::json!({
        "eos_token": "<|im_end|>",
        "chat_template": "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    })
    .to_string();
    let tok = ChatTokenizer::from_json(&tokenizer, &config).expect("load");
    let err = tok
        .render_chat(&[ChatMessage::new("system", "x")], true)
        .expect_err("raise_exception");
    assert!(
        err.to_string()
            .contains("first message must be from the user"),
        "{err}"
    );
    assert_eq!(
        tok.render_chat(&[ChatMessage::new("user", "ok")], true)
            .expect("render"),
        "ok"
    );
}

#[test]
fn shared_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ChatTokenizer>();
    let expected = FAST.encode_chat(&conversation(), true).expect("encode");
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..50 {
                    assert_eq!(
                        FAST.encode_chat(&conversation(), true).expect("encode"),
                        expected
                    );
                }
            });
        }
    });
}
