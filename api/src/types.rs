//! The `kvasir.dev/v1alpha1` resources, and the `InferencePool` of the
//! Gateway API Inference Extension that they route to.
//!
//! Every spec denies unknown fields: in a cluster the API server prunes
//! them (structural schemas), and offline `kvasirctl validate` reports a
//! typo (`modle:`) with its path instead of silently ignoring it.

// Several `printcolumn(type_ = "string", ...)` in one `#[kube]` attribute
// read to clippy as duplicated attributes; they are separate columns.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use kube_derive::CustomResource;
use kvasir_policy::{
    Action, Budget, ClassBudget, ClassWeight, Classification, Match, TenantSource,
};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// API group of the Kvasir resources.
pub const GROUP: &str = "kvasir.dev";
/// API version of the Kvasir resources.
pub const VERSION: &str = "v1alpha1";
/// `apiVersion` of the Kvasir resources.
pub const API_VERSION: &str = "kvasir.dev/v1alpha1";
/// Group of the Gateway API kinds a policy targets.
pub const GATEWAY_GROUP: &str = "gateway.networking.k8s.io";
/// `apiVersion` of the Inference Extension's `InferencePool`.
pub const INFERENCE_POOL_API_VERSION: &str = "inference.networking.k8s.io/v1";
/// Annotation on an `InferencePool`: the model names it serves, comma
/// separated (the v1 `InferencePool` has no model list; the policies need
/// one to check `rewriteModel`).
pub const MODELS_ANNOTATION: &str = "kvasir.dev/models";
/// Annotation on an `InferencePool`: its pool name in the cache-indexer's
/// configuration (default: the pool's name).
pub const INDEXER_POOL_ANNOTATION: &str = "kvasir.dev/indexer-pool";
/// Annotation on an `InferencePool` or `InferenceProvider`: the Envoy
/// cluster to use instead of the generated name (plain-Envoy setups).
pub const CLUSTER_ANNOTATION: &str = "kvasir.dev/cluster";

/// A routing policy: when `match` holds for a request on one of the
/// targets, `action` is taken.
///
/// Order is explicit: for each target, policies are tried by ascending
/// `precedence`; two policies on the same target with the same precedence
/// are an error, so the order never depends on names or creation times.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "kvasir.dev",
    version = "v1alpha1",
    kind = "InferencePolicy",
    namespaced,
    status = "ResourceStatus",
    shortname = "ipol",
    category = "kvasir",
    printcolumn(name = "Precedence", type_ = "integer", json_path = ".spec.precedence"),
    printcolumn(name = "PII-Guard", type_ = "boolean", json_path = ".spec.piiGuard"),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status"
    ),
    printcolumn(
        name = "Programmed",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Programmed\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    crates(kube_core = "::kube_core")
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferencePolicySpec {
    /// Evaluation order on each target: lower first (0 to 1000000). Two
    /// policies on one target must not share a precedence.
    #[schemars(range(min = 0, max = 1_000_000))]
    pub precedence: i32,
    /// The `Gateway`s or `HTTPRoute`s (same namespace) whose traffic the
    /// policy applies to.
    #[schemars(length(min = 1, max = 16))]
    pub target_refs: Vec<TargetRef>,
    /// The conditions; all that are set must hold. Omitted: every request.
    #[serde(default, rename = "match", skip_serializing_if = "Match::is_catch_all")]
    #[schemars(schema_with = "crate::schema::match_")]
    pub match_: Match,
    /// What to do: exactly one of `route`, `reject`, `provider`, `shed`.
    #[schemars(schema_with = "crate::schema::action")]
    pub action: Action,
    /// A PII guard: PII traffic in this policy's scope (its tenants,
    /// classes, models, APIs) never goes to a provider, whatever the order.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pii_guard: bool,
}

/// A Gateway API object in the same namespace (Gateway API's
/// `LocalPolicyTargetReference`).
#[derive(
    Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, JsonSchema,
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TargetRef {
    /// Always `gateway.networking.k8s.io`.
    #[serde(default = "gateway_group")]
    #[schemars(extend("enum" = ["gateway.networking.k8s.io"]))]
    pub group: String,
    /// `Gateway` or `HTTPRoute`.
    pub kind: TargetKind,
    /// The object's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

fn gateway_group() -> String {
    GATEWAY_GROUP.to_owned()
}

impl TargetRef {
    /// A reference to `kind/name` in the Gateway API group.
    pub fn new(kind: TargetKind, name: impl Into<String>) -> TargetRef {
        TargetRef {
            group: gateway_group(),
            kind,
            name: name.into(),
        }
    }
}

impl std::fmt::Display for TargetRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.kind.as_str(), self.name)
    }
}

