//! What a namespace's reconcile should write, decided without I/O: the
//! status conditions of every `kvasir.dev` object and whether a deleted
//! object may let go of its finalizer. [`crate::reconcile`] does the calls.

use std::collections::{BTreeMap, BTreeSet};

use kvasir_api::assemble::{Finding, ObjectRef};
use kvasir_api::status::{ACCEPTED, REASON_ACCEPTED, REASON_INVALID, RESOLVED_REFS};
use kvasir_api::{Condition, TargetRef};
use kvasir_policy::Severity;

/// The finalizer on every `kvasir.dev` object: a deleted object stays
/// until the configuration in force no longer holds it.
pub const FINALIZER: &str = "kvasir.dev/controller";
/// Condition type: the object is in the configuration Envoy runs.
pub const PROGRAMMED: &str = "Programmed";

/// One `kvasir.dev` object as the plan sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    /// Kind and name.
    pub id: ObjectRef,
    /// `metadata.generation`.
    pub generation: Option<i64>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// Carries [`FINALIZER`].
    pub finalized: bool,
    /// `status.conditions` as read.
    pub conditions: Vec<Condition>,
    /// The targets it names (policies, settings); `None`: every target of
    /// its namespace (tenants, providers).
    pub targets: Option<BTreeSet<TargetRef>>,
}

/// How one target's reconcile ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Applied: the EnvoyExtensionPolicy holds this config.
    Applied {
        /// The policy's name.
        policy: String,
        /// `sha256:<hex>` of the config.
        hash: String,
    },
    /// Does not compile; the last good configuration stays.
    Invalid(Vec<Finding>),
    /// Another field manager owns the policy's fields; not forced.
    Conflicted(String),
    /// The API server refused or failed; retried.
    Failed(String),
}

/// Every target's outcome, and findings (errors of invalid targets,
/// warnings of valid ones) by object.
#[derive(Debug, Default)]
pub struct Outcomes {
    /// By target.
    pub targets: BTreeMap<TargetRef, Outcome>,
    /// Warnings of targets that compiled.
    pub warnings: Vec<Finding>,
}

impl Outcomes {
    fn findings(&self) -> impl Iterator<Item = &Finding> {
        let errors = self.targets.values().flat_map(|o| match o {
            Outcome::Invalid(f) => f.as_slice(),
            _ => &[],
        });
        errors.chain(self.warnings.iter())
    }
}

/// Why a finding is about a reference (a `ResolvedRefs` matter) rather
/// than the object's own fields: the reason it gets, or `None`.
pub fn ref_reason(f: &Finding) -> Option<&'static str> {
    if f.path.contains("secretRef") {
        return Some(if f.message.contains("not found") {
            "SecretNotFound"
        } else {
            "InvalidSecret"
        });
    }
    if f.message.starts_with("unknown pool") {
        return Some("PoolNotFound");
    }
    if f.message.starts_with("unknown provider") {
        return Some("ProviderNotFound");
    }
    None
}

/// The conditions `object` should carry. `now` is RFC 3339; a condition
/// whose status did not change keeps its old `lastTransitionTime`.
pub fn conditions(object: &Object, outcomes: &Outcomes, now: &str) -> Vec<Condition> {
    let mine: Vec<&Finding> = outcomes
        .findings()
        .filter(|f| f.severity == Severity::Error && f.object.as_ref() == Some(&object.id))
        .collect();
    let own_error = mine.iter().find(|f| ref_reason(f).is_none());
    let ref_error = mine.iter().find_map(|f| ref_reason(f).map(|r| (r, *f)));
    let gen = object.generation;
    let accepted = match own_error {
        None => cond(ACCEPTED, true, REASON_ACCEPTED, String::new(), gen),
        Some(f) => cond(ACCEPTED, false, REASON_INVALID, located(f), gen),
    };
    let resolved = match ref_error {
        None => cond(RESOLVED_REFS, true, "ResolvedRefs", String::new(), gen),
        Some((reason, f)) => cond(RESOLVED_REFS, false, reason, located(f), gen),
    };
    let programmed = programmed(object, outcomes, !mine.is_empty());
    [accepted, resolved, programmed]
        .into_iter()
        .map(|c| keep_transition_time(c, &object.conditions, now))
        .collect()
}

