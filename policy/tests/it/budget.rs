//! Token budgets: validation paths and messages, class defaults, and the
//! compiled `tenants[].budget`.

use crate::common;
use common::*;
use kvasir_policy::*;
use serde_json::{json, Value};

const OK_DEFAULT: &str = r#"{"route": {"pool": "main"}}"#;

fn budget(v: Value) -> Budget {
    serde_json::from_value(v).unwrap()
}

/// The base set (tenants `a`, `b` gold, `c` free) with budgets.
fn with(tenant_a: Option<Value>, classes: Value) -> PolicySet {
    let mut set = base("[]", OK_DEFAULT);
    set.tenants[0].budget = tenant_a.map(budget);
    set.class_budgets = serde_json::from_value(classes).unwrap();
    set
}

fn compiled_budgets(set: &PolicySet) -> Vec<Option<BudgetConfig>> {
    let cfg = compile(set).unwrap_or_else(|e| panic!("{e:?}"));
    cfg.tenants().iter().map(|t| t.budget).collect()
}

#[test]
fn parses_from_the_policy_set() {
    let set = parse_json(
        r#"{"tenantSource": {"header": "x-tenant"},
            "tenants": [{"name": "a", "class": "gold", "budget": {"tokensPerMinute": 1000, "cachedTokenWeight": 0.25}}],
            "classBudgets": [{"class": "gold", "budget": {"requestsPerMinute": 60}}],
            "pools": [{"name": "main", "models": ["m"], "cluster": "c", "indexerCluster": "i"}],
            "defaultAction": {"route": {"pool": "main"}}}"#,
    )
    .unwrap();
    assert_eq!(
        set.tenants[0].budget.as_ref().unwrap().tokens_per_minute,
        Some(1000)
    );
    assert_eq!(set.class_budgets[0].class, "gold");
    let e = parse_json(
        r#"{"tenantSource": {"header": "x-tenant"},
            "tenants": [{"name": "a", "budget": {"tokenPerMinute": 1}}],
            "pools": [], "defaultAction": {"reject": {"status": 403}}}"#,
    )
    .unwrap_err();
    assert!(e.to_string().contains("tenants[0].budget"), "{e}");
}

#[test]
fn validation_errors_name_the_field() {
    let set = with(
        Some(
            json!({"tokensPerMinute": 0, "promptTokensPerMinute": 2_000_000_000u64,
                    "maxConcurrent": 0, "cachedTokenWeight": 1.5, "defaultOutputTokens": 0}),
        ),
        json!([
            {"class": "Gold", "budget": {"requestsPerMinute": 1}},
            {"class": "gold", "budget": {}},
            {"class": "gold", "budget": {"requestsPerMinute": 1}},
        ]),
    );
    assert_eq!(
        findings(&set),
        vec![
            "tenants[0].budget.tokensPerMinute: must be between 1 and 1000000000",
            "tenants[0].budget.promptTokensPerMinute: must be between 1 and 1000000000",
            "tenants[0].budget.maxConcurrent: must be between 1 and 1000000",
            "tenants[0].budget.cachedTokenWeight: must be between 0 and 1 (the share of an uncached token's cost)",
            "tenants[0].budget.defaultOutputTokens: must be between 1 and 10000000",
            "classBudgets[0].class: `Gold` is not a valid class name",
            "classBudgets[1].budget: sets no limit: set one or more of `tokensPerMinute`, `promptTokensPerMinute`, `completionTokensPerMinute`, `requestsPerMinute`, `maxConcurrent`",
            "classBudgets[2].class: duplicate class `gold` (also classBudgets[1])",
        ]
    );
    assert!(compile(&set).is_err());
}

#[test]
fn warnings_for_settings_that_do_nothing() {
    let set = with(
        Some(
            json!({"requestsPerMinute": 10, "cachedTokenWeight": 0.5, "defaultOutputTokens": 100}),
        ),
        json!([{"class": "platinum", "budget": {"maxConcurrent": 4}}]),
    );
    assert_eq!(
        findings(&set),
        vec![
            "warning: tenants[0].budget.cachedTokenWeight: unused: only `tokensPerMinute` and `promptTokensPerMinute` count cached tokens",
            "warning: tenants[0].budget.defaultOutputTokens: unused: only `tokensPerMinute` and `completionTokensPerMinute` reserve output tokens",
            "warning: classBudgets[0].class: no tenant has class `platinum`",
        ]
    );
    assert!(compile(&set).is_ok());
    let set = with(
        Some(json!({"tokensPerMinute": 100, "promptTokensPerMinute": 100})),
        json!([]),
    );
    assert_eq!(
        findings(&set),
        vec!["warning: tenants[0].budget.promptTokensPerMinute: never binds: `tokensPerMinute` (100) is lower"]
    );
}

#[test]
fn class_budgets_are_defaults_and_a_tenant_budget_replaces_them() {
    let set = with(
        Some(json!({"completionTokensPerMinute": 500})),
        json!([{"class": "gold", "budget": {"tokensPerMinute": 10000, "requestsPerMinute": 60, "cachedTokenWeight": 0.1234}}]),
    );
    let gold = BudgetConfig {
        tokens_per_minute: Some(10000),
        prompt_tokens_per_minute: None,
        completion_tokens_per_minute: None,
        requests_per_minute: Some(60),
        max_concurrent: None,
        cached_token_weight_permille: 123,
        default_output_tokens: 512,
    };
    let own = BudgetConfig {
        tokens_per_minute: None,
        completion_tokens_per_minute: Some(500),
        requests_per_minute: None,
        cached_token_weight_permille: 1000,
        ..gold
    };
    // a: its own (replacing gold's whole); b: gold's; c (free): none.
    assert_eq!(compiled_budgets(&set), vec![Some(own), Some(gold), None]);
}

#[test]
fn compiled_shape_and_round_trip() {
    let set = with(
        Some(
            json!({"tokensPerMinute": 6000, "maxConcurrent": 3, "cachedTokenWeight": 0, "defaultOutputTokens": 64}),
        ),
        json!([]),
    );
    let cfg = compile(&set).unwrap();
    let v: Value = serde_json::from_slice(&cfg.to_json()).unwrap();
    assert_eq!(
        v["tenants"][0],
        json!({"name": "a", "class": "gold", "budget": {
            "tokensPerMinute": 6000, "maxConcurrent": 3,
            "cachedTokenWeightPermille": 0, "defaultOutputTokens": 64}, "weight": 1})
    );
    assert_eq!(
        v["tenants"][2],
        json!({"name": "c", "class": "free", "weight": 1})
    );
    assert_eq!(FilterConfig::from_json(&cfg.to_json()).unwrap(), cfg);
}

#[test]
fn the_loader_refuses_a_bad_compiled_budget() {
    let set = with(Some(json!({"tokensPerMinute": 6000})), json!([]));
    let good: Value = serde_json::from_slice(&compile(&set).unwrap().to_json()).unwrap();
    for (field, value, message) in [
        (
            "tokensPerMinute",
            json!(0),
            "must be between 1 and 1000000000",
        ),
        (
            "cachedTokenWeightPermille",
            json!(1001),
            "must be at most 1000",
        ),
        (
            "defaultOutputTokens",
            json!(0),
            "must be between 1 and 10000000",
        ),
        ("maxConcurrent", json!(0), "must be between 1 and 1000000"),
    ] {
        let mut v = good.clone();
        v["tenants"][0]["budget"][field] = value;
        let e = FilterConfig::from_json(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert_eq!(
            e,
            ConfigError::Invalid {
                path: format!("tenants[0].budget.{field}"),
                message: message.into()
            }
        );
    }
}
