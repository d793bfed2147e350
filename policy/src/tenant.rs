//! Tenant resolution: who sent a request.
//!
//! Rules, in this order:
//!
//! 1. With the `apiKey` or `jwtClaim` source, a client-sent tenant header
//!    (`tenantSource.tenantHeader`, default `x-tenant`) is never read: it is
//!    reported as ignored (the filter then overwrites it with the resolved
//!    tenant), or the request is refused with 403 when `onTenantHeader:
//!    reject`. A client can therefore never choose its tenant.
//! 2. The identity is read: the trusted header's value, the API key
//!    (`Authorization: Bearer <key>` or `x-api-key: <key>`), or the JWT
//!    claim (from the header `jwt_authn` wrote or from its metadata, which
//!    the filter reads and passes in). A request carrying both key headers
//!    with different keys is refused with 401: charging either one would
//!    be a guess (OpenAI's SDKs send the first, Anthropic's the second, and
//!    a client that sets both by mistake must hear about it). Both with
//!    the same key is one credential.
//! 3. A presented identity must match a tenant: an API key's SHA-256 is
//!    looked up in the sorted hash table, a header or claim value in the
//!    sorted value table. No match is 401, whatever `unknownTenant` says.
//! 4. No identity at all: the default tenant with `unknownTenant: default`,
//!    else 401.
//!
//! Keys are hashed and dropped; errors never carry the key, the header
//! value or the claim, so nothing a client sent can reach a log through
//! them.

use sha2::{Digest, Sha256};

use crate::config::{FilterConfig, TenantSourceKind};
use crate::matcher::Headers;
use crate::types::{OnTenantHeader, UnknownTenant};

/// What the filter hands to tenant resolution.
pub struct TenantInput<'a> {
    /// The request headers.
    pub headers: &'a dyn Headers,
    /// With `jwtClaim` from metadata: the claim's value, read by the filter
    /// from `metadata.filter_metadata["envoy.filters.http.jwt_authn"]`.
    pub jwt_claim: Option<&'a str>,
}

/// How the tenant was identified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TenantVia {
    /// The trusted tenant header.
    Header,
    /// An API key.
    ApiKey,
    /// A JWT claim.
    JwtClaim,
    /// No identity: the default tenant.
    Default,
}

/// A resolved tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantMatch<'c> {
    /// The tenant's name.
    pub name: &'c str,
    /// Its class.
    pub class: Option<&'c str>,
    /// Its index in [`FilterConfig::tenants`] (for per-tenant stat arrays).
    pub index: usize,
    /// How it was identified.
    pub via: TenantVia,
    /// Whether a client-sent tenant header was present and ignored (the
    /// filter must overwrite or remove it before the request goes on).
    pub client_header_ignored: bool,
}

/// Why no tenant was resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TenantError {
    /// No key, claim or tenant header, and no default tenant.
    #[error("missing credentials")]
    MissingCredentials,
    /// The API key matches no tenant.
    #[error("invalid API key")]
    UnknownApiKey,
    /// `Authorization: Bearer` and `x-api-key` carry different keys.
    #[error("conflicting credentials: `Authorization: Bearer` and `x-api-key` carry different keys; send one key")]
    ConflictingCredentials,
    /// The header or claim value matches no tenant.
    #[error("unknown tenant")]
    UnknownTenant,
    /// A client-sent tenant header while the tenant comes from a key or a
    /// JWT, with `onTenantHeader: reject`.
    #[error("the `{header}` header is not accepted")]
    TenantHeaderNotAllowed {
        /// The header's name (not its value).
        header: String,
    },
}

impl TenantError {
    /// The HTTP status to answer with: 401 for missing, unknown or
    /// conflicting identities, 403 for a forbidden tenant header.
    pub fn status(&self) -> u16 {
        match self {
            TenantError::TenantHeaderNotAllowed { .. } => 403,
            _ => 401,
        }
    }
}

