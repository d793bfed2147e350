//! The compiled filter config: one versioned JSON document
//! (`"version": "kvasir.filter/v1"`) that the controller and `kvasirctl
//! compile` write and the wasm filter reads in `on_configure`.
//!
//! The document is plain data in a canonical form: tenants, pools and
//! providers sorted by name, key hashes and tenant values in sorted tables,
//! tenant classes already expanded into tenant names, model lists split into
//! exact names (sorted, binary-searched) and globs, every default filled in.
//! [`FilterConfig::from_json`] checks every reference and builds the lookup
//! index (parsed globs, binary hashes, index numbers), so per-request work
//! is lookups only and a bad document is refused at configure time instead
//! of failing (or panicking) on a request.
//!
//! Compatibility: within `kvasir.filter/v1` changes are additive; a reader
//! ignores fields it does not know, so an older filter can read a newer
//! controller's document. Anything else is a new version string.

use serde::{Deserialize, Serialize};

use crate::glob::Glob;
use crate::pii::PiiKinds;
use crate::types::{ApiKind, HeaderMatch, OnTenantHeader, PiiKind, UnknownTenant};
use crate::validate::{is_header_name, is_header_value, is_key_hash};

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

/// A compiled, loaded filter config: the document plus its lookup index.
///
/// Built by [`crate::compile()`] or [`FilterConfig::from_json`]; the two
/// agree because `compile` goes through the same loader.
#[derive(Debug, Clone)]
pub struct FilterConfig {
    pub(crate) doc: Doc,
    pub(crate) idx: Index,
}

impl PartialEq for FilterConfig {
    fn eq(&self, other: &Self) -> bool {
        // The index is a function of the document.
        self.doc == other.doc
    }
}

/// Per-request lookup structures derived from the document.
#[derive(Debug, Clone, Default)]
pub(crate) struct Index {
    /// (value, tenant index), sorted by value.
    pub values: Vec<(String, u32)>,
    /// (hash, tenant index), sorted by hash.
    pub keys: Vec<([u8; 32], u32)>,
    pub default_tenant: Option<u32>,
    pub policies: Vec<RtPolicy>,
    pub default_action: RtAction,
    /// Indices of PII guard policies, in order.
    pub guards: Vec<u32>,
    pub pii: PiiKinds,
    pub needs_pii: bool,
    pub needs_easy: bool,
    pub pools_needing_state: Vec<u32>,
    pub any_provider: bool,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct RtPolicy {
    /// Sorted tenant indices, if restricted.
    pub tenants: Option<Vec<u32>>,
    /// Whether models are restricted (exact list lives in the doc).
    pub models: bool,
    pub globs: Vec<Glob>,
    /// Bit set of allowed APIs (0: any).
    pub apis: u8,
    pub tokens: Option<(u32, u32)>,
    pub pool_state: Option<(u32, Option<f64>, Option<f64>)>,
    pub action: RtAction,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum RtAction {
    Route(u32),
    #[default]
    Reject,
    Provider(u32),
    Shed,
}

pub(crate) fn api_bit(a: ApiKind) -> u8 {
    match a {
        ApiKind::Chat => 1,
        ApiKind::Completions => 2,
        ApiKind::AnthropicMessages => 4,
    }
}

/// Parses `sha256:<hex>` into bytes.
pub(crate) fn parse_key_hash(s: &str) -> Option<[u8; 32]> {
    if !is_key_hash(s) {
        return None;
    }
    let h = s.as_bytes().get(7..)?;
    let mut out = [0u8; 32];
    for (k, pair) in h.chunks(2).enumerate() {
        let v = |c: u8| {
            if c.is_ascii_digit() {
                c - b'0'
            } else {
                c - b'a' + 10
            }
        };
        out[k] = v(pair[0]) << 4 | v(pair[1]);
    }
    Some(out)
}

/// ` at `path`` when there is a path.
fn at_path(path: &str) -> String {
    if path.is_empty() {
        String::new()
    } else {
        format!(" at `{path}`")
    }
}

fn invalid(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        path: path.into(),
        message: message.into(),
    }
}

/// Strips serde_json's " at line L column C" suffix (reported separately).
pub(crate) fn serde_message(e: &serde_json::Error) -> String {
    let s = e.to_string();
    let suffix = format!(" at line {} column {}", e.line(), e.column());
    s.strip_suffix(&suffix).map(str::to_owned).unwrap_or(s)
}

/// The path of the first error in a document that failed to parse.
#[cfg(feature = "config-paths")]
fn error_path(bytes: &[u8]) -> String {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize::<_, Doc>(&mut de) {
        Ok(_) => String::new(),
        Err(e) => crate::parse::path_string(e.path()),
    }
}

/// Without `config-paths` there is no path (line and column remain).
#[cfg(not(feature = "config-paths"))]
fn error_path(_: &[u8]) -> String {
    String::new()
}

impl FilterConfig {
    /// Reads a compiled document (the filter's `on_configure`). Never
    /// panics; refuses anything inconsistent.
    pub fn from_json(bytes: &[u8]) -> Result<FilterConfig, ConfigError> {
        #[derive(Deserialize)]
        struct Probe {
            #[serde(default)]
            version: Option<String>,
        }
        // Plain serde_json on the way in: the path-tracking wrapper doubles
        // the deserializer code in the wasm module (about 50 KB), so paths
        // are computed only on failure, and only with `config-paths`.
        let doc: Doc = match serde_json::from_slice(bytes) {
            Ok(d) => d,
            Err(inner) => {
                // A document of another version may fail on shape; say
                // "wrong version" rather than a confusing field error.
                if let Ok(Probe { version: Some(v) }) = serde_json::from_slice::<Probe>(bytes) {
                    if v != FILTER_CONFIG_VERSION {
                        return Err(ConfigError::Version { found: v });
                    }
                }
                return Err(ConfigError::Json {
                    path: error_path(bytes),
                    line: inner.line(),
                    column: inner.column(),
                    message: serde_message(&inner),
                });
            }
        };
        Self::from_doc(doc)
    }

