//! What a namespace's reconcile should write, decided without I/O: the
//! status conditions of every `kvasir.dev` object and whether a deleted
//! object may let go of its finalizer. [`crate::reconcile`] does the calls.

use std::collections::{BTreeMap, BTreeSet};

use kvasir_api::assemble::{Finding, ObjectRef};
use kvasir_api::status::{
    ACCEPTED, CONTROLLER_NAME, REASON_ACCEPTED, REASON_INVALID, REASON_TARGET_NOT_FOUND,
    RESOLVED_REFS,
};
use kvasir_api::{AncestorRef, Condition, PolicyAncestorStatus, TargetRef, GATEWAY_GROUP};
use kvasir_policy::Severity;
use serde_json::Value;

pub use kvasir_api::status::PROGRAMMED;

/// The finalizer on every `kvasir.dev` object: a deleted object stays
/// until the configuration in force no longer holds it.
pub const FINALIZER: &str = "kvasir.dev/controller";
/// Reason of `Programmed=False`: Envoy Gateway reports `Accepted=False`
/// on the target's EnvoyExtensionPolicy.
pub const REASON_NOT_ACCEPTED: &str = "NotAccepted";
/// Reason of `Programmed=False`: Envoy Gateway reports that another
/// EnvoyExtensionPolicy overrides the target's on some of its routes.
pub const REASON_OVERRIDDEN: &str = "Overridden";

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
    /// `status.ancestors` as read.
    pub ancestors: Vec<PolicyAncestorStatus>,
    /// The targets it names (policies, settings); `None`: every target of
    /// its namespace (tenants, providers).
    pub targets: Option<BTreeSet<TargetRef>>,
}

/// What Envoy Gateway says about an applied EnvoyExtensionPolicy
/// (`status.ancestors[].conditions`, for the policy's current generation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GatewayVerdict {
    /// Nothing yet for this generation (Envoy Gateway has not processed
    /// it, or none runs).
    NotReported,
    /// `Accepted=True` on every ancestor it reported.
    Accepted,
    /// `Accepted=False` on an ancestor.
    NotAccepted {
        /// The ancestor, e.g. `Gateway serving/inference-gateway`.
        ancestor: String,
        /// Envoy Gateway's reason (`Conflicted`, `Invalid`, ...).
        reason: String,
        /// Envoy Gateway's message.
        message: String,
    },
    /// `Overridden=True` on an ancestor: another policy replaces this one
    /// on some routes.
    Overridden {
        /// The ancestor.
        ancestor: String,
        /// Envoy Gateway's message.
        message: String,
    },
}

fn ancestor_name(a: &Value) -> String {
    let r = &a["ancestorRef"];
    let kind = r["kind"].as_str().unwrap_or("Gateway");
    let name = r["name"].as_str().unwrap_or("");
    match r["namespace"].as_str() {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    }
}

/// Reads Envoy Gateway's verdict from an EnvoyExtensionPolicy as the API
/// server returned it. Conditions of an older generation than the
/// object's are stale (the policy changed since) and count as not
/// reported; a refusal anywhere wins over acceptance elsewhere.
pub fn gateway_verdict(policy: &Value) -> GatewayVerdict {
    let generation = policy["metadata"]["generation"].as_i64();
    let Some(ancestors) = policy["status"]["ancestors"].as_array() else {
        return GatewayVerdict::NotReported;
    };
    let current = |c: &&Value| match (c["observedGeneration"].as_i64(), generation) {
        (Some(seen), Some(now)) => seen >= now,
        _ => true,
    };
    let mut accepted = false;
    let mut overridden = None;
    for a in ancestors {
        if a["controllerName"].as_str() == Some(CONTROLLER_NAME) {
            continue;
        }
        let conds: Vec<&Value> = a["conditions"]
            .as_array()
            .map(|c| c.iter().filter(current).collect())
            .unwrap_or_default();
        for c in &conds {
            let (t, st) = (c["type"].as_str(), c["status"].as_str());
            let text = |k: &str| c[k].as_str().unwrap_or("").to_owned();
            match (t, st) {
                (Some("Accepted"), Some("False")) => {
                    return GatewayVerdict::NotAccepted {
                        ancestor: ancestor_name(a),
                        reason: text("reason"),
                        message: text("message"),
                    }
                }
                (Some("Accepted"), Some("True")) => accepted = true,
                (Some("Overridden"), Some("True")) if overridden.is_none() => {
                    overridden = Some(GatewayVerdict::Overridden {
                        ancestor: ancestor_name(a),
                        message: text("message"),
                    });
                }
                _ => {}
            }
        }
    }
    match overridden {
        Some(o) => o,
        None if accepted => GatewayVerdict::Accepted,
        None => GatewayVerdict::NotReported,
    }
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
        /// What Envoy Gateway reports on the policy.
        gateway: GatewayVerdict,
    },
    /// The Gateway or HTTPRoute does not exist in the namespace: nothing
    /// is applied for it (and a policy written for it earlier is deleted).
    TargetNotFound,
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
    /// The namespace (for `status.ancestors`).
    pub namespace: String,
}

