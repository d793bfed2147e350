//! The OpenAI-compatible request and error shapes vLLM serves.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::validation::{lax_int, Int, Validator};

/// An API error, rendered in vLLM's shape:
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// vLLM's error type name, e.g. `BadRequestError`.
    pub kind: &'static str,
    /// Human-readable reason.
    pub message: String,
    /// The offending parameter, when known.
    pub param: Option<String>,
}

impl ApiError {
    /// 400 BadRequestError.
    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "BadRequestError",
            message: message.into(),
            param: None,
        }
    }

    /// 400 naming the parameter.
    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.into()),
            ..Self::bad_request(message)
        }
    }

    /// 404 NotFoundError (vLLM's answer to an unknown model).
    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError",
            message: message.into(),
            param: None,
        }
    }

    /// 500 InternalServerError.
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "InternalServerError",
            message: message.into(),
            param: None,
        }
    }

    /// 503 ServiceUnavailableError.
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "ServiceUnavailableError",
            message: message.into(),
            param: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with usage.
    #[serde(default)]
    pub include_usage: bool,
    /// Send usage on every chunk (vLLM extension).
    #[serde(default)]
    pub continuous_usage_stats: bool,
}

/// The fields of a chat request the simulator uses; others are accepted
/// and ignored, as vLLM ignores unknown fields.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    /// Model name; vLLM serves its default model when it is left out.
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<ChatMessageIn>,
    /// Completion length limit, as sent (read by [`ChatRequest::ints`]).
    #[serde(default, deserialize_with = "crate::priority::present")]
    pub max_tokens: Option<Value>,
    /// Newer name of `max_tokens`, as sent.
    #[serde(default, deserialize_with = "crate::priority::present")]
    pub max_completion_tokens: Option<Value>,
    /// Number of choices (only 1 is simulated), as sent.
    #[serde(default, deserialize_with = "crate::priority::present")]
    pub n: Option<Value>,
    /// SSE streaming.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// vLLM's prefix-cache salt.
    pub cache_salt: Option<String>,
    /// vLLM extension: append the assistant header (default true).
    pub add_generation_prompt: Option<bool>,
    /// vLLM's scheduling priority, as sent (checked by `priority::check`).
    #[serde(default, deserialize_with = "crate::priority::present")]
    pub priority: Option<Value>,
    /// Top-k sampling, as sent (only checked: `int | None`).
    #[serde(default, deserialize_with = "crate::priority::present")]
    pub top_k: Option<Value>,
    /// The sampling seed, as sent (only checked: `int | None` in i64).
    #[serde(default, deserialize_with = "crate::priority::present")]
    pub seed: Option<Value>,
    /// The least output tokens, as sent (only checked: `int`, default 0).
    #[serde(default, deserialize_with = "crate::priority::present")]
    pub min_tokens: Option<Value>,
}

/// One chat message as sent.
#[derive(Debug, Deserialize)]
pub struct ChatMessageIn {
    /// `system`, `user`, `assistant`, `tool`, `developer`.
    pub role: String,
    /// A string, an array of content parts, or null.
    #[serde(default)]
    pub content: Value,
}

/// The fields of a completions request the simulator uses.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    /// Model name.
    pub model: Option<String>,
    /// A string, a list of token ids, or a one-element list of either.
    pub prompt: Value,
    /// Completion length limit (OpenAI's default for completions is 16),
    /// as sent (read by [`CompletionRequest::ints`]).
    #[serde(default, deserialize_with = "crate::priority::present")]
    pub max_tokens: Option<Value>,
    /// Number of choices (only 1 is simulated), as sent.
    #[serde(default, deserialize_with = "crate::priority::present")]
    pub n: Option<Value>,
    /// SSE streaming.
    #[serde(default)]
    pub stream: bool,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// vLLM's prefix-cache salt.
    pub cache_salt: Option<String>,
    /// vLLM's scheduling priority, as sent (checked by `priority::check`).
    #[serde(default, deserialize_with = "crate::priority::present")]
    pub priority: Option<Value>,
    /// Top-k sampling, as sent (only checked: `int | None`).
    #[serde(default, deserialize_with = "crate::priority::present")]
    pub top_k: Option<Value>,
    /// The sampling seed, as sent (only checked: `int | None` in i64).
    #[serde(default, deserialize_with = "crate::priority::present")]
    pub seed: Option<Value>,
    /// The least output tokens, as sent (only checked: `int`, default 0).
    #[serde(default, deserialize_with = "crate::priority::present")]
    pub min_tokens: Option<Value>,
}

