//! A pool's flow control on Kubernetes: annotations on its
//! `InferencePool`, the one place both consumers read it from.
//!
//! The pool is where the indexer's per-pool settings already live
//! (`kvasir.dev/block-size`, ...), and the indexer's pools file is written
//! per namespace from the pools alone. Putting flow control anywhere per
//! target (`InferenceSettings`) would let two targets routing to one pool
//! ask for two different queues. So:
//!
//! | annotation | `flowControl` key | default |
//! | --- | --- | --- |
//! | `kvasir.dev/flow-control` | `enabled` (`true` / `false`) | `false` |
//! | `kvasir.dev/flow-control-threshold` | `threshold` | 1.0 |
//! | `kvasir.dev/flow-control-max-queued` | `maxQueued` | 1024 |
//! | `kvasir.dev/flow-control-max-queued-per-tenant` | `maxQueuedPerTenant` | 256 |
//! | `kvasir.dev/flow-control-max-wait-ms` | `maxWaitMs` | 10000 |
//! | `kvasir.dev/flow-control-saturated-prefill-tokens` | `saturatedPrefillTokens` | 0 (off) |
//! | `kvasir.dev/flow-control-reserve` | `reserve` | 0.5 |
//!
//! They become the policy set's `pools[].flowControl`, which compiles into
//! the filter's `maxQueueWaitMs` ([`crate::assemble`]), and, through
//! `kvasir_policy::flow::resolve`, the indexer's `pools[].flowControl`
//! ([`crate::indexer`]): one value, two outputs that cannot disagree.

use kube_core::ResourceExt;
use kvasir_policy::FlowControl;

use crate::types::InferencePool;

/// `true` turns the pool's flow control on.
pub const FLOW_CONTROL_ANNOTATION: &str = "kvasir.dev/flow-control";
/// Saturation (0..1) at or above which picks wait.
pub const FLOW_CONTROL_THRESHOLD_ANNOTATION: &str = "kvasir.dev/flow-control-threshold";
/// Picks waiting in the pool at most.
pub const FLOW_CONTROL_MAX_QUEUED_ANNOTATION: &str = "kvasir.dev/flow-control-max-queued";
/// Picks one tenant may have waiting at most.
pub const FLOW_CONTROL_MAX_QUEUED_PER_TENANT_ANNOTATION: &str =
    "kvasir.dev/flow-control-max-queued-per-tenant";
/// How long a pick may wait, ms.
pub const FLOW_CONTROL_MAX_WAIT_MS_ANNOTATION: &str = "kvasir.dev/flow-control-max-wait-ms";
/// Queued prefill tokens on an engine that count as saturated.
pub const FLOW_CONTROL_SATURATED_PREFILL_TOKENS_ANNOTATION: &str =
    "kvasir.dev/flow-control-saturated-prefill-tokens";
/// Room kept for tenants under their fair share (0..1).
pub const FLOW_CONTROL_RESERVE_ANNOTATION: &str = "kvasir.dev/flow-control-reserve";

/// Each annotation and the `flowControl` key it sets.
pub const FLOW_CONTROL_ANNOTATIONS: [(&str, &str); 7] = [
    (FLOW_CONTROL_ANNOTATION, "enabled"),
    (FLOW_CONTROL_THRESHOLD_ANNOTATION, "threshold"),
    (FLOW_CONTROL_MAX_QUEUED_ANNOTATION, "maxQueued"),
    (
        FLOW_CONTROL_MAX_QUEUED_PER_TENANT_ANNOTATION,
        "maxQueuedPerTenant",
    ),
    (FLOW_CONTROL_MAX_WAIT_MS_ANNOTATION, "maxWaitMs"),
    (
        FLOW_CONTROL_SATURATED_PREFILL_TOKENS_ANNOTATION,
        "saturatedPrefillTokens",
    ),
    (FLOW_CONTROL_RESERVE_ANNOTATION, "reserve"),
];

/// The annotation that sets `flowControl` key `field`; the section as a
/// whole (`""`) is `kvasir.dev/flow-control`.
pub fn annotation_of(field: &str) -> Option<&'static str> {
    if field.is_empty() {
        return Some(FLOW_CONTROL_ANNOTATION);
    }
    FLOW_CONTROL_ANNOTATIONS
        .iter()
        .find(|(_, f)| *f == field)
        .map(|(a, _)| *a)
}

