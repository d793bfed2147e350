//! Compilation of a validated [`PolicySet`] into the filter's
//! [`FilterConfig`].
//!
//! Everything that can be decided without a request is decided here: sets
//! are sorted and de-duplicated (so the order in which the controller found
//! the resources never shows in the bytes), tenant classes are expanded into
//! tenant names, defaults are written out, secrets are resolved. The output
//! bytes are a pure function of the policy set's meaning.

use std::collections::BTreeSet;

use crate::config::*;
use crate::diagnostic::{Severity, ValidationError};
use crate::glob::is_glob;
use crate::scope::tenant_scope;
use crate::types::*;
use crate::validate::{validate, DEFAULT_TENANT_HEADER};

/// Default `Pick` timeout (ms): short, because a slow pick must not cost
/// more than the cache hit it could win; the filter fails open after it.
pub const DEFAULT_INDEXER_TIMEOUT_MS: u32 = 50;
/// Default largest "easy" prompt (estimated tokens).
pub const DEFAULT_EASY_MAX_PROMPT_TOKENS: u32 = 512;
/// Default pool-state staleness limit (ms): a few indexer poll periods.
pub const DEFAULT_POOL_STATE_MAX_AGE_MS: u32 = 5000;
/// Message of a `reject` without one. Generic on purpose: policy names are
/// configuration, not something to tell clients.
pub const DEFAULT_REJECT_MESSAGE: &str = "request rejected by policy";
/// Message of a `shed` without one.
pub const DEFAULT_SHED_MESSAGE: &str = "the service is saturated; retry later";

/// Validates and compiles. Provider credentials are not part of the
/// result: Envoy injects them (see [`crate::types::ProviderAuth`]).
pub fn compile(set: &PolicySet) -> Result<FilterConfig, Vec<ValidationError>> {
    validate(set)?;
    let mut providers = Vec::with_capacity(set.providers.len());
    for p in &set.providers {
        providers.push(ProviderConfig {
            name: p.name.clone(),
            cluster: p.cluster.clone(),
            authority: p.authority.clone(),
            model: p.model.clone(),
        });
    }
    providers.sort_by(|a, b| a.name.cmp(&b.name));

    let doc = Doc {
        version: FILTER_CONFIG_VERSION.to_owned(),
        tenant_source: tenant_source(&set.tenant_source),
        tenants: {
            let mut t: Vec<_> = set
                .tenants
                .iter()
                .map(|t| TenantConfig {
                    name: t.name.clone(),
                    class: t.class.clone(),
                    budget: crate::budget::compile(set, t),
                    weight: crate::flow::weight(set, t),
                })
                .collect();
            t.sort_by(|a, b| a.name.cmp(&b.name));
            t
        },
        tenant_values: if set.tenant_source.api_key.is_some() {
            Vec::new()
        } else {
            let mut v: Vec<_> = set
                .tenants
                .iter()
                .map(|t| TenantValueEntry {
                    value: t.header_value.clone().unwrap_or_else(|| t.name.clone()),
                    tenant: t.name.clone(),
                })
                .collect();
            v.sort_by(|a, b| a.value.cmp(&b.value));
            v
        },
        api_keys: if set.tenant_source.api_key.is_some() {
            let mut v: Vec<_> = set
                .tenants
                .iter()
                .flat_map(|t| {
                    t.api_key_hashes.iter().map(|h| ApiKeyEntry {
                        hash: h.clone(),
                        tenant: t.name.clone(),
                    })
                })
                .collect();
            v.sort_by(|a, b| a.hash.cmp(&b.hash));
            v
        } else {
            Vec::new()
        },
        pools: {
            let mut v: Vec<_> = set
                .pools
                .iter()
                .map(|p| PoolConfig {
                    name: p.name.clone(),
                    models: sorted(p.models.iter().cloned()),
                    cluster: p.cluster.clone(),
                    indexer_cluster: p.indexer_cluster.clone(),
                    indexer_pool: p.indexer_pool.clone().unwrap_or_else(|| p.name.clone()),
                    indexer_timeout_ms: p.indexer_timeout_ms.unwrap_or(DEFAULT_INDEXER_TIMEOUT_MS),
                    max_queue_wait_ms: crate::flow::max_queue_wait_ms(p.flow_control.as_ref()),
                    report_first_token: crate::flow::counts_prefill_work(p.flow_control.as_ref()),
                })
                .collect();
            v.sort_by(|a, b| a.name.cmp(&b.name));
            v
        },
        providers,
        classification: ClassificationConfig {
            pii_detectors: sorted(
                set.classification
                    .pii_detectors
                    .clone()
                    .unwrap_or_else(|| PiiKinds::all().iter().collect()),
            ),
            easy_max_prompt_tokens: set
                .classification
                .easy
                .and_then(|e| e.max_prompt_tokens)
                .unwrap_or(DEFAULT_EASY_MAX_PROMPT_TOKENS),
            easy_no_code_fences: set
                .classification
                .easy
                .and_then(|e| e.no_code_fences)
                .unwrap_or(true),
        },
        pool_state_max_age_ms: set
            .pool_state_max_age_ms
            .unwrap_or(DEFAULT_POOL_STATE_MAX_AGE_MS),
        gateway_replicas: set.gateway_replicas.unwrap_or(1),
        policies: set
            .policies
            .iter()
            .map(|p| PolicyConfig {
                name: p.name.clone(),
                pii_guard: p.pii_guard,
                match_: match_config(set, &p.match_),
                action: action_config(set, &p.action),
            })
            .collect(),
        default_action: action_config(set, &set.default_action),
    };
    FilterConfig::from_doc(doc).map_err(|e| {
        // Validation should have caught it: a bug, but still an answer.
        vec![error("", format!("internal: compiled config refused: {e}"))]
    })
}

