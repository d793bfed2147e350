//! Request-body validation errors as vLLM's server answers them, on every
//! API (the Anthropic routes included): FastAPI rejects a body that does not
//! fit the request model before any handler runs, and vLLM's handler for
//! that answers 400 in the OpenAI error shape with `type` "Bad Request",
//! `param` the first error's dotted location (`body.max_tokens`) and a
//! message listing pydantic's errors with their inputs summarized.

use crate::openai::ApiError;
use axum::http::{header, HeaderMap, StatusCode};
use serde_json::{Map, Value};

/// vLLM reports at most this many errors in the message.
const MAX_REPORTED: usize = 10;

/// A JSON type a field must have.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Ty {
    /// A string.
    Str,
    /// An integer.
    Int,
    /// A number.
    Num,
    /// A boolean.
    Bool,
    /// A list.
    List,
    /// An object.
    Obj,
}

impl Ty {
    fn check(self, v: &Value) -> Result<(), (&'static str, &'static str)> {
        let ok = match self {
            Ty::Str => v.is_string(),
            Ty::Int => v.as_i64().is_some() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
            Ty::Num => v.is_number(),
            Ty::Bool => v.is_boolean(),
            Ty::List => v.is_array(),
            Ty::Obj => v.is_object(),
        };
        if ok {
            return Ok(());
        }
        Err(match self {
            Ty::Str => ("string_type", "Input should be a valid string"),
            Ty::Int if v.is_string() => (
                "int_parsing",
                "Input should be a valid integer, unable to parse string as an integer",
            ),
            Ty::Int => ("int_type", "Input should be a valid integer"),
            Ty::Num => ("float_type", "Input should be a valid number"),
            Ty::Bool => ("bool_type", "Input should be a valid boolean"),
            Ty::List => ("list_type", "Input should be a valid list"),
            Ty::Obj => ("dict_type", "Input should be a valid dictionary"),
        })
    }
}

/// Python's `repr` of an error's input as vLLM 0.34's
/// `_summarize_error_input` leaves it: containers described, long strings
/// cut, anything else turned into its `str` (so numbers show quoted).
fn summarize(v: &Value) -> String {
    match v {
        Value::Null => py_str("None"),
        Value::Bool(b) => py_str(if *b { "True" } else { "False" }),
        Value::Number(n) => py_str(&n.to_string()),
        Value::String(s) if s.chars().count() > 200 => py_str(&format!(
            "{}...[truncated]",
            s.chars().take(200).collect::<String>()
        )),
        Value::String(s) => py_str(s),
        Value::Array(a) => py_str(&format!("<list of {} items>", a.len())),
        Value::Object(o) => py_str(&format!("<dict of {} items>", o.len())),
    }
}

