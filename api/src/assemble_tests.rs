use super::*;
use crate::document::{parse, Document};
use kvasir_policy::{ApiKind, Decision, NoText, PoolStates, RequestFacts, TenantInput};

const EXAMPLES: &[&str] = &[
    include_str!("../../crds/examples/base.yaml"),
    include_str!("../../crds/examples/pii-stays-inside.yaml"),
    include_str!("../../crds/examples/cheaper-model-for-easy-prompts.yaml"),
    include_str!("../../crds/examples/batch-when-idle.yaml"),
    include_str!("../../crds/examples/burst-to-provider.yaml"),
];

fn load(texts: &[&str]) -> Resources {
    let mut res = Resources {
        namespace: "serving".into(),
        ..Resources::default()
    };
    for text in texts {
        for d in serde_yaml::Deserializer::from_str(text) {
            let v: serde_json::Value = serde::Deserialize::deserialize(d).unwrap();
            let doc: Document = parse(v).unwrap();
            res.insert(doc);
        }
    }
    res
}

fn gateway() -> TargetRef {
    TargetRef::new(TargetKind::Gateway, "inference-gateway")
}

#[test]
fn examples_compile_in_precedence_order() {
    let res = load(EXAMPLES);
    assert_eq!(
        targets(&res).into_iter().collect::<Vec<_>>(),
        vec![gateway()]
    );
    let c = compile(&res, &gateway(), &Options::default()).unwrap();
    let names: Vec<_> = c
        .config
        .policies()
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "pii-stays-inside",
            "batch-when-idle",
            "batch-waits",
            "cheaper-model-for-easy-prompts",
            "burst-to-provider"
        ]
    );
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    let pools: Vec<_> = c
        .config
        .pools()
        .iter()
        .map(|p| p.cluster.as_str())
        .collect();
    assert_eq!(
        pools,
        ["kvasir/serving/pool/main", "kvasir/serving/pool/small"]
    );
    // The provider's credential is not in the bytes; the tenants' keys only
    // as hashes.
    let text = String::from_utf8(c.bytes.clone()).unwrap();
    assert!(!text.contains("sk-acme"), "{text}");
    assert!(text.contains(&hash_api_key("sk-acme-example-1")));
    assert!(text.contains(&hash_api_key("sk-eval-example")));
}

#[test]
fn secret_names_are_the_tenants_key_secrets() {
    let names: Vec<_> = load(EXAMPLES).secret_names().into_iter().collect();
    assert_eq!(names, ["acme-api-keys", "nightly-eval-api-keys"]);
}

#[test]
fn same_resources_in_any_order_give_the_same_bytes() {
    let a = compile(&load(EXAMPLES), &gateway(), &Options::default()).unwrap();
    let mut rev: Vec<&str> = EXAMPLES.to_vec();
    rev.reverse();
    let mut res = load(&rev);
    res.policies.reverse();
    res.tenants.reverse();
    let b = compile(&res, &gateway(), &Options::default()).unwrap();
    assert_eq!(a.bytes, b.bytes);
}

#[test]
fn api_key_from_secret_identifies_the_tenant() {
    let c = compile(&load(EXAMPLES), &gateway(), &Options::default()).unwrap();
    let headers = [("authorization", "Bearer sk-eval-example")];
    let t = c
        .config
        .resolve_tenant(&TenantInput {
            headers: &headers,
            jwt_claim: None,
        })
        .unwrap();
    assert_eq!(t.name, "nightly-eval");
    let facts = RequestFacts {
        tenant: Some(t.name),
        api: ApiKind::Chat,
        model: "llama-3.1-8b-instruct",
        headers: &headers,
        estimated_prompt_tokens: 2000,
        prompt: &NoText,
    };
    let out = c.config.evaluate(&facts, &PoolStates::new(&c.config), 0);
    assert_eq!(out.policy_name(), "batch-waits");
    assert!(matches!(
        out.decision,
        Decision::Shed {
            retry_after_s: 60,
            ..
        }
    ));
}

#[test]
fn budgets_compile_from_the_tenant_and_its_class() {
    let c = compile(&load(EXAMPLES), &gateway(), &Options::default()).unwrap();
    let budget = |name: &str| {
        let i = c.config.tenant_index(name).unwrap();
        c.config.tenants()[i].budget.unwrap()
    };
    let acme = budget("acme");
    assert_eq!(acme.tokens_per_minute, Some(100_000));
    assert_eq!(acme.requests_per_minute, Some(600));
    assert_eq!(acme.cached_token_weight_permille, 500);
    let eval = budget("nightly-eval");
    assert_eq!(eval.tokens_per_minute, Some(200_000));
    assert_eq!(eval.max_concurrent, Some(8));
    assert_eq!(eval.cached_token_weight_permille, 1000);
}

#[test]
fn budget_errors_map_to_resource_fields() {
    let mut res = load(EXAMPLES);
    let acme = res.tenants.iter_mut().find(|t| t.name_any() == "acme");
    acme.unwrap()
        .spec
        .budget
        .as_mut()
        .unwrap()
        .tokens_per_minute = Some(0);
    let classes = res.settings[0].spec.class_budgets.as_mut().unwrap();
    classes.push(classes[0].clone());
    let errs = compile(&res, &gateway(), &Options::default()).unwrap_err();
    let got: Vec<_> = errs
        .iter()
        .map(|e| (e.object.as_ref().unwrap().to_string(), e.path.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            (
                "InferenceTenant/acme".to_owned(),
                "spec.budget.tokensPerMinute"
            ),
            (
                "InferenceSettings/inference-gateway".to_owned(),
                "spec.classBudgets[1].class"
            ),
        ],
        "{errs:?}"
    );
}

