//! Request bodies: which API a path is, and the few fields of its body the
//! filter needs, parsed with serde into borrowed strings (everything else
//! is skipped without being built).
//!
//! Parsing is strict about the fields it reads (a wrong type is a 400, as
//! vLLM answers) and refuses duplicate keys of those fields, so the filter
//! and the engine can never read two different `model`s from one body.
//! Where vLLM requires an object (a message, a content part, a
//! `stream_options`) only an object is accepted: serde's derive would also
//! take a list (`["user","hi"]`, `[false]`) and read it positionally. The
//! whole body must be UTF-8, not just the strings read. Integers are read
//! as vLLM's pydantic models read them: `1e2` and `100.0` are 100, `1.5` is
//! a 400. The filter never decompresses: a `Content-Encoding` other than
//! `identity` is refused ([`content_encoding_error`]).

use std::borrow::Cow;
use std::fmt;
use std::ops::ControlFlow;

use kvasir_policy::{ApiKind, PromptText, Unscannable};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
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

/// A value vLLM requires to be a JSON object: serde's derived structs also
/// accept a list, read positionally, which vLLM refuses.
struct Obj<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for V<T> {
            type Value = T;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(V(std::marker::PhantomData)).map(Obj)
    }
}

/// An integral number as pydantic's lax mode reads an `int`: an integer,
/// or a float with no fractional part (`1e2`, `100.0`).
fn integral<E: de::Error>(v: f64) -> Result<u64, E> {
    // 2^64 as f64 is exact; every f64 below it converts without loss.
    if v.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&v) {
        Ok(v as u64)
    } else {
        Err(E::custom(format!(
            "expected a non-negative integer, got {v}"
        )))
    }
}

/// A non-negative integer (`max_tokens`), `1e2` included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Count(u64);

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Count;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a non-negative integer")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Count, E> {
                Ok(Count(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Count, E> {
                u64::try_from(v)
                    .map(Count)
                    .map_err(|_| E::custom(format!("expected a non-negative integer, got {v}")))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Count, E> {
                integral(v).map(Count)
            }
        }
        d.deserialize_any(V)
    }
}

/// A token id (`1e2` included, as vLLM reads it).
struct TokenId(u32);

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let Count(n) = Count::deserialize(d)?;
        u32::try_from(n)
            .map(TokenId)
            .map_err(|_| de::Error::custom("token id out of range"))
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

/// Text content: a string, or a list of content parts whose text parts
/// count (images and other parts are skipped). `null` is no content. Text
/// parts are vLLM's: bare strings, `text`, `input_text` and `output_text`
/// (their `text`), `refusal` and `thinking` (the field of that name).
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
struct PartFields<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Str<'a>>,
    #[serde(borrow, default)]
    text: Option<Str<'a>>,
    #[serde(borrow, default)]
    refusal: Option<Str<'a>>,
    #[serde(borrow, default)]
    thinking: Option<Str<'a>>,
}

/// One content part: its text, if it is a text part.
struct Part<'a>(Option<Cow<'a, str>>);

impl<'de: 'a, 'a> Deserialize<'de> for Part<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Part<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a content part (an object or a string)")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Part(Some(Cow::Borrowed(v))))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Part(Some(Cow::Owned(v.to_owned()))))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let p = PartFields::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let text = match p.kind.as_ref().map_or("text", |k| &k.0) {
                    "text" | "input_text" | "output_text" => p.text,
                    "refusal" => p.refusal,
                    "thinking" => p.thinking,
                    _ => None,
                };
                Ok(Part(text.map(|t| t.0)))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
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
                while let Some(Part(p)) = seq.next_element::<Part<'a>>()? {
                    parts.extend(p);
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

/// `stream_options` (only `include_usage` matters here; an object, as
/// vLLM requires).
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
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                u32::try_from(integral::<E>(v)?)
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
                while let Some(TokenId(id)) = seq.next_element()? {
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
    messages: Option<Vec<Obj<Message<'a>>>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<Obj<StreamOptions>>,
    #[serde(default)]
    max_tokens: Option<Count>,
    #[serde(default)]
    max_completion_tokens: Option<Count>,
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
    stream_options: Option<Obj<StreamOptions>>,
    #[serde(default)]
    max_tokens: Option<Count>,
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
    messages: Option<Vec<Obj<Message<'a>>>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<Count>,
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
    /// The whole body (valid UTF-8), for the PII scan of every string.
    pub body: &'a str,
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

/// Why a body sent with `Content-Encoding: <value>` is refused (a 415), or
/// `None` when it is plain. vLLM does not decompress either, and a filter
/// that cannot read the body can neither route nor scan it.
pub fn content_encoding_error(value: Option<&str>) -> Option<BodyError> {
    let v = value?.trim();
    let plain = v.is_empty()
        || v.split(',')
            .all(|c| c.trim().eq_ignore_ascii_case("identity"));
    (!plain).then(|| {
        BodyError::new(
            "unsupported_content_encoding",
            None,
            format!("Content-Encoding `{v}` is not supported: send the request body uncompressed"),
        )
    })
}

/// Parses the body of a request to `api`.
pub fn parse_body(api: ApiKind, body: &[u8]) -> Result<ParsedRequest<'_>, BodyError> {
    // The whole body, not just what serde reads: skipped strings are not
    // checked, and the PII scan walks the text.
    let text = std::str::from_utf8(body).map_err(|e| {
        BodyError::new(
            "invalid_json",
            None,
            format!(
                "request body is not valid JSON: invalid UTF-8 at byte {}",
                e.valid_up_to()
            ),
        )
    })?;
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
                Some(m) if !m.is_empty() => m.into_iter().map(|Obj(m)| m).collect(),
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
                include_usage: b.stream_options.as_ref().and_then(|o| o.0.include_usage),
                has_stream_options: b.stream_options.is_some(),
                max_tokens: b.max_completion_tokens.or(b.max_tokens).map_or(0, |c| c.0),
                cache_salt: b.cache_salt.map(|s| s.0),
                body: text,
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
                include_usage: b.stream_options.as_ref().and_then(|o| o.0.include_usage),
                has_stream_options: b.stream_options.is_some(),
                max_tokens: b.max_tokens.map_or(0, |c| c.0),
                cache_salt: b.cache_salt.map(|s| s.0),
                body: text,
            })
        }
        ApiKind::AnthropicMessages => {
            let b: AnthropicBody = parse(body)?;
            let model = require_model(b.model)?;
            let mut messages: Vec<_> = match b.messages {
                Some(m) if !m.is_empty() => m.into_iter().map(|Obj(m)| m).collect(),
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
                max_tokens: b.max_tokens.map_or(0, |c| c.0),
                cache_salt: None,
                body: text,
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

    /// Every string value and key of the whole body (see [`crate::scan`]).
    /// Token ids cannot be read as text: such a prompt is [`Unscannable`].
    fn visit_strings(
        &self,
        f: &mut dyn FnMut(&str) -> ControlFlow<()>,
    ) -> Result<ControlFlow<()>, Unscannable> {
        match &self.prompt {
            RequestPrompt::Completion(Prompt::Ids(_)) => Err(Unscannable),
            RequestPrompt::Completion(Prompt::Batch(_, lists)) if !lists.is_empty() => {
                Err(Unscannable)
            }
            _ => crate::scan::visit_json_strings(self.body, f),
        }
    }
}

#[cfg(test)]
#[path = "request_tests.rs"]
mod tests;