/// The kinds a policy can target.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, JsonSchema,
)]
pub enum TargetKind {
    /// A `Gateway`: all its routes.
    Gateway,
    /// One `HTTPRoute`.
    #[serde(rename = "HTTPRoute")]
    HttpRoute,
}

impl TargetKind {
    /// The kind as written in YAML.
    pub fn as_str(self) -> &'static str {
        match self {
            TargetKind::Gateway => "Gateway",
            TargetKind::HttpRoute => "HTTPRoute",
        }
    }
}

/// A tenant: who may send requests, how it is recognised, and its class.
/// The tenant's name is the resource's name (a DNS-1123 label: it is a
/// stats label). Tenants apply to every target in their namespace.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "kvasir.dev",
    version = "v1alpha1",
    kind = "InferenceTenant",
    namespaced,
    status = "ResourceStatus",
    shortname = "itenant",
    category = "kvasir",
    printcolumn(name = "Class", type_ = "string", json_path = ".spec.class"),
    printcolumn(name = "Weight", type_ = "integer", json_path = ".spec.weight"),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status"
    ),
    printcolumn(
        name = "Programmed",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Programmed\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    crates(kube_core = "::kube_core")
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferenceTenantSpec {
    /// Optional class (`gold`, `free`, ...): policies can match classes
    /// instead of listing tenants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 63), pattern(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"))]
    pub class: Option<String>,
    /// How requests of this tenant are recognised; which field is used
    /// depends on the target's `InferenceSettings.spec.tenantSource`.
    #[serde(default)]
    pub identity: TenantIdentity,
    /// The tenant's token budget (tokens, prompt or completion tokens and
    /// requests per minute, concurrent requests); replaces its class's
    /// (`InferenceSettings.spec.classBudgets`) as a whole. None and no
    /// class budget: unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::budget")]
    pub budget: Option<Budget>,
    /// The tenant's weight in a saturated pool's fair share (1 to 1000):
    /// when a pool's flow control holds requests back, each priority band
    /// releases them in proportion to their tenants' weights, counted in
    /// tokens (prompt plus expected output), not requests. Default: its
    /// class's (`InferenceSettings.spec.classWeights`), else 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub weight: Option<u32>,
}

/// A tenant's identities, one per tenant source.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantIdentity {
    /// With a `header` tenant source: the header's value for this tenant
    /// (default: the tenant's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub header_value: Option<String>,
    /// With a `jwtClaim` tenant source: the claim's value for this tenant
    /// (default: the tenant's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub jwt_claim_value: Option<String>,
    /// With an `apiKey` tenant source: the Secret holding the tenant's API
    /// keys. Only their SHA-256 reaches the filter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_keys: Option<ApiKeys>,
}

/// Where a tenant's API keys are.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiKeys {
    /// The Secret (same namespace). Without `key`, every value of the
    /// Secret is one API key (one entry per client, so a key is revoked by
    /// deleting its entry); with `key`, only that entry.
    pub secret_ref: KeySelector,
}

/// A Secret, or one key of it, in the resource's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KeySelector {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// A key of the Secret's `data`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub key: Option<String>,
}

