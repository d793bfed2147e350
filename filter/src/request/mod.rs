//! Request bodies: which API a path is, and the few fields of its body the
//! filter needs, parsed with serde into borrowed strings (everything else
//! is skipped without being built). One module per API family: [`openai`]
//! (chat and completions), [`messages`] (Anthropic), [`responses`]
//! (OpenAI's Responses API); [`content`] is chat content as vLLM reads it.
//!
//! Parsing is strict about the fields it reads (a wrong type is a 400, as
//! vLLM answers) and refuses duplicate keys of those fields, so the filter
//! and the engine can never read two different `model`s from one body.
//! Where vLLM requires an object (a message, a content part, a
//! `stream_options`) only an object is accepted: serde's derive would also
//! take a list (`["user","hi"]`, `[false]`) and read it positionally. The
//! whole body must be UTF-8, not just the strings read. Integers are read
//! as vLLM's pydantic models read them ([`int`]): `1e2`, `100.0` and
//! `"100"` are 100, `true` is 1, `1.5` and `"1e2"` are a 400. The filter
//! never decompresses: a `Content-Encoding` other than `identity` is
//! refused ([`content_encoding_error`]).

use std::borrow::Cow;
use std::fmt;
use std::ops::ControlFlow;

use kvasir_policy::{ApiKind, PromptText, Unscannable};
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use int::{LaxInt, NotInt};

pub mod content;
mod int;
pub mod messages;
pub mod openai;
pub mod responses;

pub use content::{Content, Message, StreamOptions};
pub use openai::Prompt;
pub use responses::{stored_response_request, StoredOp};

