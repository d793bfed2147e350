//! The OpenAI-compatible request and error shapes vLLM serves.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{json, Value};

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
    /// Completion length limit.
    pub max_tokens: Option<u32>,
    /// Newer name of `max_tokens`.
    pub max_completion_tokens: Option<u32>,
    /// Number of choices (only 1 is simulated).
    pub n: Option<u32>,
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
    /// Completion length limit (OpenAI's default for completions is 16).
    pub max_tokens: Option<u32>,
    /// Number of choices (only 1 is simulated).
    pub n: Option<u32>,
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
}

/// The prompt of a completions request.
#[derive(Debug, PartialEq)]
pub enum Prompt {
    /// Text, tokenized by the server.
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
}

/// Reads `prompt`: a string, a list of ints, or a one-element list of
/// either (batches of several prompts are not simulated).
pub fn parse_prompt(v: &Value) -> Result<Prompt, ApiError> {
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_number) => a
            .iter()
            .enumerate()
            .map(|(i, x)| {
                x.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| {
                        ApiError::bad_param(
                            "prompt",
                            format!("prompt[{i}] must be a non-negative token id, got {x}"),
                        )
                    })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Prompt::Tokens),
        Value::Array(a) if a.len() == 1 => parse_prompt(&a[0]),
        Value::Array(a) if a.is_empty() => {
            Err(ApiError::bad_param("prompt", "prompt must not be empty"))
        }
        Value::Array(_) => Err(ApiError::bad_param(
            "prompt",
            "batched prompts are not supported by vllm-sim; send one prompt per request",
        )),
        other => Err(ApiError::bad_param(
            "prompt",
            format!(
                "prompt must be a string or a list of token ids, got {}",
                type_name(other)
            ),
        )),
    }
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
        assert!(parse_prompt(&json!([-1]))
            .unwrap_err()
            .message
            .contains("prompt[0]"));
        assert!(parse_prompt(&json!(5))
            .unwrap_err()
            .message
            .contains("number"));
        assert!(parse_prompt(&json!(["a", "b"])).is_err());
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