fn located(f: &Finding) -> String {
    if f.path.is_empty() {
        f.message.clone()
    } else {
        format!("{}: {}", f.path, f.message)
    }
}

fn cond(type_: &str, ok: bool, reason: &str, message: String, gen: Option<i64>) -> Condition {
    Condition {
        type_: type_.to_owned(),
        status: if ok { "True" } else { "False" }.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: gen,
        last_transition_time: String::new(),
    }
}

fn keep_transition_time(mut c: Condition, old: &[Condition], now: &str) -> Condition {
    let same = old
        .iter()
        .find(|o| o.type_ == c.type_ && o.status == c.status);
    c.last_transition_time = match same {
        Some(o) if !o.last_transition_time.is_empty() => o.last_transition_time.clone(),
        _ => now.to_owned(),
    };
    c
}

/// The targets `object` contributes to among those of the namespace.
fn targets_of<'a>(object: &'a Object, outcomes: &'a Outcomes) -> Vec<&'a TargetRef> {
    outcomes
        .targets
        .keys()
        .filter(|t| object.targets.as_ref().is_none_or(|mine| mine.contains(t)))
        .collect()
}

fn programmed(object: &Object, outcomes: &Outcomes, has_errors: bool) -> Condition {
    let gen = object.generation;
    let targets = targets_of(object, outcomes);
    if targets.is_empty() {
        let msg = "no InferenceSettings or InferencePolicy of this namespace targets a Gateway or HTTPRoute that compiles here";
        return cond(PROGRAMMED, false, "NoTarget", msg.into(), gen);
    }
    let mut applied = Vec::new();
    for t in targets {
        match &outcomes.targets[t] {
            Outcome::Applied { policy, hash } => applied.push(format!("{t} ({policy}, {hash})")),
            Outcome::Invalid(findings) => {
                let msg = if has_errors {
                    format!(
                        "{t} keeps its last good configuration until the errors above are fixed"
                    )
                } else {
                    let first = findings
                        .iter()
                        .find(|f| f.severity == Severity::Error)
                        .map(|f| f.to_string())
                        .unwrap_or_default();
                    format!("{t} keeps its last good configuration: {first}")
                };
                return cond(PROGRAMMED, false, REASON_INVALID, msg, gen);
            }
            Outcome::Conflicted(msg) => {
                let msg = format!("{t}: {msg}");
                return cond(PROGRAMMED, false, "Conflicted", msg, gen);
            }
            Outcome::Failed(msg) => {
                let msg = format!("{t}: {msg} (retrying)");
                return cond(PROGRAMMED, false, "Pending", msg, gen);
            }
        }
    }
    let msg = format!("in force on {}", applied.join(", "));
    cond(PROGRAMMED, true, "Programmed", msg, gen)
}

/// Whether the conditions differ from those read, ignoring times (so an
/// unchanged object is not patched every reconcile).
pub fn status_changed(old: &[Condition], new: &[Condition]) -> bool {
    let key = |c: &Condition| {
        (
            c.type_.clone(),
            c.status.clone(),
            c.reason.clone(),
            c.message.clone(),
            c.observed_generation,
        )
    };
    let a: BTreeSet<_> = old.iter().map(key).collect();
    let b: BTreeSet<_> = new.iter().map(key).collect();
    a != b
}

