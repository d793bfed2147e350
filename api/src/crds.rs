//! The CRDs as YAML: what `kvasirctl crds` prints and `make crds` writes
//! under `crds/` (a test fails when the committed files drift).

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube_core::CustomResourceExt;

use crate::types::{InferencePolicy, InferenceProvider, InferenceSettings, InferenceTenant};

/// First line of every generated file.
pub const HEADER: &str =
    "# Generated from the kvasir-api Rust types by `make crds`; do not edit.\n";

/// The Kvasir CRDs, in a fixed order.
pub fn all() -> Vec<CustomResourceDefinition> {
    vec![
        InferencePolicy::crd(),
        InferenceTenant::crd(),
        InferenceProvider::crd(),
        InferenceSettings::crd(),
    ]
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
