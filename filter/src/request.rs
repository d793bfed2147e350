//! Request bodies: which API a path is, and the few fields of its body the
//! filter needs, parsed with serde into borrowed strings (everything else
//! is skipped without being built).
//!
//! Parsing is strict about the fields it reads (a wrong type is a 400, as
//! vLLM answers) and refuses duplicate keys of those fields, so the filter
//! and the engine can never read two different `model`s from one body.

use std::borrow::Cow;
use std::fmt;
use std::ops::ControlFlow;

use kvasir_policy::{ApiKind, PromptText};
use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;

/// The API of a request path (query string ignored), or `None` for paths
/// the filter passes through untouched (`/v1/models`, `/health`, ...).
pub fn api_for_path(path: &str) -> Option<ApiKind> {
    let path = path.split(['?', '#']).next().unwrap_or_default();
    match path.trim_end_matches('/') {
        "/v1/chat/completions" => Some(ApiKind::Chat),
        "/v1/completions" => Some(ApiKind::Completions),
        "/v1/messages" => Some(ApiKind::AnthropicMessages),
        _ => None,
    }
}

/// A string that borrows from the body when it has no escapes (serde's
/// own `Cow` support does not reach through `Option`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Str<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Str<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V(std::marker::PhantomData))
    }
}

/// Why a body was refused (all are 400s).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyError {
    /// What is wrong, for the error message.
    pub message: String,
    /// The offending top-level field, if one is to blame (OpenAI's `param`).
    pub param: Option<&'static str>,
    /// A short machine-readable code (OpenAI's `code`).
    pub code: &'static str,
}

impl BodyError {
    fn new(
        code: &'static str,
        param: Option<&'static str>,
        message: impl Into<String>,
    ) -> BodyError {
        BodyError {
            message: message.into(),
            param,
            code,
        }
    }
}

/// Text content: a string, or a list of content parts whose `text` parts
/// count (images and other parts are skipped). `null` is no content.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Content<'a> {
    /// The text pieces in order (one for a plain string).
    pub parts: Vec<Cow<'a, str>>,
}

impl Content<'_> {
    /// Total bytes of text.
    pub fn text_len(&self) -> usize {
        self.parts.iter().map(|p| p.len()).sum()
    }

    /// The text as vLLM flattens content parts: text parts joined with "\n".
    pub fn flattened(&self) -> String {
        match self.parts.as_slice() {
            [one] => one.to_string(),
            parts => parts.join("\n"),
        }
    }
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Str<'a>>,
    #[serde(borrow, default)]
    text: Option<Str<'a>>,
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Content<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a list of content parts, or null")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Content {
                    parts: vec![Cow::Borrowed(v)],
                })
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Content {
                    parts: vec![Cow::Owned(v.to_owned())],
                })
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Content {
                    parts: vec![Cow::Owned(v)],
                })
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Content::default())
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Content::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(p) = seq.next_element::<Part<'a>>()? {
                    let is_text = p.kind.as_ref().is_none_or(|k| k.0 == "text");
                    if let (true, Some(t)) = (is_text, p.text) {
                        parts.push(t.0);
                    }
                }
                Ok(Content { parts })
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Message<'a> {
    /// `system`, `user`, `assistant`, `tool`, ...
    #[serde(borrow)]
    pub role: Cow<'a, str>,
    /// Its text.
    #[serde(borrow, default)]
    pub content: Content<'a>,
}