/// The key of `Authorization: Bearer <key>` or of `x-api-key` (an
/// `Authorization` with another scheme is no key), or
/// [`TenantError::ConflictingCredentials`] when both carry a key and the
/// keys differ.
fn presented_key(h: &dyn Headers) -> Result<Option<&str>, TenantError> {
    let bearer = h.header("authorization").and_then(|v| {
        let v = v.trim();
        let (scheme, rest) = v.split_once(|c: char| c.is_ascii_whitespace())?;
        let key = rest.trim();
        (scheme.eq_ignore_ascii_case("bearer") && !key.is_empty()).then_some(key)
    });
    let x_api_key = h
        .header("x-api-key")
        .map(str::trim)
        .filter(|k| !k.is_empty());
    match (bearer, x_api_key) {
        // Both are the client's own; comparing them reveals nothing.
        (Some(a), Some(b)) if a != b => Err(TenantError::ConflictingCredentials),
        (a, b) => Ok(a.or(b)),
    }
}

/// Resolves a request's tenant (see the module docs for the rules).
pub fn resolve_tenant<'c>(
    cfg: &'c FilterConfig,
    input: &TenantInput<'_>,
) -> Result<TenantMatch<'c>, TenantError> {
    let src = cfg.tenant_source();
    let found = |index: u32, via: TenantVia, ignored: bool| {
        let t = &cfg.tenants()[index as usize];
        TenantMatch {
            name: &t.name,
            class: t.class.as_deref(),
            index: index as usize,
            via,
            client_header_ignored: ignored,
        }
    };
    let mut ignored = false;
    if src.kind != TenantSourceKind::Header && input.headers.header(&src.tenant_header).is_some() {
        if src.on_tenant_header == OnTenantHeader::Reject {
            return Err(TenantError::TenantHeaderNotAllowed {
                header: src.tenant_header.clone(),
            });
        }
        ignored = true;
    }
    let by_value = |v: &str| -> Option<u32> {
        cfg.idx
            .values
            .binary_search_by(|(x, _)| x.as_str().cmp(v))
            .ok()
            .map(|k| cfg.idx.values[k].1)
    };
    let (identity, via) = match src.kind {
        TenantSourceKind::Header => (
            src.header.as_deref().and_then(|h| input.headers.header(h)),
            TenantVia::Header,
        ),
        TenantSourceKind::JwtClaim => (
            match &src.header {
                Some(h) => input.headers.header(h),
                None => input.jwt_claim,
            },
            TenantVia::JwtClaim,
        ),
        TenantSourceKind::ApiKey => (presented_key(input.headers)?, TenantVia::ApiKey),
    };
    match identity {
        Some(id) => {
            let t = if via == TenantVia::ApiKey {
                let h: [u8; 32] = Sha256::digest(id.as_bytes()).into();
                cfg.idx
                    .keys
                    .binary_search_by(|(x, _)| x.cmp(&h))
                    .ok()
                    .map(|k| cfg.idx.keys[k].1)
                    .ok_or(TenantError::UnknownApiKey)?
            } else {
                by_value(id).ok_or(TenantError::UnknownTenant)?
            };
            Ok(found(t, via, ignored))
        }
        None => match (src.unknown_tenant, cfg.idx.default_tenant) {
            (UnknownTenant::Default, Some(d)) => Ok(found(d, TenantVia::Default, ignored)),
            _ => Err(TenantError::MissingCredentials),
        },
    }
}

impl FilterConfig {
    /// [`resolve_tenant`] as a method.
    pub fn resolve_tenant(&self, input: &TenantInput<'_>) -> Result<TenantMatch<'_>, TenantError> {
        resolve_tenant(self, input)
    }
}

/// `sha256:<hex>` of a key: what goes into `apiKeyHashes` (used by
/// `kvasirctl` to hash a key the operator types, and by tests).
pub fn hash_api_key(key: &str) -> String {
    let d = Sha256::digest(key.as_bytes());
    let mut s = String::with_capacity(71);
    s.push_str("sha256:");
    for b in d {
        s.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
        s.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
    }
    s
}
