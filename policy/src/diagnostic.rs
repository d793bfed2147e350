//! A finding of validation: where, why, how serious. Its own module so
//! that the checks of each part (budgets, flow control) and the whole
//! set's validation share it without depending on each other.

use std::fmt;

use serde::{Deserialize, Serialize};

/// How serious a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Severity {
    /// The policy set is refused.
    Error,
    /// Accepted, but probably not what the author meant.
    Warning,
}

/// One finding: where, why, how serious.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ValidationError {
    /// Where: e.g. `policies[2].match.models[0]`; empty for the whole set.
    pub path: String,
    /// Why, in a sentence a person can act on.
    pub message: String,
    /// Error or warning.
    pub severity: Severity,
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.severity == Severity::Warning {
            f.write_str("warning: ")?;
        }
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

impl std::error::Error for ValidationError {}