/// Whether a deleted object may drop its finalizer: every target it fed
/// was applied without it, or is gone. While a target keeps its last good
/// configuration (invalid, conflicted, failed), that configuration may
/// still hold the object, so it stays visible until that ends.
pub fn may_release(object: &Object, outcomes: &Outcomes) -> bool {
    targets_of(object, outcomes)
        .into_iter()
        .all(|t| matches!(outcomes.targets[t], Outcome::Applied { .. }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_api::TargetKind;

    fn policy(name: &str, target: &TargetRef) -> Object {
        Object {
            id: ObjectRef {
                kind: "InferencePolicy",
                name: name.into(),
            },
            generation: Some(2),
            deleting: false,
            finalized: true,
            conditions: vec![],
            targets: Some([target.clone()].into()),
        }
    }

    fn gw() -> TargetRef {
        TargetRef::new(TargetKind::Gateway, "gw")
    }

    fn applied() -> Outcome {
        Outcome::Applied {
            policy: "kvasir-gateway-gw".into(),
            hash: "sha256:00".into(),
        }
    }

    fn error(object: &str, path: &str, message: &str) -> Finding {
        Finding {
            object: Some(ObjectRef {
                kind: "InferencePolicy",
                name: object.into(),
            }),
            path: path.into(),
            message: message.into(),
            severity: Severity::Error,
        }
    }

    fn by_type<'a>(c: &'a [Condition], t: &str) -> &'a Condition {
        c.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn an_applied_target_programs_its_objects() {
        let o = Outcomes {
            targets: [(gw(), applied())].into(),
            warnings: vec![],
        };
        let c = conditions(&policy("p", &gw()), &o, "t1");
        assert!(c.iter().all(|c| c.status == "True"), "{c:?}");
        assert_eq!(by_type(&c, PROGRAMMED).observed_generation, Some(2));
        assert!(by_type(&c, PROGRAMMED)
            .message
            .contains("kvasir-gateway-gw"));
    }

    #[test]
    fn an_invalid_object_names_its_field_and_others_say_why_they_wait() {
        let bad = error("bad", "spec.match.models[0]", "empty model name");
        let o = Outcomes {
            targets: [(gw(), Outcome::Invalid(vec![bad]))].into(),
            warnings: vec![],
        };
        let c = conditions(&policy("bad", &gw()), &o, "t");
        let a = by_type(&c, ACCEPTED);
        assert_eq!((a.status.as_str(), a.reason.as_str()), ("False", "Invalid"));
        assert_eq!(a.message, "spec.match.models[0]: empty model name");
        let c = conditions(&policy("good", &gw()), &o, "t");
        assert_eq!(by_type(&c, ACCEPTED).status, "True");
        let p = by_type(&c, PROGRAMMED);
        assert_eq!(p.status, "False");
        assert!(
            p.message.contains("last good configuration"),
            "{}",
            p.message
        );
        assert!(p.message.contains("InferencePolicy/bad"), "{}", p.message);
    }

    #[test]
    fn missing_references_are_resolved_refs_not_accepted() {
        let f = error("p", "spec.action.route.pool", "unknown pool `x`");
        let o = Outcomes {
            targets: [(gw(), Outcome::Invalid(vec![f]))].into(),
            warnings: vec![],
        };
        let c = conditions(&policy("p", &gw()), &o, "t");
        assert_eq!(by_type(&c, ACCEPTED).status, "True");
        let r = by_type(&c, RESOLVED_REFS);
        assert_eq!(
            (r.status.as_str(), r.reason.as_str()),
            ("False", "PoolNotFound")
        );
    }

    #[test]
    fn transition_times_move_only_with_the_status() {
        let o = Outcomes {
            targets: [(gw(), applied())].into(),
            warnings: vec![],
        };
        let mut p = policy("p", &gw());
        p.conditions = conditions(&p, &o, "t1");
        let again = conditions(&p, &o, "t2");
        assert!(again.iter().all(|c| c.last_transition_time == "t1"));
        assert!(!status_changed(&p.conditions, &again));
        let conflicted = Outcomes {
            targets: [(gw(), Outcome::Conflicted("owned by kubectl".into()))].into(),
            warnings: vec![],
        };
        let c = conditions(&p, &conflicted, "t3");
        assert_eq!(by_type(&c, PROGRAMMED).last_transition_time, "t3");
        assert_eq!(by_type(&c, PROGRAMMED).reason, "Conflicted");
        assert!(status_changed(&p.conditions, &c));
    }

    #[test]
    fn a_deleted_object_is_released_only_once_out_of_force() {
        let mut p = policy("p", &gw());
        p.deleting = true;
        let ok = Outcomes {
            targets: [(gw(), applied())].into(),
            warnings: vec![],
        };
        assert!(may_release(&p, &ok));
        let stuck = Outcomes {
            targets: [(gw(), Outcome::Invalid(vec![]))].into(),
            warnings: vec![],
        };
        assert!(!may_release(&p, &stuck));
        // Its target is gone: nothing can hold it.
        assert!(may_release(&p, &Outcomes::default()));
    }

    #[test]
    fn objects_without_targets_say_so() {
        let mut t = policy("t", &gw());
        t.targets = None;
        let c = conditions(&t, &Outcomes::default(), "t");
        assert_eq!(by_type(&c, PROGRAMMED).reason, "NoTarget");
    }
}
