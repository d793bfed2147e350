//! YAML (and JSON, a subset of YAML 1.2) documents with the line and column
//! of every node, so an error's field path can be shown as `file:line:col`.
//!
//! Built from saphyr-parser's events (a small, pure-Rust YAML 1.2 parser
//! that reports positions); each document becomes a `serde_json::Value`
//! plus an index from field path (`spec.match.models[0]`, the format
//! serde_path_to_error writes) to position. A mapping entry's position is
//! its key's: the line a person looks at.

use std::collections::BTreeMap;

use saphyr_parser::{Event, Parser, ScalarStyle, ScanError, Span};
use serde_json::{Map, Number, Value};

/// A 1-based line and column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Pos {
    /// Line, from 1.
    pub line: usize,
    /// Column, from 1.
    pub column: usize,
}

/// One document of a file.
#[derive(Debug, Clone)]
pub struct Doc {
    /// 1-based index of the document in its file.
    pub index: usize,
    /// The document as JSON.
    pub value: Value,
    /// Where the document starts.
    pub start: Pos,
    /// Field path -> position.
    pub positions: BTreeMap<String, Pos>,
}

impl Doc {
    /// The position of `path`, or of its nearest parent that has one.
    pub fn position(&self, path: &str) -> Pos {
        let mut p = path;
        loop {
            if let Some(pos) = self.positions.get(p) {
                return *pos;
            }
            match p.rfind(['.', '[']) {
                Some(i) => p = &p[..i],
                None => return self.start,
            }
        }
    }
}

/// A file that is not valid YAML.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} (line {}, column {})", pos.line, pos.column)]
pub struct SyntaxError {
    /// Where.
    pub pos: Pos,
    /// Why.
    pub message: String,
}

fn pos(span: &Span) -> Pos {
    Pos {
        line: span.start.line(),
        column: span.start.col() + 1,
    }
}

fn scan_err(e: ScanError) -> SyntaxError {
    SyntaxError {
        pos: Pos {
            line: e.marker().line(),
            column: e.marker().col() + 1,
        },
        message: e.info().to_owned(),
    }
}

/// A path segment for a mapping key: `.key`, or `["key"]` when the key has
/// characters a dotted path cannot carry.
pub fn key_segment(key: &str) -> String {
    if !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        format!(".{key}")
    } else {
        format!("[{}]", Value::String(key.to_owned()))
    }
}

fn join(path: &str, seg: &str) -> String {
    let p = format!("{path}{seg}");
    p.strip_prefix('.').map(str::to_owned).unwrap_or(p)
}

/// YAML 1.2 core schema resolution of a plain scalar.
fn plain(s: &str) -> Value {
    match s {
        "" | "~" | "null" | "Null" | "NULL" => return Value::Null,
        "true" | "True" | "TRUE" => return Value::Bool(true),
        "false" | "False" | "FALSE" => return Value::Bool(false),
        _ => {}
    }
    if let Ok(i) = s.parse::<i64>() {
        return Value::Number(i.into());
    }
    if let Ok(u) = s.parse::<u64>() {
        return Value::Number(u.into());
    }
    let hex = s
        .strip_prefix("0x")
        .and_then(|h| i64::from_str_radix(h, 16).ok());
    let oct = s
        .strip_prefix("0o")
        .and_then(|h| i64::from_str_radix(h, 8).ok());
    if let Some(i) = hex.or(oct) {
        return Value::Number(i.into());
    }
    let looks_float = s.bytes().any(|b| b.is_ascii_digit())
        && s.bytes()
            .all(|b| b.is_ascii_digit() || b"+-.eE".contains(&b));
    if looks_float {
        if let Some(n) = s.parse::<f64>().ok().and_then(Number::from_f64) {
            return Value::Number(n);
        }
    }
    Value::String(s.to_owned())
}

struct Builder<'a> {
    events: std::iter::Peekable<Parser<'a, saphyr_parser::StrInput<'a>>>,
    anchors: BTreeMap<usize, Value>,
    positions: BTreeMap<String, Pos>,
}

impl<'a> Builder<'a> {
    fn next(&mut self) -> Result<(Event<'a>, Span), SyntaxError> {
        match self.events.next() {
            Some(r) => r.map_err(scan_err),
            None => Err(SyntaxError {
                pos: Pos { line: 1, column: 1 },
                message: "unexpected end of input".into(),
            }),
        }
    }

    /// Builds the node starting with `ev` at `path`.
    fn node(&mut self, ev: Event<'a>, span: Span, path: &str) -> Result<Value, SyntaxError> {
        self.positions.entry(path.to_owned()).or_insert(pos(&span));
        let (v, anchor) = match ev {
            Event::Scalar(s, style, anchor, _) => {
                let v = if style == ScalarStyle::Plain {
                    plain(&s)
                } else {
                    Value::String(s.into_owned())
                };
                (v, anchor)
            }
            Event::Alias(id) => match self.anchors.get(&id) {
                Some(v) => (v.clone(), 0),
                None => return Err(err(&span, "unknown alias")),
            },
            Event::SequenceStart(anchor, _) => (self.sequence(path)?, anchor),
            Event::MappingStart(anchor, _) => (self.mapping(path)?, anchor),
            _ => return Err(err(&span, "unexpected YAML event")),
        };
        if anchor != 0 {
            self.anchors.insert(anchor, v.clone());
        }
        Ok(v)
    }

