//! The committed CRD YAML under `crds/` is what the types generate, and it
//! is a well-formed `apiextensions.k8s.io/v1` CustomResourceDefinition.

use std::path::PathBuf;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, CustomResourceDefinitionVersion, JSONSchemaProps,
};

fn crds_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crds")
}

/// The version's OpenAPI schema (every Kvasir CRD version has one).
fn schema(v: &CustomResourceDefinitionVersion) -> &JSONSchemaProps {
    v.schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref())
        .expect("openAPIV3Schema")
}

#[test]
fn committed_crds_match_the_types() {
    let files = kvasir_api::crds::files().unwrap();
    assert_eq!(files.len(), 4);
    for (name, want) in files {
        let path = crds_dir().join(&name);
        let got = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            got == want,
            "crds/{name} is out of date with the Rust types in api/src/types.rs: run `make crds` and commit the result"
        );
    }
}

/// Every node of a structural schema has a type (or preserves unknown
/// fields), and one-of fields use CEL, not `oneOf`.
fn check_structural(path: &str, s: &JSONSchemaProps) {
    assert!(
        s.type_.is_some() || s.x_kubernetes_preserve_unknown_fields == Some(true),
        "{path}: no type"
    );
    assert!(
        s.one_of.is_none() && s.any_of.is_none(),
        "{path}: oneOf/anyOf"
    );
    for (k, v) in s.properties.iter().flatten() {
        check_structural(&format!("{path}.{k}"), v);
    }
    if let Some(k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaPropsOrArray::Schema(items)) = &s.items {
        check_structural(&format!("{path}[]"), items);
    }
    for v in s.x_kubernetes_validations.iter().flatten() {
        let open = v.rule.matches('(').count();
        assert_eq!(
            open,
            v.rule.matches(')').count(),
            "{path}: unbalanced CEL {}",
            v.rule
        );
        assert!(
            v.rule.contains("self"),
            "{path}: CEL rule does not read self"
        );
        assert!(v.message.is_some(), "{path}: CEL rule without message");
    }
}

#[test]
fn committed_crds_are_valid_crds() {
    for (name, _) in kvasir_api::crds::files().unwrap() {
        let text = std::fs::read_to_string(crds_dir().join(&name)).unwrap_or_default();
        let crd: CustomResourceDefinition = serde_yaml::from_str(&text)
            .unwrap_or_else(|e| panic!("crds/{name} is not a CustomResourceDefinition: {e}"));
        assert_eq!(crd.spec.group, "kvasir.dev");
        assert_eq!(crd.spec.scope, "Namespaced");
        assert_eq!(
            crd.metadata.name.as_deref(),
            Some(format!("{}.kvasir.dev", crd.spec.names.plural).as_str())
        );
        let v = &crd.spec.versions[0];
        assert_eq!(v.name, "v1alpha1");
        assert!(v.served && v.storage);
        assert!(
            v.subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some(),
            "{name}: status subresource"
        );
        assert!(
            !v.additional_printer_columns.as_ref().unwrap().is_empty(),
            "{name}: printer columns"
        );
        check_structural(&crd.spec.names.kind, schema(v));
    }
}

#[test]
fn policy_schema_has_the_rules_validation_has() {
    let crd = kvasir_api::crds::all().remove(0);
    let v = &crd.spec.versions[0];
    let root = schema(v);
    let spec = &root.properties.as_ref().unwrap()["spec"];
    let props = spec.properties.as_ref().unwrap();
    let req = spec.required.as_ref().unwrap();
    for f in ["precedence", "targetRefs", "action"] {
        assert!(req.contains(&f.to_owned()), "{f} required");
    }
    let action = &props["action"];
    let rule = &action.x_kubernetes_validations.as_ref().unwrap()[0].rule;
    assert!(rule.contains("exists_one"), "{rule}");
    let target = props["targetRefs"].items.as_ref().unwrap();
    let k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaPropsOrArray::Schema(t) = target else {
        panic!("items")
    };
    let kinds = t.properties.as_ref().unwrap()["kind"]
        .enum_
        .clone()
        .unwrap();
    assert_eq!(kinds.len(), 2);
}
