//! A minimal typed `InferencePool` (`inference.networking.k8s.io/v1`).
//!
//! Only the fields discovery reads are typed. The struct implements
//! [`kube::Resource`] by hand instead of `#[derive(CustomResource)]`: the
//! derive needs kube's `derive` feature, which pulls in `schemars` and a proc
//! macro, only to generate a schema we never install (the upstream project
//! owns the CRD).

use super::DiscoveryError;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::NamespaceResourceScope;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::BTreeMap;

/// API group of the Gateway API Inference Extension's `InferencePool`.
pub const GROUP: &str = "inference.networking.k8s.io";
/// The served (and storage) version of `InferencePool`.
pub const VERSION: &str = "v1";
/// `apiVersion` as it appears in objects.
pub const API_VERSION: &str = "inference.networking.k8s.io/v1";
/// `kind` of the object.
pub const KIND: &str = "InferencePool";
/// Resource name used in API paths.
pub const PLURAL: &str = "inferencepools";

/// An `InferencePool`: a set of model-server pods (chosen by label) and the
/// port(s) they serve inference on.
///
/// Every field is defaulted on decode: the API server already validates
/// pools against the CRD, and a lenient decode lets [`InferencePool::validate`]
/// report a clear [`DiscoveryError`] instead of a serde error deep inside the
/// watcher. `status` is not read and not kept.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct InferencePool {
    /// Standard object metadata (name, namespace, resourceVersion, ...).
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The desired pool.
    #[serde(default)]
    pub spec: InferencePoolSpec,
}

/// `spec` of an [`InferencePool`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// Which pods (in the pool's namespace) belong to the pool.
    #[serde(default)]
    pub selector: PoolSelector,
    /// Ports the model servers listen on; the CRD allows 1 to 8, unique.
    #[serde(default)]
    pub target_ports: Vec<PoolPort>,
    /// `http` (default) or `kubernetes.io/h2c`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub app_protocol: Option<String>,
    /// The endpoint picker serving this pool (optional since v1.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

/// The pool's label selector. In `v1` it is `matchLabels` only (the CRD has
/// no `matchExpressions`): a pod is selected when it carries every pair.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolSelector {
    /// Label key -> required value.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// A port number as the CRD spells it (`{number: int32}`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolPort {
    /// 1..=65535 once validated; kept as the CRD's `int32` so an out-of-range
    /// value decodes and is reported rather than failing the whole object.
    pub number: i32,
}

/// `spec.endpointPickerRef`: the Service (or other kind) of the picker.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    /// API group of the referent; empty for core.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Kind of the referent; `Service` when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name of the referent.
    #[serde(default)]
    pub name: String,
    /// Port of the picker's gRPC service (required for `Service`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<PoolPort>,
    /// `FailOpen` or `FailClose` (default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
}

