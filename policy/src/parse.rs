//! Parsing a policy set from JSON, with the path of the first error.
//!
//! YAML is the CLI's business (this crate stays serde + serde_json only);
//! it can reuse [`deserialize_with_path`] with any serde deserializer, e.g.
//! `serde_yaml::Deserializer`, to get the same paths.

use std::fmt;

use serde::Deserializer;

use crate::json_error::{path_string, serde_message};
use crate::types::PolicySet;

/// A JSON parse error: where in the document (path and position) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// Path of the offending value, e.g. `policies[2].match.modle`; empty
    /// at the document root.
    pub path: String,
    /// 1-based line.
    pub line: usize,
    /// 1-based column.
    pub column: usize,
    /// What went wrong (serde's words, e.g. "unknown field `modle`,
    /// expected one of ...").
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.path.is_empty() {
            write!(f, "{}: ", self.path)?;
        }
        write!(
            f,
            "{} (line {}, column {})",
            self.message, self.line, self.column
        )
    }
}

impl std::error::Error for ParseError {}

/// An error of any deserializer, with the path where it happened.
#[derive(Debug)]
pub struct PathError<E> {
    /// Path of the offending value; empty at the root.
    pub path: String,
    /// The deserializer's error (with its own position information).
    pub error: E,
}

impl<E: fmt::Display> fmt::Display for PathError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.error)
        } else {
            write!(f, "{}: {}", self.path, self.error)
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for PathError<E> {}

/// Deserializes a [`PolicySet`] from any serde deserializer, tracking the
/// path (for the CLI's YAML input).
pub fn deserialize_with_path<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<PolicySet, PathError<D::Error>> {
    serde_path_to_error::deserialize(d).map_err(|e| PathError {
        path: path_string(e.path()),
        error: e.into_inner(),
    })
}

/// Parses a policy set from JSON text. Only the shape is checked here; run
/// [`crate::validate()`] (or [`crate::compile()`]) for the meaning.
pub fn parse_json(text: &str) -> Result<PolicySet, ParseError> {
    parse_json_slice(text.as_bytes())
}

/// [`parse_json`] on bytes.
pub fn parse_json_slice(bytes: &[u8]) -> Result<PolicySet, ParseError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let res = match serde_path_to_error::deserialize(&mut de) {
        Ok(set) => de.end().map(|()| set).map_err(|e| (String::new(), e)),
        Err(e) => Err((path_string(e.path()), e.into_inner())),
    };
    res.map_err(|(path, e)| ParseError {
        path,
        line: e.line(),
        column: e.column(),
        message: serde_message(&e),
    })
}