    /// Builds the index, checking every invariant the matcher relies on.
    pub(crate) fn from_doc(mut doc: Doc) -> Result<FilterConfig, ConfigError> {
        if doc.version != FILTER_CONFIG_VERSION {
            return Err(ConfigError::Version {
                found: doc.version.clone(),
            });
        }
        // Entry checks first, so paths count entries as they were written.
        for (i, p) in doc.pools.iter().enumerate() {
            if p.cluster.is_empty() || p.indexer_cluster.is_empty() || p.indexer_pool.is_empty() {
                return Err(invalid(
                    format!("pools[{i}]"),
                    "cluster, indexerCluster and indexerPool are required",
                ));
            }
            if p.indexer_timeout_ms == 0 {
                return Err(invalid(
                    format!("pools[{i}].indexerTimeoutMs"),
                    "must be at least 1",
                ));
            }
        }
        for (i, p) in doc.providers.iter().enumerate() {
            if p.cluster.is_empty() {
                return Err(invalid(format!("providers[{i}].cluster"), "required"));
            }
            if let Some(a) = &p.authority {
                if a.is_empty() || !is_header_value(a) || a.contains(' ') {
                    return Err(invalid(
                        format!("providers[{i}].authority"),
                        "not a valid authority",
                    ));
                }
            }
        }

        // Canonical order, so lookups can binary-search even in a
        // hand-written document.
        doc.tenants.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        doc.pools.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        doc.providers.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        for w in doc.tenants.windows(2) {
            if w[0].name == w[1].name {
                return Err(invalid(
                    "tenants",
                    format!("duplicate tenant `{}`", w[0].name),
                ));
            }
        }
        for w in doc.pools.windows(2) {
            if w[0].name == w[1].name {
                return Err(invalid("pools", format!("duplicate pool `{}`", w[0].name)));
            }
        }
        for w in doc.providers.windows(2) {
            if w[0].name == w[1].name {
                return Err(invalid(
                    "providers",
                    format!("duplicate provider `{}`", w[0].name),
                ));
            }
        }
        let tenant = |name: &str| -> Option<u32> {
            doc.tenants
                .binary_search_by(|t| t.name.as_str().cmp(name))
                .ok()
                .map(|i| i as u32)
        };
        let pool = |name: &str| -> Option<u32> {
            doc.pools
                .binary_search_by(|t| t.name.as_str().cmp(name))
                .ok()
                .map(|i| i as u32)
        };
        let provider = |name: &str| -> Option<u32> {
            doc.providers
                .binary_search_by(|t| t.name.as_str().cmp(name))
                .ok()
                .map(|i| i as u32)
        };
        let mut idx = Index::default();

        // Tenant source.
        let ts = &doc.tenant_source;
        if !is_header_name(&ts.tenant_header) {
            return Err(invalid(
                "tenantSource.tenantHeader",
                "not a valid header name",
            ));
        }
        match ts.kind {
            TenantSourceKind::Header => {
                if !ts.header.as_deref().is_some_and(is_header_name) {
                    return Err(invalid(
                        "tenantSource.header",
                        "a valid header name is required",
                    ));
                }
            }
            TenantSourceKind::JwtClaim => {
                let ok = match (&ts.header, &ts.jwt_metadata_key) {
                    (Some(h), None) => is_header_name(h),
                    (None, Some(k)) => !k.is_empty(),
                    _ => false,
                };
                if !ok || ts.jwt_claim.as_deref().is_none_or(str::is_empty) {
                    return Err(invalid(
                        "tenantSource",
                        "jwtClaim needs a claim and exactly one of a header or a metadata key",
                    ));
                }
            }
            TenantSourceKind::ApiKey => {}
        }
        idx.default_tenant = match (&ts.default_tenant, ts.unknown_tenant) {
            (Some(d), UnknownTenant::Default) => Some(tenant(d).ok_or_else(|| {
                invalid(
                    "tenantSource.defaultTenant",
                    format!("unknown tenant `{d}`"),
                )
            })?),
            (None, UnknownTenant::Default) => {
                return Err(invalid(
                    "tenantSource.defaultTenant",
                    "required with unknownTenant: default",
                ))
            }
            _ => None,
        };
        for (i, v) in doc.tenant_values.iter().enumerate() {
            let t = tenant(&v.tenant).ok_or_else(|| {
                invalid(
                    format!("tenantValues[{i}].tenant"),
                    format!("unknown tenant `{}`", v.tenant),
                )
            })?;
            idx.values.push((v.value.clone(), t));
        }
        idx.values.sort_unstable();
        for w in idx.values.windows(2) {
            if w[0].0 == w[1].0 {
                return Err(invalid("tenantValues", "a value identifies two tenants"));
            }
        }
        for (i, k) in doc.api_keys.iter().enumerate() {
            let h = parse_key_hash(&k.hash).ok_or_else(|| {
                invalid(
                    format!("apiKeys[{i}].hash"),
                    "not `sha256:` + 64 lowercase hex digits",
                )
            })?;
            let t = tenant(&k.tenant).ok_or_else(|| {
                invalid(
                    format!("apiKeys[{i}].tenant"),
                    format!("unknown tenant `{}`", k.tenant),
                )
            })?;
            idx.keys.push((h, t));
        }
        idx.keys.sort_unstable();
        for w in idx.keys.windows(2) {
            if w[0].0 == w[1].0 {
                return Err(invalid("apiKeys", "a key hash belongs to two tenants"));
            }
        }
        doc.tenant_values
            .sort_unstable_by(|a, b| a.value.cmp(&b.value));
        doc.api_keys.sort_unstable_by(|a, b| a.hash.cmp(&b.hash));

        let c = &mut doc.classification;
        c.pii_detectors.sort_unstable();
        c.pii_detectors.dedup();
        idx.pii = PiiKinds::of(&c.pii_detectors);

        let action = |path: &str, a: &ActionConfig| -> Result<RtAction, ConfigError> {
            Ok(match a {
                ActionConfig::Route(r) => RtAction::Route(pool(&r.pool).ok_or_else(|| {
                    invalid(
                        format!("{path}.route.pool"),
                        format!("unknown pool `{}`", r.pool),
                    )
                })?),
                ActionConfig::Reject(r) => {
                    if !(400..=599).contains(&r.status) {
                        return Err(invalid(
                            format!("{path}.reject.status"),
                            "not a 4xx or 5xx status",
                        ));
                    }
                    RtAction::Reject
                }
                ActionConfig::Provider(p) => {
                    RtAction::Provider(provider(&p.provider).ok_or_else(|| {
                        invalid(
                            format!("{path}.provider.provider"),
                            format!("unknown provider `{}`", p.provider),
                        )
                    })?)
                }
                ActionConfig::Shed(s) => {
                    if s.retry_after_s == 0 {
                        return Err(invalid(
                            format!("{path}.shed.retryAfterS"),
                            "must be at least 1",
                        ));
                    }
                    RtAction::Shed
                }
            })
        };

        let mut needs_state = vec![false; doc.pools.len()];
        for (i, p) in doc.policies.iter_mut().enumerate() {
            let path = format!("policies[{i}]");
            let m = &mut p.match_;
            let mut rt = RtPolicy::default();
            if let Some(ts) = &mut m.tenants {
                let mut v = Vec::with_capacity(ts.len());
                for (j, t) in ts.iter().enumerate() {
                    v.push(tenant(t).ok_or_else(|| {
                        invalid(
                            format!("{path}.match.tenants[{j}]"),
                            format!("unknown tenant `{t}`"),
                        )
                    })?);
                }
                v.sort_unstable();
                v.dedup();
                ts.sort_unstable();
                ts.dedup();
                rt.tenants = Some(v);
            }
            if let Some(ms) = &mut m.models {
                ms.exact.sort_unstable();
                ms.exact.dedup();
                ms.globs.sort_unstable();
                ms.globs.dedup();
                for (j, g) in ms.globs.iter().enumerate() {
                    rt.globs.push(Glob::parse(g).map_err(|e| {
                        invalid(
                            format!("{path}.match.models.globs[{j}]"),
                            format!("bad glob: {e}"),
                        )
                    })?);
                }
                rt.models = true;
            }
            if let Some(a) = &mut m.apis {
                a.sort_unstable();
                a.dedup();
                rt.apis = a.iter().fold(0, |acc, &k| acc | api_bit(k));
                if rt.apis == 0 {
                    // An empty list matches nothing; keep that meaning.
                    rt.apis = 0x80;
                }
            }
            for (j, h) in m.headers.iter_mut().enumerate() {
                h.name.make_ascii_lowercase();
                let n = [h.exact.is_some(), h.prefix.is_some(), h.present.is_some()]
                    .iter()
                    .filter(|&&x| x)
                    .count();
                if n != 1 || !is_header_name(&h.name) {
                    return Err(invalid(
                        format!("{path}.match.headers[{j}]"),
                        "a valid name and exactly one of exact, prefix, present",
                    ));
                }
            }
            m.headers.sort_unstable_by(|a, b| {
                (&a.name, &a.exact, &a.prefix, a.present)
                    .cmp(&(&b.name, &b.exact, &b.prefix, b.present))
            });
            rt.tokens = m.prompt_tokens.map(|r| (r.min, r.max));
            if let Some(ps) = &m.pool_state {
                let k = pool(&ps.pool).ok_or_else(|| {
                    invalid(
                        format!("{path}.match.poolState.pool"),
                        format!("unknown pool `{}`", ps.pool),
                    )
                })?;
                let bad = |t: Option<f64>| t.is_some_and(|t| !(0.0..=1.0).contains(&t));
                if bad(ps.above) || bad(ps.below) || (ps.above.is_none() && ps.below.is_none()) {
                    return Err(invalid(
                        format!("{path}.match.poolState"),
                        "thresholds must be in [0, 1]",
                    ));
                }
                needs_state[k as usize] = true;
                rt.pool_state = Some((k, ps.above, ps.below));
            }
            idx.needs_pii |= m.pii.is_some();
            idx.needs_easy |= m.easy.is_some();
            rt.action = action(&format!("{path}.action"), &p.action)?;
            if p.pii_guard {
                if matches!(rt.action, RtAction::Provider(_)) {
                    return Err(invalid(
                        format!("{path}.piiGuard"),
                        "a PII guard cannot send to a provider",
                    ));
                }
                idx.guards.push(i as u32);
            }
            idx.any_provider |= matches!(rt.action, RtAction::Provider(_));
            idx.policies.push(rt);
        }
        idx.default_action = action("defaultAction", &doc.default_action)?;
        idx.any_provider |= matches!(idx.default_action, RtAction::Provider(_));
        // Guards only cost a scan when a provider could be chosen.
        idx.needs_pii |= !idx.guards.is_empty() && idx.any_provider;
        if idx.needs_pii && idx.pii.is_empty() {
            return Err(invalid(
                "classification.piiDetectors",
                "PII conditions need at least one detector",
            ));
        }
        idx.pools_needing_state = needs_state
            .iter()
            .enumerate()
            .filter(|(_, &n)| n)
            .map(|(i, _)| i as u32)
            .collect();
        Ok(FilterConfig { doc, idx })
    }