impl kube::Resource for InferencePool {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        Cow::Borrowed(KIND)
    }
    fn group(_: &()) -> Cow<'_, str> {
        Cow::Borrowed(GROUP)
    }
    fn version(_: &()) -> Cow<'_, str> {
        Cow::Borrowed(VERSION)
    }
    fn api_version(_: &()) -> Cow<'_, str> {
        Cow::Borrowed(API_VERSION)
    }
    fn plural(_: &()) -> Cow<'_, str> {
        Cow::Borrowed(PLURAL)
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl InferencePool {
    /// `namespace/name`, for messages.
    pub fn key(&self) -> (String, String) {
        (
            self.metadata.namespace.clone().unwrap_or_default(),
            self.metadata.name.clone().unwrap_or_default(),
        )
    }

    /// The selector as a Kubernetes `labelSelector` query (`k1=v1,k2=v2`,
    /// keys sorted), after checking it is safe to send.
    ///
    /// An empty `matchLabels` is an error rather than "select everything":
    /// the CRD forbids it (`minProperties: 1`), and subscribing to every pod
    /// of the namespace would be a far worse failure than stopping.
    pub fn label_selector(&self) -> Result<String, DiscoveryError> {
        let labels = &self.spec.selector.match_labels;
        if labels.is_empty() {
            return Err(self.bad_selector("spec.selector.matchLabels is empty".to_string()));
        }
        let mut parts = Vec::with_capacity(labels.len());
        for (key, value) in labels {
            if let Err(why) = check_label_key(key) {
                return Err(self.bad_selector(format!("label key {key:?}: {why}")));
            }
            if let Err(why) = check_label_value(value) {
                return Err(self.bad_selector(format!("label {key:?} value {value:?}: {why}")));
            }
            parts.push(format!("{key}={value}"));
        }
        Ok(parts.join(","))
    }

    /// The target ports in spec order, duplicates dropped, each checked to
    /// be a real port number.
    pub fn target_ports(&self) -> Result<Vec<u16>, DiscoveryError> {
        if self.spec.target_ports.is_empty() {
            return Err(self.bad_ports("spec.targetPorts is empty".to_string()));
        }
        let mut out: Vec<u16> = Vec::with_capacity(self.spec.target_ports.len());
        for p in &self.spec.target_ports {
            let port = u16::try_from(p.number)
                .ok()
                .filter(|n| *n != 0)
                .ok_or_else(|| self.bad_ports(format!("{} is not a port number", p.number)))?;
            if !out.contains(&port) {
                out.push(port);
            }
        }
        Ok(out)
    }

    /// Everything discovery needs from the pool is usable: a non-empty,
    /// well-formed selector and valid target ports.
    pub fn validate(&self) -> Result<(), DiscoveryError> {
        self.label_selector()?;
        self.target_ports()?;
        Ok(())
    }

    /// Whether `labels` carries every pair of the pool's `matchLabels`. An
    /// empty selector matches nothing (see [`InferencePool::label_selector`]).
    pub fn selects(&self, labels: Option<&BTreeMap<String, String>>) -> bool {
        let wanted = &self.spec.selector.match_labels;
        if wanted.is_empty() {
            return false;
        }
        let Some(labels) = labels else {
            return false;
        };
        wanted.iter().all(|(k, v)| labels.get(k) == Some(v))
    }

    fn bad_selector(&self, reason: String) -> DiscoveryError {
        let (namespace, name) = self.key();
        DiscoveryError::BadSelector {
            namespace,
            name,
            reason,
        }
    }

    fn bad_ports(&self, reason: String) -> DiscoveryError {
        let (namespace, name) = self.key();
        DiscoveryError::BadTargetPorts {
            namespace,
            name,
            reason,
        }
    }
}

/// A label name segment (or value, when non-empty): at most 63 characters,
/// alphanumerics at both ends, `-`, `_`, `.` inside. The same rule keeps
/// `,`, `=`, `!` and spaces out of the query we build.
fn check_label_name(s: &str) -> Result<(), &'static str> {
    if s.is_empty() {
        return Err("empty");
    }
    if s.len() > 63 {
        return Err("longer than 63 characters");
    }
    let bytes = s.as_bytes();
    let end_ok = |b: u8| b.is_ascii_alphanumeric();
    if !end_ok(bytes[0]) || !end_ok(bytes[bytes.len() - 1]) {
        return Err("must start and end with an alphanumeric character");
    }
    if !bytes
        .iter()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err("only alphanumerics, '-', '_' and '.' are allowed");
    }
    Ok(())
}

/// `[prefix/]name` where prefix is a DNS subdomain.
fn check_label_key(key: &str) -> Result<(), &'static str> {
    let name = match key.split_once('/') {
        Some((prefix, name)) => {
            if prefix.is_empty() || prefix.len() > 253 {
                return Err("prefix must be 1-253 characters");
            }
            let dns_ok = prefix.split('.').all(|label| {
                !label.is_empty()
                    && label.len() <= 63
                    && label
                        .bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            });
            if !dns_ok {
                return Err("prefix must be a lowercase DNS subdomain");
            }
            name
        }
        None => key,
    };
    check_label_name(name)
}

fn check_label_value(value: &str) -> Result<(), &'static str> {
    if value.is_empty() {
        return Ok(());
    }
    check_label_name(value)
}
