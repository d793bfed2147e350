//! One YAML/JSON document to a typed resource, with the path of the first
//! error (`spec.match.modle`), for `kvasirctl` and tests.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Secret;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::assemble::Resources;
use crate::types::*;

/// A document Kvasir reads.
#[derive(Debug, Clone)]
pub enum Document {
    /// `InferencePolicy`.
    Policy(InferencePolicy),
    /// `InferenceTenant`.
    Tenant(InferenceTenant),
    /// `InferenceProvider`.
    Provider(InferenceProvider),
    /// `InferenceSettings`.
    Settings(InferenceSettings),
    /// The Inference Extension's `InferencePool`.
    Pool(InferencePool),
    /// A `v1` `Secret` (tenants' API keys).
    Secret(Box<Secret>),
}

/// Why a document was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DocumentError {
    /// Not a kind Kvasir reads (a Deployment in the same directory): the
    /// caller may skip it.
    #[error("{api_version} {kind} is not a kind kvasirctl reads; skipped")]
    Unsupported {
        /// `apiVersion`.
        api_version: String,
        /// `kind`.
        kind: String,
    },
    /// A Kvasir kind with a wrong field.
    #[error("{path}: {message}")]
    Invalid {
        /// The document's `kind` (empty when unknown).
        kind: String,
        /// The field, e.g. `spec.match.modle`; empty for the document.
        path: String,
        /// Why.
        message: String,
    },
}

fn typed<T: DeserializeOwned>(kind: &str, v: Value) -> Result<T, DocumentError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        DocumentError::Invalid {
            kind: kind.to_owned(),
            path: if path == "." { String::new() } else { path },
            message: e.into_inner().to_string(),
        }
    })
}

fn invalid(kind: &str, path: &str, message: &str) -> DocumentError {
    DocumentError::Invalid {
        kind: kind.to_owned(),
        path: path.to_owned(),
        message: message.to_owned(),
    }
}

/// Reads one document by its `apiVersion` and `kind`.
pub fn parse(v: Value) -> Result<Document, DocumentError> {
    let Some(obj) = v.as_object() else {
        return Err(invalid(
            "",
            "",
            "a document must be a mapping with `apiVersion` and `kind`",
        ));
    };
    let field = |k: &str| obj.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
    let (api_version, kind) = (field("apiVersion"), field("kind"));
    if api_version.is_empty() {
        return Err(invalid(&kind, "apiVersion", "required"));
    }
    if kind.is_empty() {
        return Err(invalid("", "kind", "required"));
    }
    let has_name = obj
        .get("metadata")
        .and_then(|m| m.get("name"))
        .and_then(Value::as_str)
        .is_some_and(|n| !n.is_empty());
    let doc = match (api_version.as_str(), kind.as_str()) {
        (API_VERSION, "InferencePolicy") => Document::Policy(typed(&kind, v)?),
        (API_VERSION, "InferenceTenant") => Document::Tenant(typed(&kind, v)?),
        (API_VERSION, "InferenceProvider") => Document::Provider(typed(&kind, v)?),
        (API_VERSION, "InferenceSettings") => Document::Settings(typed(&kind, v)?),
        (INFERENCE_POOL_API_VERSION, "InferencePool") => Document::Pool(typed(&kind, v)?),
        ("v1", "Secret") => Document::Secret(Box::new(typed(&kind, v)?)),
        _ if api_version.starts_with("kvasir.dev/") => {
            return Err(invalid(
                &kind,
                "kind",
                &format!("unknown kind `{kind}` in {api_version}: {API_VERSION} has InferencePolicy, InferenceTenant, InferenceProvider, InferenceSettings"),
            ))
        }
        _ => return Err(DocumentError::Unsupported { api_version, kind }),
    };
    if !has_name {
        return Err(invalid(&kind, "metadata.name", "required"));
    }
    Ok(doc)
}

impl Document {
    /// `metadata.namespace`, if set.
    pub fn namespace(&self) -> Option<&str> {
        let m = match self {
            Document::Policy(r) => &r.metadata,
            Document::Tenant(r) => &r.metadata,
            Document::Provider(r) => &r.metadata,
            Document::Settings(r) => &r.metadata,
            Document::Pool(r) => &r.metadata,
            Document::Secret(r) => &r.metadata,
        };
        m.namespace.as_deref()
    }
}

/// A Secret's values: `data` (base64 in YAML, already decoded) with
/// `stringData` on top, as the API server merges them.
pub fn secret_values(s: &Secret) -> BTreeMap<String, Vec<u8>> {
    let mut out: BTreeMap<String, Vec<u8>> = s
        .data
        .iter()
        .flatten()
        .map(|(k, v)| (k.clone(), v.0.clone()))
        .collect();
    for (k, v) in s.string_data.iter().flatten() {
        out.insert(k.clone(), v.clone().into_bytes());
    }
    out
}

impl Resources {
    /// Adds a document (the caller has checked its namespace).
    pub fn insert(&mut self, d: Document) {
        match d {
            Document::Policy(r) => self.policies.push(r),
            Document::Tenant(r) => self.tenants.push(r),
            Document::Provider(r) => self.providers.push(r),
            Document::Settings(r) => self.settings.push(r),
            Document::Pool(r) => self.pools.push(r),
            Document::Secret(s) => {
                let name = s.metadata.name.clone().unwrap_or_default();
                self.secrets.insert(name, secret_values(&s));
            }
        }
    }
}