/// `stream_options` (only `include_usage` matters here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub struct StreamOptions {
    /// Whether the final SSE chunk carries `usage`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// A `/v1/completions` prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt<'a> {
    /// One text prompt.
    Text(Cow<'a, str>),
    /// Token ids.
    Ids(Vec<u32>),
    /// A batch (several prompts): parsed for stats, not picked.
    Batch(Vec<Cow<'a, str>>, Vec<Vec<u32>>),
}

enum PromptElem<'a> {
    Id(u32),
    Text(Cow<'a, str>),
    Ids(Vec<u32>),
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptElem<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = PromptElem<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a token id, a string, or a list of token ids")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                u32::try_from(v)
                    .map(PromptElem::Id)
                    .map_err(|_| E::custom("token id out of range"))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                u32::try_from(v)
                    .map(PromptElem::Id)
                    .map_err(|_| E::custom("token id out of range"))
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(PromptElem::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(PromptElem::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut ids = Vec::new();
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(PromptElem::Ids(ids))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Prompt<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Prompt<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a list of strings, a list of token ids, or a list of lists of token ids")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Prompt::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Prompt::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let (mut ids, mut texts, mut lists) = (Vec::new(), Vec::new(), Vec::new());
                while let Some(e) = seq.next_element::<PromptElem<'a>>()? {
                    match e {
                        PromptElem::Id(i) => ids.push(i),
                        PromptElem::Text(t) => texts.push(t),
                        PromptElem::Ids(l) => lists.push(l),
                    }
                }
                let kinds = usize::from(!ids.is_empty())
                    + usize::from(!texts.is_empty())
                    + usize::from(!lists.is_empty());
                if kinds > 1 {
                    return Err(de::Error::custom(
                        "prompt mixes token ids, strings and lists",
                    ));
                }
                Ok(if !ids.is_empty() {
                    Prompt::Ids(ids)
                } else if texts.len() == 1 {
                    Prompt::Text(texts.remove(0))
                } else if lists.len() == 1 {
                    Prompt::Ids(lists.remove(0))
                } else {
                    Prompt::Batch(texts, lists)
                })
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

#[derive(Deserialize)]
struct ChatBody<'a> {
    #[serde(borrow, default)]
    model: Option<Str<'a>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(borrow, default)]
    cache_salt: Option<Str<'a>>,
}

#[derive(Deserialize)]
struct CompletionsBody<'a> {
    #[serde(borrow, default)]
    model: Option<Str<'a>>,
    #[serde(borrow, default)]
    prompt: Option<Prompt<'a>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(borrow, default)]
    cache_salt: Option<Str<'a>>,
}

#[derive(Deserialize)]
struct AnthropicBody<'a> {
    #[serde(borrow, default)]
    model: Option<Str<'a>>,
    #[serde(borrow, default)]
    system: Option<Content<'a>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Message<'a>>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u64>,
}

/// The prompt of a parsed request.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestPrompt<'a> {
    /// Chat messages (Anthropic's `system` first, as a `system` message).
    Chat(Vec<Message<'a>>),
    /// A completions prompt.
    Completion(Prompt<'a>),
}

/// The fields of a request body the filter uses.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedRequest<'a> {
    /// The API.
    pub api: ApiKind,
    /// `model` (required, non-empty).
    pub model: Cow<'a, str>,
    /// The prompt.
    pub prompt: RequestPrompt<'a>,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage` as sent.
    pub include_usage: Option<bool>,
    /// Whether the body has a `stream_options` object.
    pub has_stream_options: bool,
    /// `max_tokens` (or `max_completion_tokens`), 0 when absent.
    pub max_tokens: u64,
    /// vLLM's `cache_salt`.
    pub cache_salt: Option<Cow<'a, str>>,
}

const PARAMS: [&str; 9] = [
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "system",
    "cache_salt",
];

fn serde_error(e: serde_json::Error, path: String) -> BodyError {
    use serde_json::error::Category;
    match e.classify() {
        Category::Syntax | Category::Eof | Category::Io => BodyError::new(
            "invalid_json",
            None,
            format!("request body is not valid JSON: {e}"),
        ),
        Category::Data => {
            let top = path.split(['.', '[']).next().unwrap_or_default();
            let param = PARAMS.into_iter().find(|p| *p == top);
            let at = if path.is_empty() || path == "." {
                String::new()
            } else {
                format!(" at `{path}`")
            };
            BodyError::new(
                "invalid_type",
                param,
                format!("invalid request body{at}: {e}"),
            )
        }
    }
}

/// Parses `body` as `T`; on failure parses again with path tracking so the
/// error names the field (the happy path pays nothing for it).
fn parse<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, BodyError> {
    match serde_json::from_slice(body) {
        Ok(v) => Ok(v),
        Err(first) => {
            let mut d = serde_json::Deserializer::from_slice(body);
            match serde_path_to_error::deserialize::<_, T>(&mut d) {
                // The value parsed, so the first error was after it
                // (trailing characters): report that one.
                Ok(_) => Err(serde_error(first, String::new())),
                Err(e) => {
                    let path = e.path().to_string();
                    Err(serde_error(e.into_inner(), path))
                }
            }
        }
    }
}

