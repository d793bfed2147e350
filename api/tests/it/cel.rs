//! The CRDs' CEL rules compile, and they reject at admission what
//! `kvasir_policy::validate` rejects for one-of fields, ranges of pairs and
//! names (evaluated by kube-cel, the CEL of Kubernetes' libraries, without
//! an API server).

use serde_json::{json, Value};

fn schema(kind: &str) -> Value {
    let crd = kvasir_api::crds::all()
        .into_iter()
        .find(|c| c.spec.names.kind == kind)
        .unwrap();
    let s = crd.spec.versions[0]
        .schema
        .clone()
        .unwrap()
        .open_api_v3_schema
        .unwrap();
    serde_json::to_value(s).unwrap()
}

fn policy(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "kvasir.dev/v1alpha1", "kind": "InferencePolicy",
           "metadata": {"name": name}, "spec": spec})
}

fn base_spec() -> Value {
    json!({"precedence": 1, "targetRefs": [{"kind": "Gateway", "name": "g"}],
           "action": {"route": {"pool": "main"}}})
}

fn errors(kind: &str, obj: &Value) -> Vec<String> {
    match kube_cel::validate(&schema(kind), obj, None) {
        Ok(()) => Vec::new(),
        Err(e) => e.into_vec().into_iter().map(|e| e.to_string()).collect(),
    }
}

#[test]
fn every_rule_compiles() {
    for crd in kvasir_api::crds::all() {
        let s = serde_json::to_value(
            crd.spec.versions[0]
                .schema
                .clone()
                .unwrap()
                .open_api_v3_schema
                .unwrap(),
        )
        .unwrap();
        let compiled = kube_cel::compile_schema(&s);
        assert!(
            !compiled.has_errors(),
            "{}: {:?}",
            crd.spec.names.kind,
            compiled.compilation_errors()
        );
    }
}

#[test]
fn valid_policy_passes() {
    let mut spec = base_spec();
    spec["match"] = json!({"headers": [{"name": "x-batch", "present": true}],
                           "promptTokens": {"min": 1, "max": 10},
                           "poolState": {"pool": "main", "saturationAbove": 0.2, "saturationBelow": 0.8}});
    assert_eq!(
        errors("InferencePolicy", &policy("ok", spec)),
        Vec::<String>::new()
    );
}

#[test]
fn one_of_and_pair_rules_reject() {
    let cases = [
        (
            json!({"route": {"pool": "a"}, "reject": {"status": 403}}),
            "exactly one of `route`",
        ),
        (json!({}), "exactly one of `route`"),
    ];
    for (action, want) in cases {
        let mut spec = base_spec();
        spec["action"] = action;
        let errs = errors("InferencePolicy", &policy("p", spec));
        assert!(errs.iter().any(|e| e.contains(want)), "{errs:?}");
    }
    let matches = [
        (
            json!({"headers": [{"name": "x", "exact": "a", "prefix": "b"}]}),
            "exactly one of `exact`",
        ),
        (
            json!({"promptTokens": {"min": 10, "max": 1}}),
            "`min` is greater than `max`",
        ),
        (json!({"promptTokens": {}}), "set `min`, `max` or both"),
        (
            json!({"poolState": {"pool": "p", "saturationAbove": 0.9, "saturationBelow": 0.1}}),
            "empty band",
        ),
    ];
    for (m, want) in matches {
        let mut spec = base_spec();
        spec["match"] = m;
        let errs = errors("InferencePolicy", &policy("p", spec));
        assert!(errs.iter().any(|e| e.contains(want)), "{want}: {errs:?}");
    }
}

#[test]
fn names_must_be_labels() {
    let errs = errors("InferencePolicy", &policy("has.dots", base_spec()));
    assert!(
        errs.iter().any(|e| e.contains("DNS-1123 label")),
        "{errs:?}"
    );
}

#[test]
fn settings_tenant_source_rules() {
    let settings = |src: Value| {
        json!({"apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceSettings",
               "metadata": {"name": "s"},
               "spec": {"targetRefs": [{"kind": "Gateway", "name": "g"}], "tenantSource": src,
                        "defaultAction": {"reject": {"status": 403}}}})
    };
    assert!(errors("InferenceSettings", &settings(json!({"apiKey": {}}))).is_empty());
    let errs = errors(
        "InferenceSettings",
        &settings(json!({"apiKey": {}, "header": "x-t"})),
    );
    assert!(
        errs.iter().any(|e| e.contains("exactly one of `header`")),
        "{errs:?}"
    );
    let errs = errors(
        "InferenceSettings",
        &settings(json!({"apiKey": {}, "unknownTenant": "default"})),
    );
    assert!(errs.iter().any(|e| e.contains("defaultTenant")), "{errs:?}");
    let errs = errors(
        "InferenceSettings",
        &settings(json!({"jwtClaim": {"claim": "c"}})),
    );
    assert!(
        errs.iter().any(|e| e.contains("`payloadInMetadata`")),
        "{errs:?}"
    );
}

#[test]
fn a_budget_needs_a_limit() {
    let tenant = |budget: Value| {
        json!({"apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceTenant",
               "metadata": {"name": "t"}, "spec": {"budget": budget}})
    };
    assert_eq!(
        errors("InferenceTenant", &tenant(json!({"maxConcurrent": 2}))),
        Vec::<String>::new()
    );
    let errs = errors(
        "InferenceTenant",
        &tenant(json!({"cachedTokenWeight": 0.5})),
    );
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert!(
        errs[0].contains("set one or more of `tokensPerMinute`"),
        "{errs:?}"
    );
}

#[test]
fn weights_are_bounded_in_the_schema() {
    use kvasir_policy::flow::MAX_WEIGHT;
    let tenant = schema("InferenceTenant");
    let w = &tenant["properties"]["spec"]["properties"]["weight"];
    assert_eq!(
        (w["minimum"].as_f64(), w["maximum"].as_f64()),
        (Some(1.0), Some(f64::from(MAX_WEIGHT)))
    );
    let settings = schema("InferenceSettings");
    let cw = &settings["properties"]["spec"]["properties"]["classWeights"];
    assert_eq!(cw["x-kubernetes-list-map-keys"], json!(["class"]));
    let w = &cw["items"]["properties"]["weight"];
    assert_eq!(
        (w["minimum"].as_f64(), w["maximum"].as_f64()),
        (Some(1.0), Some(f64::from(MAX_WEIGHT)))
    );
    // A tenant with a weight passes the tenant's CEL rules (kube-cel
    // checks rules only; the bounds above are the API server's).
    let t = json!({"apiVersion": "kvasir.dev/v1alpha1", "kind": "InferenceTenant",
                   "metadata": {"name": "t"}, "spec": {"weight": 4}});
    assert_eq!(errors("InferenceTenant", &t), Vec::<String>::new());
}
