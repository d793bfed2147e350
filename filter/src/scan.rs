//! Every string of a request body, for the PII scan: each string value and
//! each object key at any depth, unescaped, whatever the API and whatever
//! the field, so PII in a tool call's arguments, a message's `name`, a
//! tool's description or `user` is seen as surely as in a message.
//!
//! A byte-level walk, not a serde visitor: no recursion (a body nested
//! 10,000 deep, which the parser accepts in the fields it skips, is still
//! walked to the end), no tree built, and strings without escapes are
//! handed over as slices of the body. It relies on the body having been
//! accepted as JSON and UTF-8 by [`crate::request::parse_body`]; anything
//! it still cannot make sense of makes the body [`Unscannable`], which the
//! PII scan counts as PII.

use std::borrow::Cow;
use std::ops::ControlFlow;

use kvasir_policy::Unscannable;

/// The shortest number literal that could be PII: a 13-digit card number
/// (phone numbers and national ids need a `+`, spaces or dashes, which a
/// JSON number cannot hold).
const MIN_PII_NUMBER: usize = 13;

/// Calls `f` on every string value and object key of the JSON text `body`
/// (unescaped), and on every number literal of 13 or more characters (a
/// card number sent as a number), in order, until `f` breaks.
pub fn visit_json_strings(
    body: &str,
    f: &mut dyn FnMut(&str) -> ControlFlow<()>,
) -> Result<ControlFlow<()>, Unscannable> {
    let b = body.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' => {
                let (end, escaped) = string_end(b, i).ok_or(Unscannable)?;
                let s = unescape(body.get(i..end).ok_or(Unscannable)?, escaped)?;
                if f(&s).is_break() {
                    return Ok(ControlFlow::Break(()));
                }
                i = end;
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < b.len() && matches!(b[i], b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9')
                {
                    i += 1;
                }
                if i - start >= MIN_PII_NUMBER {
                    let n = body.get(start..i).ok_or(Unscannable)?;
                    if f(n).is_break() {
                        return Ok(ControlFlow::Break(()));
                    }
                }
            }
            _ => i += 1,
        }
    }
    Ok(ControlFlow::Continue(()))
}

/// End (exclusive, after the closing quote) of the string starting at
/// `b[i] == '"'`, and whether it has escapes.
fn string_end(b: &[u8], i: usize) -> Option<(usize, bool)> {
    let mut j = i + 1;
    let mut escaped = false;
    loop {
        let k = j + b.get(j..)?.iter().position(|&c| c == b'"' || c == b'\\')?;
        if b[k] == b'"' {
            return Some((k + 1, escaped));
        }
        escaped = true;
        j = k + 2;
    }
}

/// The text of the JSON string literal `lit` (quotes included).
fn unescape(lit: &str, escaped: bool) -> Result<Cow<'_, str>, Unscannable> {
    if !escaped {
        return lit
            .get(1..lit.len() - 1)
            .map(Cow::Borrowed)
            .ok_or(Unscannable);
    }
    // Rare (a JSON encoder escapes only quotes, backslashes and control
    // characters, or everything non-ASCII): serde_json's own unescaping, so
    // the text is what a JSON reader sees. What it refuses (a lone
    // surrogate) is unscannable.
    serde_json::from_str::<String>(lit)
        .map(Cow::Owned)
        .map_err(|_| Unscannable)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(body: &str) -> Result<Vec<String>, Unscannable> {
        let mut out = Vec::new();
        let done = visit_json_strings(body, &mut |s| {
            out.push(s.to_string());
            ControlFlow::Continue(())
        })?;
        assert_eq!(done, ControlFlow::Continue(()));
        Ok(out)
    }

    #[test]
    fn keys_and_values_at_any_depth_unescaped() {
        let body = r#"{"a":"x","b":[1,{"c\u0040d":"e\"f\\g\n"}],"h":{"i":[["j"]]},"k":null,"l":true,"m":-1.5e3}"#;
        assert_eq!(
            all(body).unwrap(),
            [
                "a",
                "x",
                "b",
                "c@d",
                "e\"f\\g\n",
                "h",
                "i",
                "j",
                "k",
                "l",
                "m"
            ]
        );
    }

    #[test]
    fn long_numbers_are_visited_short_ones_not() {
        let body = r#"{"seed":4111111111111111,"n":123456789012,"x":-1234567890123}"#;
        assert_eq!(
            all(body).unwrap(),
            ["seed", "4111111111111111", "n", "x", "-1234567890123"]
        );
    }

    #[test]
    fn deep_nesting_is_walked_without_recursion() {
        let mut s = String::from(r#"{"x":"#);
        s.push_str(&"[".repeat(100_000));
        s.push_str(r#""deep""#);
        s.push_str(&"]".repeat(100_000));
        s.push('}');
        assert_eq!(all(&s).unwrap(), ["x", "deep"]);
    }

    #[test]
    fn break_stops_and_broken_text_is_unscannable() {
        let mut n = 0;
        let r = visit_json_strings(r#"["a","b","c"]"#, &mut |_| {
            n += 1;
            ControlFlow::Break(())
        });
        assert_eq!((r, n), (Ok(ControlFlow::Break(())), 1));
        assert_eq!(all(r#"{"a":"unterminated"#), Err(Unscannable));
        assert_eq!(all(r#"{"a":"bad \q escape"}"#), Err(Unscannable));
    }

    #[test]
    fn escaped_non_ascii_and_surrogate_pairs() {
        assert_eq!(
            all(r#"["\u00e9t\u00e9 \ud83d\ude00"]"#).unwrap(),
            ["été 😀"]
        );
    }
}
