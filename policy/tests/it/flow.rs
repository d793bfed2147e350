//! Fair share and flow control: tenants' `weight` and `classWeights`,
//! pools' `flowControl`: defaults, validation paths and messages, the
//! compiled `tenants[].weight` and `pools[].maxQueueWaitMs`, and the
//! indexer's section from the same source.

use crate::common;
use common::*;
use kvasir_flowcontrol::FlowControlConfig;
use kvasir_policy::flow::{check_flow_control, max_queue_wait_ms, resolve};
use kvasir_policy::*;
use serde_json::{json, Value};

const OK_DEFAULT: &str = r#"{"route": {"pool": "main"}}"#;

/// The base set (tenants `a`, `b` gold, `c` free; pools `main`, `alt`)
/// with tenant `a`'s weight, class weights and `main`'s flow control.
fn with(weight_a: Option<u32>, classes: Value, flow: Option<Value>) -> PolicySet {
    let mut set = base("[]", OK_DEFAULT);
    set.tenants[0].weight = weight_a;
    set.class_weights = serde_json::from_value(classes).unwrap();
    set.pools[0].flow_control = flow.map(|f| serde_json::from_value(f).unwrap());
    set
}

fn compiled(set: &PolicySet) -> FilterConfig {
    compile(set).unwrap_or_else(|e| panic!("{e:?}"))
}

fn weights(set: &PolicySet) -> Vec<(String, u32)> {
    let cfg = compiled(set);
    cfg.tenants()
        .iter()
        .map(|t| (t.name.clone(), t.weight))
        .collect()
}

fn pairs(v: &[(&str, u32)]) -> Vec<(String, u32)> {
    v.iter().map(|(n, w)| (n.to_string(), *w)).collect()
}

fn wait_of(cfg: &FilterConfig, pool: &str) -> u32 {
    let p = cfg.pools().iter().find(|p| p.name == pool).unwrap();
    p.max_queue_wait_ms
}

#[test]
fn parses_from_the_policy_set() {
    let set = parse_json(
        r#"{"tenantSource": {"header": "x-tenant"},
            "tenants": [{"name": "a", "class": "gold", "weight": 3}],
            "classWeights": [{"class": "gold", "weight": 2}],
            "pools": [{"name": "main", "models": ["m"], "cluster": "c", "indexerCluster": "i",
                       "flowControl": {"enabled": true, "threshold": 0.8, "maxQueued": 100,
                                       "maxQueuedPerTenant": 10, "maxWaitMs": 2500}}],
            "defaultAction": {"route": {"pool": "main"}}}"#,
    )
    .unwrap();
    assert_eq!(set.tenants[0].weight, Some(3));
    assert_eq!(set.class_weights[0].weight, 2);
    let fc = set.pools[0].flow_control.as_ref().unwrap();
    assert_eq!(
        (fc.enabled, fc.threshold, fc.max_queued, fc.max_wait_ms),
        (Some(true), Some(0.8), Some(100), Some(2500))
    );
    let e = parse_json(
        r#"{"tenantSource": {"header": "x-tenant"},
            "pools": [{"name": "main", "models": ["m"], "cluster": "c", "indexerCluster": "i",
                       "flowControl": {"maxWait": 1}}],
            "defaultAction": {"route": {"pool": "main"}}}"#,
    )
    .unwrap_err();
    assert!(e.to_string().contains("pools[0].flowControl"), "{e}");
}

#[test]
fn weights_default_to_one_and_classes_give_defaults() {
    // Nothing set: every tenant 1, every pool never waits.
    let set = with(None, json!([]), None);
    assert_eq!(weights(&set), pairs(&[("a", 1), ("b", 1), ("c", 1)]));
    let cfg = compiled(&set);
    assert!(cfg.pools().iter().all(|p| p.max_queue_wait_ms == 0));
    // a's own weight wins over gold's; b takes gold's; c (free) stays 1.
    let set = with(Some(7), json!([{"class": "gold", "weight": 4}]), None);
    assert_eq!(weights(&set), pairs(&[("a", 7), ("b", 4), ("c", 1)]));
    assert!(findings(&set).is_empty(), "{:?}", findings(&set));
}

#[test]
fn weight_errors_name_the_field() {
    let set = with(
        Some(0),
        json!([
            {"class": "Gold", "weight": 2},
            {"class": "gold", "weight": 1001},
            {"class": "gold", "weight": 3},
        ]),
        None,
    );
    assert_eq!(
        findings(&set),
        vec![
            "tenants[0].weight: must be between 1 and 1000, got 0",
            "classWeights[0].class: `Gold` is not a valid class name",
            "classWeights[1].weight: must be between 1 and 1000, got 1001",
            "classWeights[2].class: duplicate class `gold` (also classWeights[1])",
        ]
    );
    assert!(compile(&set).is_err());
}

