//! Scopes of a policy's match: which tenants it can apply to, and whether
//! two matches (a policy and a PII guard) can hold for the same request.
//! Used by validation (its warnings) and by compilation (classes expanded
//! into tenants).

use std::collections::BTreeSet;

use crate::glob::{is_glob, Glob};
use crate::types::{ApiKind, Match, PolicySet};

/// The tenants a match can apply to (`None`: any tenant), with classes
/// expanded and intersected with `tenants`. Unknown names simply drop out;
/// validation reports them.
pub(crate) fn tenant_scope(set: &PolicySet, m: &Match) -> Option<BTreeSet<String>> {
    let by_name = m
        .tenants
        .as_ref()
        .map(|t| t.iter().cloned().collect::<BTreeSet<_>>());
    let by_class = m.tenant_classes.as_ref().map(|classes| {
        set.tenants
            .iter()
            .filter(|t| t.class.as_ref().is_some_and(|c| classes.contains(c)))
            .map(|t| t.name.clone())
            .collect::<BTreeSet<_>>()
    });
    match (by_name, by_class) {
        (None, None) => None,
        (Some(a), None) => Some(a),
        (None, Some(b)) => Some(b),
        (Some(a), Some(b)) => Some(a.intersection(&b).cloned().collect()),
    }
}

/// Whether two model lists can both match some model name (conservative:
/// two globs are assumed to overlap).
fn models_overlap(a: &Option<Vec<String>>, b: &Option<Vec<String>>) -> bool {
    let (Some(a), Some(b)) = (a, b) else {
        return true;
    };
    a.iter().any(|x| {
        b.iter().any(|y| match (is_glob(x), is_glob(y)) {
            (false, false) => x == y,
            (true, false) => Glob::parse(x).is_ok_and(|g| g.matches(y)),
            (false, true) => Glob::parse(y).is_ok_and(|g| g.matches(x)),
            (true, true) => true,
        })
    })
}

fn opt_overlap<T: Ord + Clone>(a: Option<BTreeSet<T>>, b: Option<BTreeSet<T>>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a.intersection(&b).next().is_some(),
        _ => true,
    }
}

fn apis(m: &Match) -> Option<BTreeSet<ApiKind>> {
    m.apis.as_ref().map(|a| a.iter().copied().collect())
}

/// Whether a policy's match and a guard's scope (tenants, models, APIs) can
/// hold for the same request.
pub(crate) fn scope_overlaps(set: &PolicySet, m: &Match, guard: &Match) -> bool {
    opt_overlap(tenant_scope(set, m), tenant_scope(set, guard))
        && models_overlap(&m.models, &guard.models)
        && opt_overlap(apis(m), apis(guard))
}