fn outcome_of<'a>(outcomes: &'a Outcomes, t: &TargetRef) -> Option<&'a Outcome> {
    outcomes.targets.get(t)
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

/// The first target `object` names that does not exist.
fn missing_target<'a>(object: &'a Object, outcomes: &Outcomes) -> Option<&'a TargetRef> {
    object
        .targets
        .as_ref()?
        .iter()
        .find(|t| matches!(outcome_of(outcomes, t), Some(Outcome::TargetNotFound)))
}

fn target_not_found(t: &TargetRef, namespace: &str) -> String {
    format!(
        "{t} does not exist in namespace `{namespace}`: check the targetRefs name (nothing is applied for it until it exists)"
    )
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
    let resolved = match (ref_error, missing_target(object, outcomes)) {
        (Some((reason, f)), _) => cond(RESOLVED_REFS, false, reason, located(f), gen),
        (None, Some(t)) => cond(
            RESOLVED_REFS,
            false,
            REASON_TARGET_NOT_FOUND,
            format!(
                "spec.targetRefs: {}",
                target_not_found(t, &outcomes.namespace)
            ),
            gen,
        ),
        (None, None) => cond(RESOLVED_REFS, true, "ResolvedRefs", String::new(), gen),
    };
    let programmed = programmed(object, outcomes, !mine.is_empty());
    [accepted, resolved, programmed]
        .into_iter()
        .map(|c| keep_transition_time(c, &object.conditions, now))
        .collect()
}