/// An external model provider (OpenAI, Anthropic, another cluster): its
/// backend, model, and the Secret holding its credential. The credential
/// never enters the filter configuration: Envoy injects it.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "kvasir.dev",
    version = "v1alpha1",
    kind = "InferenceProvider",
    namespaced,
    status = "ResourceStatus",
    shortname = "iprov",
    category = "kvasir",
    printcolumn(
        name = "Backend",
        type_ = "string",
        json_path = ".spec.backendRef.name"
    ),
    printcolumn(name = "Model", type_ = "string", json_path = ".spec.model"),
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status"
    ),
    printcolumn(
        name = "Programmed",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Programmed\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    crates(kube_core = "::kube_core")
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferenceProviderSpec {
    /// The backend that reaches the provider (an Envoy Gateway `Backend`
    /// by default, or a `Service`).
    pub backend_ref: BackendRef,
    /// The `:authority` to send (e.g. `api.openai.com`); default unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), pattern(r"^[^\s/]+$"))]
    pub authority: Option<String>,
    /// The model the provider is asked for, unless a policy says otherwise
    /// (default: the request's model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256), pattern(r"^[^\s*?]+$"))]
    pub model: Option<String>,
    /// The provider's credential: a header and the Secret holding its
    /// value. There is no field for the value itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<ProviderCredential>,
}

/// A backend object in the same namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BackendRef {
    /// API group (default `gateway.envoyproxy.io`; empty for a Service).
    #[serde(default = "backend_group")]
    pub group: String,
    /// Kind (default `Backend`).
    #[serde(default = "backend_kind")]
    pub kind: String,
    /// Name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Port (required for a Service).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<u16>,
}

fn backend_group() -> String {
    "gateway.envoyproxy.io".to_owned()
}

fn backend_kind() -> String {
    "Backend".to_owned()
}

/// A provider's credential.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProviderCredential {
    /// The header it goes in: `authorization` (sent as `Bearer <value>`
    /// by the injector) or `x-api-key`.
    #[schemars(length(min = 1, max = 256), pattern(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$"))]
    pub header: String,
    /// The Secret key holding the value.
    pub secret_ref: SecretKeyRef,
}

/// One key of a Secret in the same namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretKeyRef {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key in the Secret.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// Per-target settings: where the tenant comes from, what happens when no
/// policy matches, the classifiers. Exactly one per target.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "kvasir.dev",
    version = "v1alpha1",
    kind = "InferenceSettings",
    plural = "inferencesettings",
    namespaced,
    status = "ResourceStatus",
    shortname = "isettings",
    category = "kvasir",
    printcolumn(
        name = "Accepted",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Accepted\")].status"
    ),
    printcolumn(
        name = "Programmed",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Programmed\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    ),
    crates(kube_core = "::kube_core")
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InferenceSettingsSpec {
    /// The `Gateway`s or `HTTPRoute`s these settings apply to.
    #[schemars(length(min = 1, max = 16))]
    pub target_refs: Vec<TargetRef>,
    /// Where a request's tenant comes from.
    #[schemars(schema_with = "crate::schema::tenant_source")]
    pub tenant_source: TenantSource,
    /// What happens when no policy matches.
    #[schemars(schema_with = "crate::schema::action")]
    pub default_action: Action,
    /// Classifier settings (PII detectors, the "easy" rule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::classification")]
    pub classification: Option<Classification>,
    /// How old a pool-state sample may be before `poolState` conditions
    /// treat the state as unknown (ms, default 5000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 600_000))]
    pub pool_state_max_age_ms: Option<u32>,
    /// Envoy replicas that serve this policy set (default 1). While a
    /// request's pick cannot be made (the indexer unreachable or too slow),
    /// each Envoy admits the tenant's request against its own share of the
    /// tenant's budget: every limit divided by this number (at least one
    /// request in flight), so that the replicas together stay within it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub gateway_replicas: Option<u32>,
    /// Default token budgets by tenant class: a tenant of the class
    /// without a `budget` of its own gets the class's, in a bucket of its
    /// own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::class_budgets")]
    pub class_budgets: Option<Vec<ClassBudget>>,
    /// Default fair-share weights by tenant class: a tenant of the class
    /// without a `weight` of its own gets the class's (each tenant still
    /// has its own share).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "crate::schema::class_weights")]
    pub class_weights: Option<Vec<ClassWeight>>,
}

