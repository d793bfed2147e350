//! How vLLM turns a Responses request into chat messages (its simple,
//! non-harmony path: `construct_input_messages`): the instructions as a
//! system message, then the stored conversation of `previous_response_id`
//! without its system messages, then that response's output as assistant
//! messages, then the new input. A chain of responses therefore renders
//! each turn as the previous turn's prompt plus its answer plus the new
//! input, and the earlier turns stay a cached prefix.

use crate::openai::ApiError;
use kvasir_tokenizer::{ChatMessage, ChatTokenizer};
use serde_json::Value;

/// Content part types vLLM's chat parser reads as text.
const TEXT_PARTS: &[&str] = &["input_text", "text", "output_text"];

/// Item types vLLM renders as tool calls, tool results or reasoning, which
/// the simulator's text-only chat template cannot.
const NOT_RENDERABLE: &[&str] = &[
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
];

fn bad_input(message: String) -> ApiError {
    ApiError::bad_param("input", message)
}

/// The text of a user, system or developer message's content: a string,
/// or its text parts joined with newlines.
fn content_text(i: usize, content: Option<&Value>) -> Result<String, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for p in parts {
                match p["type"].as_str() {
                    Some(t) if TEXT_PARTS.contains(&t) => {
                        texts.push(p["text"].as_str().unwrap_or_default())
                    }
                    Some(t) => {
                        return Err(bad_input(format!(
                            "vllm-sim cannot render input[{i}]'s {t} part: its chat template takes text only (vLLM would render it)"
                        )))
                    }
                    None => return Err(bad_input(format!("input[{i}]: a content part has no type"))),
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(bad_input(format!(
            "input[{i}].content must be a string or a list of content parts"
        ))),
    }
}

/// An assistant message's text: a string, or its first part's text (vLLM
/// reads `content[0].text` of an output message).
fn assistant_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .first()
            .and_then(|p| p["text"].as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

/// One input item as a chat message.
fn item_message(i: usize, item: &Value) -> Result<ChatMessage, ApiError> {
    let Some(obj) = item.as_object() else {
        return Err(bad_input(format!("input[{i}] must be an object")));
    };
    let role = obj.get("role").and_then(Value::as_str);
    let kind = obj
        .get("type")
        .and_then(Value::as_str)
        .or(role.map(|_| "message"))
        .unwrap_or("(none)");
    if NOT_RENDERABLE.contains(&kind) {
        return Err(bad_input(format!(
            "vllm-sim cannot render {kind} items: its chat template takes text messages only (vLLM would render them)"
        )));
    }
    match (kind, role) {
        ("message", Some("assistant")) => Ok(ChatMessage::new(
            "assistant",
            assistant_text(obj.get("content")),
        )),
        ("message", Some(r)) => Ok(ChatMessage::new(r, content_text(i, obj.get("content"))?)),
        _ => Err(bad_input(format!("Unsupported input item type: {kind}"))),
    }
}

/// Whether the last input item is an unfinished assistant message, which
/// vLLM continues instead of starting a new turn.
pub fn continues_final_message(input: &Value) -> bool {
    let Some(last) = input.as_array().and_then(|a| a.last()) else {
        return false;
    };
    last["role"] == "assistant"
        && matches!(last["status"].as_str(), Some("in_progress" | "incomplete"))
}

/// A previous response as the next turn sees it: the messages it was
/// rendered from (when stored) and its output.
pub struct Previous<'a> {
    /// The stored messages, if any.
    pub messages: Option<Vec<ChatMessage>>,
    /// The stored response's `output` items.
    pub output: &'a Value,
}

