//! Model-name globs: `*` matches any run of characters (also none), `?`
//! exactly one character; everything else is literal.
//!
//! Patterns are parsed once (at compile time and again when the filter
//! loads its config) into literal segments, so matching a request is a
//! handful of `starts_with`/`find` calls with no allocation.

use std::fmt;

/// Characters that other glob dialects give a meaning; rejected so a
/// pattern never silently means something else than its author thought.
const RESERVED: &[char] = &['[', ']', '{', '}', '\\', '!'];

/// Why a pattern is not a valid glob.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GlobError {
    /// Empty pattern.
    #[error("empty pattern")]
    Empty,
    /// A reserved character.
    #[error("`{0}` is not supported (only `*` and `?` are special)")]
    Reserved(char),
    /// Whitespace or a control character (never part of a model name).
    #[error("whitespace or control characters are not allowed")]
    Whitespace,
    /// `**`, which is the same as `*` here but means "across segments"
    /// elsewhere.
    #[error("`**` is not supported (use `*`)")]
    DoubleStar,
}

/// One element of a parsed glob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tok {
    Lit(char),
    /// `?`: exactly one character.
    One,
    /// `*`: any run of characters.
    Star,
}

/// A parsed glob pattern.
#[derive(Clone, PartialEq, Eq)]
pub struct Glob {
    source: String,
    toks: Vec<Tok>,
}

impl fmt::Debug for Glob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Glob({:?})", self.source)
    }
}

/// Whether a pattern contains glob syntax (otherwise it is an exact name).
pub fn is_glob(pattern: &str) -> bool {
    pattern.contains(['*', '?'])
}

impl Glob {
    /// Parses a pattern.
    pub fn parse(pattern: &str) -> Result<Glob, GlobError> {
        if pattern.is_empty() {
            return Err(GlobError::Empty);
        }
        if pattern.contains("**") {
            return Err(GlobError::DoubleStar);
        }
        let mut toks = Vec::with_capacity(pattern.len());
        for c in pattern.chars() {
            if c.is_whitespace() || c.is_control() {
                return Err(GlobError::Whitespace);
            }
            if RESERVED.contains(&c) {
                return Err(GlobError::Reserved(c));
            }
            toks.push(match c {
                '*' => Tok::Star,
                '?' => Tok::One,
                c => Tok::Lit(c),
            });
        }
        Ok(Glob {
            source: pattern.to_owned(),
            toks,
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Whether `text` matches the whole pattern.
    ///
    /// The classic two-pointer wildcard match: on a mismatch it only ever
    /// backtracks to the last `*`, so the cost is at most (text length x
    /// pattern length) even for a hostile model name like a long run of
    /// `a` against `*a*a*a*b`: the model string comes from the client.
    pub fn matches(&self, text: &str) -> bool {
        let p = &self.toks;
        let (mut pi, mut ti) = (0, 0);
        // (pattern index after the last star, text index it matched up to)
        let mut star: Option<(usize, usize)> = None;
        while let Some(c) = text[ti..].chars().next() {
            match p.get(pi) {
                Some(Tok::One) => {
                    pi += 1;
                    ti += c.len_utf8();
                    continue;
                }
                Some(Tok::Lit(l)) if *l == c => {
                    pi += 1;
                    ti += c.len_utf8();
                    continue;
                }
                Some(Tok::Star) => {
                    pi += 1;
                    star = Some((pi, ti));
                    continue;
                }
                _ => {}
            }
            // Mismatch: let the last star swallow one more character.
            let Some((sp, st)) = star else {
                return false;
            };
            let next = st + text[st..].chars().next().map_or(1, char::len_utf8);
            star = Some((sp, next));
            pi = sp;
            ti = next;
        }
        p[pi..].iter().all(|t| *t == Tok::Star)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(p: &str, t: &str) -> bool {
        Glob::parse(p).unwrap().matches(t)
    }

    #[test]
    fn literals_and_stars() {
        assert!(m("llama-3-8b", "llama-3-8b"));
        assert!(!m("llama-3-8b", "llama-3-8b-instruct"));
        assert!(m("llama-*", "llama-3-8b"));
        assert!(m("llama-*", "llama-"));
        assert!(!m("llama-*", "llam"));
        assert!(m("*-instruct", "qwen3-8b-instruct"));
        assert!(m("*", ""));
        assert!(m("meta-llama/*-8b*", "meta-llama/Llama-3.1-8b-Instruct"));
        assert!(!m("meta-llama/*-8b*", "meta-llama/Llama-3.1-70b-Instruct"));
        assert!(m("a*b*c", "aXbYbZc"));
        assert!(!m("a*b*c", "aXbYbZ"));
        assert!(m("*a", "aaa"));
    }

    #[test]
    fn question_marks_count_characters() {
        assert!(m("gpt-4?", "gpt-4o"));
        assert!(!m("gpt-4?", "gpt-4"));
        assert!(!m("gpt-4?", "gpt-4oo"));
        assert!(m("q??n", "qwen"));
        assert!(m("caf?", "café"));
        assert!(m("*?", "x"));
        assert!(!m("*?", ""));
        assert!(m("*??x", "abx"));
        assert!(!m("*??x", "bx"));
    }

    #[test]
    fn bad_patterns() {
        assert_eq!(Glob::parse(""), Err(GlobError::Empty));
        assert_eq!(Glob::parse("llama-[38]b"), Err(GlobError::Reserved('[')));
        assert_eq!(Glob::parse("a**"), Err(GlobError::DoubleStar));
        assert_eq!(Glob::parse("a b"), Err(GlobError::Whitespace));
        assert_eq!(Glob::parse("{a,b}"), Err(GlobError::Reserved('{')));
    }

    #[test]
    fn hostile_inputs_stay_linear() {
        let g = Glob::parse("*a*a*a*a*a*b").unwrap();
        let text = "a".repeat(200_000);
        let t = std::time::Instant::now();
        assert!(!g.matches(&text));
        assert!(g.matches(&format!("{text}b")));
        // Quadratic at worst in the pattern, never exponential.
        assert!(
            t.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn is_glob_detects_syntax() {
        assert!(is_glob("a*"));
        assert!(is_glob("a?"));
        assert!(!is_glob("meta-llama/Llama-3.1-8B"));
    }
}
