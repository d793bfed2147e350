//! OpenAI's Responses API: the `POST /v1/responses` body, its chat messages
//! as vLLM 0.34 builds them (`construct_input_messages`), and the paths of
//! the requests on a stored response (`GET /v1/responses/{id}`,
//! `POST /v1/responses/{id}/cancel`).
//!
//! The messages are `instructions` as a system message (when non-empty),
//! then the input: a string is one user message; each item of a list
//! becomes a message or joins the assistant message before it (a function
//! call's tool call, a reasoning item's reasoning, or an assistant message's
//! text when that message has none yet). With `previous_response_id`, vLLM
//! puts the stored conversation before these; the filter cannot see it,
//! and the indexer routes such a request by the response id, not the
//! prompt.

use std::borrow::Cow;

use kvasir_policy::ApiKind;
use serde::Deserialize;

use super::content::{Content, Message};
use super::{
    parse, require_model, BodyError, Count, ListOf, ParsedRequest, RequestPrompt, Str, TextOrList,
};

/// One input item (an object). Which fields count depends on its `type`.
#[derive(Deserialize)]
struct Item<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Str<'a>>,
    #[serde(borrow, default)]
    role: Option<Str<'a>>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    /// A function call output's result.
    #[serde(borrow, default)]
    output: Option<Content<'a>>,
}

/// `input`: a string or a list of items.
type Input<'a> = TextOrList<'a, Item<'a>>;

impl ListOf for Item<'_> {
    const WHAT: &'static str = "input items";
}

#[derive(Deserialize)]
struct ResponsesBody<'a> {
    #[serde(borrow, default)]
    model: Option<Str<'a>>,
    #[serde(borrow, default)]
    input: Option<Input<'a>>,
    #[serde(borrow, default)]
    instructions: Option<Str<'a>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(borrow, default)]
    previous_response_id: Option<Str<'a>>,
    #[serde(default)]
    max_output_tokens: Option<Count>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(borrow, default)]
    cache_salt: Option<Str<'a>>,
}

/// A chat message being built: vLLM merges later items into an assistant
/// message whose content, reasoning or tool calls are still unset.
struct Turn<'a> {
    role: Cow<'a, str>,
    content: Option<Content<'a>>,
    reasoning: bool,
}

impl<'a> Turn<'a> {
    fn new(role: Cow<'a, str>, content: Option<Content<'a>>) -> Turn<'a> {
        Turn {
            role,
            content,
            reasoning: false,
        }
    }

    fn is_assistant(&self) -> bool {
        self.role == "assistant"
    }
}

/// An assistant item's text: vLLM takes the first content part only.
fn first_part(content: Option<Content<'_>>) -> Content<'_> {
    let first = content.and_then(|c| c.parts.into_iter().next());
    Content {
        parts: vec![first.unwrap_or(Cow::Borrowed(""))],
    }
}

/// Adds one input item to `turns` as vLLM's
/// `_construct_message_from_response_item` does. Items vLLM refuses (an
/// unknown type, no role) are left out: the engine answers them with 400.
fn add_item<'a>(item: Item<'a>, turns: &mut Vec<Turn<'a>>) {
    let last_assistant = turns.last_mut().filter(|t| t.is_assistant());
    let kind = item.kind.as_ref().map(|k| k.0.as_ref());
    match kind {
        Some("function_call" | "custom_tool_call") => {
            if last_assistant.is_none() {
                turns.push(Turn::new(Cow::Borrowed("assistant"), None));
            }
        }
        Some("reasoning") => match last_assistant {
            Some(t) if !t.reasoning => t.reasoning = true,
            _ => {
                let mut t = Turn::new(Cow::Borrowed("assistant"), None);
                t.reasoning = true;
                turns.push(t);
            }
        },
        Some("function_call_output" | "custom_tool_call_output") => {
            turns.push(Turn::new(Cow::Borrowed("tool"), item.output));
        }
        None | Some("message") if item.role.as_ref().is_some_and(|r| r.0 == "assistant") => {
            let text = first_part(item.content);
            match last_assistant {
                Some(t) if t.content.is_none() => t.content = Some(text),
                _ => turns.push(Turn::new(Cow::Borrowed("assistant"), Some(text))),
            }
        }
        _ => {
            if let Some(role) = item.role {
                turns.push(Turn::new(role.0, item.content));
            }
        }
    }
}

