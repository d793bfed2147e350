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
//!
//! The document's types are in `doc`; the checks and the lookup index the
//! matcher runs on are built section by section in `index`.

mod checks;
mod doc;
mod index;

use serde::Deserialize;

pub(crate) use doc::Doc;
pub use doc::{
    ActionConfig, ApiKeyEntry, BudgetConfig, ClassificationConfig, ConfigError, MatchConfig,
    ModelsConfig, PolicyConfig, PoolConfig, PoolStateConfig, ProviderActionConfig, ProviderConfig,
    RejectConfig, RouteConfig, ShedConfig, TenantConfig, TenantSourceConfig, TenantSourceKind,
    TenantValueEntry, TokenRangeConfig, FILTER_CONFIG_VERSION,
};
pub(crate) use index::{api_bit, Index, RtAction, RtPolicy};

use crate::json_error::serde_message;

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

/// The path of the first error in a document that failed to parse.
#[cfg(feature = "config-paths")]
fn error_path(bytes: &[u8]) -> String {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize::<_, Doc>(&mut de) {
        Ok(_) => String::new(),
        Err(e) => crate::json_error::path_string(e.path()),
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
        let idx = index::build(&mut doc)?;
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

    /// Envoy replicas serving the policy set: each admits a tenant's
    /// request against this share of its budget when it cannot ask the
    /// indexer.
    pub fn gateway_replicas(&self) -> u32 {
        self.doc.gateway_replicas.max(1)
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
