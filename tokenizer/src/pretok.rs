//! A hand-written scanner equivalent to Qwen2/Qwen3's split regex
//!
//! ```text
//! (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
//! ```
//!
//! as Oniguruma (what Hugging Face `tokenizers` and so vLLM run) evaluates
//! it: leftmost-first alternation with backtracking. The regex engine is the
//! slowest part of the reference tokenizer; this scanner decides each piece
//! from at most a few character classes.
//!
//! Every character falls in exactly one class: letter (`\p{L}`), number
//! (`\p{N}`), whitespace (`\s`, Unicode White_Space) or other. The tables
//! come from `regex-syntax`, pinned to Unicode 16.0, the version of the
//! Oniguruma bundled with `tokenizers`, so that characters assigned later
//! are classed as "other" there and here alike.

use std::ops::ControlFlow;
use std::sync::OnceLock;

use crate::TokenizerError;

/// The exact pattern this scanner implements; any other is refused at load.
pub(crate) const QWEN_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

const OTHER: u8 = 0;
const LETTER: u8 = 1;
const NUMBER: u8 = 2;
const SPACE: u8 = 3;

/// Character classes: a flat table for the BMP (64 KiB, one lookup) and
/// sorted ranges for the rest.
pub(crate) struct Classes {
    bmp: Box<[u8]>,
    astral: Vec<(u32, u32, u8)>,
}

fn class_ranges(pattern: &str) -> Result<Vec<(u32, u32)>, TokenizerError> {
    use regex_syntax::hir::{Class, HirKind};
    let hir = regex_syntax::Parser::new()
        .parse(pattern)
        .map_err(|e| TokenizerError::Invalid(format!("class {pattern}: {e}")))?;
    match hir.kind() {
        HirKind::Class(Class::Unicode(c)) => Ok(c
            .ranges()
            .iter()
            .map(|r| (r.start() as u32, r.end() as u32))
            .collect()),
        _ => Err(TokenizerError::Invalid(format!(
            "class {pattern} is not a Unicode class"
        ))),
    }
}

impl Classes {
    fn build() -> Result<Self, TokenizerError> {
        let mut bmp = vec![OTHER; 0x10000].into_boxed_slice();
        let mut astral = Vec::new();
        // `Age=V16_0` is cumulative: assigned in Unicode 16.0 or earlier.
        for (pattern, class) in [
            (r"[\p{L}&&\p{Age=V16_0}]", LETTER),
            (r"[\p{N}&&\p{Age=V16_0}]", NUMBER),
            (r"[\s&&\p{Age=V16_0}]", SPACE),
        ] {
            for (lo, hi) in class_ranges(pattern)? {
                for cp in lo..=hi.min(0xFFFF) {
                    bmp[cp as usize] = class;
                }
                if hi > 0xFFFF {
                    astral.push((lo.max(0x10000), hi, class));
                }
            }
        }
        astral.sort_unstable();
        Ok(Classes { bmp, astral })
    }

    pub(crate) fn get() -> Result<&'static Classes, TokenizerError> {
        static CLASSES: OnceLock<Result<Classes, String>> = OnceLock::new();
        CLASSES
            .get_or_init(|| Classes::build().map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| TokenizerError::Invalid(e.clone()))
    }

    #[inline]
    fn of(&self, c: char) -> u8 {
        let cp = c as u32;
        if let Some(&k) = self.bmp.get(cp as usize) {
            return k;
        }
        match self.astral.binary_search_by(|&(lo, hi, _)| {
            if hi < cp {
                std::cmp::Ordering::Less
            } else if lo > cp {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        }) {
            Ok(i) => self.astral[i].2,
            Err(_) => OTHER,
        }
    }
}

/// Splits `text` into the regex's pieces, calling `f` with each, in order.
/// The pieces cover `text` exactly (every character matches some branch).
/// Stops when `f` breaks; the break carries the byte offset just past the
/// piece `f` broke on.
pub(crate) fn try_for_each_piece<'t>(
    classes: &Classes,
    text: &'t str,
    mut f: impl FnMut(&'t str) -> ControlFlow<()>,
) -> ControlFlow<usize> {
    let s = Scanner { classes, text };
    let mut i = 0;
    while i < text.len() {
        let end = s.piece_end(i);
        debug_assert!(end > i && text.is_char_boundary(end));
        if f(&text[i..end]).is_break() {
            return ControlFlow::Break(end);
        }
        i = end;
    }
    ControlFlow::Continue(())
}

/// Start of the run of whitespace that ends `text` (its length when it
/// ends otherwise).
pub(crate) fn trailing_space_start(classes: &Classes, text: &str) -> usize {
    text.char_indices()
        .rev()
        .take_while(|&(_, c)| classes.of(c) == SPACE)
        .last()
        .map_or(text.len(), |(i, _)| i)
}

struct Scanner<'a> {
    classes: &'a Classes,
    text: &'a str,
}

