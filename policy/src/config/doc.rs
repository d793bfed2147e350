//! The serialized document: every type of `kvasir.filter/v1`, and the
//! error a refused document gives. Plain data; the checks live in the
//! index builder.

use serde::{Deserialize, Serialize};

use crate::types::{ApiKind, HeaderMatch, OnTenantHeader, PiiKind, UnknownTenant};

/// The version string of the document this crate reads and writes.
pub const FILTER_CONFIG_VERSION: &str = "kvasir.filter/v1";

/// The serialized document. Private: [`FilterConfig`] is the only way in,
/// so the index can never disagree with the data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Doc {
    pub version: String,
    pub tenant_source: TenantSourceConfig,
    pub tenants: Vec<TenantConfig>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenant_values: Vec<TenantValueEntry>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub api_keys: Vec<ApiKeyEntry>,
    pub pools: Vec<PoolConfig>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub providers: Vec<ProviderConfig>,
    pub classification: ClassificationConfig,
    pub pool_state_max_age_ms: u32,
    /// Written only when not 1, so documents without it compile to the
    /// same bytes as before it existed.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub gateway_replicas: u32,
    pub policies: Vec<PolicyConfig>,
    pub default_action: ActionConfig,
}

/// How the tenant is found, with every default filled in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TenantSourceConfig {
    /// The source.
    pub kind: TenantSourceKind,
    /// `header`: the tenant header; `jwtClaim`: the header `jwt_authn`
    /// copied the claim into (absent when the claim is read from metadata).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    /// `jwtClaim`: the claim's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwt_claim: Option<String>,
    /// `jwtClaim` from metadata: the `payload_in_metadata` key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwt_metadata_key: Option<String>,
    /// What to do when no tenant is identified.
    pub unknown_tenant: UnknownTenant,
    /// The default tenant's name (with `unknownTenant: default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default_tenant: Option<String>,
    /// The client-facing tenant header (lowercase). With `apiKey`/`jwtClaim`
    /// it is never trusted: the filter overwrites it with the resolved
    /// tenant (or rejects, per `onTenantHeader`).
    pub tenant_header: String,
    /// What to do with a client-sent `tenantHeader` (`apiKey`/`jwtClaim`).
    pub on_tenant_header: OnTenantHeader,
}

/// Where the tenant comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum TenantSourceKind {
    /// A trusted request header.
    Header,
    /// An API key (`Authorization: Bearer` or `x-api-key`).
    ApiKey,
    /// A JWT claim from `jwt_authn`.
    JwtClaim,
}

/// A tenant in the compiled config.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TenantConfig {
    /// Name.
    pub name: String,
    /// Class, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// The tenant's budget (its own, else its class's), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<BudgetConfig>,
    /// The tenant's weight in a saturated pool's fair share (flow control,
    /// by tokens, within a priority band): its own, else its class's, else
    /// 1; 1..=1000.
    #[serde(default = "default_weight")]
    pub weight: u32,
}

fn default_weight() -> u32 {
    1
}

/// A tenant's budget with every default filled in. The filter sends it
/// with each pick; the indexer reserves against it (`kvasir-budget`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BudgetConfig {
    /// Prompt plus completion tokens per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// Prompt tokens per minute.
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
    /// A cached prompt token's cost in thousandths of an uncached one
    /// (0..=1000): an integer, so the bytes are canonical and the
    /// arithmetic exact.
    pub cached_token_weight_permille: u16,
    /// Completion tokens reserved without `max_tokens` before any are
    /// learned.
    pub default_output_tokens: u32,
}

/// A header/claim value and the tenant it identifies (sorted by value).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TenantValueEntry {
    /// The value.
    pub value: String,
    /// The tenant's name.
    pub tenant: String,
}

/// A key hash and its tenant (sorted by hash).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApiKeyEntry {
    /// `sha256:<64 hex>`.
    pub hash: String,
    /// The tenant's name.
    pub tenant: String,
}

/// A pool in the compiled config.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolConfig {
    /// Name.
    pub name: String,
    /// Models served (sorted).
    pub models: Vec<String>,
    /// The pool's Envoy cluster.
    pub cluster: String,
    /// The indexer's Envoy cluster (gRPC).
    pub indexer_cluster: String,
    /// The pool's name at the indexer.
    pub indexer_pool: String,
    /// `Pick` timeout.
    pub indexer_timeout_ms: u32,
    /// How long a pick may wait in the indexer's flow-control queue, ms, on
    /// top of `indexer_timeout_ms` (0: it never waits; a pick the pool
    /// would queue is shed at once). The indexer pool's `maxWaitMs` when
    /// the policy's `flowControl` is enabled, else 0; at most 600000.
    #[serde(default)]
    pub max_queue_wait_ms: u32,
    /// Whether the filter reports each response's first token for this pool
    /// even when the shared `reportFirstToken` setting is off: the pool's
    /// flow control counts queued prefill work (`saturatedPrefillTokens`),
    /// which without the report would count a pick's prefill until its end.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub report_first_token: bool,
}