fn py_str(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// Collects a body's validation errors.
#[derive(Debug, Default)]
pub struct Validator {
    errors: Vec<(String, String)>,
}

impl Validator {
    /// Records one error at `loc` (field names and list indices under `body`).
    pub fn error(&mut self, loc: &[&str], kind: &str, msg: &str, input: &Value) {
        self.push(loc, kind, msg, input, None);
    }

    /// Records an error with pydantic's `ctx` (a Python dict literal, such
    /// as `{'le': 5}` for a bound).
    pub fn error_ctx(&mut self, loc: &[&str], kind: &str, msg: &str, input: &Value, ctx: &str) {
        self.push(loc, kind, msg, input, Some(ctx));
    }

    fn push(&mut self, loc: &[&str], kind: &str, msg: &str, input: &Value, ctx: Option<&str>) {
        let loc = std::iter::once("body")
            .chain(loc.iter().copied())
            .collect::<Vec<_>>()
            .join(".");
        let ctx = ctx.map(|c| format!(", 'ctx': {c}")).unwrap_or_default();
        let text = format!(
            "{{'type': '{kind}', 'loc': '{loc}', 'msg': '{msg}', 'input': {}{ctx}}}",
            summarize(input)
        );
        self.errors.push((loc, text));
    }

    /// Checks one field of `obj` (at `loc`): present unless optional, null
    /// only if optional, of type `ty`. Returns it when it is there and fits.
    pub fn field<'v>(
        &mut self,
        obj: &'v Map<String, Value>,
        loc: &[&str],
        ty: Ty,
        required: bool,
    ) -> Option<&'v Value> {
        let name = loc.last().copied().unwrap_or_default();
        match obj.get(name) {
            None if required => {
                self.error(
                    loc,
                    "missing",
                    "Field required",
                    &Value::Object(obj.clone()),
                );
                None
            }
            None | Some(Value::Null) if !required => None,
            Some(v) => match ty.check(v) {
                Ok(()) => Some(v),
                Err((kind, msg)) => {
                    self.error(loc, kind, msg, v);
                    None
                }
            },
            None => None,
        }
    }

    /// Whether nothing was wrong so far.
    pub fn is_ok(&self) -> bool {
        self.errors.is_empty()
    }

    /// The 400 vLLM answers, if there were errors.
    pub fn finish(self) -> Result<(), ApiError> {
        if self.errors.is_empty() {
            return Ok(());
        }
        let n = self.errors.len();
        let label = if n == 1 { "error" } else { "errors" };
        let mut message = format!("{n} validation {label}:\n");
        for (_, e) in self.errors.iter().take(MAX_REPORTED) {
            message.push_str(&format!("  {e}\n"));
        }
        if n > MAX_REPORTED {
            message.push_str(&format!("  ...and {} more {label}\n", n - MAX_REPORTED));
        }
        Err(bad_request(
            message.trim_end().to_string(),
            Some(self.errors[0].0.clone()),
        ))
    }
}

fn bad_request(message: String, param: Option<String>) -> ApiError {
    ApiError {
        status: StatusCode::BAD_REQUEST,
        kind: "Bad Request",
        message,
        param,
    }
}

/// vLLM's `validate_json_request` then the body's parse: the content type
/// must be `application/json` and the body a JSON object.
pub fn json_object(headers: &HeaderMap, body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let media = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if media != "application/json" {
        return Err(bad_request(
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed"
                .into(),
            None,
        ));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(other) => {
            let mut v = Validator::default();
            v.error(
                &[],
                "model_attributes_type",
                "Input should be a valid dictionary or object to extract fields from",
                &other,
            );
            v.finish().map(|()| Map::new())
        }
        Err(e) => {
            let pos = e.column().to_string();
            let mut v = Validator::default();
            v.error(
                &[&pos],
                "json_invalid",
                "JSON decode error",
                &Value::Object(Map::new()),
            );
            v.finish().map(|()| Map::new())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn errors_read_like_vllms() {
        let body = json!({"model": "m", "max_tokens": "x"});
        let obj = body.as_object().unwrap();
        let mut v = Validator::default();
        v.field(obj, &["messages"], Ty::List, true);
        v.field(obj, &["max_tokens"], Ty::Int, true);
        v.field(obj, &["stream"], Ty::Bool, false);
        let e = v.finish().unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.kind, "Bad Request");
        assert_eq!(e.param.as_deref(), Some("body.messages"));
        assert!(e.message.starts_with("2 validation errors:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field required', 'input': '<dict of 2 items>'}"), "{}", e.message);
        assert!(e.message.contains("'type': 'int_parsing'"), "{}", e.message);
    }

    #[test]
    fn content_type_and_body_are_checked() {
        let mut h = HeaderMap::new();
        assert!(json_object(&h, b"{}")
            .unwrap_err()
            .message
            .contains("Unsupported Media Type"));
        h.insert(
            header::CONTENT_TYPE,
            "application/json; charset=utf-8".parse().unwrap(),
        );
        assert!(json_object(&h, b"{}").unwrap().is_empty());
        assert_eq!(
            json_object(&h, b"[1]").unwrap_err().param.as_deref(),
            Some("body")
        );
        assert!(json_object(&h, b"{")
            .unwrap_err()
            .message
            .contains("json_invalid"));
    }
}