/// The integer fields of a chat or completions request as vLLM reads them.
#[derive(Debug, Clone, PartialEq)]
pub struct Ints {
    /// The output limit the engine applies: chat's `max_completion_tokens`
    /// when set, else `max_tokens` (completions: `max_tokens`, 16 when
    /// absent); `None` for no limit.
    pub max_tokens: Option<Int>,
    /// `n` (`None`: 1).
    pub n: Option<Int>,
    /// The body's `priority` (0 when absent).
    pub priority: i64,
}

/// `n`, `seed`, `top_k`, `min_tokens` and `priority`, in the order of
/// vLLM's request models (pydantic lists errors in field order);
/// `n_nullable`: chat's `int | None` against completions' `int`.
fn sampling_ints(
    v: &mut Validator,
    n: Option<&Value>,
    n_nullable: bool,
    seed: Option<&Value>,
    top_k: Option<&Value>,
    min_tokens: Option<&Value>,
    priority: Option<&Value>,
) -> (Option<Int>, i64) {
    let n = n.and_then(|x| v.int_value(&["n"], x, n_nullable));
    if let Some(s) = seed.filter(|s| !s.is_null()) {
        crate::priority::bounded_i64(v, "seed", s);
    }
    if let Some(k) = top_k {
        v.int_value(&["top_k"], k, true);
    }
    if let Some(m) = min_tokens {
        v.int_value(&["min_tokens"], m, false);
    }
    let priority = crate::priority::check(v, priority);
    (n, priority)
}

impl ChatRequest {
    /// Its integer fields, or vLLM's 400 for those pydantic's lax `int`
    /// refuses (all of them in one answer, as pydantic reports them).
    pub fn ints(&self) -> Result<Ints, ApiError> {
        let mut v = Validator::default();
        let mt = self
            .max_tokens
            .as_ref()
            .and_then(|x| v.int_value(&["max_tokens"], x, true));
        let mct = self
            .max_completion_tokens
            .as_ref()
            .and_then(|x| v.int_value(&["max_completion_tokens"], x, true));
        let (n, priority) = sampling_ints(
            &mut v,
            self.n.as_ref(),
            true,
            self.seed.as_ref(),
            self.top_k.as_ref(),
            self.min_tokens.as_ref(),
            self.priority.as_ref(),
        );
        v.finish().map(|()| Ints {
            max_tokens: mct.or(mt),
            n,
            priority,
        })
    }
}

impl CompletionRequest {
    /// Its prompt (see [`prompt_union`]) and integer fields, or vLLM's 400
    /// (see [`ChatRequest::ints`]).
    pub fn check(&self) -> Result<(PromptValue, Ints), ApiError> {
        let mut v = Validator::default();
        let prompt = prompt_union(&mut v, &self.prompt);
        let max_tokens = match &self.max_tokens {
            None => Some(Int::I64(16)),
            Some(x) => v.int_value(&["max_tokens"], x, true),
        };
        let (n, priority) = sampling_ints(
            &mut v,
            self.n.as_ref(),
            false,
            self.seed.as_ref(),
            self.top_k.as_ref(),
            self.min_tokens.as_ref(),
            self.priority.as_ref(),
        );
        v.finish().map(|()| {
            let ints = Ints {
                max_tokens,
                n,
                priority,
            };
            (prompt.unwrap_or(PromptValue::None), ints)
        })
    }
}

/// The prompt of a completions request.
#[derive(Debug, PartialEq)]
pub enum Prompt {
    /// Text, tokenized by the server.
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// What vLLM's `prompt` union (`list[int >= 0] | list[list[int >= 0]] |
/// str | list[str] | None`) makes of a value.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptValue {
    /// `null`.
    None,
    /// A string.
    Text(String),
    /// A list of strings.
    Texts(Vec<String>),
    /// A list of token ids.
    Ids(Vec<Int>),
    /// A list of lists of token ids.
    Lists(Vec<Vec<Int>>),
}

/// One error of a union member, replayed into the validator when every
/// member failed.
type MemberError<'v> = (
    Vec<String>,
    &'static str,
    &'static str,
    &'v Value,
    Option<&'static str>,
);

/// A token id of `list[Annotated[int, Field(ge=0)]]`, or its error.
fn token_id<'v>(loc: Vec<String>, x: &'v Value, errors: &mut Vec<MemberError<'v>>) -> Option<Int> {
    match lax_int(x) {
        Ok(i) if i.below(0) => {
            errors.push((
                loc,
                "greater_than_equal",
                "Input should be greater than or equal to 0",
                x,
                Some("{'ge': 0}"),
            ));
            None
        }
        Ok(i) => Some(i),
        Err((kind, msg)) => {
            errors.push((loc, kind, msg, x, None));
            None
        }
    }
}

