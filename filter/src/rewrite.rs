//! Body rewrites: a new `model`, `stream_options.include_usage: true`, and
//! vLLM's `priority` (the pool's engine priority, replacing the client's).
//!
//! The body is spliced, not re-serialized: a small scanner finds the byte
//! spans of the top-level members and only the changed values are
//! replaced, so everything else (key order, number formatting, unknown
//! fields) reaches the engine byte for byte, and a 100 KB prompt is copied
//! once instead of being parsed into a DOM. The scanner runs only on bodies
//! serde has already accepted; if it still cannot make sense of one, the
//! rewrite falls back to a full `serde_json::Value` round trip.

use serde_json::Value;

/// What to change in a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rewrite<'a> {
    /// Replace the top-level `model` with this.
    pub model: Option<&'a str>,
    /// Set `stream_options.include_usage` to true (creating
    /// `stream_options` when absent).
    pub include_usage: bool,
    /// Set the top-level `priority` to this, replacing every `priority`
    /// member the client sent (a client must not choose its own place in
    /// the engine's queue).
    pub priority: Option<i32>,
}

impl Rewrite<'_> {
    /// Whether there is nothing to do.
    pub fn is_noop(&self) -> bool {
        self.model.is_none() && !self.include_usage && self.priority.is_none()
    }
}