use crate::pii::PiiKinds;

fn error(path: impl Into<String>, message: impl Into<String>) -> ValidationError {
    ValidationError {
        path: path.into(),
        message: message.into(),
        severity: Severity::Error,
    }
}

fn sorted<T: Ord>(it: impl IntoIterator<Item = T>) -> Vec<T> {
    it.into_iter()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

fn tenant_source(s: &TenantSource) -> TenantSourceConfig {
    let (kind, header, claim, meta) = if let Some(h) = &s.header {
        (
            TenantSourceKind::Header,
            Some(h.to_ascii_lowercase()),
            None,
            None,
        )
    } else if let Some(j) = &s.jwt_claim {
        (
            TenantSourceKind::JwtClaim,
            j.header.as_ref().map(|h| h.to_ascii_lowercase()),
            Some(j.claim.clone()),
            j.payload_in_metadata.clone(),
        )
    } else {
        (TenantSourceKind::ApiKey, None, None, None)
    };
    let tenant_header = match kind {
        TenantSourceKind::Header => header.clone().unwrap_or_default(),
        _ => s
            .tenant_header
            .as_deref()
            .unwrap_or(DEFAULT_TENANT_HEADER)
            .to_ascii_lowercase(),
    };
    TenantSourceConfig {
        kind,
        header,
        jwt_claim: claim,
        jwt_metadata_key: meta,
        unknown_tenant: s.unknown_tenant.unwrap_or(UnknownTenant::Reject),
        default_tenant: s.default_tenant.clone(),
        tenant_header,
        on_tenant_header: s.on_tenant_header.unwrap_or(OnTenantHeader::Ignore),
    }
}

fn match_config(set: &PolicySet, m: &Match) -> MatchConfig {
    MatchConfig {
        tenants: tenant_scope(set, m).map(|s| s.into_iter().collect()),
        models: m.models.as_ref().map(|ms| ModelsConfig {
            exact: sorted(ms.iter().filter(|x| !is_glob(x)).cloned()),
            globs: sorted(ms.iter().filter(|x| is_glob(x)).cloned()),
        }),
        apis: m.apis.as_ref().map(|a| sorted(a.iter().copied())),
        headers: m
            .headers
            .as_ref()
            .map(|hs| {
                sorted(hs.iter().map(|h| HeaderMatch {
                    name: h.name.to_ascii_lowercase(),
                    ..h.clone()
                }))
            })
            .unwrap_or_default(),
        prompt_tokens: m.prompt_tokens.map(|r| TokenRangeConfig {
            min: r.min.unwrap_or(0),
            max: r.max.unwrap_or(u32::MAX),
        }),
        pii: m.pii,
        easy: m.easy,
        pool_state: m.pool_state.as_ref().map(|p| PoolStateConfig {
            pool: p.pool.clone(),
            above: p.saturation_above,
            below: p.saturation_below,
        }),
    }
}

fn action_config(set: &PolicySet, a: &Action) -> ActionConfig {
    match a {
        Action::Route(r) => ActionConfig::Route(RouteConfig {
            pool: r.pool.clone(),
            rewrite_model: r.rewrite_model.clone(),
            priority: r.priority.unwrap_or(0),
            include_usage: r.include_usage.unwrap_or(false),
        }),
        Action::Reject(r) => ActionConfig::Reject(RejectConfig {
            status: r.status,
            message: r
                .message
                .clone()
                .unwrap_or_else(|| DEFAULT_REJECT_MESSAGE.to_owned()),
        }),
        Action::Provider(p) => ActionConfig::Provider(ProviderActionConfig {
            provider: p.provider.clone(),
            rewrite_model: p.rewrite_model.clone().or_else(|| {
                set.providers
                    .iter()
                    .find(|x| x.name == p.provider)
                    .and_then(|x| x.model.clone())
            }),
            include_usage: p.include_usage.unwrap_or(false),
        }),
        Action::Shed(s) => ActionConfig::Shed(ShedConfig {
            retry_after_s: s.retry_after_s,
            message: s
                .message
                .clone()
                .unwrap_or_else(|| DEFAULT_SHED_MESSAGE.to_owned()),
        }),
    }
}
