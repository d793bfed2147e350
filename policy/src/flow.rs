//! Fair share and flow control in the policy set: tenants' `weight` and
//! `classWeights`, and pools' `flowControl`. Their validation (exact
//! paths) and what they compile into.
//!
//! One section feeds both sides of a pool's flow control: the indexer's
//! `pools[].flowControl` is [`resolve`] of it, and the filter's
//! `pools[].maxQueueWaitMs` is [`max_queue_wait_ms`] of the same section,
//! so the filter's pick deadline always covers the indexer's longest wait
//! (a queued pick is answered, released or shed, never timed out).
//!
//! A class weight is a default, like a class budget: every tenant of the
//! class without a `weight` of its own gets it, and each tenant still has
//! its own share (the class is not one tenant).

use std::collections::BTreeMap;

/// The indexer's pool section, re-exported so users of this crate (the
/// pools file kvasir-api writes) name the same type.
pub use kvasir_flowcontrol::FlowControlConfig;

pub use crate::bounds::{DEFAULT_WEIGHT, MAX_QUEUED, MAX_WAIT_MS, MAX_WEIGHT};
use crate::diagnostic::{Severity, ValidationError};
use crate::syntax::is_name;
use crate::types::{FlowControl, PolicySet, Tenant};

fn finding(path: String, message: impl Into<String>, severity: Severity) -> ValidationError {
    ValidationError {
        path,
        message: message.into(),
        severity,
    }
}

fn weight_error(path: String, w: u32) -> Option<ValidationError> {
    (!(1..=MAX_WEIGHT).contains(&w)).then(|| {
        let msg = format!("must be between 1 and {MAX_WEIGHT}, got {w}");
        finding(path, msg, Severity::Error)
    })
}

/// Findings of every weight and every pool's flow control, in document
/// order (tenants, class weights, pools).
pub(crate) fn check(set: &PolicySet) -> Vec<ValidationError> {
    let mut out = Vec::new();
    for (i, t) in set.tenants.iter().enumerate() {
        if let Some(w) = t.weight {
            out.extend(weight_error(format!("tenants[{i}].weight"), w));
        }
    }
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, cw) in set.class_weights.iter().enumerate() {
        let p = format!("classWeights[{i}]");
        if !is_name(&cw.class) {
            let msg = format!("`{}` is not a valid class name", cw.class);
            out.push(finding(format!("{p}.class"), msg, Severity::Error));
        } else if let Some(k) = seen.insert(&cw.class, i) {
            let msg = format!("duplicate class `{}` (also classWeights[{k}])", cw.class);
            out.push(finding(format!("{p}.class"), msg, Severity::Error));
        } else if !set
            .tenants
            .iter()
            .any(|t| t.class.as_deref() == Some(cw.class.as_str()) && t.weight.is_none())
        {
            let msg = format!(
                "unused: no tenant of class `{}` goes without a weight of its own",
                cw.class
            );
            out.push(finding(format!("{p}.class"), msg, Severity::Warning));
        }
        out.extend(weight_error(format!("{p}.weight"), cw.weight));
    }
    for (i, pool) in set.pools.iter().enumerate() {
        if let Some(fc) = &pool.flow_control {
            out.extend(check_flow_control(&format!("pools[{i}].flowControl"), fc));
        }
    }
    out
}

