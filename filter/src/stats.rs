//! Stat names and the sink they are written to.
//!
//! Names are dotted so the bootstrap's `stats_config.stats_tags` regexes
//! turn segments into Prometheus labels (see `envoy/envoy.yaml`):
//!
//! | name | type | labels in `/stats/prometheus` |
//! | --- | --- | --- |
//! | `kvasir.tenant.<t>.model.<m>.requests.<decision>` | counter | tenant, model, decision |
//! | `kvasir.tenant.<t>.model.<m>.prompt_tokens.cached` / `.uncached` | counter | tenant, model, (kind) |
//! | `kvasir.tenant.<t>.model.<m>.completion_tokens` | counter | tenant, model |
//! | `kvasir.tenant.<t>.model.<m>.failopen` | counter | tenant, model |
//! | `kvasir.tenant.<t>.model.<m>.ttft_ms` / `itl_ms` / `e2e_ms` | histogram | tenant, model |
//! | `kvasir.tenant.<t>.model.<m>.responses.<class>` | counter | tenant, model, class (2xx/4xx/5xx/cancelled) |
//! | `kvasir.tenant.<t>.model.<m>.rate_limited.<limit>` / `shed.<cause>` | counter | tenant, model |
//! | `kvasir.tenant.<t>.model.<m>.usage_reports` | counter | tenant, model |
//! | `kvasir.tenant.<t>.model.<m>.queue_wait_ms` | histogram | tenant, model |
//! | `kvasir.pool.<p>.pick.<result>` | counter | pool, result |
//! | `kvasir.pool.<p>.pick_us` | histogram | pool |
//! | `kvasir.pool.<p>.queue_wait_ms` | histogram | pool |
//! | `kvasir.pool.<p>.saturation_permille` | gauge | pool |
//! | `kvasir.pool.<p>.report.<result>` | counter | pool, result |
//! | `kvasir.stats.dropped` | counter | |
//!
//! Tenant names are DNS labels already; model names come from the
//! configuration only (unknown models are `other`), and are sanitized:
//! every character other than ASCII letters, digits, `-` and `_` becomes
//! `_` (so `Qwen/Qwen3-8B` is `Qwen_Qwen3-8B` and `llama-3.1` is
//! `llama-3_1`), because a dot would start a new name segment.

use std::collections::HashMap;

/// Where stats go: Envoy's metrics in the filter, a map in tests.
pub trait Stats {
    /// Adds `n` (> 0; zero is skipped) to a counter.
    fn count(&self, name: &str, n: u64);
    /// Sets a gauge.
    fn gauge(&self, name: &str, value: u64);
    /// Records a histogram sample.
    fn record(&self, name: &str, value: u64);
}

/// `s` with every character outside `[A-Za-z0-9_-]` replaced by `_`; an
/// empty string becomes `_`.
pub fn sanitize(s: &str) -> String {
    if s.is_empty() {
        return "_".into();
    }
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The prefix of one tenant's and model's stats:
/// `kvasir.tenant.<t>.model.<m>`.
pub fn tenant_model_prefix(tenant: &str, model_label: &str) -> String {
    format!(
        "kvasir.tenant.{}.model.{}",
        sanitize(tenant),
        sanitize(model_label)
    )
}

/// The tenant label of requests whose tenant is not known.
pub const UNKNOWN_TENANT: &str = "unknown";

/// What happened to a request, as the `decision` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestDecision {
    /// Routed to a pool (picked or failed open).
    Route,
    /// Sent to an external provider.
    Provider,
    /// Rejected by a policy.
    Reject,
    /// Shed (429).
    Shed,
    /// Refused: invalid JSON, wrong types, missing fields.
    Invalid,
    /// Refused: no or unknown tenant (401) or a forbidden tenant header (403).
    Unauthorized,
    /// Refused: body over the limit (413).
    TooLarge,
    /// A path the filter does not parse, passed through.
    Passthrough,
}

impl RequestDecision {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            RequestDecision::Route => "route",
            RequestDecision::Provider => "provider",
            RequestDecision::Reject => "reject",
            RequestDecision::Shed => "shed",
            RequestDecision::Invalid => "invalid",
            RequestDecision::Unauthorized => "unauthorized",
            RequestDecision::TooLarge => "too_large",
            RequestDecision::Passthrough => "passthrough",
        }
    }
}

/// The response class label: `2xx`, `4xx`, `5xx`, `other`, `cancelled`.
pub fn response_class(status: Option<u16>, completed: bool) -> &'static str {
    if !completed {
        return "cancelled";
    }
    match status {
        Some(200..=299) => "2xx",
        Some(400..=499) => "4xx",
        Some(500..=599) => "5xx",
        _ => "other",
    }
}

