//! A request's scheduling priority as vLLM 0.34 reads it: the body's
//! `priority` (chat completions, completions, responses: a pydantic `int`
//! in [-2^63, 2^63-1], default 0), overridden by the `X-Vllm-Priority`
//! header when that parses as an integer (`_get_priority` in
//! `entrypoints/generate/base/serving.py`; the Anthropic route reaches it
//! through the chat handler, so there only the header counts). A non-zero
//! priority on an fcfs engine is accepted and has no effect, as in vLLM.

use crate::openai::ApiError;
use crate::validation::{int_str, Int, Validator};
use axum::http::HeaderMap;
use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// vLLM's header that overrides the body's `priority`.
pub const PRIORITY_HEADER: &str = "x-vllm-priority";

/// For `#[serde(default, deserialize_with = "present")]`: keeps an
/// explicit `null` apart from an absent field (pydantic rejects the first).
pub fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

/// The body's `priority` (absent: 0), or vLLM's 400 for a value pydantic's
/// lax `int` refuses.
pub fn body_priority(v: Option<&Value>) -> Result<i64, ApiError> {
    let mut val = Validator::default();
    let p = check(&mut val, v);
    val.finish().map(|()| p)
}

/// Reads the body's `priority` (absent: 0), recording pydantic's error in
/// `val` when its lax `int` refuses the value (then 0).
pub fn check(val: &mut Validator, v: Option<&Value>) -> i64 {
    match v {
        Some(v) => bounded_i64(val, "priority", v),
        None => 0,
    }
}

/// An `int` field bounded to [-2^63, 2^63 - 1] (`Field(ge=_INT64_MIN,
/// le=_INT64_MAX)`: vLLM's `priority` and `seed`), recording pydantic's
/// error in `val` when it is refused (then 0).
pub fn bounded_i64(val: &mut Validator, name: &str, v: &Value) -> i64 {
    let loc = [name];
    match val.int_value(&loc, v, false) {
        Some(Int::I64(i)) => return i,
        Some(Int::Big {
            negative: false, ..
        }) => val.error_ctx(
            &loc,
            "less_than_equal",
            &format!("Input should be less than or equal to {}", i64::MAX),
            v,
            &format!("{{'le': {}}}", i64::MAX),
        ),
        Some(Int::Big { negative: true, .. }) => val.error_ctx(
            &loc,
            "greater_than_equal",
            &format!("Input should be greater than or equal to {}", i64::MIN),
            v,
            &format!("{{'ge': {}}}", i64::MIN),
        ),
        None => {}
    }
    0
}

/// The priority vLLM schedules with: the header's when it parses as an
/// integer (Python's `int()`), else the body's.
pub fn request_priority(headers: &HeaderMap, body: i64) -> i64 {
    headers
        .get(PRIORITY_HEADER)
        .and_then(|h| h.to_str().ok())
        .and_then(|s| int_str(s, false))
        .and_then(|i| i.as_i64())
        .unwrap_or(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(v: Value) -> ApiError {
        body_priority(Some(&v)).unwrap_err()
    }

    #[test]
    fn lax_ints_are_accepted_as_pydantic_does() {
        for (v, want) in [
            (json!(-3), -3),
            (json!(2.0), 2),
            (json!(true), 1),
            (json!(" 7 "), 7),
            (json!("1_000"), 1000),
            (json!("+3"), 3),
            (json!("1.00"), 1),
            (json!(i64::MIN), i64::MIN),
        ] {
            assert_eq!(body_priority(Some(&v)).unwrap(), want, "{v}");
        }
        assert_eq!(body_priority(None).unwrap(), 0);
    }

    #[test]
    fn refusals_read_like_vllms() {
        let e = err(json!("high"));
        assert_eq!(e.kind, "Bad Request");
        assert_eq!(e.param.as_deref(), Some("body.priority"));
        assert_eq!(e.message, "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.priority', 'msg': 'Input should be a valid integer, unable to parse string as an integer', 'input': 'high'}");
        assert!(err(json!(1.5)).message.contains("'type': 'int_from_float'"));
        assert!(err(json!(null)).message.contains("'type': 'int_type'"));
        assert!(err(json!([1]))
            .message
            .contains("'input': '<list of 1 items>'"));
        assert!(err(json!(1e30)).message.contains("int_parsing_size"));
        assert!(err(json!(9_223_372_036_854_775_808u64))
            .message
            .ends_with("'input': '9223372036854775808', 'ctx': {'le': 9223372036854775807}}"));
        assert!(err(json!("-99999999999999999999"))
            .message
            .contains("greater_than_equal"));
        for bad in ["1__0", "_1", "", "0x10", "1e3", "1.5"] {
            assert!(err(json!(bad)).message.contains("int_parsing"), "{bad}");
        }
    }

    #[test]
    fn the_header_overrides_the_body_when_it_is_an_integer() {
        let mut h = HeaderMap::new();
        assert_eq!(request_priority(&h, 4), 4);
        h.insert(PRIORITY_HEADER, " -2 ".parse().unwrap());
        assert_eq!(request_priority(&h, 4), -2);
        // Python's int() refuses "1.0"; vLLM then falls back to the body.
        h.insert(PRIORITY_HEADER, "1.0".parse().unwrap());
        assert_eq!(request_priority(&h, 4), 4);
        h.insert(PRIORITY_HEADER, "x".parse().unwrap());
        assert_eq!(request_priority(&h, 4), 4);
    }
}
