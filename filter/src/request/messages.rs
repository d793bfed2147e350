//! Anthropic's `/v1/messages` and `/v1/messages/count_tokens` bodies, and
//! their chat messages as vLLM 0.34 builds them
//! (`AnthropicServingMessages.to_chat_completion_request`): the system
//! prompt first, its text blocks joined with nothing between them; a text
//! block is content, a `thinking` block reasoning and a `tool_use` block a
//! tool call (neither is content); a user's `tool_result` becomes a `tool`
//! message placed before that user message (which is dropped when nothing
//! else is left in it).
//!
//! vLLM merges inline `system` messages into the leading one when the
//! model's chat template cannot render them in place. The filter cannot
//! see the template, so it keeps them in place (templates that accept
//! them, such as Qwen3's, render the same prompt either way).

use std::borrow::Cow;

use kvasir_policy::ApiKind;
use serde::Deserialize;

use super::content::{Content, Message, BILLING_HEADER};
use super::{
    parse, require_model, BodyError, Count, ListOf, Obj, ParsedRequest, RequestPrompt, Str,
    TextOrList,
};

/// One content block (an object, as vLLM's `AnthropicContentBlock`).
#[derive(Deserialize)]
struct Block<'a> {
    #[serde(borrow, rename = "type")]
    kind: Str<'a>,
    #[serde(borrow, default)]
    text: Option<Str<'a>>,
    #[serde(borrow, default)]
    content: Option<ToolResult<'a>>,
}

/// An item of a `tool_result` block's list content.
#[derive(Deserialize)]
struct ResultItem<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Str<'a>>,
    #[serde(borrow, default)]
    text: Option<Str<'a>>,
}

/// A `tool_result` block's content: a string or a list of objects.
type ToolResult<'a> = TextOrList<'a, ResultItem<'a>>;

impl ListOf for ResultItem<'_> {
    const WHAT: &'static str = "objects";
}

/// A message's (or `system`'s) content: a string or a list of blocks.
type Blocks<'a> = TextOrList<'a, Block<'a>>;

impl ListOf for Block<'_> {
    const WHAT: &'static str = "content blocks";
}

#[derive(Deserialize)]
struct AnthropicMessage<'a> {
    #[serde(borrow)]
    role: Str<'a>,
    #[serde(borrow)]
    content: Blocks<'a>,
}

#[derive(Deserialize)]
struct MessagesBody<'a> {
    #[serde(borrow, default)]
    model: Option<Str<'a>>,
    #[serde(borrow, default)]
    system: Option<Blocks<'a>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Obj<AnthropicMessage<'a>>>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<Count>,
    #[serde(borrow, default)]
    cache_salt: Option<Str<'a>>,
}

/// `count_tokens` reads no generation fields (vLLM ignores them there).
#[derive(Deserialize)]
struct CountTokensBody<'a> {
    #[serde(borrow, default)]
    model: Option<Str<'a>>,
    #[serde(borrow, default)]
    system: Option<Blocks<'a>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Obj<AnthropicMessage<'a>>>>,
}

fn one<'a>(role: &'a str, text: Cow<'a, str>) -> Message<'a> {
    Message {
        role: Cow::Borrowed(role),
        content: Content { parts: vec![text] },
    }
}

/// Text blocks' text, billing headers left out, joined with nothing
/// between them (vLLM's system text); `None` when nothing is left.
fn system_text<'a>(blocks: Blocks<'a>, top_level: bool) -> Option<Cow<'a, str>> {
    match blocks {
        // The top-level string is kept whole (the chat parser strips the
        // header later); an inline string with the header is dropped.
        Blocks::Text(t) if !top_level && t.starts_with(BILLING_HEADER) => None,
        Blocks::Text(t) => (!t.is_empty()).then_some(t),
        Blocks::List(bs) => {
            let mut parts: Vec<Cow<'a, str>> = bs
                .into_iter()
                .filter(|b| b.kind.0 == "text")
                .filter_map(|b| b.text.map(|t| t.0))
                .filter(|t| !t.is_empty() && !t.starts_with(BILLING_HEADER))
                .collect();
            match parts.len() {
                0 => None,
                1 => parts.pop(),
                _ => Some(Cow::Owned(parts.concat())),
            }
        }
    }
}