/// Reads `prompt` as pydantic's smart-mode union does: a string, a list of
/// strings only (the exact match wins, so `["1"]` is text), else a list
/// whose every element is a lax token id (`[1, "2", true]` is `[1, 2, 1]`)
/// or whose every element is a list of them. When no member fits, every
/// member's errors are recorded in member order, at `body.prompt...` (vLLM
/// drops pydantic's member names from the location).
pub fn prompt_union(v: &mut Validator, p: &Value) -> Option<PromptValue> {
    let at = |rest: &[String]| -> Vec<String> {
        std::iter::once("prompt".to_string())
            .chain(rest.iter().cloned())
            .collect()
    };
    let items = match p {
        Value::Null => return Some(PromptValue::None),
        Value::String(s) => return Some(PromptValue::Text(s.clone())),
        Value::Array(items) => items,
        other => {
            let list = ("list_type", "Input should be a valid list");
            let string = ("string_type", "Input should be a valid string");
            for (kind, msg) in [list, list, string, list] {
                v.error(&["prompt"], kind, msg, other);
            }
            return None;
        }
    };
    if items.iter().all(Value::is_string) {
        let texts = items
            .iter()
            .filter_map(|x| x.as_str().map(str::to_string))
            .collect();
        return Some(PromptValue::Texts(texts));
    }
    let mut errors: Vec<MemberError<'_>> = Vec::new();
    // list[int]
    let mark = errors.len();
    let ids: Vec<Option<Int>> = items
        .iter()
        .enumerate()
        .map(|(i, x)| token_id(at(&[i.to_string()]), x, &mut errors))
        .collect();
    if errors.len() == mark {
        return Some(PromptValue::Ids(ids.into_iter().flatten().collect()));
    }
    // list[list[int]]
    let mark = errors.len();
    let mut lists = Vec::with_capacity(items.len());
    for (i, x) in items.iter().enumerate() {
        match x {
            Value::Array(inner) => lists.push(
                inner
                    .iter()
                    .enumerate()
                    .filter_map(|(j, y)| {
                        token_id(at(&[i.to_string(), j.to_string()]), y, &mut errors)
                    })
                    .collect::<Vec<_>>(),
            ),
            other => errors.push((
                at(&[i.to_string()]),
                "list_type",
                "Input should be a valid list",
                other,
                None,
            )),
        }
    }
    if errors.len() == mark {
        return Some(PromptValue::Lists(lists));
    }
    // str, then list[str]
    errors.push((
        at(&[]),
        "string_type",
        "Input should be a valid string",
        p,
        None,
    ));
    for (i, x) in items.iter().enumerate().filter(|(_, x)| !x.is_string()) {
        errors.push((
            at(&[i.to_string()]),
            "string_type",
            "Input should be a valid string",
            x,
            None,
        ));
    }
    for (loc, kind, msg, input, ctx) in errors {
        let loc: Vec<&str> = loc.iter().map(String::as_str).collect();
        match ctx {
            Some(c) => v.error_ctx(&loc, kind, msg, input, c),
            None => v.error(&loc, kind, msg, input),
        }
    }
    None
}

/// The one prompt the simulator serves from what the union read: text,
/// or token ids (a one-element list of either); batches of several
/// prompts are not simulated.
pub fn prompt_of(p: PromptValue) -> Result<Prompt, ApiError> {
    let ids = |ids: Vec<Int>| -> Result<Prompt, ApiError> {
        ids.iter()
            .enumerate()
            .map(|(i, t)| {
                t.as_i64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| {
                        ApiError::bad_param(
                            "prompt",
                            format!("Token id {t} at prompt[{i}] is out of vocabulary"),
                        )
                    })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Prompt::Tokens)
    };
    let empty = || Err(ApiError::bad_param("prompt", "prompt must not be empty"));
    let batch = || {
        Err(ApiError::bad_param(
            "prompt",
            "batched prompts are not supported by vllm-sim; send one prompt per request",
        ))
    };
    match p {
        PromptValue::None => Err(ApiError::bad_param(
            "prompt",
            "prompt must be a string or a list of token ids, got null",
        )),
        PromptValue::Text(t) => Ok(Prompt::Text(t)),
        PromptValue::Texts(mut t) if t.len() == 1 => Ok(Prompt::Text(t.remove(0))),
        PromptValue::Ids(i) if !i.is_empty() => ids(i),
        PromptValue::Lists(mut l) if l.len() == 1 => {
            let l = l.remove(0);
            if l.is_empty() {
                empty()
            } else {
                ids(l)
            }
        }
        PromptValue::Texts(t) if t.is_empty() => empty(),
        PromptValue::Ids(_) => empty(),
        PromptValue::Texts(_) | PromptValue::Lists(_) => batch(),
    }
}

