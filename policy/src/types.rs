//! The user-facing policy types: what the Kubernetes resources and
//! `kvasirctl` carry.
//!
//! Every struct is `camelCase` on the wire and denies unknown fields, so a
//! typo (`modle:`) is an error with a path instead of a silently ignored
//! setting. Optional fields are `Option` so validation can tell "not set"
//! from "set to the default" and say when a field does not apply.
//!
//! Where a field is one of several alternatives (the tenant source, a header
//! matcher, a provider's auth value) it is written the Kubernetes way: a
//! struct of optional fields of which exactly one must be set. That keeps the
//! YAML short (`header: x-tenant`) and lets validation name the offending
//! field, which a serde enum error cannot do as precisely.

use serde::{Deserialize, Serialize};

/// A complete policy set: everything the filter needs to decide, before
/// compilation.
///
/// The controller assembles one from the cluster's policy resources; the CLI
/// reads one from a YAML or JSON file. Order matters only in `policies`
/// (first match wins); `tenants`, `pools` and `providers` are sets, and
/// compilation sorts them so their order never changes the output bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PolicySet {
    /// The tenants that may send requests.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<Tenant>,
    /// Default budgets by tenant class: a tenant of the class without a
    /// `budget` of its own gets this one (its own bucket, not one shared by
    /// the class).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub class_budgets: Vec<ClassBudget>,
    /// Default fair-share weights by tenant class: a tenant of the class
    /// without a `weight` of its own gets this one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub class_weights: Vec<ClassWeight>,
    /// Where the tenant of a request comes from.
    pub tenant_source: TenantSource,
    /// The vLLM pools requests can be routed to.
    pub pools: Vec<Pool>,
    /// External model providers requests can be sent to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub providers: Vec<Provider>,
    /// Settings of the prompt classifiers (PII detectors, "easy" rule).
    #[serde(default)]
    pub classification: Classification,
    /// How old a pool-state sample may be before `poolState` conditions
    /// treat the state as unknown (milliseconds; default 5000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_state_max_age_ms: Option<u32>,
    /// Envoy replicas that serve this policy set (default 1). While a
    /// request's pick cannot be made (the indexer unreachable or too slow),
    /// each Envoy admits the tenant's request against its own share of the
    /// tenant's budget: every limit divided by this number (at least one
    /// request in flight), so that the replicas together stay within it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_replicas: Option<u32>,
    /// The ordered policies: the first whose match holds decides (subject to
    /// the PII guard rule, see [`Policy::pii_guard`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub policies: Vec<Policy>,
    /// What happens when no policy matches.
    pub default_action: Action,
}

/// One tenant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Tenant {
    /// The tenant's name: a DNS-1123 label (lowercase letters, digits, `-`,
    /// at most 63). It is a stats label and a segment of dotted stat names,
    /// so dots and upper case are not allowed.
    pub name: String,
    /// Optional class (`gold`, `free`, ...), same character rules as names.
    /// Policies can match on classes instead of listing tenants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// SHA-256 hashes of the tenant's API keys, each `sha256:` followed by 64
    /// lowercase hex digits. Keys themselves are never stored: the filter
    /// hashes the presented key and looks the hash up.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub api_key_hashes: Vec<String>,
    /// The value that identifies this tenant in the tenant header (source
    /// `header`) or in the JWT claim (source `jwtClaim`). Defaults to the
    /// tenant's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header_value: Option<String>,
    /// The tenant's token budget; replaces its class's (`classBudgets`)
    /// as a whole. None and no class budget: unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<Budget>,
    /// The tenant's weight in a saturated pool's fair share (1..=1000):
    /// within a priority band, waiting requests are released in proportion
    /// to their tenants' weights, counted in tokens. Default: its class's
    /// (`classWeights`), else 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<u32>,
}

/// A token budget: rates per minute, reserved when a request is admitted
/// (prompt tokens plus an output estimate) and settled to the real usage.
/// Every limit is optional; at least one must be set.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Budget {
    /// Prompt (cached ones weighted) plus completion tokens per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// Prompt tokens per minute (cached ones weighted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_per_minute: Option<u64>,
    /// Completion tokens per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens_per_minute: Option<u64>,
    /// Requests per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    /// Requests in flight at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent: Option<u32>,
    /// What a prompt token found in the engine's cache costs, 0..1 of an
    /// uncached one (default 1, as OpenAI counts them; thousandths).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_token_weight: Option<f64>,
    /// Completion tokens reserved for a request without `max_tokens` until
    /// the tenant's own lengths are learned (default 512).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_output_tokens: Option<u32>,
}