    fn sequence(&mut self, path: &str) -> Result<Value, SyntaxError> {
        let mut items = Vec::new();
        loop {
            let (ev, span) = self.next()?;
            if matches!(ev, Event::SequenceEnd) {
                return Ok(Value::Array(items));
            }
            let p = format!("{path}[{}]", items.len());
            items.push(self.node(ev, span, &p)?);
        }
    }

    fn mapping(&mut self, path: &str) -> Result<Value, SyntaxError> {
        let mut map = Map::new();
        loop {
            let (ev, span) = self.next()?;
            if matches!(ev, Event::MappingEnd) {
                return Ok(Value::Object(map));
            }
            let key = match self.node(ev, span, "\u{0}key")? {
                Value::String(s) => s,
                Value::Null => String::new(),
                other => other.to_string(),
            };
            if map.contains_key(&key) {
                return Err(err(&span, &format!("duplicate key `{key}`")));
            }
            let p = join(path, &key_segment(&key));
            self.positions.insert(p.clone(), pos(&span));
            let (ev, vspan) = self.next()?;
            let v = self.node(ev, vspan, &p)?;
            map.insert(key, v);
        }
    }
}

fn err(span: &Span, message: &str) -> SyntaxError {
    SyntaxError {
        pos: pos(span),
        message: message.to_owned(),
    }
}

/// Every document of `text` (empty documents are skipped but counted).
pub fn parse(text: &str) -> Result<Vec<Doc>, SyntaxError> {
    let mut b = Builder {
        events: Parser::new_from_str(text).peekable(),
        anchors: BTreeMap::new(),
        positions: BTreeMap::new(),
    };
    let mut docs = Vec::new();
    let mut index = 0;
    loop {
        let (ev, span) = b.next()?;
        match ev {
            Event::StreamStart | Event::DocumentEnd | Event::Nothing => {}
            Event::StreamEnd => return Ok(docs),
            Event::DocumentStart(_) => {
                index += 1;
                b.positions.clear();
                b.anchors.clear();
                let (ev, vspan) = b.next()?;
                if matches!(ev, Event::DocumentEnd) {
                    continue;
                }
                let value = b.node(ev, vspan, "")?;
                b.positions.remove("\u{0}key");
                if !value.is_null() {
                    docs.push(Doc {
                        index,
                        value,
                        start: pos(&span),
                        positions: std::mem::take(&mut b.positions),
                    });
                }
            }
            _ => return Err(err(&span, "unexpected YAML event")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_of_keys_and_items() {
        let text =
            "a: 1\n---\n# c\nspec:\n  match:\n    models:\n      - x\n      - \"y\"\n  n: 0x10\n";
        let docs = parse(text).unwrap();
        assert_eq!(docs.len(), 2);
        let d = &docs[1];
        assert_eq!(d.index, 2);
        assert_eq!(d.value["spec"]["match"]["models"][1], "y");
        assert_eq!(d.value["spec"]["n"], 16);
        assert_eq!(d.position("spec.match"), Pos { line: 5, column: 3 });
        assert_eq!(
            d.position("spec.match.models[1]"),
            Pos { line: 8, column: 9 }
        );
        // Unknown paths fall back to the nearest parent.
        assert_eq!(d.position("spec.match.modle"), Pos { line: 5, column: 3 });
    }

    #[test]
    fn scalars_resolve_like_yaml_1_2() {
        let d = &parse("[1, -2, 1.5, true, null, '3', x, 1e3, ~]").unwrap()[0];
        assert_eq!(
            d.value,
            serde_json::json!([1, -2, 1.5, true, null, "3", "x", 1000.0, null])
        );
    }

    #[test]
    fn json_and_anchors() {
        let d = &parse("{\"a\": {\"b\": [1, 2]}}").unwrap()[0];
        assert_eq!(d.value["a"]["b"][1], 2);
        let d = &parse("x: &a {k: 1}\ny: *a\n").unwrap()[0];
        assert_eq!(d.value["y"]["k"], 1);
        let d = &parse("metadata:\n  annotations:\n    kvasir.dev/models: m\n").unwrap()[0];
        assert_eq!(
            d.position("metadata.annotations[\"kvasir.dev/models\"]"),
            Pos { line: 3, column: 5 }
        );
    }

    #[test]
    fn syntax_errors_have_positions() {
        let e = parse("a: [1, 2\nb: 3\n").unwrap_err();
        assert!(e.pos.line >= 1, "{e}");
        let e = parse("a: 1\na: 2\n").unwrap_err();
        assert_eq!(e.pos, Pos { line: 2, column: 1 });
        assert!(e.message.contains("duplicate key"));
    }
}
