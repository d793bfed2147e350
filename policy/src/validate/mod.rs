//! Validation of a [`PolicySet`], with exact paths.
//!
//! Paths are JSON-pointer-ish, the way serde_path_to_error writes them
//! (`policies[2].match.models[0]`), so a parse error and a validation error
//! point at things the same way and `kvasirctl` can show either next to the
//! source line.

mod policies;
mod tenants;
mod upstreams;

use crate::glob::Glob;
use crate::scope::{scope_overlaps, tenant_scope};
use crate::syntax::{is_header_name, is_header_value, is_key_hash, is_model_name, is_name};
use crate::types::*;

use crate::diagnostic::{Severity, ValidationError};

/// Default of [`TenantSource::tenant_header`].
pub const DEFAULT_TENANT_HEADER: &str = "x-tenant";

/// Checks a policy set; `Err` holds every error (warnings are left out:
/// see [`check`]).
pub fn validate(set: &PolicySet) -> Result<(), Vec<ValidationError>> {
    let errors: Vec<_> = check(set)
        .into_iter()
        .filter(|e| e.severity == Severity::Error)
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// Every finding, errors and warnings, in document order.
pub fn check(set: &PolicySet) -> Vec<ValidationError> {
    let mut v = Checker {
        set,
        out: Vec::new(),
    };
    v.run();
    v.out
}

struct Checker<'a> {
    set: &'a PolicySet,
    out: Vec<ValidationError>,
}

/// Most Envoy replicas a policy set may name (`gatewayReplicas`).
pub const MAX_GATEWAY_REPLICAS: u32 = 1000;

const NAME_RULE: &str =
    "use lowercase letters, digits and `-` (at most 63, starting and ending with a letter or digit)";

fn action_kind(a: &Action) -> &'static str {
    match a {
        Action::Route(_) => "route",
        Action::Reject(_) => "reject",
        Action::Provider(_) => "provider",
        Action::Shed(_) => "shed",
    }
}

impl Checker<'_> {
    pub(super) fn err(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.out.push(ValidationError {
            path: path.into(),
            message: message.into(),
            severity: Severity::Error,
        });
    }

    pub(super) fn warn(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.out.push(ValidationError {
            path: path.into(),
            message: message.into(),
            severity: Severity::Warning,
        });
    }

    pub(super) fn name(&mut self, path: String, what: &str, name: &str) {
        if !is_name(name) {
            self.err(
                path,
                format!("`{name}` is not a valid {what} name: {NAME_RULE}"),
            );
        }
    }

    fn run(&mut self) {
        self.tenants();
        self.out.extend(crate::budget::check(self.set));
        self.out.extend(crate::flow::check(self.set));
        self.tenant_source();
        self.pools();
        self.providers();
        self.classification();
        if self.set.pool_state_max_age_ms == Some(0) {
            self.err("poolStateMaxAgeMs", "must be at least 1 ms");
        }
        if self
            .set
            .gateway_replicas
            .is_some_and(|n| !(1..=MAX_GATEWAY_REPLICAS).contains(&n))
        {
            self.err(
                "gatewayReplicas",
                format!("must be between 1 and {MAX_GATEWAY_REPLICAS}"),
            );
        }
        self.policies();
        let default = &self.set.default_action;
        self.action("defaultAction", default);
    }
}
