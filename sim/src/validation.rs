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
        if self == Ty::Int {
            return lax_int(v).map(|_| ());
        }
        let ok = match self {
            Ty::Str => v.is_string(),
            Ty::Int => false,
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
            Ty::Int => INT_TYPE,
            Ty::Num => ("float_type", "Input should be a valid number"),
            Ty::Bool => ("bool_type", "Input should be a valid boolean"),
            Ty::List => ("list_type", "Input should be a valid list"),
            Ty::Obj => ("dict_type", "Input should be a valid dictionary"),
        })
    }
}

/// An integer as pydantic's lax `int` reads a JSON value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Int {
    /// One that fits `i64`.
    I64(i64),
    /// One past `i64` (a Python int has no bound): its decimal digits,
    /// and whether it is negative.
    Big {
        /// Below zero.
        negative: bool,
        /// The digits, no sign, no leading zeros.
        digits: String,
    },
}

impl std::fmt::Display for Int {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Int::I64(n) => write!(f, "{n}"),
            Int::Big { negative, digits } => {
                write!(f, "{}{digits}", if *negative { "-" } else { "" })
            }
        }
    }
}

impl Int {
    /// Whether it is below `n`.
    pub fn below(&self, n: i64) -> bool {
        match self {
            Int::I64(m) => *m < n,
            Int::Big { negative, .. } => *negative,
        }
    }

    /// The value when it fits `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Int::I64(n) => Some(*n),
            Int::Big { .. } => None,
        }
    }
}

/// 2^63 as f64 (exact).
const TWO_POW_63: f64 = 9_223_372_036_854_775_808.0;

const INT_TYPE: (&str, &str) = ("int_type", "Input should be a valid integer");
const INT_PARSING: (&str, &str) = (
    "int_parsing",
    "Input should be a valid integer, unable to parse string as an integer",
);

/// A value as pydantic v2's lax (Python-mode) `int` validator reads what
/// `json.loads` made of it, with pydantic's error type and message when it
/// refuses: an integer; a boolean (`true` is 1); a float with no
/// fractional part whose magnitude is below 2^63 (`1e2`, `100.0`; a larger
/// one is `int_parsing_size`, a fraction `int_from_float`); a string read
/// by [`int_str`]; nothing else (`int_type`).
///
/// One case is out of reach: a JSON integer literal past `u64`, which
/// Python reads as an int (accepted) and serde_json as a float (refused
/// here as `int_parsing_size`). vLLM refuses such a value later anyway
/// for every field the simulator reads (it is past any context length,
/// or past `priority`'s bounds), with another message.
pub fn lax_int(v: &Value) -> Result<Int, (&'static str, &'static str)> {
    match v {
        Value::Bool(b) => Ok(Int::I64(i64::from(*b))),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                return Ok(Int::I64(i));
            }
            if let Some(u) = n.as_u64() {
                return Ok(Int::Big {
                    negative: false,
                    digits: u.to_string(),
                });
            }
            let f = n.as_f64().unwrap_or(f64::NAN);
            if f.fract() != 0.0 {
                Err((
                    "int_from_float",
                    "Input should be a valid integer, got a number with a fractional part",
                ))
            } else if f.abs() < TWO_POW_63 {
                Ok(Int::I64(f as i64))
            } else {
                Err((
                    "int_parsing_size",
                    "Unable to parse input string as an integer, exceeded maximum size",
                ))
            }
        }
        Value::String(s) => int_str(s, true).ok_or(INT_PARSING),
        _ => Err(INT_TYPE),
    }
}