/// A value that does not parse: the annotation and why.
pub type AnnotationError = (&'static str, String);

/// The pool's flow-control section from its annotations: `None` when it
/// has none of them. Only parsing happens here; ranges are
/// `kvasir_policy::flow::check_flow_control`'s.
pub fn flow_control(pool: &InferencePool) -> Result<Option<FlowControl>, Vec<AnnotationError>> {
    let ann = pool.annotations();
    if !FLOW_CONTROL_ANNOTATIONS
        .iter()
        .any(|(a, _)| ann.contains_key(*a))
    {
        return Ok(None);
    }
    let mut errors = Vec::new();
    let get = |key: &str| ann.get(key).map(|v| v.trim());
    let enabled = match get(FLOW_CONTROL_ANNOTATION) {
        None => None,
        Some("true") => Some(true),
        Some("false") => Some(false),
        Some(v) => {
            let msg = format!("`{v}` must be `true` or `false`");
            errors.push((FLOW_CONTROL_ANNOTATION, msg));
            None
        }
    };
    let threshold = get(FLOW_CONTROL_THRESHOLD_ANNOTATION).and_then(|v| {
        v.parse::<f64>().map_or_else(
            |_| {
                let msg = format!("`{v}` is not a number (the pool saturation, 0..1, at or above which picks wait)");
                errors.push((FLOW_CONTROL_THRESHOLD_ANNOTATION, msg));
                None
            },
            Some,
        )
    });
    let reserve = get(FLOW_CONTROL_RESERVE_ANNOTATION).and_then(|v| {
        v.parse::<f64>().map_or_else(
            |_| {
                let msg = format!("`{v}` is not a number (the share of room, 0..1, kept for tenants under their share)");
                errors.push((FLOW_CONTROL_RESERVE_ANNOTATION, msg));
                None
            },
            Some,
        )
    });
    let mut count = |key: &'static str| {
        let v = get(key)?;
        v.parse::<u64>()
            .map_err(|_| errors.push((key, format!("`{v}` is not a whole number"))))
            .ok()
    };
    let fc = FlowControl {
        enabled,
        threshold,
        max_queued: count(FLOW_CONTROL_MAX_QUEUED_ANNOTATION),
        max_queued_per_tenant: count(FLOW_CONTROL_MAX_QUEUED_PER_TENANT_ANNOTATION),
        max_wait_ms: count(FLOW_CONTROL_MAX_WAIT_MS_ANNOTATION),
        saturated_prefill_tokens: count(FLOW_CONTROL_SATURATED_PREFILL_TOKENS_ANNOTATION),
        reserve,
    };
    match errors.is_empty() {
        true => Ok(Some(fc)),
        false => Err(errors),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_annotation_no_section() {
        let p = InferencePool::annotated("p", &[("kvasir.dev/models", "m")]);
        assert_eq!(flow_control(&p), Ok(None));
    }

    #[test]
    fn every_annotation_sets_its_key() {
        let p = InferencePool::annotated(
            "p",
            &[
                (FLOW_CONTROL_ANNOTATION, "true"),
                (FLOW_CONTROL_THRESHOLD_ANNOTATION, " 0.85 "),
                (FLOW_CONTROL_MAX_QUEUED_ANNOTATION, "500"),
                (FLOW_CONTROL_MAX_QUEUED_PER_TENANT_ANNOTATION, "50"),
                (FLOW_CONTROL_MAX_WAIT_MS_ANNOTATION, "3000"),
                (FLOW_CONTROL_SATURATED_PREFILL_TOKENS_ANNOTATION, "8192"),
                (FLOW_CONTROL_RESERVE_ANNOTATION, "0.25"),
            ],
        );
        assert_eq!(
            flow_control(&p),
            Ok(Some(FlowControl {
                enabled: Some(true),
                threshold: Some(0.85),
                max_queued: Some(500),
                max_queued_per_tenant: Some(50),
                max_wait_ms: Some(3000),
                saturated_prefill_tokens: Some(8192),
                reserve: Some(0.25),
            }))
        );
        // One annotation alone gives a section with the rest unset.
        let p = InferencePool::annotated("p", &[(FLOW_CONTROL_MAX_WAIT_MS_ANNOTATION, "1")]);
        let fc = flow_control(&p).unwrap().unwrap();
        assert_eq!((fc.enabled, fc.max_wait_ms), (None, Some(1)));
    }

    #[test]
    fn values_that_do_not_parse_name_their_annotation() {
        let p = InferencePool::annotated(
            "p",
            &[
                (FLOW_CONTROL_ANNOTATION, "yes"),
                (FLOW_CONTROL_THRESHOLD_ANNOTATION, "high"),
                (FLOW_CONTROL_MAX_QUEUED_ANNOTATION, "-1"),
                (FLOW_CONTROL_MAX_WAIT_MS_ANNOTATION, "2s"),
            ],
        );
        let errs = flow_control(&p).unwrap_err();
        let keys: Vec<&str> = errs.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            keys,
            [
                FLOW_CONTROL_ANNOTATION,
                FLOW_CONTROL_THRESHOLD_ANNOTATION,
                FLOW_CONTROL_MAX_QUEUED_ANNOTATION,
                FLOW_CONTROL_MAX_WAIT_MS_ANNOTATION
            ]
        );
        assert_eq!(errs[0].1, "`yes` must be `true` or `false`");
        assert_eq!(errs[3].1, "`2s` is not a whole number");
    }

    #[test]
    fn annotation_of_every_key() {
        for (a, f) in FLOW_CONTROL_ANNOTATIONS {
            assert_eq!(annotation_of(f), Some(a));
        }
        assert_eq!(annotation_of(""), Some(FLOW_CONTROL_ANNOTATION));
        assert_eq!(annotation_of("nope"), None);
    }
}