/// The API of a `POST` to `path` (query string ignored) that carries a
/// body, or `None` for paths the filter does not parse (`/v1/models`,
/// `/health`, ...; the requests on a stored response are
/// [`stored_response_request`]'s). The path must be the API's exactly, as
/// vLLM's router matches it: `/v1/chat/completions/` is no API (vLLM
/// answers it with a redirect, not a completion), so the filter passes it
/// by and the gateway's routes answer it 404.
pub fn api_for_path(path: &str) -> Option<ApiKind> {
    let path = path.split(['?', '#']).next().unwrap_or_default();
    match path {
        "/v1/chat/completions" => Some(ApiKind::Chat),
        "/v1/completions" => Some(ApiKind::Completions),
        "/v1/messages" => Some(ApiKind::AnthropicMessages),
        "/v1/messages/count_tokens" => Some(ApiKind::AnthropicCountTokens),
        "/v1/responses" => Some(ApiKind::Responses),
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

/// What a list element is called in [`TextOrList`]'s error message.
trait ListOf {
    /// E.g. "content blocks": "expected a string or a list of content blocks".
    const WHAT: &'static str;
}

/// A string, or a list whose every element must be an object (Anthropic's
/// content and tool results, the Responses API's `input`). A hand-written
/// visitor rather than an untagged enum: that would buffer the value and
/// lose the element's own error (and borrowed strings).
enum TextOrList<'a, T> {
    Text(Cow<'a, str>),
    List(Vec<T>),
}

impl<'de: 'a, 'a, T: Deserialize<'de> + ListOf> Deserialize<'de> for TextOrList<'a, T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a, T>(std::marker::PhantomData<(&'a (), T)>);
        impl<'de: 'a, 'a, T: Deserialize<'de> + ListOf> Visitor<'de> for V<'a, T> {
            type Value = TextOrList<'a, T>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "a string or a list of {}", T::WHAT)
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(TextOrList::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(TextOrList::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::new();
                while let Some(Obj(i)) = seq.next_element::<Obj<T>>()? {
                    items.push(i);
                }
                Ok(TextOrList::List(items))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// The error for a value that is no lax integer, or one the filter cannot
/// use (see [`int`]).
fn int_error<E: de::Error>(what: impl fmt::Display, why: Result<LaxInt, NotInt>) -> E {
    E::custom(match why {
        Ok(LaxInt::Negative) => format!("expected a non-negative integer, got {what}"),
        Ok(LaxInt::TooLarge) | Err(NotInt::FloatTooLarge) => {
            format!("integer out of range: {what}")
        }
        Err(NotInt::Fraction) => {
            format!("expected an integer, got {what} (a number with a fractional part)")
        }
        Err(NotInt::BadString) | Ok(LaxInt::Value(_)) => {
            format!("expected an integer, got {what}")
        }
    })
}

/// `v` as a non-negative integer, or the error for it.
fn count_of<E: de::Error>(what: impl fmt::Display, v: Result<LaxInt, NotInt>) -> Result<u64, E> {
    match v {
        Ok(LaxInt::Value(n)) => Ok(n),
        other => Err(int_error(what, other)),
    }
}

/// A non-negative integer (`max_tokens`, a token id) as vLLM's lax `int`
/// reads it: `1e2`, `100.0`, `true` and `" 100 "` included (see [`int`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Count(u64);

/// [`Count`]'s visitor, also used where a value may be a count or
/// something else ([`openai::Prompt`]'s elements).
struct CountVisitor;

impl Visitor<'_> for CountVisitor {
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
            .map_err(|_| int_error(v, Ok(LaxInt::Negative)))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Count, E> {
        count_of(v, int::int_f64(v)).map(Count)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Count, E> {
        Ok(Count(u64::from(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Count, E> {
        count_of(format_args!("the string {v:?}"), int::int_str(v)).map(Count)
    }
}

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(CountVisitor)
    }
}

/// A token id (`1e2` and `"100"` included, as vLLM reads it).
struct TokenId(u32);

impl TokenId {
    fn of<E: de::Error>(Count(n): Count) -> Result<TokenId, E> {
        u32::try_from(n)
            .map(TokenId)
            .map_err(|_| E::custom(format!("token id out of range: {n}")))
    }
}

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        TokenId::of(Count::deserialize(d)?)
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

/// The prompt of a parsed request.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestPrompt<'a> {
    /// Chat messages, as vLLM makes them of the body (Anthropic's `system`
    /// first, the Responses API's `instructions` and input items).
    Chat(Vec<Message<'a>>),
    /// A completions prompt.
    Completion(Prompt<'a>),
    /// None: a request on a stored response (`GET`, `cancel`).
    None,
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
    /// The stored response the request is bound to: the Responses API's
    /// `previous_response_id`, or the id in a `GET` or `cancel` path.
    pub response_id: Option<Cow<'a, str>>,
    /// Whether the engine may store the response (`store`, default true;
    /// only the Responses API has it).
    pub store: bool,
    /// The whole body (valid UTF-8), for the PII scan of every string.
    pub body: &'a str,
}

impl<'a> ParsedRequest<'a> {
    /// A request with only its API, model, prompt and body; the other
    /// fields at their defaults.
    fn new(
        api: ApiKind,
        model: Cow<'a, str>,
        prompt: RequestPrompt<'a>,
        body: &'a str,
    ) -> ParsedRequest<'a> {
        ParsedRequest {
            api,
            model,
            prompt,
            stream: false,
            include_usage: None,
            has_stream_options: false,
            max_tokens: 0,
            cache_salt: None,
            response_id: None,
            store: true,
            body,
        }
    }

    /// A request on the stored response `id` (no body, no model).
    pub fn stored_response(id: Cow<'a, str>) -> ParsedRequest<'a> {
        ParsedRequest {
            response_id: Some(id),
            ..ParsedRequest::new(
                ApiKind::Responses,
                Cow::Borrowed(""),
                RequestPrompt::None,
                "",
            )
        }
    }
}

const PARAMS: [&str; 14] = [
    "model",
    "messages",
    "prompt",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "system",
    "cache_salt",
    "input",
    "instructions",
    "previous_response_id",
    "max_output_tokens",
    "store",
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
        ApiKind::Chat => openai::chat(body, text),
        ApiKind::Completions => openai::completions(body, text),
        ApiKind::AnthropicMessages => messages::messages(body, text),
        ApiKind::AnthropicCountTokens => messages::count_tokens(body, text),
        ApiKind::Responses => responses::responses(body, text),
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
            RequestPrompt::None => 0,
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
            RequestPrompt::Completion(Prompt::Ids(_)) | RequestPrompt::None => {
                ControlFlow::Continue(())
            }
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
mod tests;
