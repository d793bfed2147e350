//! Status conditions from compile findings, for the controller: one
//! `Accepted` condition per resource, `False` with the first error's path
//! and message when the resource is why a target does not compile.

use kvasir_policy::Severity;

use crate::assemble::{Finding, ObjectRef};
use crate::types::Condition;

/// Condition type: the resource is valid and compiled into its targets.
pub const ACCEPTED: &str = "Accepted";
/// Condition type: the Secrets, pools and providers it names exist.
pub const RESOLVED_REFS: &str = "ResolvedRefs";
/// Reason of a `True` `Accepted`.
pub const REASON_ACCEPTED: &str = "Accepted";
/// Reason of a `False` `Accepted`.
pub const REASON_INVALID: &str = "Invalid";
/// Condition type: the configuration in force holds the object.
pub const PROGRAMMED: &str = "Programmed";
/// `controllerName` of the controller's `status.ancestors` entries.
pub const CONTROLLER_NAME: &str = "kvasir.dev/controller";
/// Reason: a Gateway or HTTPRoute the object targets does not exist.
pub const REASON_TARGET_NOT_FOUND: &str = "TargetNotFound";

/// The `Accepted` condition of `object` given every finding of its
/// namespace's compiles. `now` is RFC 3339 (the caller owns the clock, so
/// this stays pure).
pub fn accepted(
    object: &ObjectRef,
    findings: &[Finding],
    generation: Option<i64>,
    now: &str,
) -> Condition {
    let first = findings
        .iter()
        .find(|f| f.severity == Severity::Error && f.object.as_ref() == Some(object));
    let (status, reason, message) = match first {
        None => ("True", REASON_ACCEPTED, String::new()),
        Some(f) if f.path.is_empty() => ("False", REASON_INVALID, f.message.clone()),
        Some(f) => (
            "False",
            REASON_INVALID,
            format!("{}: {}", f.path, f.message),
        ),
    };
    Condition {
        type_: ACCEPTED.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: generation,
        last_transition_time: now.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepted_names_the_first_error() {
        let o = ObjectRef {
            kind: "InferencePolicy",
            name: "p".into(),
        };
        let f = vec![Finding {
            object: Some(o.clone()),
            path: "spec.action.route.pool".into(),
            message: "unknown pool `x`".into(),
            severity: Severity::Error,
        }];
        let c = accepted(&o, &f, Some(3), "2026-01-01T00:00:00Z");
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("False", "Invalid"));
        assert_eq!(c.message, "spec.action.route.pool: unknown pool `x`");
        assert_eq!(c.observed_generation, Some(3));
        let c = accepted(&o, &[], None, "2026-01-01T00:00:00Z");
        assert_eq!(c.status, "True");
    }
}