/// A pool stat: `kvasir.pool.<p>.<rest>`.
pub fn pool_stat(pool: &str, rest: &str) -> String {
    format!("kvasir.pool.{}.{rest}", sanitize(pool))
}

/// Milliseconds from nanoseconds, rounded to nearest (histogram unit).
pub fn ns_to_ms(ns: u64) -> u64 {
    (ns + 500_000) / 1_000_000
}

/// What a stat name needs before it is written ([`StatIds::lookup`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatId {
    /// Defined already under this id.
    Known(u32),
    /// Not yet: define it, then [`StatIds::defined`].
    Define,
    /// Not written: the bound is reached (count `kvasir.stats.dropped`).
    Full,
}

/// Envoy metric ids by name: each defined once per VM (a define
/// allocates a new id every time), and at most `max` of them (tenant and
/// model labels multiply names; Envoy's memory must not).
#[derive(Debug)]
pub struct StatIds {
    ids: HashMap<String, u32>,
    max: usize,
}

impl Default for StatIds {
    fn default() -> Self {
        StatIds {
            ids: HashMap::new(),
            max: 4096,
        }
    }
}

impl StatIds {
    /// Bounds the names (`maxStats`); those defined already stay.
    pub fn set_max(&mut self, max: usize) {
        self.max = max;
    }

    /// What `name` needs.
    pub fn lookup(&self, name: &str) -> StatId {
        match self.ids.get(name) {
            Some(id) => StatId::Known(*id),
            None if self.ids.len() >= self.max => StatId::Full,
            None => StatId::Define,
        }
    }

    /// `name` was defined as `id`.
    pub fn defined(&mut self, name: &str, id: u32) {
        self.ids.insert(name.to_string(), id);
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! A recording [`Stats`] for tests.
    use super::Stats;
    use std::cell::RefCell;
    use std::collections::BTreeMap;

    /// Every stat written, by name.
    #[derive(Debug, Default)]
    pub struct MemStats {
        pub counters: RefCell<BTreeMap<String, u64>>,
        pub gauges: RefCell<BTreeMap<String, u64>>,
        pub histograms: RefCell<BTreeMap<String, Vec<u64>>>,
    }

    impl Stats for MemStats {
        fn count(&self, name: &str, n: u64) {
            assert!(n > 0, "counter {name} incremented by 0");
            *self.counters.borrow_mut().entry(name.into()).or_default() += n;
        }
        fn gauge(&self, name: &str, value: u64) {
            self.gauges.borrow_mut().insert(name.into(), value);
        }
        fn record(&self, name: &str, value: u64) {
            self.histograms
                .borrow_mut()
                .entry(name.into())
                .or_default()
                .push(value);
        }
    }

    impl MemStats {
        pub fn counter(&self, name: &str) -> u64 {
            self.counters.borrow().get(name).copied().unwrap_or(0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_have_no_stray_dots() {
        assert_eq!(sanitize("Qwen/Qwen3-8B"), "Qwen_Qwen3-8B");
        assert_eq!(sanitize("llama-3.1"), "llama-3_1");
        assert_eq!(sanitize("a b:c"), "a_b_c");
        assert_eq!(sanitize(""), "_");
        assert_eq!(sanitize("é"), "_");
        assert_eq!(
            tenant_model_prefix("acme", "Qwen/Qwen3-8B"),
            "kvasir.tenant.acme.model.Qwen_Qwen3-8B"
        );
        assert_eq!(pool_stat("main", "pick.ok"), "kvasir.pool.main.pick.ok");
    }

    #[test]
    fn classes_and_units() {
        assert_eq!(response_class(Some(200), true), "2xx");
        assert_eq!(response_class(Some(429), true), "4xx");
        assert_eq!(response_class(Some(503), true), "5xx");
        assert_eq!(response_class(None, true), "other");
        assert_eq!(response_class(Some(200), false), "cancelled");
        assert_eq!(ns_to_ms(1_499_999), 1);
        assert_eq!(ns_to_ms(1_500_000), 2);
        assert_eq!(RequestDecision::TooLarge.as_str(), "too_large");
    }

    #[test]
    fn stat_ids_are_defined_once_and_bounded() {
        let mut ids = StatIds::default();
        assert_eq!(ids.lookup("a"), StatId::Define);
        ids.defined("a", 10);
        assert_eq!(ids.lookup("a"), StatId::Known(10));
        ids.set_max(2);
        ids.defined("b", 11);
        assert_eq!(ids.lookup("c"), StatId::Full);
        assert_eq!(ids.lookup("b"), StatId::Known(11), "defined names stay");
        ids.set_max(1);
        assert_eq!(ids.lookup("a"), StatId::Known(10));
        assert_eq!(ids.lookup("c"), StatId::Full);
    }
}