/// The default budget of a tenant class.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClassBudget {
    /// The class.
    pub class: String,
    /// Its tenants' budget (each tenant its own).
    pub budget: Budget,
}

/// The default fair-share weight of a tenant class.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClassWeight {
    /// The class.
    pub class: String,
    /// Its tenants' weight (1..=1000), each tenant its own share.
    pub weight: u32,
}

/// Where a request's tenant comes from. Exactly one of `header`, `apiKey`,
/// `jwtClaim` must be set.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantSource {
    /// Trust a request header (e.g. `x-tenant`) set by something in front of
    /// Envoy. Its value is matched against each tenant's `headerValue`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// Identify the tenant by its API key: `Authorization: Bearer <key>`, or
    /// `x-api-key: <key>` (Anthropic style); both with different keys is a
    /// 401.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key: Option<ApiKeySource>,
    /// Identify the tenant by a claim of a JWT verified by Envoy's
    /// `jwt_authn` filter.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwt_claim: Option<JwtClaimSource>,
    /// What to do when no tenant is identified (default `reject`: 401).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unknown_tenant: Option<UnknownTenant>,
    /// The tenant used when `unknownTenant: default`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_tenant: Option<String>,
    /// The tenant header a client might send to claim a tenant (default
    /// `x-tenant`). With `apiKey` or `jwtClaim` sources it is never trusted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_header: Option<String>,
    /// With `apiKey` or `jwtClaim`: whether a client-sent `tenantHeader` is
    /// ignored (default; the filter overwrites it) or the request rejected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_tenant_header: Option<OnTenantHeader>,
}

/// API key source settings (currently none: both `Authorization: Bearer`
/// and `x-api-key` are read). An object so settings can be added later
/// without changing the shape.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ApiKeySource {}

/// A JWT claim as left by Envoy's `jwt_authn` filter: either copied into a
/// request header (`claim_to_headers`) or in the dynamic metadata
/// (`payload_in_metadata`). Exactly one of `header`, `payloadInMetadata`.
///
/// With `header`, the `jwt_authn` requirement must reject requests without a
/// valid token, or a client could send that header itself.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JwtClaimSource {
    /// The claim's name (e.g. `tenant`, or `org_id`).
    pub claim: String,
    /// The header `claim_to_headers` writes the claim into.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// The `payload_in_metadata` key of the `jwt_authn` provider: the filter
    /// reads `metadata.filter_metadata["envoy.filters.http.jwt_authn"][key][claim]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload_in_metadata: Option<String>,
}

/// What to do with a request whose tenant is not identified.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum UnknownTenant {
    /// Answer 401.
    Reject,
    /// Treat it as `defaultTenant`. This applies only to requests that
    /// carry no identity at all (no key, no claim, no tenant header): a
    /// presented key, claim or header value that matches no tenant is always
    /// rejected, so a mistyped key is an error, not anonymity.
    Default,
}

/// What to do with a client-sent tenant header when the tenant comes from a
/// key or a JWT.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum OnTenantHeader {
    /// Ignore it (the filter overwrites it with the resolved tenant).
    Ignore,
    /// Reject the request (403): a client that tries to pick its tenant is
    /// misconfigured or hostile.
    Reject,
}

/// A pool of vLLM instances behind one Envoy cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Pool {
    /// The pool's name (DNS-1123 label; a stats label).
    pub name: String,
    /// The model names the pool serves (at least one). A route's
    /// `rewriteModel` must be one of them.
    pub models: Vec<String>,
    /// The Envoy cluster of the pool's endpoints (with the override-host
    /// load balancer).
    pub cluster: String,
    /// The Envoy cluster (HTTP/2) of the cache-indexer's gRPC service.
    pub indexer_cluster: String,
    /// The pool's name in the indexer's configuration (default: `name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub indexer_pool: Option<String>,
    /// Timeout of the `Pick` call in milliseconds (default 50, at most
    /// 5000). On timeout the filter fails open to Envoy's load balancing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub indexer_timeout_ms: Option<u32>,
    /// Flow control at the indexer: when the pool is saturated, picks wait
    /// in priority bands and tenants' fair queues instead of in an engine's
    /// queue. The same keys and defaults as the indexer's
    /// `pools[].flowControl`; off unless `enabled: true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_control: Option<FlowControl>,
}

