//! Token budgets in the policy set: validation of `tenants[].budget` and
//! `classBudgets`, their compilation into each tenant's [`BudgetConfig`],
//! and the loader's check of a compiled one.
//!
//! A class budget is a default, not a shared pool: every tenant of the
//! class without a budget of its own gets the class's limits in a bucket of
//! its own. A tenant's own budget replaces its class's as a whole, so
//! "unset" never has to mean "unlimited here, although the class limits it".

use std::collections::BTreeMap;

pub use crate::bounds::{DEFAULT_OUTPUT_TOKENS, MAX_CONCURRENT, MAX_OUTPUT_TOKENS, MAX_PER_MINUTE};
use crate::config::BudgetConfig;
use crate::diagnostic::{Severity, ValidationError};
use crate::syntax::is_name;
use crate::types::{Budget, PolicySet, Tenant};

fn finding(path: String, message: impl Into<String>, severity: Severity) -> ValidationError {
    ValidationError {
        path,
        message: message.into(),
        severity,
    }
}

/// Findings of every budget in the set, in document order (tenants, then
/// class budgets).
pub(crate) fn check(set: &PolicySet) -> Vec<ValidationError> {
    let mut out = Vec::new();
    for (i, t) in set.tenants.iter().enumerate() {
        if let Some(b) = &t.budget {
            check_budget(&format!("tenants[{i}].budget"), b, &mut out);
        }
    }
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, cb) in set.class_budgets.iter().enumerate() {
        let p = format!("classBudgets[{i}]");
        if !is_name(&cb.class) {
            let msg = format!("`{}` is not a valid class name", cb.class);
            out.push(finding(format!("{p}.class"), msg, Severity::Error));
        } else if let Some(k) = seen.insert(&cb.class, i) {
            let msg = format!("duplicate class `{}` (also classBudgets[{k}])", cb.class);
            out.push(finding(format!("{p}.class"), msg, Severity::Error));
        } else if !set
            .tenants
            .iter()
            .any(|t| t.class.as_deref() == Some(cb.class.as_str()))
        {
            let msg = format!("no tenant has class `{}`", cb.class);
            out.push(finding(format!("{p}.class"), msg, Severity::Warning));
        }
        check_budget(&format!("{p}.budget"), &cb.budget, &mut out);
    }
    out
}

fn check_budget(p: &str, b: &Budget, out: &mut Vec<ValidationError>) {
    let rates = [
        ("tokensPerMinute", b.tokens_per_minute),
        ("promptTokensPerMinute", b.prompt_tokens_per_minute),
        ("completionTokensPerMinute", b.completion_tokens_per_minute),
        ("requestsPerMinute", b.requests_per_minute),
    ];
    if rates.iter().all(|(_, v)| v.is_none()) && b.max_concurrent.is_none() {
        out.push(finding(
            p.to_owned(),
            "sets no limit: set one or more of `tokensPerMinute`, `promptTokensPerMinute`, `completionTokensPerMinute`, `requestsPerMinute`, `maxConcurrent`",
            Severity::Error,
        ));
    }
    for (field, v) in rates {
        if v.is_some_and(|v| !(1..=MAX_PER_MINUTE).contains(&v)) {
            let msg = format!("must be between 1 and {MAX_PER_MINUTE}");
            out.push(finding(format!("{p}.{field}"), msg, Severity::Error));
        }
    }
    if b.max_concurrent
        .is_some_and(|v| !(1..=MAX_CONCURRENT).contains(&v))
    {
        let msg = format!("must be between 1 and {MAX_CONCURRENT}");
        out.push(finding(format!("{p}.maxConcurrent"), msg, Severity::Error));
    }
    if let Some(w) = b.cached_token_weight {
        if !(0.0..=1.0).contains(&w) {
            let msg = "must be between 0 and 1 (the share of an uncached token's cost)";
            out.push(finding(
                format!("{p}.cachedTokenWeight"),
                msg,
                Severity::Error,
            ));
        } else if b.tokens_per_minute.is_none() && b.prompt_tokens_per_minute.is_none() {
            let msg =
                "unused: only `tokensPerMinute` and `promptTokensPerMinute` count cached tokens";
            out.push(finding(
                format!("{p}.cachedTokenWeight"),
                msg,
                Severity::Warning,
            ));
        }
    }
    if let Some(n) = b.default_output_tokens {
        if !(1..=MAX_OUTPUT_TOKENS).contains(&n) {
            let msg = format!("must be between 1 and {MAX_OUTPUT_TOKENS}");
            out.push(finding(
                format!("{p}.defaultOutputTokens"),
                msg,
                Severity::Error,
            ));
        } else if b.tokens_per_minute.is_none() && b.completion_tokens_per_minute.is_none() {
            let msg = "unused: only `tokensPerMinute` and `completionTokensPerMinute` reserve output tokens";
            out.push(finding(
                format!("{p}.defaultOutputTokens"),
                msg,
                Severity::Warning,
            ));
        }
    }
    if let Some(total) = b
        .tokens_per_minute
        .filter(|t| (1..=MAX_PER_MINUTE).contains(t))
    {
        for (field, v) in [
            ("promptTokensPerMinute", b.prompt_tokens_per_minute),
            ("completionTokensPerMinute", b.completion_tokens_per_minute),
        ] {
            if v.is_some_and(|v| v >= total) {
                let msg = format!("never binds: `tokensPerMinute` ({total}) is lower");
                out.push(finding(format!("{p}.{field}"), msg, Severity::Warning));
            }
        }
    }
}

/// The compiled budget of tenant `t`: its own, else its class's, else none.
/// Call on a validated set.
pub(crate) fn compile(set: &PolicySet, t: &Tenant) -> Option<BudgetConfig> {
    let b = t.budget.as_ref().or_else(|| {
        let class = t.class.as_deref()?;
        set.class_budgets
            .iter()
            .find(|cb| cb.class == class)
            .map(|cb| &cb.budget)
    })?;
    Some(BudgetConfig {
        tokens_per_minute: b.tokens_per_minute,
        prompt_tokens_per_minute: b.prompt_tokens_per_minute,
        completion_tokens_per_minute: b.completion_tokens_per_minute,
        requests_per_minute: b.requests_per_minute,
        max_concurrent: b.max_concurrent,
        cached_token_weight_permille: permille(b.cached_token_weight.unwrap_or(1.0)),
        default_output_tokens: b.default_output_tokens.unwrap_or(DEFAULT_OUTPUT_TOKENS),
    })
}

/// A validated weight (0..=1) in thousandths, rounded to the nearest.
fn permille(w: f64) -> u16 {
    // In 0..=1000 after clamping, so the cast cannot truncate.
    (w.clamp(0.0, 1.0) * 1000.0).round() as u16
}