/// A user's `tool_result`: its `tool` message (text items joined with
/// "\n"), and a user message for its images, if it has any.
fn push_tool_result<'a>(content: Option<ToolResult<'a>>, out: &mut Vec<Message<'a>>) {
    let (text, images) = match content {
        None => (Cow::Borrowed(""), false),
        Some(ToolResult::Text(t)) => (t, false),
        Some(ToolResult::List(items)) => {
            let kind = |i: &ResultItem<'_>| i.kind.as_ref().map(|k| k.0.to_string());
            let images = items.iter().any(|i| kind(i).as_deref() == Some("image"));
            let texts: Vec<Cow<'a, str>> = items
                .into_iter()
                .filter(|i| i.kind.as_ref().is_some_and(|k| k.0 == "text"))
                .map(|i| i.text.map_or(Cow::Borrowed(""), |t| t.0))
                .collect();
            (Cow::Owned(texts.join("\n")), images)
        }
    };
    out.push(one("tool", text));
    if images {
        out.push(Message {
            role: Cow::Borrowed("user"),
            content: Content::default(),
        });
    }
}

/// An assistant's `tool_result` is text in its own message.
fn assistant_tool_result(content: Option<ToolResult<'_>>) -> String {
    let text = match content {
        None => String::new(),
        Some(ToolResult::Text(t)) => t.into_owned(),
        // vLLM writes Python's repr of the list here; the text items are
        // the closest the filter can render without Python.
        Some(ToolResult::List(items)) => items
            .into_iter()
            .filter_map(|i| i.text.map(|t| t.0.into_owned()))
            .collect::<Vec<_>>()
            .join("\n"),
    };
    format!("Tool result: {text}")
}

/// One non-system message's blocks: its content (if any) after the `tool`
/// messages its tool results make.
fn push_message<'a>(role: Cow<'a, str>, blocks: Vec<Block<'a>>, out: &mut Vec<Message<'a>>) {
    let mut parts: Vec<Cow<'a, str>> = Vec::new();
    let mut has_content = false;
    for b in blocks {
        match b.kind.0.as_ref() {
            "text" => {
                if let Some(t) = b.text.filter(|t| !t.0.is_empty()) {
                    parts.push(t.0);
                    has_content = true;
                }
            }
            "image" => has_content = true,
            "tool_result" if role == "user" => push_tool_result(b.content, out),
            "tool_result" => {
                parts.push(Cow::Owned(assistant_tool_result(b.content)));
                has_content = true;
            }
            // thinking is reasoning and tool_use a tool call: no content.
            _ => {}
        }
    }
    if role == "user" && !has_content {
        return;
    }
    out.push(Message {
        role,
        content: Content { parts },
    });
}

/// The chat messages vLLM makes of `system` and `messages`.
fn chat_messages<'a>(
    system: Option<Blocks<'a>>,
    messages: Vec<AnthropicMessage<'a>>,
) -> Vec<Message<'a>> {
    let mut out = Vec::with_capacity(messages.len() + 1);
    if let Some(s) = system.and_then(|s| system_text(s, true)) {
        out.push(one("system", s));
    }
    for m in messages {
        match (m.role.0.as_ref(), m.content) {
            ("system", c) => {
                if let Some(t) = system_text(c, false) {
                    out.push(one("system", t));
                }
            }
            (_, Blocks::Text(t)) => out.push(Message {
                role: m.role.0,
                content: Content { parts: vec![t] },
            }),
            (_, Blocks::List(bs)) => push_message(m.role.0, bs, &mut out),
        }
    }
    out
}

fn require_messages<T>(m: Option<Vec<Obj<T>>>) -> Result<Vec<T>, BodyError> {
    match m {
        Some(m) if !m.is_empty() => Ok(m.into_iter().map(|Obj(m)| m).collect()),
        _ => Err(BodyError::new(
            "missing_messages",
            Some("messages"),
            "`messages` must be a non-empty list",
        )),
    }
}

/// Parses a `/v1/messages` body.
pub(super) fn messages<'a>(body: &'a [u8], text: &'a str) -> Result<ParsedRequest<'a>, BodyError> {
    let b: MessagesBody = parse(body)?;
    let model = require_model(b.model)?;
    let messages = chat_messages(b.system, require_messages(b.messages)?);
    Ok(ParsedRequest {
        stream: b.stream.unwrap_or(false),
        max_tokens: b.max_tokens.map_or(0, |c| c.0),
        cache_salt: b.cache_salt.map(|s| s.0),
        ..ParsedRequest::new(
            ApiKind::AnthropicMessages,
            model,
            RequestPrompt::Chat(messages),
            text,
        )
    })
}

/// Parses a `/v1/messages/count_tokens` body.
pub(super) fn count_tokens<'a>(
    body: &'a [u8],
    text: &'a str,
) -> Result<ParsedRequest<'a>, BodyError> {
    let b: CountTokensBody = parse(body)?;
    let model = require_model(b.model)?;
    let messages = chat_messages(b.system, require_messages(b.messages)?);
    Ok(ParsedRequest::new(
        ApiKind::AnthropicCountTokens,
        model,
        RequestPrompt::Chat(messages),
        text,
    ))
}

#[cfg(test)]
#[path = "messages_tests.rs"]
mod tests;