/// vLLM's `construct_input_messages`; see the module docs.
pub fn chat_messages(
    instructions: Option<&str>,
    input: &Value,
    previous: Option<Previous<'_>>,
) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out = Vec::new();
    if let Some(i) = instructions.filter(|i| !i.is_empty()) {
        out.push(ChatMessage::new("system", i));
    }
    if let Some(p) = previous {
        // Instructions do not carry over across responses.
        out.extend(
            p.messages
                .into_iter()
                .flatten()
                .filter(|m| m.role != "system"),
        );
        for item in p.output.as_array().into_iter().flatten() {
            if item["type"] != "message" {
                continue;
            }
            for part in item["content"].as_array().into_iter().flatten() {
                let text = part["text"].as_str().unwrap_or_default();
                out.push(ChatMessage::new("assistant", text));
            }
        }
    }
    match input {
        Value::String(s) => out.push(ChatMessage::new("user", s.as_str())),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                out.push(item_message(i, item)?);
            }
        }
        _ => {
            return Err(bad_input(
                "input must be a string or a list of items".into(),
            ))
        }
    }
    Ok(out)
}

/// The prompt ids: the chat template with the generation prompt, or, to
/// continue an unfinished final message, without it and cut right after
/// that message's text (as transformers' `continue_final_message` does).
pub fn encode(
    tok: &ChatTokenizer,
    messages: &[ChatMessage],
    continue_final: bool,
) -> Result<Vec<u32>, ApiError> {
    let fail = |e: kvasir_tokenizer::TokenizerError| {
        ApiError::bad_param("input", format!("chat template failed: {e}"))
    };
    if !continue_final {
        return tok.encode_chat(messages, true).map_err(fail);
    }
    let text = tok.render_chat(messages, false).map_err(fail)?;
    let last = messages.last().map_or("", |m| m.content.as_str());
    let cut = text
        .rfind(last)
        .map(|at| at + last.len())
        .or_else(|| text.rfind(last.trim()).map(|at| at + last.trim().len()))
        .ok_or_else(|| {
            ApiError::bad_param(
                "input",
                "the final assistant message is not in the rendered prompt",
            )
        })?;
    Ok(tok.encode(&text[..cut]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn roles(m: &[ChatMessage]) -> Vec<(&str, &str)> {
        m.iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect()
    }

    #[test]
    fn string_input_and_instructions() {
        let m = chat_messages(Some("Be brief."), &json!("Hi"), None).unwrap();
        assert_eq!(roles(&m), [("system", "Be brief."), ("user", "Hi")]);
    }

    #[test]
    fn items_become_messages() {
        let input = json!([
            {"role": "developer", "content": "dev"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x", "annotations": []}, {"type": "output_text", "text": "y"}]},
            {"role": "assistant", "content": "plain"},
        ]);
        let m = chat_messages(None, &input, None).unwrap();
        assert_eq!(
            roles(&m),
            [
                ("developer", "dev"),
                ("user", "a\nb"),
                ("assistant", "x"),
                ("assistant", "plain")
            ]
        );
        let e =
            chat_messages(None, &json!([{"type": "item_reference", "id": "x"}]), None).unwrap_err();
        assert_eq!(e.message, "Unsupported input item type: item_reference");
        assert_eq!(e.param.as_deref(), Some("input"));
        assert!(chat_messages(
            None,
            &json!([{"type": "function_call_output", "call_id": "c", "output": "o"}]),
            None
        )
        .is_err());
        assert!(chat_messages(
            None,
            &json!([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]),
            None
        )
        .is_err());
    }

    #[test]
    fn previous_turns_come_first_without_their_system() {
        let stored = vec![
            ChatMessage::new("system", "old"),
            ChatMessage::new("user", "q1"),
        ];
        let output = json!([{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a1"}]}]);
        let prev = Previous {
            messages: Some(stored),
            output: &output,
        };
        let m = chat_messages(Some("new"), &json!("q2"), Some(prev)).unwrap();
        assert_eq!(
            roles(&m),
            [
                ("system", "new"),
                ("user", "q1"),
                ("assistant", "a1"),
                ("user", "q2")
            ]
        );
    }

    #[test]
    fn unfinished_assistant_message_is_continued() {
        let input = json!([{"role": "user", "content": "q"}, {"type": "message", "role": "assistant", "status": "incomplete", "content": [{"type": "output_text", "text": "Once upon"}]}]);
        assert!(continues_final_message(&input));
        assert!(!continues_final_message(&json!("q")));
        assert!(!continues_final_message(
            &json!([{"role": "assistant", "content": "done"}])
        ));
    }
}