fn require_model(model: Option<Str<'_>>) -> Result<Cow<'_, str>, BodyError> {
    match model {
        Some(Str(m)) if !m.trim().is_empty() => Ok(m),
        _ => Err(BodyError::new(
            "missing_model",
            Some("model"),
            "`model` is required",
        )),
    }
}

/// Parses the body of a request to `api`.
pub fn parse_body(api: ApiKind, body: &[u8]) -> Result<ParsedRequest<'_>, BodyError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(BodyError::new(
            "invalid_json",
            None,
            "request body is empty: a JSON object is required",
        ));
    }
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        // Syntax first: garbage gets the syntax error, not "expected a map".
        return match serde_json::from_slice::<IgnoredAny>(body) {
            Err(e) => Err(serde_error(e, String::new())),
            Ok(_) => Err(BodyError::new(
                "invalid_type",
                None,
                "request body must be a JSON object",
            )),
        };
    }
    match api {
        ApiKind::Chat => {
            let b: ChatBody = parse(body)?;
            let model = require_model(b.model)?;
            let messages = match b.messages {
                Some(m) if !m.is_empty() => m,
                _ => {
                    return Err(BodyError::new(
                        "missing_messages",
                        Some("messages"),
                        "`messages` must be a non-empty list",
                    ))
                }
            };
            Ok(ParsedRequest {
                api,
                model,
                prompt: RequestPrompt::Chat(messages),
                stream: b.stream.unwrap_or(false),
                include_usage: b.stream_options.and_then(|o| o.include_usage),
                has_stream_options: b.stream_options.is_some(),
                max_tokens: b.max_completion_tokens.or(b.max_tokens).unwrap_or(0),
                cache_salt: b.cache_salt.map(|s| s.0),
            })
        }
        ApiKind::Completions => {
            let b: CompletionsBody = parse(body)?;
            let model = require_model(b.model)?;
            let prompt = match b.prompt {
                Some(Prompt::Text(t)) => Prompt::Text(t),
                Some(Prompt::Ids(ids)) if !ids.is_empty() => Prompt::Ids(ids),
                Some(Prompt::Batch(t, l)) if !(t.is_empty() && l.is_empty()) => Prompt::Batch(t, l),
                _ => {
                    return Err(BodyError::new(
                        "missing_prompt",
                        Some("prompt"),
                        "`prompt` is required",
                    ))
                }
            };
            Ok(ParsedRequest {
                api,
                model,
                prompt: RequestPrompt::Completion(prompt),
                stream: b.stream.unwrap_or(false),
                include_usage: b.stream_options.and_then(|o| o.include_usage),
                has_stream_options: b.stream_options.is_some(),
                max_tokens: b.max_tokens.unwrap_or(0),
                cache_salt: b.cache_salt.map(|s| s.0),
            })
        }
        ApiKind::AnthropicMessages => {
            let b: AnthropicBody = parse(body)?;
            let model = require_model(b.model)?;
            let mut messages = match b.messages {
                Some(m) if !m.is_empty() => m,
                _ => {
                    return Err(BodyError::new(
                        "missing_messages",
                        Some("messages"),
                        "`messages` must be a non-empty list",
                    ))
                }
            };
            if let Some(system) = b.system.filter(|s| !s.parts.is_empty()) {
                messages.insert(
                    0,
                    Message {
                        role: Cow::Borrowed("system"),
                        content: system,
                    },
                );
            }
            Ok(ParsedRequest {
                api,
                model,
                prompt: RequestPrompt::Chat(messages),
                stream: b.stream.unwrap_or(false),
                include_usage: None,
                has_stream_options: false,
                max_tokens: b.max_tokens.unwrap_or(0),
                cache_salt: None,
            })
        }
    }
}

impl ParsedRequest<'_> {
    /// The prompt-size estimate the policies' token ranges are written
    /// against: about 4 bytes of text per token, token ids counted as they
    /// are.
    pub fn estimated_prompt_tokens(&self) -> u32 {
        match &self.prompt {
            RequestPrompt::Chat(ms) => {
                kvasir_policy::estimate_tokens(ms.iter().map(|m| m.content.text_len()).sum())
            }
            RequestPrompt::Completion(Prompt::Text(t)) => kvasir_policy::estimate_tokens(t.len()),
            RequestPrompt::Completion(Prompt::Ids(ids)) => {
                u32::try_from(ids.len()).unwrap_or(u32::MAX)
            }
            RequestPrompt::Completion(Prompt::Batch(t, l)) => {
                let text = kvasir_policy::estimate_tokens(t.iter().map(|s| s.len()).sum());
                let ids = u32::try_from(l.iter().map(Vec::len).sum::<usize>()).unwrap_or(u32::MAX);
                text.saturating_add(ids)
            }
        }
    }
}