impl Scanner<'_> {
    /// The character at byte `i`, its class and UTF-8 length.
    #[inline]
    fn at(&self, i: usize) -> Option<(char, u8, usize)> {
        let b = *self.text.as_bytes().get(i)?;
        if b < 0x80 {
            return Some((b as char, self.classes.bmp[b as usize], 1));
        }
        let c = self.text[i..].chars().next()?;
        Some((c, self.classes.of(c), c.len_utf8()))
    }

    #[inline]
    fn class_at(&self, i: usize) -> Option<u8> {
        self.at(i).map(|(_, k, _)| k)
    }

    /// End of the run of characters of `class` starting at `i`.
    #[inline]
    fn run_end(&self, mut i: usize, class: u8) -> usize {
        let bytes = self.text.as_bytes();
        while i < bytes.len() {
            let b = bytes[i];
            if b < 0x80 {
                if self.classes.bmp[b as usize] != class {
                    break;
                }
                i += 1;
            } else {
                match self.at(i) {
                    Some((_, k, n)) if k == class => i += n,
                    _ => break,
                }
            }
        }
        i
    }

    /// Length of `s|t|re|ve|m|ll|d` (case-insensitive, Unicode simple case
    /// folding) at `i`, just after an apostrophe.
    fn contraction_len(&self, i: usize) -> Option<usize> {
        let rest = &self.text.as_bytes()[i..];
        let lower = |k: usize| rest.get(k).map(|b| b.to_ascii_lowercase());
        match lower(0)? {
            b's' | b't' | b'm' | b'd' => Some(1),
            b'r' | b'v' if lower(1) == Some(b'e') => Some(2),
            b'l' if lower(1) == Some(b'l') => Some(2),
            // U+017F LATIN SMALL LETTER LONG S case-folds to `s`, and
            // Oniguruma's `(?i)` honours that.
            0xC5 if rest.get(1) == Some(&0xBF) => Some(2),
            _ => None,
        }
    }

    fn piece_end(&self, i: usize) -> usize {
        let Some((c, class, n)) = self.at(i) else {
            return self.text.len();
        };
        let next = i + n;
        let is_crlf = c == '\r' || c == '\n';

        // (?i:'s|'t|'re|'ve|'m|'ll|'d)
        if c == '\'' {
            if let Some(len) = self.contraction_len(next) {
                return next + len;
            }
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if class == LETTER {
            return self.run_end(next, LETTER);
        }
        let next_class = self.class_at(next);
        if class != NUMBER && !is_crlf && next_class == Some(LETTER) {
            return self.run_end(next, LETTER);
        }
        // \p{N}
        if class == NUMBER {
            return next;
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        let punct_start = if class == OTHER {
            Some(i)
        } else if c == ' ' && next_class == Some(OTHER) {
            Some(next)
        } else {
            None
        };
        if let Some(p) = punct_start {
            let end = self.run_end(p, OTHER);
            let bytes = self.text.as_bytes();
            let mut j = end;
            while j < bytes.len() && (bytes[j] == b'\r' || bytes[j] == b'\n') {
                j += 1;
            }
            return j;
        }
        // Whitespace from here on: `\s*[\r\n]+`, then `\s+(?!\S)`, then `\s+`.
        let mut j = i;
        let mut after_last_crlf = None;
        let mut last_start = i;
        while let Some((c, k, n)) = self.at(j) {
            if k != SPACE {
                break;
            }
            last_start = j;
            j += n;
            if c == '\r' || c == '\n' {
                after_last_crlf = Some(j);
            }
        }
        if let Some(end) = after_last_crlf {
            // Greedy `\s*` backs off to the last newline of the run, and
            // `[\r\n]+` then takes just that one.
            return end;
        }
        if j == self.text.len() || last_start == i {
            // Run reaches the end (lookahead holds), or a single space
            // before a non-space (`\s+` fallback).
            return j;
        }
        // `\s+(?!\S)` backs off one character so the last space can start
        // the next piece (e.g. " word").
        last_start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str) -> Vec<&str> {
        let classes = Classes::get().expect("classes");
        let mut out = Vec::new();
        let _ = try_for_each_piece(classes, text, |p| {
            out.push(p);
            ControlFlow::Continue(())
        });
        out
    }

    #[test]
    fn english_and_contractions() {
        assert_eq!(
            pieces("I'LL don't you've"),
            ["I", "'LL", " don", "'t", " you", "'ve"]
        );
        assert_eq!(pieces("'sup 'x"), ["'s", "up", " '", "x"]);
        // Oniguruma's own split of this text (checked with `tokenizers`'
        // pre-tokenizer); no Qwen3 merge involves `ſ`, so ids cannot show it.
        assert_eq!(pieces("'ſtate"), ["'ſ", "tate"]);
    }

    #[test]
    fn numbers_split_per_digit() {
        assert_eq!(pieces("abc123 4"), ["abc", "1", "2", "3", " ", "4"]);
    }

    #[test]
    fn punctuation_and_newlines() {
        assert_eq!(pieces("a...\n\nb"), ["a", "...\n\n", "b"]);
        assert_eq!(pieces(" (x)"), [" (", "x", ")"]);
        assert_eq!(pieces("(hello"), ["(hello"]);
    }

    #[test]
    fn whitespace_runs() {
        assert_eq!(pieces("a   b"), ["a", "  ", " b"]);
        assert_eq!(pieces("a \n  b"), ["a", " \n", " ", " b"]);
        assert_eq!(pieces("a  "), ["a", "  "]);
        assert_eq!(pieces("a \t1"), ["a", " ", "\t", "1"]);
        assert_eq!(pieces("\r\n\r\nx"), ["\r\n\r\n", "x"]);
        assert_eq!(pieces("\tx"), ["\tx"]);
    }

    #[test]
    fn unicode_classes() {
        let c = Classes::get().expect("classes");
        assert_eq!(c.of('é'), LETTER);
        assert_eq!(c.of('中'), LETTER);
        assert_eq!(c.of('½'), NUMBER);
        assert_eq!(c.of('\u{3000}'), SPACE);
        assert_eq!(c.of('\u{1F600}'), OTHER);
        assert_eq!(c.of('\u{10400}'), LETTER); // Deseret, astral
        assert_eq!(c.of('\u{1D7CE}'), NUMBER); // mathematical bold digit zero
        assert_eq!(pieces("你好，世界"), ["你好", "，世界"]);
    }
}