/// A pool's flow control. Every field is optional; unset ones take the
/// indexer's defaults (`kvasir_flowcontrol::FlowControlConfig`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FlowControl {
    /// Whether picks wait when the pool is saturated (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Pool saturation (0..1: the least saturated ready endpoint's) at or
    /// above which a pick waits (default 1.0: only when every endpoint is
    /// saturated; lower holds picks back earlier, binding them late).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<f64>,
    /// Picks waiting in the pool at most (default 1024); more are shed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queued: Option<u64>,
    /// Picks one tenant may have waiting at most (default 256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queued_per_tenant: Option<u64>,
    /// How long a pick may wait, ms (default 10000); then it is shed. The
    /// filter's pick deadline grows by the same amount.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait_ms: Option<u64>,
    /// Queued prefill tokens on an engine that count as saturated
    /// (default 0: requests and KV use only; see
    /// `kvasir_flowcontrol::DEFAULT_SATURATED_PREFILL_TOKENS`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saturated_prefill_tokens: Option<u64>,
    /// Room kept for tenants under their fair share, 0..1 (default
    /// `kvasir_flowcontrol::DEFAULT_RESERVE`): a tenant over its share goes
    /// only below `threshold x (1 - reserve)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserve: Option<f64>,
}

/// An external model provider reached through an Envoy cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Provider {
    /// The provider's name (DNS-1123 label; a stats label).
    pub name: String,
    /// The Envoy cluster that reaches the provider (usually TLS).
    #[serde(default)]
    pub cluster: String,
    /// The `:authority` to send (e.g. `api.openai.com`); default: unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authority: Option<String>,
    /// The model name the provider is asked for, unless the action says
    /// otherwise (default: the request's model, unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Where the provider's credential comes from. It never enters the
    /// filter configuration: Envoy holds it (an SDS secret) and injects it
    /// on the provider's cluster (`credential_injector`; see the README's
    /// security section). This names the header and the Secret for the
    /// tooling that writes Envoy's configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<ProviderAuth>,
}

/// A provider's credential: the header it goes in and the Kubernetes
/// Secret that holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProviderAuth {
    /// Header name, e.g. `authorization` or `x-api-key`.
    pub header: String,
    /// Refused by validation: a value here would be written in clear text
    /// into the filter configuration and Envoy's `/config_dump`. Kept in
    /// the type so the error names the field instead of "unknown field".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<Secret>,
    /// The Kubernetes Secret (in the policy's namespace) holding the
    /// header's value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretRef>,
}

/// A reference to a key of a Kubernetes Secret (in the policy's namespace).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SecretRef {
    /// The Secret's name.
    pub name: String,
    /// The key inside the Secret.
    pub key: String,
}

/// A secret string: serialized as is (it must reach the filter), but never
/// shown by `Debug`, so it cannot leak into logs by accident.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl Secret {
    /// The secret value.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

/// Classifier settings.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Classification {
    /// PII detectors to run (default: all).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pii_detectors: Option<Vec<PiiKind>>,
    /// The rule that makes a prompt "easy".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub easy: Option<EasyRule>,
}

/// A prompt is "easy" when its estimated token count is at most
/// `maxPromptTokens` and, with `noCodeFences`, it contains no "```".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EasyRule {
    /// Largest estimated prompt size that is still easy (default 512).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_prompt_tokens: Option<u32>,
    /// Whether a code fence makes a prompt not easy (default true): code
    /// questions tend to need the stronger model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_code_fences: Option<bool>,
}

/// A kind of personal data the classifier detects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum PiiKind {
    /// E-mail addresses.
    Email,
    /// Phone numbers: `+` international forms, North American
    /// `(415) 555-2671` / `415-555-2671`, and `0`-trunk national forms.
    Phone,
    /// Payment card numbers (13-19 digits, known network prefix, Luhn).
    PaymentCard,
    /// IBANs (country length table and mod-97 check).
    Iban,
    /// National ids: US SSN (`123-45-6789`, invalid areas excluded), Spanish
    /// DNI/NIE and Italian codice fiscale (both checksum verified).
    NationalId,
}

/// The API a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ApiKind {
    /// OpenAI `/v1/chat/completions`.
    Chat,
    /// OpenAI `/v1/completions`.
    Completions,
    /// Anthropic `/v1/messages`.
    AnthropicMessages,
    /// Anthropic `/v1/messages/count_tokens`: a prompt to count, nothing
    /// generated. Its own kind, so `apis: [anthropicMessages]` does not
    /// cover it.
    AnthropicCountTokens,
    /// OpenAI's Responses API: `POST /v1/responses`, and the requests on a
    /// stored response, `GET /v1/responses/{id}` and
    /// `POST /v1/responses/{id}/cancel` (these carry no model and no
    /// prompt, so `models`, `promptTokens`, `pii` and `easy` conditions see
    /// an empty model and an empty prompt).
    Responses,
}