/// Reads `prompt` (see [`prompt_union`] and [`prompt_of`]): vLLM's 400 for
/// a value its union refuses, the simulator's for what it does not serve.
pub fn parse_prompt(v: &Value) -> Result<Prompt, ApiError> {
    let mut val = Validator::default();
    let p = prompt_union(&mut val, v);
    val.finish()?;
    prompt_of(p.unwrap_or(PromptValue::None))
}

/// JSON type name for error messages.
pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Flattens a message's content into text, as chat templates see it:
/// a string as is, text parts joined with newlines, null as empty.
pub fn content_text(i: usize, v: &Value) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut out = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str);
                match (kind, p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push(t),
                    _ => {
                        return Err(ApiError::bad_param(
                            "messages",
                            format!("messages[{i}].content[{j}]: only {{\"type\": \"text\", \"text\": ...}} parts are supported"),
                        ))
                    }
                }
            }
            Ok(out.join("\n"))
        }
        other => Err(ApiError::bad_param(
            "messages",
            format!(
                "messages[{i}].content must be a string or an array of content parts, got {}",
                type_name(other)
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_parse_or_fail_clearly() {
        assert_eq!(
            parse_prompt(&json!("hi")).unwrap(),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            parse_prompt(&json!([1, 2])).unwrap(),
            Prompt::Tokens(vec![1, 2])
        );
        assert_eq!(
            parse_prompt(&json!([[3]])).unwrap(),
            Prompt::Tokens(vec![3])
        );
        assert!(parse_prompt(&json!(["a", "b"]))
            .unwrap_err()
            .message
            .contains("batched prompts"));
    }

    #[test]
    fn prompts_follow_vllms_union() {
        // Lax token ids: strings holding integers, booleans, whole floats,
        // once the list is not all strings.
        assert_eq!(
            parse_prompt(&json!([1, "2", true, 3.0, " 4 "])).unwrap(),
            Prompt::Tokens(vec![1, 2, 1, 3, 4])
        );
        assert_eq!(
            parse_prompt(&json!([["1_0", false]])).unwrap(),
            Prompt::Tokens(vec![10, 0])
        );
        // All strings: text prompts, whatever they hold.
        assert_eq!(
            parse_prompt(&json!(["5"])).unwrap(),
            Prompt::Text("5".into())
        );
        // What no member accepts: every member's errors, in vLLM's shape.
        let e = parse_prompt(&json!([1.5])).unwrap_err();
        assert_eq!(e.kind, "Bad Request");
        assert_eq!(e.param.as_deref(), Some("body.prompt.0"));
        assert_eq!(
            e.message,
            "4 validation errors:\n  \
             {'type': 'int_from_float', 'loc': 'body.prompt.0', 'msg': 'Input should be a valid integer, got a number with a fractional part', 'input': '1.5'}\n  \
             {'type': 'list_type', 'loc': 'body.prompt.0', 'msg': 'Input should be a valid list', 'input': '1.5'}\n  \
             {'type': 'string_type', 'loc': 'body.prompt', 'msg': 'Input should be a valid string', 'input': '<list of 1 items>'}\n  \
             {'type': 'string_type', 'loc': 'body.prompt.0', 'msg': 'Input should be a valid string', 'input': '1.5'}"
        );
        let e = parse_prompt(&json!([-1])).unwrap_err();
        assert!(
            e.message.starts_with("4 validation errors:\n  {'type': 'greater_than_equal', 'loc': 'body.prompt.0', 'msg': 'Input should be greater than or equal to 0', 'input': '-1', 'ctx': {'ge': 0}}"),
            "{}",
            e.message
        );
        let e = parse_prompt(&json!(5)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("body.prompt"));
        assert!(e.message.contains("'type': 'list_type'"), "{}", e.message);
        for bad in [
            json!(["a", 1]),
            json!([[1], "a"]),
            json!([1, [2]]),
            json!([null]),
        ] {
            assert_eq!(parse_prompt(&bad).unwrap_err().kind, "Bad Request", "{bad}");
        }
    }

    #[test]
    fn content_parts_flatten() {
        let v = json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]);
        assert_eq!(content_text(0, &v).unwrap(), "a\nb");
        let e = content_text(2, &json!([{"type": "image_url"}])).unwrap_err();
        assert!(e.message.contains("messages[2].content[0]"));
    }

    #[test]
    fn error_shape_is_vllms() {
        let b = ApiError::bad_param("prompt", "x").body();
        assert_eq!(b["error"]["type"], "BadRequestError");
        assert_eq!(b["error"]["code"], 400);
        assert_eq!(b["error"]["param"], "prompt");
    }
}
