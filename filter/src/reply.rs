//! Local replies in the API's own error shape.
//!
//! OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/responses*`,
//! and any other path): `{"error": {"message", "type", "param", "code"}}`
//! with OpenAI's type names (`invalid_request_error`,
//! `authentication_error`, ...) and a string `code` saying exactly what
//! happened. Anthropic (`/v1/messages`, `/v1/messages/count_tokens`):
//! `{"type": "error", "error": {"type", "message"}}` with Anthropic's type
//! names. Clients' SDKs then raise their usual exception for the status.
//! An unknown stored response is answered exactly as vLLM answers it
//! ([`unknown_response`]).

use kvasir_policy::ApiKind;
use serde_json::json;

/// A header on every reply the filter makes. Envoy's `local_reply_config`
/// (envoy/envoy.yaml) rewrites Envoy's own plain-text answers into the
/// API's JSON shape and leaves replies carrying this header alone, which
/// are JSON already.
pub const REPLY_MARKER: &str = "x-kvasir-reply";

/// A reply the filter sends instead of forwarding the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalReply {
    /// HTTP status.
    pub status: u16,
    /// Extra headers (`content-type` is always set).
    pub headers: Vec<(String, String)>,
    /// The JSON body.
    pub body: Vec<u8>,
}

/// The error shape to answer in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// OpenAI's.
    OpenAi,
    /// Anthropic's.
    Anthropic,
}

impl Shape {
    /// The shape of an API (`None`: a path the filter does not parse).
    pub fn of(api: Option<ApiKind>) -> Shape {
        match api {
            Some(ApiKind::AnthropicMessages | ApiKind::AnthropicCountTokens) => Shape::Anthropic,
            _ => Shape::OpenAi,
        }
    }
}

fn openai_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        500..=599 => "server_error",
        _ => "invalid_request_error",
    }
}

fn anthropic_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}

/// An error reply. `code` is OpenAI's machine-readable code (e.g.
/// `invalid_json`, `policy_rejected`); `param` the offending field.
pub fn error_reply(
    shape: Shape,
    status: u16,
    code: &str,
    param: Option<&str>,
    message: &str,
) -> LocalReply {
    let body = match shape {
        Shape::OpenAi => json!({"error": {
            "message": message,
            "type": openai_type(status),
            "param": param,
            "code": code,
        }}),
        Shape::Anthropic => json!({"type": "error", "error": {
            "type": anthropic_type(status),
            "message": message,
        }}),
    };
    LocalReply {
        status,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            (REPLY_MARKER.into(), "filter".into()),
        ],
        // A json! value of strings always serializes.
        body: serde_json::to_vec(&body).unwrap_or_default(),
    }
}

/// vLLM's answer to a Responses API request naming a response it does not
/// hold (`_make_not_found_error`: an `ErrorResponse` whose `code` is the
/// status as a number), so a client cannot tell the gateway's answer from
/// the engine's.
pub fn unknown_response(id: &str) -> LocalReply {
    let body = json!({"error": {
        "message": format!("Response with id '{id}' not found."),
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }});
    LocalReply {
        status: 404,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            (REPLY_MARKER.into(), "filter".into()),
        ],
        body: serde_json::to_vec(&body).unwrap_or_default(),
    }
}

/// A 429 for a shed request, with `Retry-After`.
pub fn shed_reply(shape: Shape, retry_after_s: u32, message: &str) -> LocalReply {
    let mut r = error_reply(shape, 429, "shed", None, message);
    r.headers
        .push(("retry-after".into(), retry_after_s.to_string()));
    r
}

/// The reply of a VM without a valid configuration: 503, fail closed
/// (tenants are not checked, so nothing may pass).
pub fn not_configured() -> LocalReply {
    error_reply(
        Shape::OpenAi,
        503,
        "not_configured",
        None,
        "the gateway filter is not configured",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn body(r: &LocalReply) -> Value {
        serde_json::from_slice(&r.body).unwrap()
    }

    #[test]
    fn openai_shape() {
        let r = error_reply(
            Shape::OpenAi,
            400,
            "missing_model",
            Some("model"),
            "`model` is required",
        );
        assert_eq!(r.status, 400);
        assert!(r.headers.contains(&(REPLY_MARKER.into(), "filter".into())));
        assert_eq!(
            body(&r),
            json!({"error": {"message": "`model` is required", "type": "invalid_request_error", "param": "model", "code": "missing_model"}})
        );
        assert_eq!(
            body(&error_reply(Shape::OpenAi, 401, "x", None, "m"))["error"]["type"],
            "authentication_error"
        );
        assert_eq!(
            body(&error_reply(Shape::OpenAi, 401, "x", None, "m"))["error"]["param"],
            Value::Null
        );
    }

    #[test]
    fn anthropic_shape() {
        let r = error_reply(Shape::Anthropic, 413, "body_too_large", None, "too big");
        assert_eq!(
            body(&r),
            json!({"type": "error", "error": {"type": "request_too_large", "message": "too big"}})
        );
    }

    #[test]
    fn shed_has_retry_after() {
        let r = shed_reply(Shape::OpenAi, 7, "busy");
        assert_eq!(r.status, 429);
        assert!(r.headers.contains(&("retry-after".into(), "7".into())));
        assert_eq!(body(&r)["error"]["type"], "rate_limit_error");
        assert_eq!(
            Shape::of(Some(ApiKind::AnthropicMessages)),
            Shape::Anthropic
        );
        assert_eq!(Shape::of(None), Shape::OpenAi);
    }

    #[test]
    fn unknown_response_is_vllms_404() {
        let r = unknown_response("resp_1\"x");
        assert_eq!(r.status, 404);
        assert!(r.headers.contains(&(REPLY_MARKER.into(), "filter".into())));
        assert_eq!(
            body(&r),
            json!({"error": {"message": "Response with id 'resp_1\"x' not found.",
                "type": "invalid_request_error", "param": "response_id", "code": 404}})
        );
        assert_eq!(
            Shape::of(Some(ApiKind::AnthropicCountTokens)),
            Shape::Anthropic
        );
        assert_eq!(Shape::of(Some(ApiKind::Responses)), Shape::OpenAi);
    }

    #[test]
    fn messages_are_escaped() {
        let r = error_reply(Shape::OpenAi, 400, "c", None, "a \"quoted\" \u{0} msg");
        assert_eq!(body(&r)["error"]["message"], "a \"quoted\" \u{0} msg");
    }

    #[test]
    fn without_a_configuration_everything_is_refused() {
        let r = not_configured();
        assert_eq!(r.status, 503);
        assert_eq!(body(&r)["error"]["code"], "not_configured");
    }
}