/// A provider in the compiled config. It carries no credential (Envoy
/// injects it on the provider's cluster); a document that still has a
/// provider `auth` is refused rather than silently sending requests
/// without one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ProviderConfig {
    /// Name.
    pub name: String,
    /// Envoy cluster.
    pub cluster: String,
    /// `:authority` to set, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authority: Option<String>,
    /// Default model rewrite, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// Classifier settings with defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClassificationConfig {
    /// Enabled PII detectors (sorted).
    pub pii_detectors: Vec<PiiKind>,
    /// Easy rule: largest estimated prompt.
    pub easy_max_prompt_tokens: u32,
    /// Easy rule: code fences make a prompt not easy.
    pub easy_no_code_fences: bool,
}

/// A compiled policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyConfig {
    /// Name.
    pub name: String,
    /// PII guard flag.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pii_guard: bool,
    /// Conditions.
    #[serde(rename = "match")]
    pub match_: MatchConfig,
    /// Action.
    pub action: ActionConfig,
}

/// Compiled conditions; an absent field matches anything.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MatchConfig {
    /// Tenant names (classes expanded, intersected with names; sorted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenants: Option<Vec<String>>,
    /// Models.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models: Option<ModelsConfig>,
    /// APIs (sorted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apis: Option<Vec<ApiKind>>,
    /// Header conditions (names lowercase; sorted).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<HeaderMatch>,
    /// Prompt token range, bounds filled in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<TokenRangeConfig>,
    /// PII condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pii: Option<bool>,
    /// Easy condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub easy: Option<bool>,
    /// Pool state condition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_state: Option<PoolStateConfig>,
}

/// Model patterns split by kind.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModelsConfig {
    /// Exact names (sorted).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exact: Vec<String>,
    /// Globs (sorted).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub globs: Vec<String>,
}

/// Inclusive token range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenRangeConfig {
    /// Lower bound.
    pub min: u32,
    /// Upper bound.
    pub max: u32,
}

/// Pool saturation condition.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolStateConfig {
    /// Pool name.
    pub pool: String,
    /// Saturation must be above this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub above: Option<f64>,
    /// Saturation must be below this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub below: Option<f64>,
}

/// A compiled action, every default filled in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ActionConfig {
    /// Route to a pool.
    Route(RouteConfig),
    /// Reject.
    Reject(RejectConfig),
    /// Send to a provider.
    Provider(ProviderActionConfig),
    /// Shed with 429.
    Shed(ShedConfig),
}

/// Route action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteConfig {
    /// Pool name.
    pub pool: String,
    /// Model rewrite.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rewrite_model: Option<String>,
    /// Indexer priority.
    pub priority: i32,
    /// Inject `stream_options.include_usage`.
    pub include_usage: bool,
}

/// Reject action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RejectConfig {
    /// Status.
    pub status: u16,
    /// Message.
    pub message: String,
}

/// Provider action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProviderActionConfig {
    /// Provider name.
    pub provider: String,
    /// Model rewrite (the action's, else the provider's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rewrite_model: Option<String>,
    /// Inject `stream_options.include_usage`.
    pub include_usage: bool,
}

/// Shed action.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShedConfig {
    /// `Retry-After` seconds.
    pub retry_after_s: u32,
    /// Message.
    pub message: String,
}

/// Why a compiled document was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// Not JSON, or not the document's shape.
    #[error("invalid filter config{} (line {line}, column {column}): {message}", at_path(.path))]
    Json {
        /// Where (`policies[0].action`).
        path: String,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// What serde said.
        message: String,
    },
    /// Another version.
    #[error(
        "unsupported filter config version `{found}` (this filter reads `{FILTER_CONFIG_VERSION}`)"
    )]
    Version {
        /// The version found.
        found: String,
    },
    /// Well-formed but inconsistent (a dangling reference, a bad hash...).
    #[error("invalid filter config at `{path}`: {message}")]
    Invalid {
        /// Where.
        path: String,
        /// Why.
        message: String,
    },
}

/// ` at `path`` when there is a path.
fn at_path(path: &str) -> String {
    if path.is_empty() {
        String::new()
    } else {
        format!(" at `{path}`")
    }
}

/// A [`ConfigError::Invalid`] at `path`.
pub(super) fn invalid(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        path: path.into(),
        message: message.into(),
    }
}

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}