/// An integer string. `pydantic`: as pydantic-core reads one for an `int`
/// (Unicode whitespace trimmed as Rust's `str::trim` does, then an optional
/// sign, ASCII digits with single underscores between digits, then
/// optionally `.` and zeros: `" 1_000.00 "` is 1000; `"1e2"`, `"100."`,
/// `".0"`, `"0x10"` are no integer). Otherwise as Python's `int()` reads a
/// string: the same without the `.000` tail and trimming Python's
/// whitespace (`str.strip`).
pub fn int_str(s: &str, pydantic: bool) -> Option<Int> {
    let s = if pydantic {
        s.trim()
    } else {
        s.trim_matches(|c: char| c.is_whitespace() || ('\x1c'..='\x1f').contains(&c))
    };
    let (negative, rest) = match s.as_bytes().first()? {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    let digits = match rest.split_once('.') {
        Some((d, zeros)) if pydantic && !zeros.is_empty() && zeros.bytes().all(|c| c == b'0') => d,
        Some(_) => return None,
        None => rest,
    };
    let b = digits.as_bytes();
    let well_formed = b.first().is_some_and(u8::is_ascii_digit)
        && b.last().is_some_and(u8::is_ascii_digit)
        && b.iter().all(|c| c.is_ascii_digit() || *c == b'_')
        && !digits.contains("__");
    if !well_formed {
        return None;
    }
    let clean: String = digits.chars().filter(char::is_ascii_digit).collect();
    let trimmed = clean.trim_start_matches('0');
    let digits = if trimmed.is_empty() { "0" } else { trimmed };
    let signed = format!("{}{digits}", if negative { "-" } else { "" });
    Some(match signed.parse::<i64>() {
        Ok(n) => Int::I64(n),
        Err(_) => Int::Big {
            negative,
            digits: digits.to_string(),
        },
    })
}

/// Python's `repr` of an error's input as vLLM 0.34's
/// `_summarize_error_input` leaves it: containers described, long strings
/// cut, anything else turned into its `str` (so numbers show quoted).
fn summarize(v: &Value) -> String {
    match v {
        Value::Null => py_str("None"),
        Value::Bool(b) => py_str(if *b { "True" } else { "False" }),
        Value::Number(n) => match n.as_f64().filter(|_| n.is_f64()) {
            Some(f) => py_str(&py_float(f)),
            None => py_str(&n.to_string()),
        },
        Value::String(s) if s.chars().count() > 200 => py_str(&format!(
            "{}...[truncated]",
            s.chars().take(200).collect::<String>()
        )),
        Value::String(s) => py_str(s),
        Value::Array(a) => py_str(&format!("<list of {} items>", a.len())),
        Value::Object(o) => py_str(&format!("<dict of {} items>", o.len())),
    }
}

/// Python's `str` of a float: the shortest digits that read back (as
/// Rust's), written out between 1e-4 and 1e16 (`100.0`, `0.0001`) and in
/// exponent form elsewhere (`1e+20`, `1.5e-05`).
fn py_float(f: f64) -> String {
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let plain = format!("{f}");
        if plain.contains('.') {
            plain
        } else {
            format!("{plain}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
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

    /// Reads the integer field at `loc` as pydantic's lax `int` does
    /// ([`lax_int`]), recording its error. Absent: `None`. `null`: `None`
    /// when `nullable` (an `int | None` field), else pydantic's
    /// `int_type` error.
    pub fn int(&mut self, obj: &Map<String, Value>, loc: &[&str], nullable: bool) -> Option<Int> {
        let v = obj.get(loc.last().copied().unwrap_or_default())?;
        self.int_value(loc, v, nullable)
    }

    /// [`Validator::int`] for a value in hand.
    pub fn int_value(&mut self, loc: &[&str], v: &Value, nullable: bool) -> Option<Int> {
        if v.is_null() && nullable {
            return None;
        }
        match lax_int(v) {
            Ok(i) => Some(i),
            Err((kind, msg)) => {
                self.error(loc, kind, msg, v);
                None
            }
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

    /// The shared table (tests/vectors/lax_int.json, made with pydantic
    /// and vLLM's error rendering): what the simulator's lax `int` reads,
    /// and vLLM's 400 word for word.
    #[test]
    fn lax_int_vectors_match_pydantic() {
        use crate::openai::{ChatRequest, CompletionRequest, PromptValue};
        let table: Value =
            serde_json::from_str(include_str!("../../tests/vectors/lax_int.json")).unwrap();
        for v in table["ints"].as_array().unwrap() {
            let text = v["json"].as_str().unwrap();
            let value: Value = serde_json::from_str(text).unwrap();
            let got = lax_int(&value).map(|i| i.to_string()).map_err(|e| e.0);
            match (v.get("value"), v.get("error")) {
                (Some(n), _) => assert_eq!(got.as_deref(), Ok(n.as_str().unwrap()), "{text}"),
                (_, Some(e)) => assert_eq!(got, Err(e.as_str().unwrap()), "{text}"),
                _ => panic!("{v}"),
            }
        }
        let int = |i: Option<&Int>, default: &str| i.map_or(default.to_string(), Int::to_string);
        for b in table["bodies"].as_array().unwrap() {
            let text = b["body"].as_str().unwrap();
            let (ints, prompt) = if b["api"] == "chat" {
                let req: ChatRequest = serde_json::from_str(text).unwrap();
                (req.ints(), None)
            } else {
                let req: CompletionRequest = serde_json::from_str(text).unwrap();
                match req.check() {
                    Ok((p, i)) => (Ok(i), Some(p)),
                    Err(e) => (Err(e), None),
                }
            };
            match b.get("accepted") {
                Some(a) => {
                    let ints = ints.unwrap_or_else(|e| panic!("{text}: {}", e.message));
                    let limit = if b["api"] == "chat" {
                        let mct = &a["max_completion_tokens"];
                        if mct.is_null() {
                            &a["max_tokens"]
                        } else {
                            mct
                        }
                    } else {
                        &a["max_tokens"]
                    };
                    assert_eq!(
                        ints.max_tokens.as_ref().map(Int::to_string).as_deref(),
                        limit.as_str(),
                        "{text}"
                    );
                    assert_eq!(
                        int(ints.n.as_ref(), "1"),
                        a["n"].as_str().unwrap(),
                        "{text}"
                    );
                    assert_eq!(ints.priority.to_string(), a["priority"].as_str().unwrap());
                    if let Some(p) = prompt {
                        let got = match p {
                            PromptValue::Ids(ids) => {
                                json!(ids.iter().map(Int::to_string).collect::<Vec<_>>())
                            }
                            PromptValue::Lists(l) => json!(l
                                .iter()
                                .map(|ids| ids.iter().map(Int::to_string).collect::<Vec<_>>())
                                .collect::<Vec<_>>()),
                            PromptValue::Texts(t) => json!(t),
                            other => panic!("{text}: {other:?}"),
                        };
                        assert_eq!(got, a["prompt"], "{text}");
                    }
                }
                None => {
                    let e = ints.expect_err(text);
                    assert_eq!(e.kind, "Bad Request");
                    assert_eq!(e.param.as_deref(), b["param"].as_str(), "{text}");
                    assert_eq!(e.message, b["message"].as_str().unwrap(), "{text}");
                }
            }
        }
    }

    #[test]
    fn an_integer_literal_past_u64_reads_as_a_float() {
        // Python reads it as an int (pydantic accepts it, vLLM then refuses
        // the limit); serde_json as a float: refused here already.
        let v: Value = serde_json::from_str("99999999999999999999").unwrap();
        assert_eq!(lax_int(&v).unwrap_err().0, "int_parsing_size");
        // Within u64 it is an int past i64, as in Python.
        let v: Value = serde_json::from_str("18446744073709551615").unwrap();
        assert_eq!(lax_int(&v).unwrap().to_string(), "18446744073709551615");
    }

    #[test]
    fn python_writes_floats_so() {
        for (f, s) in [
            (1e20, "1e+20"),
            (1.5, "1.5"),
            (100.0, "100.0"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (-2.5e-7, "-2.5e-07"),
            (1.5e300, "1.5e+300"),
        ] {
            assert_eq!(py_float(f), s, "{f}");
        }
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