#[test]
fn equal_precedence_is_an_error() {
    let mut res = load(EXAMPLES);
    let p = res
        .policies
        .iter_mut()
        .find(|p| p.name_any() == "batch-waits")
        .unwrap();
    p.spec.precedence = 50;
    let errs = compile(&res, &gateway(), &Options::default()).unwrap_err();
    assert_eq!(errs.len(), 1, "{errs:?}");
    // Blamed: the later by name (the name only orders the message).
    assert_eq!(errs[0].object.as_ref().unwrap().name, "batch-when-idle");
    assert_eq!(errs[0].path, "spec.precedence");
    assert!(
        errs[0].message.contains("`batch-waits`"),
        "{}",
        errs[0].message
    );
}

#[test]
fn missing_secret_and_key_are_errors_with_paths() {
    let mut res = load(EXAMPLES);
    res.secrets.remove("acme-api-keys");
    res.secrets
        .get_mut("nightly-eval-api-keys")
        .unwrap()
        .clear();
    let errs = compile(&res, &gateway(), &Options::default()).unwrap_err();
    let got: Vec<_> = errs
        .iter()
        .map(|e| (e.object.as_ref().unwrap().name.as_str(), e.path.as_str()))
        .collect();
    assert!(
        got.contains(&("acme", "spec.identity.apiKeys.secretRef.name")),
        "{errs:?}"
    );
    assert!(
        got.contains(&("nightly-eval", "spec.identity.apiKeys.secretRef.key")),
        "{errs:?}"
    );
}

#[test]
fn policy_errors_map_to_resource_fields() {
    let mut res = load(EXAMPLES);
    let p = res
        .policies
        .iter_mut()
        .find(|p| p.name_any() == "cheaper-model-for-easy-prompts")
        .unwrap();
    if let Action::Route(r) = &mut p.spec.action {
        r.rewrite_model = Some("gpt-5".into());
    }
    p.spec.match_.models = Some(vec!["[".into()]);
    let errs = compile(&res, &gateway(), &Options::default()).unwrap_err();
    let paths: Vec<_> = errs.iter().map(|e| e.path.as_str()).collect();
    assert_eq!(
        paths,
        ["spec.match.models[0]", "spec.action.route.rewriteModel"],
        "{errs:?}"
    );
    assert!(errs
        .iter()
        .all(|e| e.object.as_ref().unwrap().kind == "InferencePolicy"));
}

#[test]
fn pool_without_models_annotation_names_the_annotation() {
    let mut res = load(EXAMPLES);
    res.pools[1].metadata.annotations = None;
    let errs = compile(&res, &gateway(), &Options::default()).unwrap_err();
    assert_eq!(
        errs[0].object.as_ref().unwrap().to_string(),
        "InferencePool/small"
    );
    assert_eq!(errs[0].path, "metadata.annotations[\"kvasir.dev/models\"]");
}

#[test]
fn target_without_settings_blames_the_policy_ref() {
    let mut res = load(EXAMPLES);
    res.settings.clear();
    let errs = compile(&res, &gateway(), &Options::default()).unwrap_err();
    assert_eq!(errs.len(), 1);
    assert_eq!(errs[0].path, "spec.targetRefs[0]");
    assert!(errs[0]
        .message
        .contains("no InferenceSettings targets Gateway/inference-gateway"));
}

#[test]
fn unknown_field_is_a_path() {
    let v = serde_json::json!({
        "apiVersion": "kvasir.dev/v1alpha1", "kind": "InferencePolicy",
        "metadata": {"name": "x"},
        "spec": {"precedence": 1, "targetRefs": [{"kind": "Gateway", "name": "g"}],
                 "match": {"modle": ["a"]}, "action": {"reject": {"status": 403}}}
    });
    match parse(v) {
        Err(crate::DocumentError::Invalid { path, message, .. }) => {
            assert_eq!(path, "spec.match.modle");
            assert!(message.contains("unknown field"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn split_index_and_map_path() {
    assert_eq!(
        split_index("policies[12].match.x"),
        Some(("policies", 12, ".match.x"))
    );
    let o = Origins {
        settings: "s".into(),
        policies: vec!["a".into()],
        tenants: vec!["t".into()],
        tenant_value_field: "jwtClaimValue",
        ..Origins::default()
    };
    let (ob, p) = map_path(&o, "tenants[0].headerValue");
    assert_eq!(
        (ob.unwrap().name, p.as_str()),
        ("t".into(), "spec.identity.jwtClaimValue")
    );
    let (ob, p) = map_path(&o, "tenantSource.jwtClaim.claim");
    assert_eq!(
        (ob.unwrap().kind, p.as_str()),
        ("InferenceSettings", "spec.tenantSource.jwtClaim.claim")
    );
    assert_eq!(
        rename_sections("also policies[0]", &o),
        "also InferencePolicy/a"
    );
}