#[test]
fn a_class_weight_nobody_takes_is_a_warning() {
    let set = with(None, json!([{"class": "platinum", "weight": 2}]), None);
    assert_eq!(
        findings(&set),
        vec!["warning: classWeights[0].class: unused: no tenant of class `platinum` goes without a weight of its own"]
    );
    // c is the only free tenant; with its own weight the class's is unused.
    let mut set = with(None, json!([{"class": "free", "weight": 2}]), None);
    assert!(findings(&set).is_empty());
    set.tenants[2].weight = Some(5);
    assert_eq!(findings(&set).len(), 1);
    assert!(compile(&set).is_ok());
}

#[test]
fn flow_control_compiles_into_both_sides() {
    let set = with(
        None,
        json!([]),
        Some(json!({"enabled": true, "threshold": 0.9, "maxWaitMs": 4000})),
    );
    let cfg = compiled(&set);
    assert_eq!(wait_of(&cfg, "main"), 4000);
    assert_eq!(wait_of(&cfg, "alt"), 0, "no flowControl: never waits");
    let indexer = resolve(set.pools[0].flow_control.as_ref().unwrap());
    assert_eq!(
        indexer,
        FlowControlConfig {
            enabled: true,
            threshold: 0.9,
            max_wait_ms: 4000,
            ..FlowControlConfig::default()
        }
    );
    assert_eq!(u64::from(wait_of(&cfg, "main")), indexer.max_wait_ms);

    // Enabled with every default: the indexer's default wait.
    let set = with(None, json!([]), Some(json!({"enabled": true})));
    let d = FlowControlConfig::default();
    assert_eq!(u64::from(wait_of(&compiled(&set), "main")), d.max_wait_ms);
    // Off (explicitly or by default): 0, whatever maxWaitMs says.
    for off in [json!({"enabled": false, "maxWaitMs": 4000}), json!({})] {
        let set = with(None, json!([]), Some(off));
        assert_eq!(wait_of(&compiled(&set), "main"), 0);
        assert!(!resolve(set.pools[0].flow_control.as_ref().unwrap()).enabled);
    }
}

#[test]
fn the_filter_wait_always_equals_the_indexer_wait() {
    // Over a grid of sections: maxQueueWaitMs is maxWaitMs when enabled,
    // 0 otherwise, in the compiled document and through the helper.
    for enabled in [None, Some(false), Some(true)] {
        for wait in [None, Some(0), Some(1), Some(2500), Some(600_000)] {
            let fc = FlowControl {
                enabled,
                max_wait_ms: wait,
                ..FlowControl::default()
            };
            let mut set = with(None, json!([]), None);
            set.pools[0].flow_control = Some(fc.clone());
            let cfg = compiled(&set);
            let ix = resolve(&fc);
            let want = if ix.enabled { ix.max_wait_ms } else { 0 };
            assert_eq!(u64::from(wait_of(&cfg, "main")), want, "{fc:?}");
            assert_eq!(max_queue_wait_ms(Some(&fc)), wait_of(&cfg, "main"));
        }
    }
    assert_eq!(max_queue_wait_ms(None), 0);
}

#[test]
fn flow_control_errors_name_the_field() {
    let cases = [
        (
            json!({"enabled": true, "threshold": 0}),
            "pools[0].flowControl.threshold: must be a number > 0, got 0",
        ),
        (
            json!({"enabled": true, "maxQueued": 10, "maxQueuedPerTenant": 11}),
            "pools[0].flowControl.maxQueuedPerTenant: must be at most maxQueued (10), got 11",
        ),
        (
            // Against the indexer's default maxQueued.
            json!({"enabled": true, "maxQueuedPerTenant": 2000}),
            "pools[0].flowControl.maxQueuedPerTenant: must be at most maxQueued (1024), got 2000",
        ),
        (
            json!({"enabled": true, "maxWaitMs": 600_001}),
            "pools[0].flowControl.maxWaitMs: must be at most 600000, got 600001",
        ),
        (
            json!({"enabled": true, "maxQueued": 1_000_001}),
            "pools[0].flowControl.maxQueued: must be at most 1000000, got 1000001",
        ),
    ];
    for (fc, want) in cases {
        let set = with(None, json!([]), Some(fc.clone()));
        assert_eq!(findings(&set), vec![want.to_owned()], "{fc}");
        assert!(compile(&set).is_err(), "{fc}");
    }
}

#[test]
fn flow_control_warnings_for_settings_that_never_apply() {
    let set = with(
        None,
        json!([]),
        Some(json!({"threshold": 0.5, "maxWaitMs": 100})),
    );
    assert_eq!(
        findings(&set),
        vec!["warning: pools[0].flowControl: flow control is off (`enabled` is not true): these settings never apply"]
    );
    assert!(compile(&set).is_ok());
    let set = with(
        None,
        json!([]),
        Some(json!({"enabled": true, "threshold": 1.5})),
    );
    assert_eq!(
        findings(&set),
        vec!["warning: pools[0].flowControl.threshold: above 1: a pool's saturation is at most 1, so picks never wait"]
    );
    // The checker alone, at any path (kvasir-api maps it to annotations).
    let fc = FlowControl {
        threshold: Some(-1.0),
        ..FlowControl::default()
    };
    let found: Vec<String> = check_flow_control("x", &fc)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(
        found,
        vec![
            "x.threshold: must be a number > 0, got -1",
            "warning: x: flow control is off (`enabled` is not true): these settings never apply",
        ]
    );
}