impl PromptText for ParsedRequest<'_> {
    fn visit(&self, f: &mut dyn FnMut(&str) -> ControlFlow<()>) -> ControlFlow<()> {
        match &self.prompt {
            RequestPrompt::Chat(ms) => {
                for m in ms {
                    for p in &m.content.parts {
                        f(p)?;
                    }
                }
                ControlFlow::Continue(())
            }
            RequestPrompt::Completion(Prompt::Text(t)) => f(t),
            RequestPrompt::Completion(Prompt::Batch(t, _)) => {
                for s in t {
                    f(s)?;
                }
                ControlFlow::Continue(())
            }
            RequestPrompt::Completion(Prompt::Ids(_)) => ControlFlow::Continue(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths() {
        assert_eq!(api_for_path("/v1/chat/completions"), Some(ApiKind::Chat));
        assert_eq!(
            api_for_path("/v1/chat/completions?x=1"),
            Some(ApiKind::Chat)
        );
        assert_eq!(api_for_path("/v1/completions/"), Some(ApiKind::Completions));
        assert_eq!(
            api_for_path("/v1/messages"),
            Some(ApiKind::AnthropicMessages)
        );
        assert_eq!(api_for_path("/v1/models"), None);
        assert_eq!(api_for_path("/v1/chat/completions/render"), None);
        assert_eq!(api_for_path(""), None);
    }

    #[test]
    fn chat_fields_borrow_and_skip_the_rest() {
        let body = br#"{"model":"m","messages":[{"role":"system","content":"be terse"},
            {"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"there"}]},
            {"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}],
            "stream":true,"stream_options":{"include_usage":false},"max_tokens":7,"temperature":0.2,
            "tools":[{"deep":[[[[1]]]]}]}"#;
        let r = parse_body(ApiKind::Chat, body).unwrap();
        assert_eq!(r.model, "m");
        assert!(matches!(r.model, Cow::Borrowed(_)));
        assert!(r.stream);
        assert_eq!(r.include_usage, Some(false));
        assert!(r.has_stream_options);
        assert_eq!(r.max_tokens, 7);
        let RequestPrompt::Chat(ms) = &r.prompt else {
            panic!()
        };
        assert_eq!(ms.len(), 3);
        assert_eq!(ms[1].content.flattened(), "hi\nthere");
        assert_eq!(ms[2].content.parts.len(), 0);
        assert_eq!(
            r.estimated_prompt_tokens(),
            kvasir_policy::estimate_tokens(8 + 2 + 5)
        );
        let mut seen = Vec::new();
        let _ = r.visit(&mut |s| {
            seen.push(s.to_string());
            ControlFlow::Continue(())
        });
        assert_eq!(seen, ["be terse", "hi", "there"]);
    }

    #[test]
    fn escaped_strings_are_owned_but_right() {
        let r = parse_body(
            ApiKind::Chat,
            br#"{"model":"a\"b","messages":[{"role":"user","content":"x\ny"}]}"#,
        )
        .unwrap();
        assert_eq!(r.model, "a\"b");
        let RequestPrompt::Chat(ms) = &r.prompt else {
            panic!()
        };
        assert_eq!(ms[0].content.flattened(), "x\ny");
    }

    #[test]
    fn completions_prompt_forms() {
        fn p(s: &'static str) -> Result<Prompt<'static>, &'static str> {
            match parse_body(ApiKind::Completions, s.as_bytes()).map(|r| r.prompt) {
                Ok(RequestPrompt::Completion(p)) => Ok(p),
                Ok(_) => panic!(),
                Err(e) => Err(e.code),
            }
        }
        assert_eq!(
            p(r#"{"model":"m","prompt":"hi"}"#),
            Ok(Prompt::Text("hi".into()))
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":["hi"]}"#),
            Ok(Prompt::Text("hi".into()))
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":[1,2,3]}"#),
            Ok(Prompt::Ids(vec![1, 2, 3]))
        );
        assert_eq!(
            p(r#"{"model":"m","prompt":[[4,5]]}"#),
            Ok(Prompt::Ids(vec![4, 5]))
        );
        assert!(matches!(
            p(r#"{"model":"m","prompt":["a","b"]}"#),
            Ok(Prompt::Batch(..))
        ));
        assert_eq!(p(r#"{"model":"m","prompt":[1,"a"]}"#), Err("invalid_type"));
        assert_eq!(p(r#"{"model":"m","prompt":[-1]}"#), Err("invalid_type"));
        assert_eq!(p(r#"{"model":"m","prompt":[]}"#), Err("missing_prompt"));
        assert_eq!(p(r#"{"model":"m"}"#), Err("missing_prompt"));
        assert_eq!(p(r#"{"model":"m","prompt":7}"#), Err("invalid_type"));
    }

    #[test]
    fn anthropic_system_goes_first() {
        let r = parse_body(
            ApiKind::AnthropicMessages,
            br#"{"model":"claude","max_tokens":5,"system":[{"type":"text","text":"sys"}],
                 "messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
        )
        .unwrap();
        let RequestPrompt::Chat(ms) = &r.prompt else {
            panic!()
        };
        assert_eq!(ms[0].role, "system");
        assert_eq!(ms[0].content.flattened(), "sys");
        assert_eq!(r.max_tokens, 5);
    }

    #[test]
    fn bad_bodies() {
        let code = |api, s: &[u8]| parse_body(api, s).unwrap_err();
        assert_eq!(code(ApiKind::Chat, b"").code, "invalid_json");
        assert_eq!(code(ApiKind::Chat, b"  \n").code, "invalid_json");
        assert_eq!(code(ApiKind::Chat, b"{").code, "invalid_json");
        assert_eq!(
            code(ApiKind::Chat, b"\xff\xfe\x00garbage").code,
            "invalid_json"
        );
        assert_eq!(code(ApiKind::Chat, b"[1,2]").code, "invalid_type");
        let trailing = br#"{"model":"m","messages":[{"role":"user","content":"x"}]}}"#;
        assert_eq!(code(ApiKind::Chat, trailing).code, "invalid_json");
        assert_eq!(code(ApiKind::Chat, b"\"str\"").code, "invalid_type");
        assert_eq!(
            code(
                ApiKind::Chat,
                br#"{"messages":[{"role":"user","content":"x"}]}"#
            )
            .code,
            "missing_model"
        );
        assert_eq!(
            code(
                ApiKind::Chat,
                br#"{"model":"","messages":[{"role":"user","content":"x"}]}"#
            )
            .code,
            "missing_model"
        );
        assert_eq!(
            code(ApiKind::Chat, br#"{"model":"m"}"#).code,
            "missing_messages"
        );
        assert_eq!(
            code(ApiKind::Chat, br#"{"model":"m","messages":[]}"#).code,
            "missing_messages"
        );
        let e = code(
            ApiKind::Chat,
            br#"{"model":5,"messages":[{"role":"user","content":"x"}]}"#,
        );
        assert_eq!((e.code, e.param), ("invalid_type", Some("model")));
        let e = code(
            ApiKind::Chat,
            br#"{"model":"m","stream":"yes","messages":[{"role":"user","content":"x"}]}"#,
        );
        assert_eq!((e.code, e.param), ("invalid_type", Some("stream")));
        assert_eq!(
            code(
                ApiKind::Chat,
                br#"{"model":"m","messages":[{"content":"x"}]}"#
            )
            .code,
            "invalid_type"
        );
        assert_eq!(
            code(
                ApiKind::Chat,
                br#"{"model":"m","messages":[{"role":"user","content":5}]}"#
            )
            .code,
            "invalid_type"
        );
        // Duplicate keys: the filter and the engine must never disagree on the model.
        let e = code(
            ApiKind::Chat,
            br#"{"model":"a","model":"b","messages":[{"role":"user","content":"x"}]}"#,
        );
        assert!(e.message.contains("duplicate"), "{}", e.message);
    }

    #[test]
    fn deep_nesting_never_crashes() {
        // Skipped fields are skipped without recursion: valid, accepted.
        let mut s =
            String::from(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"extra":"#);
        s.push_str(&"[".repeat(100_000));
        s.push_str(&"]".repeat(100_000));
        s.push('}');
        assert!(parse_body(ApiKind::Chat, s.as_bytes()).is_ok());
        // Unbalanced: a syntax error.
        let e = parse_body(ApiKind::Chat, &s.as_bytes()[..s.len() - 50]).unwrap_err();
        assert_eq!(e.code, "invalid_json");
        // Nesting where a field is read: a type error, from the first level.
        let mut s = String::from(r#"{"model":"m","messages":"#);
        s.push_str(&"[".repeat(100_000));
        s.push_str(&"]".repeat(100_000));
        s.push('}');
        let e = parse_body(ApiKind::Chat, s.as_bytes()).unwrap_err();
        assert_eq!((e.code, e.param), ("invalid_type", Some("messages")));
    }
}