/// One policy: when `match` holds, `action` is taken.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Policy {
    /// The policy's name (DNS-1123 label): counted in the filter's stats.
    pub name: String,
    /// The conditions; all that are set must hold. An empty match matches
    /// every request.
    #[serde(default, rename = "match", skip_serializing_if = "Match::is_catch_all")]
    pub match_: Match,
    /// What to do.
    pub action: Action,
    /// Marks a PII guard: PII traffic in this policy's scope never goes to a
    /// provider, whatever the policy order. See the crate docs, "PII guard".
    /// A guard's action must not be `provider`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pii_guard: bool,
}

/// The conditions of a policy. Every field that is set must hold; an unset
/// field matches anything. Lists inside a field are alternatives (any of).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Match {
    /// The request's tenant is one of these.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenants: Option<Vec<String>>,
    /// The request's tenant has one of these classes. With `tenants` also
    /// set, both must hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_classes: Option<Vec<String>>,
    /// The request's model equals one of these, or matches one as a glob
    /// (`*` any run of characters, `?` one character).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models: Option<Vec<String>>,
    /// The request uses one of these APIs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apis: Option<Vec<ApiKind>>,
    /// Request header conditions; all must hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<Vec<HeaderMatch>>,
    /// The estimated prompt size is within this range.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<TokenRange>,
    /// The prompt contains PII (`true`) or none (`false`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pii: Option<bool>,
    /// The prompt is easy (`true`) or not (`false`), by the easy rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub easy: Option<bool>,
    /// A pool's saturation, as last learned from the indexer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_state: Option<PoolStateMatch>,
}

/// A request header condition: `name` plus exactly one of `exact`, `prefix`,
/// `present`. Names are case-insensitive.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HeaderMatch {
    /// Header name.
    pub name: String,
    /// The value equals this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exact: Option<String>,
    /// The value starts with this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// The header is present (`true`) or absent (`false`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub present: Option<bool>,
}

/// An inclusive range of estimated prompt tokens; at least one bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TokenRange {
    /// Smallest size that matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<u32>,
    /// Largest size that matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<u32>,
}

/// A pool saturation condition: `saturationAbove` and/or `saturationBelow`
/// (both: a band). Unknown or stale state never matches, so a policy that
/// diverts on saturation falls through when the indexer is silent.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolStateMatch {
    /// The pool whose state is tested.
    pub pool: String,
    /// Matches when saturation > this (0..1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saturation_above: Option<f64>,
    /// Matches when saturation < this (0..1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saturation_below: Option<f64>,
}

/// What a policy does. Written as a one-key object: `{route: {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum Action {
    /// Send to a pool (through the indexer's pick).
    Route(RouteAction),
    /// Answer with an error.
    Reject(RejectAction),
    /// Send to an external provider.
    Provider(ProviderAction),
    /// Answer 429 with `Retry-After` (load shedding; pair with a
    /// `poolState` condition).
    Shed(ShedAction),
}

/// Route to a pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RouteAction {
    /// The pool.
    pub pool: String,
    /// Rewrite the body's `model` to this (one of the pool's models).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rewrite_model: Option<String>,
    /// Priority handed to the indexer (vLLM's convention: lower is more
    /// urgent; default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// Inject `stream_options.include_usage: true` into streaming requests
    /// so per-tenant token stats are exact (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_usage: Option<bool>,
}

/// Reject the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RejectAction {
    /// HTTP status, 400-599.
    pub status: u16,
    /// Message in the API's error body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Send to an external provider.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProviderAction {
    /// The provider's name.
    pub provider: String,
    /// Model to ask the provider for (overrides the provider's `model`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rewrite_model: Option<String>,
    /// Inject `stream_options.include_usage: true` (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_usage: Option<bool>,
}

/// Shed the request: 429 with `Retry-After`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ShedAction {
    /// Seconds for `Retry-After` (1-3600).
    pub retry_after_s: u32,
    /// Message in the API's error body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

impl Action {
    /// Whether this action sends the request outside (to a provider).
    pub fn is_provider(&self) -> bool {
        matches!(self, Action::Provider(_))
    }
}

impl Match {
    /// Whether no condition is set (the policy matches every request).
    pub fn is_catch_all(&self) -> bool {
        self == &Match::default()
    }
}