#[test]
fn compiled_shape_and_round_trip() {
    let set = with(
        Some(5),
        json!([]),
        Some(json!({"enabled": true, "maxWaitMs": 1500})),
    );
    let cfg = compiled(&set);
    let v: Value = serde_json::from_slice(&cfg.to_json()).unwrap();
    assert_eq!(v["tenants"][0]["weight"], json!(5));
    let main = v["pools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "main")
        .unwrap();
    assert_eq!(main["maxQueueWaitMs"], json!(1500));
    assert_eq!(FilterConfig::from_json(&cfg.to_json()).unwrap(), cfg);
}

#[test]
fn the_loader_refuses_bad_compiled_values_and_defaults_missing_ones() {
    let good: Value =
        serde_json::from_slice(&compiled(&with(None, json!([]), None)).to_json()).unwrap();
    let load = |v: &Value| FilterConfig::from_json(&serde_json::to_vec(v).unwrap());
    for w in [0, 1001] {
        let mut v = good.clone();
        v["tenants"][0]["weight"] = json!(w);
        assert_eq!(
            load(&v).unwrap_err(),
            ConfigError::Invalid {
                path: "tenants[0].weight".into(),
                message: "must be between 1 and 1000".into()
            }
        );
    }
    let mut v = good.clone();
    v["pools"][0]["maxQueueWaitMs"] = json!(600_001);
    assert_eq!(
        load(&v).unwrap_err(),
        ConfigError::Invalid {
            path: "pools[0].maxQueueWaitMs".into(),
            message: "must be at most 600000".into()
        }
    );
    // A document written before these fields: weight 1, no queue wait.
    let mut v = good.clone();
    v["tenants"][0].as_object_mut().unwrap().remove("weight");
    v["pools"][0]
        .as_object_mut()
        .unwrap()
        .remove("maxQueueWaitMs");
    let cfg = load(&v).unwrap();
    assert!(cfg.tenants().iter().all(|t| t.weight == 1));
    assert!(cfg.pools().iter().all(|p| p.max_queue_wait_ms == 0));
}

#[test]
fn work_saturation_and_reserve_are_carried_and_checked() {
    let set = with(
        None,
        json!([]),
        Some(json!({"enabled": true, "saturatedPrefillTokens": 8192, "reserve": 0.3})),
    );
    assert!(findings(&set).is_empty(), "{:?}", findings(&set));
    let indexer = resolve(set.pools[0].flow_control.as_ref().unwrap());
    assert_eq!(
        (indexer.saturated_prefill_tokens, indexer.reserve),
        (8192, 0.3)
    );
    // Unset: the indexer's defaults.
    let d = resolve(&FlowControl::default());
    let want = FlowControlConfig::default();
    assert_eq!(
        (d.saturated_prefill_tokens, d.reserve),
        (want.saturated_prefill_tokens, want.reserve)
    );
    // A reserve of 1 would hold a tenant over its share for good.
    let bad = with(
        None,
        json!([]),
        Some(json!({"enabled": true, "reserve": 1.0})),
    );
    assert_eq!(
        findings(&bad),
        vec!["pools[0].flowControl.reserve: must be in [0, 1), got 1"]
    );
}

/// The filter reports first tokens for a pool exactly when its flow control
/// is on and counts queued prefill work; the compiled config says so only
/// then (absent otherwise, so configs without it stay as they were).
#[test]
fn first_token_reports_follow_the_work_term() {
    let pool = |fc: &str| {
        let set = parse_json(&format!(
            r#"{{"tenantSource": {{"header": "x-tenant"}},
                "pools": [{{"name": "main", "models": ["m"], "cluster": "c", "indexerCluster": "i"{fc}}}],
                "defaultAction": {{"route": {{"pool": "main"}}}}}}"#
        ))
        .unwrap();
        let cfg = compiled(&set);
        let json = String::from_utf8(cfg.to_json()).unwrap();
        (
            cfg.pools()[0].report_first_token,
            json.contains("reportFirstToken"),
        )
    };
    assert_eq!(pool(""), (false, false));
    assert_eq!(
        pool(r#", "flowControl": {"enabled": true}"#),
        (false, false)
    );
    assert_eq!(
        pool(r#", "flowControl": {"enabled": false, "saturatedPrefillTokens": 65536}"#),
        (false, false)
    );
    assert_eq!(
        pool(r#", "flowControl": {"enabled": true, "saturatedPrefillTokens": 65536}"#),
        (true, true)
    );
}
