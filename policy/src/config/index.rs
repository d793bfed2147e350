//! The lookup index the matcher runs on, and the per-section builders
//! that check a [`Doc`], put it in canonical order and derive the index
//! from it. [`build`] runs them in document order (entries, names, tenant
//! source, tenant values, keys, classification, policies, default action):
//! that order decides which fault a document with several reports first.

use crate::glob::Glob;
use crate::pii::PiiKinds;
use crate::syntax::{is_header_name, is_header_value, is_key_hash};
use crate::types::{ApiKind, UnknownTenant};

use super::doc::{
    invalid, ActionConfig, ApiKeyEntry, ClassificationConfig, ConfigError, Doc, MatchConfig,
    PolicyConfig, PoolConfig, ProviderConfig, TenantConfig, TenantSourceConfig, TenantSourceKind,
    TenantValueEntry,
};

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
        ApiKind::AnthropicCountTokens => 8,
        ApiKind::Responses => 16,
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

/// Checks `doc`, puts it in canonical order and builds its index.
pub(crate) fn build(doc: &mut Doc) -> Result<Index, ConfigError> {
    // Entry checks first, so paths count entries as they were written.
    check_pools(&doc.pools)?;
    check_providers(&doc.providers)?;
    check_tenants(&doc.tenants)?;
    sort_by_name(doc)?;

    let names = Names {
        tenants: &doc.tenants,
        pools: &doc.pools,
        providers: &doc.providers,
    };
    let mut idx = Index::default();
    check_tenant_source(&doc.tenant_source)?;
    idx.default_tenant = default_tenant(&names, &doc.tenant_source)?;
    idx.values = tenant_values(&names, &doc.tenant_values)?;
    idx.keys = api_keys(&names, &doc.api_keys)?;
    doc.tenant_values
        .sort_unstable_by(|a, b| a.value.cmp(&b.value));
    doc.api_keys.sort_unstable_by(|a, b| a.hash.cmp(&b.hash));
    idx.pii = classification(&mut doc.classification);

    policies(&names, &mut doc.policies, &mut idx)?;
    idx.default_action = action(&names, "defaultAction", &doc.default_action)?;
    idx.any_provider |= matches!(idx.default_action, RtAction::Provider(_));
    // Guards only cost a scan when a provider could be chosen.
    idx.needs_pii |= !idx.guards.is_empty() && idx.any_provider;
    if idx.needs_pii && idx.pii.is_empty() {
        return Err(invalid(
            "classification.piiDetectors",
            "PII conditions need at least one detector",
        ));
    }
    Ok(idx)
}

/// Name-to-index lookups over the sorted tenants, pools and providers.
struct Names<'a> {
    tenants: &'a [TenantConfig],
    pools: &'a [PoolConfig],
    providers: &'a [ProviderConfig],
}

impl Names<'_> {
    fn tenant(&self, name: &str) -> Option<u32> {
        position(self.tenants, name, |t| &t.name)
    }

    fn pool(&self, name: &str) -> Option<u32> {
        position(self.pools, name, |p| &p.name)
    }

    fn provider(&self, name: &str) -> Option<u32> {
        position(self.providers, name, |p| &p.name)
    }
}

fn position<T>(sorted: &[T], name: &str, key: impl Fn(&T) -> &String) -> Option<u32> {
    sorted
        .binary_search_by(|t| key(t).as_str().cmp(name))
        .ok()
        .map(|i| i as u32)
}

fn check_pools(pools: &[PoolConfig]) -> Result<(), ConfigError> {
    for (i, p) in pools.iter().enumerate() {
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
        super::checks::queue_wait(p.max_queue_wait_ms)
            .map_err(|msg| invalid(format!("pools[{i}].maxQueueWaitMs"), msg))?;
    }
    Ok(())
}

fn check_providers(providers: &[ProviderConfig]) -> Result<(), ConfigError> {
    for (i, p) in providers.iter().enumerate() {
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
    Ok(())
}

/// Tenants' weights and budgets: the bounds validation applies.
fn check_tenants(tenants: &[TenantConfig]) -> Result<(), ConfigError> {
    for (i, t) in tenants.iter().enumerate() {
        super::checks::weight(t.weight)
            .map_err(|msg| invalid(format!("tenants[{i}].weight"), msg))?;
        if let Some(b) = &t.budget {
            super::checks::budget(b)
                .map_err(|(field, msg)| invalid(format!("tenants[{i}].budget.{field}"), msg))?;
        }
    }
    Ok(())
}

/// Canonical order, so lookups can binary-search even in a hand-written
/// document; a name may appear once.
fn sort_by_name(doc: &mut Doc) -> Result<(), ConfigError> {
    doc.tenants.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    doc.pools.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    doc.providers.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    unique(doc.tenants.iter().map(|t| &t.name), "tenants", "tenant")?;
    unique(doc.pools.iter().map(|p| &p.name), "pools", "pool")?;
    unique(
        doc.providers.iter().map(|p| &p.name),
        "providers",
        "provider",
    )
}

fn unique<'a>(
    mut sorted: impl Iterator<Item = &'a String>,
    path: &str,
    what: &str,
) -> Result<(), ConfigError> {
    let Some(mut prev) = sorted.next() else {
        return Ok(());
    };
    for name in sorted {
        if name == prev {
            return Err(invalid(path, format!("duplicate {what} `{name}`")));
        }
        prev = name;
    }
    Ok(())
}

fn check_tenant_source(ts: &TenantSourceConfig) -> Result<(), ConfigError> {
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
    Ok(())
}