/// Gateway API's policy status for an object that names targets: per
/// target (sorted, at most 16), `Accepted` (the target compiles and
/// exists) and `Programmed` (as the top-level condition, for that target
/// alone). Empty for objects without targets. Transition times move only
/// with a condition's status, as in [`conditions`].
pub fn ancestors(object: &Object, outcomes: &Outcomes, now: &str) -> Vec<PolicyAncestorStatus> {
    let Some(targets) = &object.targets else {
        return Vec::new();
    };
    let gen = object.generation;
    let mine_errors = outcomes
        .findings()
        .any(|f| f.severity == Severity::Error && f.object.as_ref() == Some(&object.id));
    targets
        .iter()
        .take(16)
        .filter_map(|t| {
            let outcome = outcome_of(outcomes, t)?;
            let accepted = match outcome {
                Outcome::TargetNotFound => cond(
                    ACCEPTED,
                    false,
                    REASON_TARGET_NOT_FOUND,
                    target_not_found(t, &outcomes.namespace),
                    gen,
                ),
                Outcome::Invalid(findings) => {
                    let first = findings
                        .iter()
                        .find(|f| f.severity == Severity::Error)
                        .map(|f| f.to_string())
                        .unwrap_or_default();
                    cond(
                        ACCEPTED,
                        false,
                        REASON_INVALID,
                        format!("{t} does not compile: {first}"),
                        gen,
                    )
                }
                _ => cond(ACCEPTED, true, REASON_ACCEPTED, String::new(), gen),
            };
            let programmed = target_programmed(t, outcome, mine_errors, &outcomes.namespace, gen);
            let ancestor_ref = AncestorRef {
                group: GATEWAY_GROUP.to_owned(),
                kind: t.kind.as_str().to_owned(),
                namespace: Some(outcomes.namespace.clone()),
                name: t.name.clone(),
            };
            let old: Vec<Condition> = object
                .ancestors
                .iter()
                .find(|a| a.ancestor_ref == ancestor_ref && a.controller_name == CONTROLLER_NAME)
                .map(|a| a.conditions.clone())
                .unwrap_or_default();
            Some(PolicyAncestorStatus {
                ancestor_ref,
                controller_name: CONTROLLER_NAME.to_owned(),
                conditions: [accepted, programmed]
                    .into_iter()
                    .map(|c| keep_transition_time(c, &old, now))
                    .collect(),
            })
        })
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

fn applied_text(t: &TargetRef, policy: &str, hash: &str, gateway: &GatewayVerdict) -> String {
    let said = match gateway {
        GatewayVerdict::Accepted => "accepted by Envoy Gateway",
        _ => "Envoy Gateway has not reported on it yet",
    };
    format!("{t} ({policy}, {hash}; {said})")
}

/// `Programmed` for one target.
fn target_programmed(
    t: &TargetRef,
    outcome: &Outcome,
    has_errors: bool,
    namespace: &str,
    gen: Option<i64>,
) -> Condition {
    match outcome {
        Outcome::Applied {
            policy,
            gateway:
                GatewayVerdict::NotAccepted {
                    ancestor,
                    reason,
                    message,
                },
            ..
        } => {
            let msg = format!(
                "{t}: Envoy Gateway does not accept EnvoyExtensionPolicy {policy} on {ancestor} ({reason}): {message}"
            );
            cond(PROGRAMMED, false, REASON_NOT_ACCEPTED, msg, gen)
        }
        Outcome::Applied {
            policy,
            gateway: GatewayVerdict::Overridden { ancestor, message },
            ..
        } => {
            let msg = format!(
                "{t}: Envoy Gateway reports EnvoyExtensionPolicy {policy} overridden on {ancestor}: {message}"
            );
            cond(PROGRAMMED, false, REASON_OVERRIDDEN, msg, gen)
        }
        Outcome::Applied {
            policy,
            hash,
            gateway,
        } => {
            let msg = format!("in force on {}", applied_text(t, policy, hash, gateway));
            cond(PROGRAMMED, true, "Programmed", msg, gen)
        }
        Outcome::TargetNotFound => cond(
            PROGRAMMED,
            false,
            REASON_TARGET_NOT_FOUND,
            target_not_found(t, namespace),
            gen,
        ),
        Outcome::Invalid(findings) => {
            let msg = if has_errors {
                format!("{t} keeps its last good configuration until the errors above are fixed")
            } else {
                let first = findings
                    .iter()
                    .find(|f| f.severity == Severity::Error)
                    .map(|f| f.to_string())
                    .unwrap_or_default();
                format!("{t} keeps its last good configuration: {first}")
            };
            cond(PROGRAMMED, false, REASON_INVALID, msg, gen)
        }
        Outcome::Conflicted(msg) => {
            let msg = format!("{t}: {msg}");
            cond(PROGRAMMED, false, "Conflicted", msg, gen)
        }
        Outcome::Failed(msg) => {
            let msg = format!("{t}: {msg} (retrying)");
            cond(PROGRAMMED, false, "Pending", msg, gen)
        }
    }
}

fn programmed(object: &Object, outcomes: &Outcomes, has_errors: bool) -> Condition {
    let gen = object.generation;
    let targets = targets_of(object, outcomes);
    if targets.is_empty() {
        let msg = "no InferenceSettings or InferencePolicy of this namespace targets a Gateway or HTTPRoute that compiles here";
        return cond(PROGRAMMED, false, "NoTarget", msg.into(), gen);
    }
    // An object that serves every target of its namespace (a tenant, a
    // provider) is not held back by a target someone misspelt: that is
    // reported on the objects that name it. Only when no target exists at
    // all is there nothing it is in force on.
    let targets: Vec<&TargetRef> = if object.targets.is_none() {
        let existing: Vec<&TargetRef> = targets
            .iter()
            .copied()
            .filter(|t| !matches!(outcomes.targets[*t], Outcome::TargetNotFound))
            .collect();
        if existing.is_empty() {
            targets.into_iter().take(1).collect()
        } else {
            existing
        }
    } else {
        targets
    };
    let mut applied = Vec::new();
    for t in targets {
        let outcome = &outcomes.targets[t];
        let c = target_programmed(t, outcome, has_errors, &outcomes.namespace, gen);
        if c.status != "True" {
            return c;
        }
        if let Outcome::Applied {
            policy,
            hash,
            gateway,
        } = outcome
        {
            applied.push(applied_text(t, policy, hash, gateway));
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

/// [`status_changed`] for `status.ancestors`: by ancestor and controller,
/// then their conditions.
pub fn ancestors_changed(old: &[PolicyAncestorStatus], new: &[PolicyAncestorStatus]) -> bool {
    if old.len() != new.len() {
        return true;
    }
    new.iter().any(|n| {
        old.iter()
            .find(|o| o.ancestor_ref == n.ancestor_ref && o.controller_name == n.controller_name)
            .is_none_or(|o| status_changed(&o.conditions, &n.conditions))
    })
}

/// Whether a deleted object may drop its finalizer: every target it fed
/// was applied without it, or is gone. While a target keeps its last good
/// configuration (invalid, conflicted, failed), that configuration may
/// still hold the object, so it stays visible until that ends.
pub fn may_release(object: &Object, outcomes: &Outcomes) -> bool {
    targets_of(object, outcomes).into_iter().all(|t| {
        matches!(
            outcomes.targets[t],
            Outcome::Applied { .. } | Outcome::TargetNotFound
        )
    })
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod tests;