/// Findings of one flow-control section at `path` (`pools[0].flowControl`):
/// the indexer's own range checks (`FlowControlConfig::validate`) on the
/// section as the indexer will read it, the bounds above, and warnings for
/// settings that never apply.
pub fn check_flow_control(path: &str, fc: &FlowControl) -> Vec<ValidationError> {
    let mut out = Vec::new();
    let mut bounded = true;
    for (field, v, max) in [
        ("maxQueued", fc.max_queued, MAX_QUEUED),
        ("maxQueuedPerTenant", fc.max_queued_per_tenant, MAX_QUEUED),
        ("maxWaitMs", fc.max_wait_ms, MAX_WAIT_MS),
    ] {
        if let Some(v) = v.filter(|v| *v > max) {
            bounded = false;
            let msg = format!("must be at most {max}, got {v}");
            out.push(finding(format!("{path}.{field}"), msg, Severity::Error));
        }
    }
    if bounded {
        if let Err(e) = resolve(fc).validate() {
            out.push(finding(
                format!("{path}.{}", e.field),
                e.message,
                Severity::Error,
            ));
        }
    }
    if fc.threshold.is_some_and(|t| t.is_finite() && t > 1.0) {
        out.push(finding(
            format!("{path}.threshold"),
            "above 1: a pool's saturation is at most 1, so picks never wait",
            Severity::Warning,
        ));
    }
    let tuned = fc.threshold.is_some()
        || fc.max_queued.is_some()
        || fc.max_queued_per_tenant.is_some()
        || fc.max_wait_ms.is_some()
        || fc.saturated_prefill_tokens.is_some()
        || fc.reserve.is_some();
    if fc.enabled != Some(true) && tuned {
        out.push(finding(
            path.to_owned(),
            "flow control is off (`enabled` is not true): these settings never apply",
            Severity::Warning,
        ));
    }
    out
}

/// The section as the indexer's `pools[].flowControl`, every default
/// filled in (the indexer's own, `FlowControlConfig::default`).
pub fn resolve(fc: &FlowControl) -> FlowControlConfig {
    let d = FlowControlConfig::default();
    // Validated values are at most MAX_QUEUED: they fit any usize.
    let count = |v: Option<u64>, default: usize| {
        v.map_or(default, |v| usize::try_from(v).unwrap_or(usize::MAX))
    };
    FlowControlConfig {
        enabled: fc.enabled.unwrap_or(d.enabled),
        threshold: fc.threshold.unwrap_or(d.threshold),
        max_queued: count(fc.max_queued, d.max_queued),
        max_queued_per_tenant: count(fc.max_queued_per_tenant, d.max_queued_per_tenant),
        max_wait_ms: fc.max_wait_ms.unwrap_or(d.max_wait_ms),
        saturated_prefill_tokens: fc
            .saturated_prefill_tokens
            .unwrap_or(d.saturated_prefill_tokens),
        reserve: fc.reserve.unwrap_or(d.reserve),
        over_share_slack: d.over_share_slack,
        reserve_counts_waiting: d.reserve_counts_waiting,
        engine_priority: d.engine_priority,
        engine_priority_by: d.engine_priority_by,
        release_order: d.release_order,
        max_quickest_skip_ms: d.max_quickest_skip_ms,
    }
}

/// Whether a pool's flow control counts queued prefill work (enabled, with
/// `saturatedPrefillTokens` above 0): its filter then reports every first
/// token, which ends a pick's prefill in the indexer's count.
pub fn counts_prefill_work(fc: Option<&FlowControl>) -> bool {
    fc.map(resolve)
        .is_some_and(|c| c.enabled && c.saturated_prefill_tokens > 0)
}

/// The filter's `maxQueueWaitMs` of a pool: the indexer's `maxWaitMs` when
/// flow control is on, else 0 (the pick never waits). Saturates at
/// [`MAX_WAIT_MS`] for an unvalidated section.
pub fn max_queue_wait_ms(fc: Option<&FlowControl>) -> u32 {
    let Some(c) = fc.map(resolve).filter(|c| c.enabled) else {
        return 0;
    };
    // At most MAX_WAIT_MS (600000), far below u32::MAX.
    c.max_wait_ms.min(MAX_WAIT_MS) as u32
}

/// The compiled weight of tenant `t`: its own, else its class's, else 1.
/// Call on a validated set.
pub(crate) fn weight(set: &PolicySet, t: &Tenant) -> u32 {
    t.weight
        .or_else(|| {
            let class = t.class.as_deref()?;
            set.class_weights
                .iter()
                .find(|cw| cw.class == class)
                .map(|cw| cw.weight)
        })
        .unwrap_or(DEFAULT_WEIGHT)
}