fn default_tenant(names: &Names, ts: &TenantSourceConfig) -> Result<Option<u32>, ConfigError> {
    Ok(match (&ts.default_tenant, ts.unknown_tenant) {
        (Some(d), UnknownTenant::Default) => Some(names.tenant(d).ok_or_else(|| {
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
    })
}

/// (value, tenant index), sorted by value.
fn tenant_values(
    names: &Names,
    entries: &[TenantValueEntry],
) -> Result<Vec<(String, u32)>, ConfigError> {
    let mut values = Vec::with_capacity(entries.len());
    for (i, v) in entries.iter().enumerate() {
        let t = names.tenant(&v.tenant).ok_or_else(|| {
            invalid(
                format!("tenantValues[{i}].tenant"),
                format!("unknown tenant `{}`", v.tenant),
            )
        })?;
        values.push((v.value.clone(), t));
    }
    values.sort_unstable();
    if values.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(invalid("tenantValues", "a value identifies two tenants"));
    }
    Ok(values)
}

/// (hash, tenant index), sorted by hash.
fn api_keys(names: &Names, entries: &[ApiKeyEntry]) -> Result<Vec<([u8; 32], u32)>, ConfigError> {
    let mut keys = Vec::with_capacity(entries.len());
    for (i, k) in entries.iter().enumerate() {
        let h = parse_key_hash(&k.hash).ok_or_else(|| {
            invalid(
                format!("apiKeys[{i}].hash"),
                "not `sha256:` + 64 lowercase hex digits",
            )
        })?;
        let t = names.tenant(&k.tenant).ok_or_else(|| {
            invalid(
                format!("apiKeys[{i}].tenant"),
                format!("unknown tenant `{}`", k.tenant),
            )
        })?;
        keys.push((h, t));
    }
    keys.sort_unstable();
    if keys.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(invalid("apiKeys", "a key hash belongs to two tenants"));
    }
    Ok(keys)
}

fn classification(c: &mut ClassificationConfig) -> PiiKinds {
    c.pii_detectors.sort_unstable();
    c.pii_detectors.dedup();
    PiiKinds::of(&c.pii_detectors)
}

/// The policies in order, with what the matcher needs to know about them
/// as a whole (guards, which classifiers and pool states they read).
fn policies(
    names: &Names,
    policies: &mut [PolicyConfig],
    idx: &mut Index,
) -> Result<(), ConfigError> {
    let mut needs_state = vec![false; names.pools.len()];
    for (i, p) in policies.iter_mut().enumerate() {
        let rt = policy(names, &format!("policies[{i}]"), p, &mut needs_state)?;
        idx.needs_pii |= p.match_.pii.is_some();
        idx.needs_easy |= p.match_.easy.is_some();
        if p.pii_guard {
            idx.guards.push(i as u32);
        }
        idx.any_provider |= matches!(rt.action, RtAction::Provider(_));
        idx.policies.push(rt);
    }
    idx.pools_needing_state = needs_state
        .iter()
        .enumerate()
        .filter(|(_, &n)| n)
        .map(|(i, _)| i as u32)
        .collect();
    Ok(())
}

/// One policy: its conditions put in canonical order, references resolved.
fn policy(
    names: &Names,
    path: &str,
    p: &mut PolicyConfig,
    needs_state: &mut [bool],
) -> Result<RtPolicy, ConfigError> {
    let m = &mut p.match_;
    let mut rt = RtPolicy {
        tenants: match_tenants(names, path, m)?,
        ..RtPolicy::default()
    };
    match_models(path, m, &mut rt)?;
    rt.apis = match_apis(m);
    match_headers(path, m)?;
    rt.tokens = m.prompt_tokens.map(|r| (r.min, r.max));
    if let Some(ps) = &m.pool_state {
        let k = names.pool(&ps.pool).ok_or_else(|| {
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
    rt.action = action(names, &format!("{path}.action"), &p.action)?;
    if p.pii_guard && matches!(rt.action, RtAction::Provider(_)) {
        return Err(invalid(
            format!("{path}.piiGuard"),
            "a PII guard cannot send to a provider",
        ));
    }
    Ok(rt)
}

/// Sorted tenant indices, if the policy names tenants.
fn match_tenants(
    names: &Names,
    path: &str,
    m: &mut MatchConfig,
) -> Result<Option<Vec<u32>>, ConfigError> {
    let Some(ts) = &mut m.tenants else {
        return Ok(None);
    };
    let mut v = Vec::with_capacity(ts.len());
    for (j, t) in ts.iter().enumerate() {
        v.push(names.tenant(t).ok_or_else(|| {
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
    Ok(Some(v))
}

fn match_models(path: &str, m: &mut MatchConfig, rt: &mut RtPolicy) -> Result<(), ConfigError> {
    let Some(ms) = &mut m.models else {
        return Ok(());
    };
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
    Ok(())
}

/// The bit set of allowed APIs (0: any).
fn match_apis(m: &mut MatchConfig) -> u8 {
    let Some(a) = &mut m.apis else {
        return 0;
    };
    a.sort_unstable();
    a.dedup();
    match a.iter().fold(0, |acc, &k| acc | api_bit(k)) {
        // An empty list matches nothing; keep that meaning.
        0 => 0x80,
        bits => bits,
    }
}

fn match_headers(path: &str, m: &mut MatchConfig) -> Result<(), ConfigError> {
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
        (&a.name, &a.exact, &a.prefix, a.present).cmp(&(&b.name, &b.exact, &b.prefix, b.present))
    });
    Ok(())
}

fn action(names: &Names, path: &str, a: &ActionConfig) -> Result<RtAction, ConfigError> {
    Ok(match a {
        ActionConfig::Route(r) => RtAction::Route(names.pool(&r.pool).ok_or_else(|| {
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
            RtAction::Provider(names.provider(&p.provider).ok_or_else(|| {
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
}