/// The Gateway API Inference Extension's `InferencePool`
/// (`inference.networking.k8s.io/v1`). Kvasir reads only its metadata (name,
/// the `kvasir.dev/*` annotations); the spec is kept as is.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "inference.networking.k8s.io",
    version = "v1",
    kind = "InferencePool",
    namespaced,
    schema = "disabled",
    crates(kube_core = "::kube_core")
)]
pub struct InferencePoolSpec {
    /// Every field of the pool's spec (selector, targetPorts,
    /// endpointPickerRef), unread.
    #[serde(flatten)]
    pub fields: BTreeMap<String, serde_json::Value>,
}

impl InferencePool {
    /// A pool with these annotations and an empty spec: everything of a
    /// pool that Kvasir reads.
    pub fn annotated(name: &str, annotations: &[(&str, &str)]) -> InferencePool {
        let mut p = InferencePool::new(
            name,
            InferencePoolSpec {
                fields: BTreeMap::new(),
            },
        );
        p.metadata.annotations = Some(
            annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        p
    }
}

/// The status of every Kvasir resource: Gateway-API-style conditions and,
/// on the kinds that attach to Gateways and HTTPRoutes (`InferencePolicy`,
/// `InferenceSettings`), Gateway API's policy status: one entry per target.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceStatus {
    /// `Accepted` (its own fields are valid), `ResolvedRefs` (the Secrets,
    /// pools, providers and targets it names exist) and `Programmed` (the
    /// configuration in force holds it), summed over its targets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// Gateway API's policy attachment status (`PolicyStatus.ancestors`):
    /// for each Gateway or HTTPRoute the object targets, `Accepted` and
    /// `Programmed` on that target alone. Empty on kinds without targets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub ancestors: Vec<PolicyAncestorStatus>,
}

/// Gateway API's `PolicyAncestorStatus`: the object's status with respect
/// to one target.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PolicyAncestorStatus {
    /// The target (a Gateway or HTTPRoute of the object's namespace).
    pub ancestor_ref: AncestorRef,
    /// Who wrote this entry: `kvasir.dev/controller`.
    #[schemars(
        length(min = 1, max = 253),
        pattern(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\/[A-Za-z0-9\/\-._~%!$&'()*+,;=:]+$")
    )]
    pub controller_name: String,
    /// `Accepted` and `Programmed` for this target.
    #[schemars(length(min = 1, max = 8))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// Gateway API's `ParentReference`, as policy status uses it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AncestorRef {
    /// `gateway.networking.k8s.io`.
    pub group: String,
    /// `Gateway` or `HTTPRoute`.
    pub kind: String,
    /// The target's namespace (the object's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The target's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// A status condition, shaped like `metav1.Condition`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// `Accepted`, `ResolvedRefs` or `Programmed`.
    #[serde(rename = "type")]
    #[schemars(length(min = 1, max = 316))]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    #[schemars(extend("enum" = ["True", "False", "Unknown"]))]
    pub status: String,
    /// A CamelCase reason (`Accepted`, `Invalid`, `SecretNotFound`, ...).
    #[schemars(
        length(min = 1, max = 1024),
        pattern(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    )]
    pub reason: String,
    /// A sentence for people: what is wrong and where.
    #[schemars(length(max = 32768))]
    pub message: String,
    /// The resource's `metadata.generation` this condition is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub observed_generation: Option<i64>,
    /// When `status` last changed (RFC 3339).
    #[schemars(extend("format" = "date-time"))]
    pub last_transition_time: String,
}