    /// The canonical bytes (compact JSON). Same input, same bytes: this is
    /// what the controller writes and what `kvasirctl compile` prints.
    pub fn to_json(&self) -> Vec<u8> {
        // Serializing plain structs, strings and finite floats cannot fail.
        serde_json::to_vec(&self.doc).unwrap_or_default()
    }

    /// Indented JSON, for people (not canonical).
    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(&self.doc).unwrap_or_default()
    }

    /// SHA-256 of [`FilterConfig::to_json`], as `sha256:<hex>`: a short
    /// identity for status conditions and the filter's logs.
    pub fn fingerprint(&self) -> String {
        use sha2::Digest;
        let d = sha2::Sha256::digest(self.to_json());
        let mut s = String::with_capacity(71);
        s.push_str("sha256:");
        for b in d {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }

    /// The tenant source settings.
    pub fn tenant_source(&self) -> &TenantSourceConfig {
        &self.doc.tenant_source
    }

    /// Tenants, sorted by name (a tenant's index is its place here).
    pub fn tenants(&self) -> &[TenantConfig] {
        &self.doc.tenants
    }

    /// Pools, sorted by name (a pool's index is its place here).
    pub fn pools(&self) -> &[PoolConfig] {
        &self.doc.pools
    }

    /// Providers, sorted by name.
    pub fn providers(&self) -> &[ProviderConfig] {
        &self.doc.providers
    }

    /// The policies, in order.
    pub fn policies(&self) -> &[PolicyConfig] {
        &self.doc.policies
    }

    /// The default action.
    pub fn default_action(&self) -> &ActionConfig {
        &self.doc.default_action
    }

    /// Classifier settings.
    pub fn classification(&self) -> &ClassificationConfig {
        &self.doc.classification
    }

    /// How old a pool-state sample may be.
    pub fn pool_state_max_age_ms(&self) -> u32 {
        self.doc.pool_state_max_age_ms
    }

    /// A tenant's index by name.
    pub fn tenant_index(&self, name: &str) -> Option<usize> {
        self.doc
            .tenants
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
    }

    /// A pool's index by name.
    pub fn pool_index(&self, name: &str) -> Option<usize> {
        self.doc
            .pools
            .binary_search_by(|t| t.name.as_str().cmp(name))
            .ok()
    }

    /// Indices of the pools some policy tests the state of: the filter
    /// polls only these with `PoolState`.
    pub fn pools_needing_state(&self) -> impl Iterator<Item = usize> + '_ {
        self.idx.pools_needing_state.iter().map(|&i| i as usize)
    }

    /// Whether a request may need PII classification (a `pii` condition,
    /// or a PII guard while some provider action exists). When false the
    /// filter can skip collecting prompt text for classification.
    pub fn needs_pii_scan(&self) -> bool {
        self.idx.needs_pii
    }

    /// Whether some policy has an `easy` condition.
    pub fn needs_easy(&self) -> bool {
        self.idx.needs_easy
    }

    /// Whether classification may read the prompt text at all.
    pub fn needs_prompt_text(&self) -> bool {
        self.idx.needs_pii || (self.idx.needs_easy && self.doc.classification.easy_no_code_fences)
    }
}