/// The chat messages vLLM makes of `instructions` and `input`.
fn chat_messages<'a>(instructions: Option<Cow<'a, str>>, input: Input<'a>) -> Vec<Message<'a>> {
    let mut turns = Vec::new();
    if let Some(i) = instructions.filter(|i| !i.is_empty()) {
        turns.push(Turn::new(
            Cow::Borrowed("system"),
            Some(Content { parts: vec![i] }),
        ));
    }
    match input {
        Input::Text(t) => turns.push(Turn::new(
            Cow::Borrowed("user"),
            Some(Content { parts: vec![t] }),
        )),
        Input::List(items) => {
            for item in items {
                add_item(item, &mut turns);
            }
        }
    }
    turns
        .into_iter()
        .map(|t| Message {
            role: t.role,
            content: t.content.unwrap_or_default(),
        })
        .collect()
}

/// Parses a `POST /v1/responses` body. `model` is required although vLLM
/// would use its default model: a request without one must not slip past
/// policies that match on the model.
pub(super) fn responses<'a>(body: &'a [u8], text: &'a str) -> Result<ParsedRequest<'a>, BodyError> {
    let b: ResponsesBody = parse(body)?;
    let model = require_model(b.model)?;
    let Some(input) = b.input else {
        return Err(BodyError::new(
            "missing_input",
            Some("input"),
            "`input` is required",
        ));
    };
    let messages = chat_messages(b.instructions.map(|s| s.0), input);
    Ok(ParsedRequest {
        stream: b.stream.unwrap_or(false),
        max_tokens: b.max_output_tokens.map_or(0, |c| c.0),
        cache_salt: b.cache_salt.map(|s| s.0),
        response_id: b.previous_response_id.map(|s| s.0),
        store: b.store.unwrap_or(true),
        ..ParsedRequest::new(
            ApiKind::Responses,
            model,
            RequestPrompt::Chat(messages),
            text,
        )
    })
}

/// A request on a stored response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredOp {
    /// `GET /v1/responses/{id}`.
    Retrieve,
    /// `POST /v1/responses/{id}/cancel`.
    Cancel,
}

/// `%XX` escapes decoded, as the engine's router decodes a path parameter;
/// the segment as it is when the result is not UTF-8 or an escape is bad.
fn percent_decoded(s: &str) -> Cow<'_, str> {
    if !s.contains('%') {
        return Cow::Borrowed(s);
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |j: usize| {
            b.get(j)
                .and_then(|c| (*c as char).to_digit(16))
                .map(|d| d as u8)
        };
        match (b[i], hex(i + 1), hex(i + 2)) {
            (b'%', Some(h), Some(l)) => {
                out.push(h * 16 + l);
                i += 3;
            }
            (c, ..) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_or(Cow::Borrowed(s), Cow::Owned)
}

/// The stored response a `method` + `path` asks about, or `None` when the
/// request is not one of those (query string ignored). These are the only
/// requests on a stored response vLLM 0.34 serves (its Responses router
/// has no `DELETE /v1/responses/{id}` and no `GET
/// /v1/responses/{id}/input_items`); the path must be exact, a trailing
/// `/` included, as vLLM's router matches it. Anything else under
/// `/v1/responses/` is not the filter's to route, and the gateway's routes
/// answer it 404.
pub fn stored_response_request<'p>(
    method: &str,
    path: &'p str,
) -> Option<(StoredOp, Cow<'p, str>)> {
    let path = path.split(['?', '#']).next().unwrap_or_default();
    let rest = path.strip_prefix("/v1/responses/")?;
    let (op, id) = match (method, rest.strip_suffix("/cancel")) {
        ("POST", Some(id)) => (StoredOp::Cancel, id),
        ("GET", None) => (StoredOp::Retrieve, rest),
        _ => return None,
    };
    (!id.is_empty() && !id.contains('/')).then(|| (op, percent_decoded(id)))
}

#[cfg(test)]
#[path = "responses_tests.rs"]
mod tests;
