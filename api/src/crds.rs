//! The CRDs as YAML: what `kvasirctl crds` prints and `make crds` writes
//! under `crds/` (a test fails when the committed files drift).

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, ValidationRule,
};
use kube_core::CustomResourceExt;

use crate::types::{InferencePolicy, InferenceProvider, InferenceSettings, InferenceTenant};

/// First line of every generated file.
pub const HEADER: &str =
    "# Generated from the kvasir-api Rust types by `make crds`; do not edit.\n";

/// The Kvasir CRDs, in a fixed order.
pub fn all() -> Vec<CustomResourceDefinition> {
    vec![
        policy_kind(label_names(InferencePolicy::crd())),
        label_names(InferenceTenant::crd()),
        label_names(InferenceProvider::crd()),
        policy_kind(InferenceSettings::crd()),
    ]
}

/// The Gateway API label that marks a CRD as a policy kind
/// (`gateway.networking.k8s.io/policy`), so tools that discover policies
/// (`gwctl`, Envoy Gateway's and others' policy views) find these.
pub const POLICY_LABEL: &str = "gateway.networking.k8s.io/policy";

/// `InferencePolicy` and `InferenceSettings` attach to Gateways and
/// HTTPRoutes through `targetRefs`: `Direct` policy attachment, because
/// each takes effect on exactly the objects it names. A Gateway's
/// configuration is not inherited by its routes as defaults or overrides:
/// each target is compiled from the objects that name it alone (and Envoy
/// Gateway lets a route's EnvoyExtensionPolicy replace the Gateway's).
fn policy_kind(mut crd: CustomResourceDefinition) -> CustomResourceDefinition {
    crd.metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert(POLICY_LABEL.to_owned(), "Direct".to_owned());
    crd
}

/// Policy, tenant and provider names are stats labels and segments of
/// dotted stat names, so they must be DNS-1123 labels (Kubernetes allows
/// dots and 253 characters): a root CEL rule says so at admission.
fn label_names(mut crd: CustomResourceDefinition) -> CustomResourceDefinition {
    let kind = crd.spec.names.kind.clone();
    for v in &mut crd.spec.versions {
        if let Some(root) = v
            .schema
            .as_mut()
            .and_then(|s| s.open_api_v3_schema.as_mut())
        {
            root.x_kubernetes_validations
                .get_or_insert_with(Vec::new)
                .push(ValidationRule {
                    rule: format!(
                        "self.metadata.name.size() <= 63 && self.metadata.name.matches('{}')",
                        crate::schema::LABEL_PATTERN
                    ),
                    message: Some(format!(
                        "an {kind} name is a DNS-1123 label (lowercase letters, digits and '-', at most 63): it is a stats label"
                    )),
                    ..ValidationRule::default()
                });
        }
    }
    crd
}

/// `(file name, YAML)` for each CRD: `kvasir.dev_<plural>.yaml`.
pub fn files() -> Result<Vec<(String, String)>, serde_yaml::Error> {
    all()
        .into_iter()
        .map(|crd| {
            let file = format!("{}_{}.yaml", crd.spec.group, crd.spec.names.plural);
            Ok((file, format!("{HEADER}{}", serde_yaml::to_string(&crd)?)))
        })
        .collect()
}

/// Every CRD in one multi-document YAML stream.
pub fn yaml() -> Result<String, serde_yaml::Error> {
    let mut out = String::new();
    for (_, y) in files()? {
        out.push_str("---\n");
        out.push_str(y.strip_prefix(HEADER).unwrap_or(&y));
    }
    Ok(out)
}