/// A top-level member: where its key starts and its value's span.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Member {
    key: String,
    value: (usize, usize),
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// End (exclusive) of the string starting at `b[i] == '"'`.
fn skip_string(b: &[u8], mut i: usize) -> Option<usize> {
    i += 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

/// End (exclusive) of the value starting at `b[i]`.
fn skip_value(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = skip_string(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
            {
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

/// The top-level members of an object body and the offset just after its
/// opening brace.
fn members(b: &[u8]) -> Option<(usize, Vec<Member>)> {
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    let open = i;
    let mut out = Vec::new();
    loop {
        i = skip_ws(b, i);
        match b.get(i)? {
            b'}' if out.is_empty() => return Some((open, out)),
            b'"' => {}
            _ => return None,
        }
        let key_end = skip_string(b, i)?;
        let raw = &b[i..key_end];
        let key = if raw.contains(&b'\\') {
            serde_json::from_slice::<String>(raw).ok()?
        } else {
            std::str::from_utf8(&raw[1..raw.len() - 1]).ok()?.to_owned()
        };
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(b, i + 1);
        let end = skip_value(b, i)?;
        out.push(Member {
            key,
            value: (i, end),
        });
        i = skip_ws(b, end);
        match b.get(i)? {
            b',' => i += 1,
            b'}' => return Some((open, out)),
            _ => return None,
        }
    }
}

fn spliced(b: &[u8], rw: &Rewrite<'_>) -> Option<Vec<u8>> {
    let (open, ms) = members(b)?;
    let mut edits: Vec<(usize, usize, Vec<u8>)> = Vec::new();
    if let Some(model) = rw.model {
        let m = ms.iter().find(|m| m.key == "model")?;
        edits.push((m.value.0, m.value.1, serde_json::to_vec(model).ok()?));
    }
    if rw.include_usage {
        match ms.iter().find(|m| m.key == "stream_options") {
            Some(m) => {
                let (start, end) = m.value;
                match serde_json::from_slice::<Value>(&b[start..end]) {
                    Ok(mut v) => {
                        match &mut v {
                            Value::Object(o) => {
                                o.insert("include_usage".into(), Value::Bool(true));
                            }
                            Value::Null => v = serde_json::json!({"include_usage": true}),
                            _ => return None,
                        }
                        edits.push((start, end, serde_json::to_vec(&v).ok()?));
                    }
                    // An object too deep for a `Value` (the parser skips
                    // unknown members at any depth): the member goes last,
                    // where a JSON reader that keeps the last of duplicate
                    // keys (Python's, vLLM's) finds it. Never skipped: the
                    // usage is what the tenant is billed from.
                    Err(_) if b[start] == b'{' && b[end - 1] == b'}' => {
                        let ins = b",\"include_usage\":true".to_vec();
                        edits.push((end - 1, end - 1, ins));
                    }
                    Err(_) => return None,
                }
            }
            None => {
                let sep = if ms.is_empty() { "" } else { "," };
                let ins = format!(r#""stream_options":{{"include_usage":true}}{sep}"#);
                edits.push((open, open, ins.into_bytes()));
            }
        }
    }
    if let Some(p) = rw.priority {
        let value = p.to_string().into_bytes();
        let mut found = false;
        // Every duplicate too: JSON readers differ on which one they keep.
        for m in ms.iter().filter(|m| m.key == "priority") {
            edits.push((m.value.0, m.value.1, value.clone()));
            found = true;
        }
        if !found {
            let sep = if ms.is_empty() { "" } else { "," };
            let ins = format!(r#""priority":{p}{sep}"#);
            edits.push((open, open, ins.into_bytes()));
        }
    }
    edits.sort_by_key(|e| e.0);
    let extra: usize = edits.iter().map(|e| e.2.len()).sum();
    let mut out = Vec::with_capacity(b.len() + extra);
    let mut at = 0;
    for (s, e, rep) in edits {
        if s < at {
            return None;
        }
        out.extend_from_slice(&b[at..s]);
        out.extend_from_slice(&rep);
        at = e;
    }
    out.extend_from_slice(&b[at..]);
    Some(out)
}

fn via_dom(b: &[u8], rw: &Rewrite<'_>) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(b).ok()?;
    let o = v.as_object_mut()?;
    if let Some(m) = rw.model {
        o.insert("model".into(), Value::String(m.into()));
    }
    if rw.include_usage {
        let so = o
            .entry("stream_options")
            .or_insert_with(|| Value::Object(Default::default()));
        if so.is_null() {
            *so = Value::Object(Default::default());
        }
        so.as_object_mut()?
            .insert("include_usage".into(), Value::Bool(true));
    }
    if let Some(p) = rw.priority {
        o.insert("priority".into(), Value::from(p));
    }
    serde_json::to_vec(&v).ok()
}

/// The rewritten body, or `None` when `body` is not a JSON object (callers
/// only rewrite bodies that parsed).
pub fn rewrite_body(body: &[u8], rw: &Rewrite<'_>) -> Option<Vec<u8>> {
    if rw.is_noop() {
        return Some(body.to_vec());
    }
    spliced(body, rw).or_else(|| via_dom(body, rw))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rw(body: &str, model: Option<&str>, include_usage: bool) -> String {
        with(
            body,
            Rewrite {
                model,
                include_usage,
                priority: None,
            },
        )
    }

    fn with(body: &str, rw: Rewrite<'_>) -> String {
        let out = rewrite_body(body.as_bytes(), &rw).unwrap();
        let s = String::from_utf8(out).unwrap();
        // Whatever the path, the result is valid JSON.
        serde_json::from_str::<Value>(&s).unwrap();
        s
    }

    #[test]
    fn model_is_replaced_in_place() {
        assert_eq!(
            rw(
                r#"{"messages":[{"role":"user","content":"model"}], "model" : "a", "x":1.50}"#,
                Some("b/c\"d"),
                false
            ),
            r#"{"messages":[{"role":"user","content":"model"}], "model" : "b/c\"d", "x":1.50}"#
        );
    }

    #[test]
    fn nested_model_keys_are_not_touched() {
        assert_eq!(
            rw(r#"{"meta":{"model":"x"},"model":"a"}"#, Some("b"), false),
            r#"{"meta":{"model":"x"},"model":"b"}"#
        );
    }

    #[test]
    fn escaped_key_is_found() {
        assert_eq!(
            rw(r#"{"mod\u0065l":"a"}"#, Some("b"), false),
            r#"{"mod\u0065l":"b"}"#
        );
    }

    #[test]
    fn include_usage_inserted_or_merged() {
        assert_eq!(
            rw(r#"{"model":"a","stream":true}"#, None, true),
            r#"{"stream_options":{"include_usage":true},"model":"a","stream":true}"#
        );
        assert_eq!(
            rw(
                r#"{"model":"a","stream_options":{"include_usage":false,"continuous_usage_stats":true}}"#,
                None,
                true
            ),
            r#"{"model":"a","stream_options":{"continuous_usage_stats":true,"include_usage":true}}"#
        );
        assert_eq!(
            rw(r#"{"model":"a","stream_options":null}"#, None, true),
            r#"{"model":"a","stream_options":{"include_usage":true}}"#
        );
        assert_eq!(
            rw(r#"{"model":"a","stream_options":{}}"#, Some("z"), true),
            r#"{"model":"z","stream_options":{"include_usage":true}}"#
        );
    }

    #[test]
    fn strings_with_brackets_and_escapes_are_skipped_right() {
        let body = r#"{"messages":[{"content":"}]\"{["}],"model":"a","n":[1,{"a":"]"}]}"#;
        assert_eq!(
            rw(body, Some("b"), false),
            r#"{"messages":[{"content":"}]\"{["}],"model":"b","n":[1,{"a":"]"}]}"#
        );
    }

    #[test]
    fn noop_and_non_objects() {
        assert_eq!(rw(r#"{"model":"a"}"#, None, false), r#"{"model":"a"}"#);
        assert_eq!(
            rewrite_body(
                b"[1]",
                &Rewrite {
                    model: Some("b"),
                    ..Rewrite::default()
                }
            ),
            None
        );
        assert_eq!(
            rewrite_body(
                b"nope",
                &Rewrite {
                    model: Some("b"),
                    ..Rewrite::default()
                }
            ),
            None
        );
    }

    #[test]
    fn include_usage_reaches_a_stream_options_too_deep_for_a_dom() {
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let body =
            format!(r#"{{"model":"a","stream_options":{{"include_usage":false,"x":{deep}}}}}"#);
        let out = rewrite_body(
            body.as_bytes(),
            &Rewrite {
                include_usage: true,
                ..Rewrite::default()
            },
        )
        .unwrap();
        let want = format!(
            r#"{{"model":"a","stream_options":{{"include_usage":false,"x":{deep},"include_usage":true}}}}"#
        );
        assert_eq!(String::from_utf8(out).unwrap(), want);
    }

    #[test]
    fn dom_fallback_when_the_member_is_missing() {
        // No top-level model: the splice gives up, the DOM path adds it.
        let s = rw(r#"{"x":1}"#, Some("b"), false);
        assert_eq!(serde_json::from_str::<Value>(&s).unwrap()["model"], "b");
    }

    fn prio(body: &str, p: i32) -> String {
        with(
            body,
            Rewrite {
                priority: Some(p),
                ..Rewrite::default()
            },
        )
    }

    #[test]
    fn priority_is_inserted_when_absent() {
        assert_eq!(
            prio(r#"{"model":"a","stream":true}"#, 1),
            r#"{"priority":1,"model":"a","stream":true}"#
        );
        assert_eq!(prio("{}", 0), r#"{"priority":0}"#);
        assert_eq!(prio(r#" { } "#, 2), r#" {"priority":2 } "#);
    }

    #[test]
    fn a_client_priority_is_replaced_every_time_it_appears() {
        // A tenant sending -100 to jump the engine's queue gets the pool's.
        assert_eq!(
            prio(r#"{"priority": -100, "model":"a"}"#, 1),
            r#"{"priority": 1, "model":"a"}"#
        );
        assert_eq!(
            prio(r#"{"priority":-1,"model":"a","priority":-2}"#, 0),
            r#"{"priority":0,"model":"a","priority":0}"#
        );
        assert_eq!(
            prio(r#"{"priorit\u0079":-5,"model":"a"}"#, 3),
            r#"{"priorit\u0079":3,"model":"a"}"#
        );
        // Not a number either: replaced all the same.
        assert_eq!(
            prio(r#"{"priority":{"x":[1]},"model":"a"}"#, 1),
            r#"{"priority":1,"model":"a"}"#
        );
        // Nested keys are the client's own.
        assert_eq!(
            prio(r#"{"metadata":{"priority":-9}}"#, 1),
            r#"{"priority":1,"metadata":{"priority":-9}}"#
        );
    }

    #[test]
    fn priority_with_the_other_rewrites() {
        let all = Rewrite {
            model: Some("z"),
            include_usage: true,
            priority: Some(4),
        };
        assert_eq!(
            with(r#"{"model":"a","stream":true}"#, all),
            r#"{"stream_options":{"include_usage":true},"priority":4,"model":"z","stream":true}"#
        );
        assert_eq!(
            with(r#"{"model":"a","priority":-3,"stream":true}"#, all),
            r#"{"stream_options":{"include_usage":true},"model":"z","priority":4,"stream":true}"#
        );
        assert!(!all.is_noop());
        assert!(Rewrite::default().is_noop());
    }

    #[test]
    fn priority_through_the_dom_fallback() {
        // No top-level model to replace: the splice gives up, the DOM path
        // sets both.
        let s = with(
            r#"{"x":1,"priority":-1}"#,
            Rewrite {
                model: Some("b"),
                include_usage: false,
                priority: Some(2),
            },
        );
        let v: Value = serde_json::from_str(&s).unwrap();
        assert_eq!(
            (v["model"].as_str(), v["priority"].as_i64()),
            (Some("b"), Some(2))
        );
    }
}
