//! Validation of a [`PolicySet`], with exact paths.
//!
//! Paths are JSON-pointer-ish, the way serde_path_to_error writes them
//! (`policies[2].match.models[0]`), so a parse error and a validation error
//! point at things the same way and `kvasirctl` can show either next to the
//! source line.

use std::collections::{BTreeMap, BTreeSet};

use crate::glob::Glob;
use crate::scope::{scope_overlaps, tenant_scope};
use crate::syntax::{is_header_name, is_header_value, is_key_hash, is_model_name, is_name};
use crate::types::*;

pub use crate::diagnostic::{Severity, ValidationError};

/// Default of [`TenantSource::tenant_header`].
pub const DEFAULT_TENANT_HEADER: &str = "x-tenant";

/// Checks a policy set; `Err` holds every error (warnings are left out:
/// see [`check`]).
pub fn validate(set: &PolicySet) -> Result<(), Vec<ValidationError>> {
    let errors: Vec<_> = check(set)
        .into_iter()
        .filter(|e| e.severity == Severity::Error)
        .collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// Every finding, errors and warnings, in document order.
pub fn check(set: &PolicySet) -> Vec<ValidationError> {
    let mut v = Checker {
        set,
        out: Vec::new(),
    };
    v.run();
    v.out
}

struct Checker<'a> {
    set: &'a PolicySet,
    out: Vec<ValidationError>,
}

/// Most Envoy replicas a policy set may name (`gatewayReplicas`).
pub const MAX_GATEWAY_REPLICAS: u32 = 1000;

const NAME_RULE: &str =
    "use lowercase letters, digits and `-` (at most 63, starting and ending with a letter or digit)";

fn action_kind(a: &Action) -> &'static str {
    match a {
        Action::Route(_) => "route",
        Action::Reject(_) => "reject",
        Action::Provider(_) => "provider",
        Action::Shed(_) => "shed",
    }
}

impl Checker<'_> {
    fn err(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.out.push(ValidationError {
            path: path.into(),
            message: message.into(),
            severity: Severity::Error,
        });
    }

    fn warn(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.out.push(ValidationError {
            path: path.into(),
            message: message.into(),
            severity: Severity::Warning,
        });
    }

    fn name(&mut self, path: String, what: &str, name: &str) {
        if !is_name(name) {
            self.err(
                path,
                format!("`{name}` is not a valid {what} name: {NAME_RULE}"),
            );
        }
    }

    fn run(&mut self) {
        self.tenants();
        self.out.extend(crate::budget::check(self.set));
        self.out.extend(crate::flow::check(self.set));
        self.tenant_source();
        self.pools();
        self.providers();
        self.classification();
        if self.set.pool_state_max_age_ms == Some(0) {
            self.err("poolStateMaxAgeMs", "must be at least 1 ms");
        }
        if self
            .set
            .gateway_replicas
            .is_some_and(|n| !(1..=MAX_GATEWAY_REPLICAS).contains(&n))
        {
            self.err(
                "gatewayReplicas",
                format!("must be between 1 and {MAX_GATEWAY_REPLICAS}"),
            );
        }
        self.policies();
        let default = &self.set.default_action;
        self.action("defaultAction", default);
    }

    fn tenants(&mut self) {
        let set = self.set;
        let mut names: BTreeMap<&str, usize> = BTreeMap::new();
        let mut values: BTreeMap<&str, usize> = BTreeMap::new();
        let mut hashes: BTreeMap<&str, usize> = BTreeMap::new();
        let api_key_source = set.tenant_source.api_key.is_some();
        for (i, t) in set.tenants.iter().enumerate() {
            let p = format!("tenants[{i}]");
            self.name(format!("{p}.name"), "tenant", &t.name);
            if let Some(&k) = names.get(t.name.as_str()) {
                self.err(
                    format!("{p}.name"),
                    format!("duplicate tenant `{}` (also tenants[{k}])", t.name),
                );
            } else {
                names.insert(&t.name, i);
            }
            if let Some(c) = &t.class {
                self.name(format!("{p}.class"), "class", c);
            }
            let value = t.header_value.as_deref().unwrap_or(&t.name);
            if let Some(hv) = &t.header_value {
                if hv.is_empty() || !is_header_value(hv) || hv.trim() != hv {
                    self.err(
                        format!("{p}.headerValue"),
                        "must be non-empty, without surrounding spaces or control characters",
                    );
                }
            }
            if let Some(&k) = values.get(value) {
                let path = if t.header_value.is_some() {
                    format!("{p}.headerValue")
                } else {
                    format!("{p}.name")
                };
                self.err(
                    path,
                    format!("tenant value `{value}` also identifies tenants[{k}]"),
                );
            } else {
                values.insert(value, i);
            }
            for (j, h) in t.api_key_hashes.iter().enumerate() {
                let hp = format!("{p}.apiKeyHashes[{j}]");
                if !is_key_hash(h) {
                    self.err(hp, "must be `sha256:` followed by 64 lowercase hex digits (the SHA-256 of the key; never the key itself)");
                    continue;
                }
                match hashes.get(h.as_str()) {
                    Some(&k) if k == i => self.err(hp, "duplicate key hash"),
                    Some(&k) => self.err(
                        hp,
                        format!("the same key hash also belongs to tenants[{k}]: a key must identify one tenant"),
                    ),
                    None => {
                        hashes.insert(h, i);
                    }
                }
            }
            if api_key_source && t.api_key_hashes.is_empty() {
                let is_default = set.tenant_source.default_tenant.as_deref() == Some(&t.name);
                if !is_default {
                    self.warn(
                        format!("{p}.apiKeyHashes"),
                        "no API key hashes: with the `apiKey` tenant source this tenant can never be identified",
                    );
                }
            }
            if !api_key_source && !t.api_key_hashes.is_empty() {
                self.warn(
                    format!("{p}.apiKeyHashes"),
                    "unused: the tenant source is not `apiKey`",
                );
            }
        }
    }

    fn tenant_source(&mut self) {
        let s = &self.set.tenant_source;
        let p = "tenantSource";
        let n = [
            s.header.is_some(),
            s.api_key.is_some(),
            s.jwt_claim.is_some(),
        ]
        .iter()
        .filter(|&&x| x)
        .count();
        if n != 1 {
            self.err(p, "set exactly one of `header`, `apiKey`, `jwtClaim`");
        }
        if let Some(h) = &s.header {
            if !is_header_name(h) {
                self.err(
                    format!("{p}.header"),
                    format!("`{h}` is not a valid header name"),
                );
            }
            if s.tenant_header.is_some() {
                self.err(
                    format!("{p}.tenantHeader"),
                    "only applies to the `apiKey` and `jwtClaim` sources (with `header`, that header is the source)",
                );
            }
            if s.on_tenant_header.is_some() {
                self.err(
                    format!("{p}.onTenantHeader"),
                    "only applies to the `apiKey` and `jwtClaim` sources (with `header`, that header is the source)",
                );
            }
        }
        let tenant_header = s.tenant_header.as_deref().unwrap_or(DEFAULT_TENANT_HEADER);
        if let Some(th) = &s.tenant_header {
            if !is_header_name(th) {
                self.err(
                    format!("{p}.tenantHeader"),
                    format!("`{th}` is not a valid header name"),
                );
            }
        }
        if let Some(j) = &s.jwt_claim {
            let jp = format!("{p}.jwtClaim");
            if j.claim.is_empty() {
                self.err(format!("{jp}.claim"), "the claim name is required");
            }
            match (&j.header, &j.payload_in_metadata) {
                (Some(h), None) => {
                    if !is_header_name(h) {
                        self.err(
                            format!("{jp}.header"),
                            format!("`{h}` is not a valid header name"),
                        );
                    } else if h.eq_ignore_ascii_case(tenant_header) {
                        self.err(
                            format!("{jp}.header"),
                            format!("must differ from the client tenant header `{tenant_header}`, which is never trusted"),
                        );
                    }
                }
                (None, Some(k)) => {
                    if k.is_empty() {
                        self.err(format!("{jp}.payloadInMetadata"), "must not be empty");
                    }
                }
                _ => self.err(jp, "set exactly one of `header`, `payloadInMetadata`"),
            }
        }
        let mode = s.unknown_tenant.unwrap_or(UnknownTenant::Reject);
        match (&s.default_tenant, mode) {
            (None, UnknownTenant::Default) => self.err(
                format!("{p}.defaultTenant"),
                "required with `unknownTenant: default`",
            ),
            (Some(_), UnknownTenant::Reject) => self.err(
                format!("{p}.defaultTenant"),
                "only used with `unknownTenant: default`",
            ),
            (Some(d), UnknownTenant::Default) => {
                if !self.set.tenants.iter().any(|t| &t.name == d) {
                    self.err(
                        format!("{p}.defaultTenant"),
                        format!("unknown tenant `{d}`"),
                    );
                }
            }
            (None, UnknownTenant::Reject) => {}
        }
        if s.api_key.is_some()
            && mode == UnknownTenant::Reject
            && self.set.tenants.iter().all(|t| t.api_key_hashes.is_empty())
        {
            self.warn(
                p,
                "no tenant has API key hashes: every request will be rejected",
            );
        }
    }

    fn pools(&mut self) {
        let mut names: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, pool) in self.set.pools.iter().enumerate() {
            let p = format!("pools[{i}]");
            self.name(format!("{p}.name"), "pool", &pool.name);
            if let Some(&k) = names.get(pool.name.as_str()) {
                self.err(
                    format!("{p}.name"),
                    format!("duplicate pool `{}` (also pools[{k}])", pool.name),
                );
            } else {
                names.insert(&pool.name, i);
            }
            if pool.models.is_empty() {
                self.err(format!("{p}.models"), "a pool serves at least one model");
            }
            let mut seen = BTreeSet::new();
            for (j, m) in pool.models.iter().enumerate() {
                if !is_model_name(m) {
                    self.err(
                        format!("{p}.models[{j}]"),
                        "a model name is non-empty and has no whitespace, control characters, `*` or `?`",
                    );
                } else if !seen.insert(m) {
                    self.err(format!("{p}.models[{j}]"), format!("duplicate model `{m}`"));
                }
            }
            self.cluster(
                format!("{p}.cluster"),
                &pool.cluster,
                "a pool needs an Envoy cluster",
            );
            self.cluster(
                format!("{p}.indexerCluster"),
                &pool.indexer_cluster,
                "a pool needs the Envoy cluster of its indexer",
            );
            if let Some(ip) = &pool.indexer_pool {
                if ip.is_empty() {
                    self.err(
                        format!("{p}.indexerPool"),
                        "must not be empty (omit it to use the pool's name)",
                    );
                }
            }
            if let Some(t) = pool.indexer_timeout_ms {
                if !(1..=5000).contains(&t) {
                    self.err(
                        format!("{p}.indexerTimeoutMs"),
                        format!("{t} is outside 1..=5000 ms (the pick must be short; the filter fails open after it)"),
                    );
                }
            }
        }
    }

    fn cluster(&mut self, path: String, c: &str, missing: &str) {
        if c.is_empty() {
            self.err(path, missing);
        } else if c
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
        {
            self.err(path, format!("`{c}` is not a valid Envoy cluster name"));
        }
    }

    fn providers(&mut self) {
        let mut names: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, pr) in self.set.providers.iter().enumerate() {
            let p = format!("providers[{i}]");
            self.name(format!("{p}.name"), "provider", &pr.name);
            if let Some(&k) = names.get(pr.name.as_str()) {
                self.err(
                    format!("{p}.name"),
                    format!("duplicate provider `{}` (also providers[{k}])", pr.name),
                );
            } else {
                names.insert(&pr.name, i);
            }
            self.cluster(
                format!("{p}.cluster"),
                &pr.cluster,
                "a provider needs an Envoy cluster",
            );
            if let Some(a) = &pr.authority {
                if a.is_empty()
                    || a.bytes()
                        .any(|b| b.is_ascii_whitespace() || b.is_ascii_control() || b == b'/')
                {
                    self.err(
                        format!("{p}.authority"),
                        format!("`{a}` is not a valid host[:port]"),
                    );
                }
            }
            if let Some(m) = &pr.model {
                if !is_model_name(m) {
                    self.err(format!("{p}.model"), "a model name is non-empty and has no whitespace, control characters, `*` or `?`");
                }
            }
            if let Some(auth) = &pr.auth {
                let ap = format!("{p}.auth");
                if !is_header_name(&auth.header) || auth.header.starts_with(':') {
                    self.err(
                        format!("{ap}.header"),
                        format!("`{}` is not a valid header name", auth.header),
                    );
                }
                if auth.value.is_some() {
                    // Never echo the value: it is a credential.
                    self.err(
                        format!("{ap}.value"),
                        "credentials are not allowed in a policy: they would be written in clear text into the filter configuration; reference a Secret with `secretRef` and let Envoy inject it (README, Security)",
                    );
                }
                match &auth.secret_ref {
                    Some(r) => {
                        if r.name.is_empty() {
                            self.err(format!("{ap}.secretRef.name"), "must not be empty");
                        }
                        if r.key.is_empty() {
                            self.err(format!("{ap}.secretRef.key"), "must not be empty");
                        }
                    }
                    None if auth.value.is_none() => self.err(format!("{ap}.secretRef"), "required"),
                    None => {}
                }
            }
        }
    }

    fn classification(&mut self) {
        let c = &self.set.classification;
        if let Some(d) = &c.pii_detectors {
            if d.is_empty() {
                self.err(
                    "classification.piiDetectors",
                    "at least one detector (omit the field to run all)",
                );
            }
            let mut seen = BTreeSet::new();
            for (j, k) in d.iter().enumerate() {
                if !seen.insert(*k) {
                    self.err(
                        format!("classification.piiDetectors[{j}]"),
                        "duplicate detector",
                    );
                }
            }
        }
        if let Some(e) = &c.easy {
            if e.max_prompt_tokens == Some(0) {
                self.err("classification.easy.maxPromptTokens", "must be at least 1");
            }
        }
    }

    fn policies(&mut self) {
        let set = self.set;
        let mut names: BTreeMap<&str, usize> = BTreeMap::new();
        let guards: Vec<usize> = set
            .policies
            .iter()
            .enumerate()
            .filter(|(_, p)| p.pii_guard)
            .map(|(i, _)| i)
            .collect();
        // First catch-all of each kind so far: a non-provider one ends the
        // list; a provider one ends it except for PII traffic that a guard
        // keeps inside.
        let mut catch_all_inside: Option<usize> = None;
        let mut catch_all_provider: Option<usize> = None;
        for (i, pol) in set.policies.iter().enumerate() {
            let p = format!("policies[{i}]");
            self.name(format!("{p}.name"), "policy", &pol.name);
            if let Some(&k) = names.get(pol.name.as_str()) {
                self.err(
                    format!("{p}.name"),
                    format!("duplicate policy `{}` (also policies[{k}])", pol.name),
                );
            } else {
                names.insert(&pol.name, i);
            }
            self.match_(&format!("{p}.match"), &pol.match_);
            self.action(&format!("{p}.action"), &pol.action);
            if pol.pii_guard {
                if pol.action.is_provider() {
                    self.err(
                        format!("{p}.piiGuard"),
                        "a PII guard keeps PII inside, so its action cannot be `provider`",
                    );
                }
                if pol.match_.pii == Some(false) {
                    self.warn(
                        format!("{p}.match.pii"),
                        "a PII guard with `pii: false` is never chosen for PII requests (its scope still keeps them from providers)",
                    );
                }
            }
            if let Some(k) = catch_all_inside {
                let other = &set.policies[k].name;
                if pol.pii_guard {
                    self.warn(
                        p.clone(),
                        format!("never chosen: policies[{k}] (`{other}`) matches every request; as a PII guard its scope still keeps PII away from providers"),
                    );
                } else {
                    self.err(
                        p.clone(),
                        format!("unreachable: policies[{k}] (`{other}`) matches every request"),
                    );
                }
            } else if let Some(k) = catch_all_provider {
                let other = &set.policies[k].name;
                if guards.is_empty() || pol.action.is_provider() {
                    self.err(
                        p.clone(),
                        format!("unreachable: policies[{k}] (`{other}`) sends every request to a provider"),
                    );
                } else {
                    self.warn(
                        p.clone(),
                        format!("reached only by PII requests inside a PII guard's scope: policies[{k}] (`{other}`) sends every other request to a provider"),
                    );
                }
            }
            if pol.match_.is_catch_all() {
                if pol.action.is_provider() {
                    catch_all_provider.get_or_insert(i);
                } else {
                    catch_all_inside.get_or_insert(i);
                }
            }
            // A provider policy ahead of an overlapping guard: legal (the
            // guard wins for PII), but the author may expect the order to
            // decide, so say what happens.
            if pol.action.is_provider() {
                if let Some(&g) = guards
                    .iter()
                    .find(|&&g| g > i && scope_overlaps(set, &pol.match_, &set.policies[g].match_))
                {
                    self.warn(
                        p.clone(),
                        format!(
                            "sends to a provider ahead of PII guard policies[{g}] (`{}`): PII requests in that guard's scope skip this policy",
                            set.policies[g].name
                        ),
                    );
                }
            }
        }
    }

    fn match_(&mut self, p: &str, m: &Match) {
        let set = self.set;
        if let Some(ts) = &m.tenants {
            if ts.is_empty() {
                self.err(
                    format!("{p}.tenants"),
                    "an empty list matches nothing; omit the field to match any tenant",
                );
            }
            for (j, t) in ts.iter().enumerate() {
                if !set.tenants.iter().any(|x| &x.name == t) {
                    self.err(format!("{p}.tenants[{j}]"), format!("unknown tenant `{t}`"));
                }
            }
        }
        if let Some(cs) = &m.tenant_classes {
            if cs.is_empty() {
                self.err(
                    format!("{p}.tenantClasses"),
                    "an empty list matches nothing; omit the field to match any class",
                );
            }
            for (j, c) in cs.iter().enumerate() {
                if !set.tenants.iter().any(|x| x.class.as_ref() == Some(c)) {
                    self.err(
                        format!("{p}.tenantClasses[{j}]"),
                        format!("no tenant has class `{c}`"),
                    );
                }
            }
        }
        if m.tenants.as_ref().is_some_and(|t| !t.is_empty())
            && m.tenant_classes.as_ref().is_some_and(|c| !c.is_empty())
            && tenant_scope(set, m).is_some_and(|s| s.is_empty())
        {
            self.err(
                p,
                "no tenant in `tenants` has a class in `tenantClasses` (both must hold): the policy never matches",
            );
        }
        if let Some(ms) = &m.models {
            if ms.is_empty() {
                self.err(
                    format!("{p}.models"),
                    "an empty list matches nothing; omit the field to match any model",
                );
            }
            for (j, pat) in ms.iter().enumerate() {
                if let Err(e) = Glob::parse(pat) {
                    self.err(format!("{p}.models[{j}]"), format!("bad glob `{pat}`: {e}"));
                }
            }
        }
        if let Some(a) = &m.apis {
            if a.is_empty() {
                self.err(
                    format!("{p}.apis"),
                    "an empty list matches nothing; omit the field to match any API",
                );
            }
        }
        if let Some(hs) = &m.headers {
            for (j, h) in hs.iter().enumerate() {
                let hp = format!("{p}.headers[{j}]");
                if !is_header_name(&h.name) {
                    self.err(
                        format!("{hp}.name"),
                        format!("`{}` is not a valid header name", h.name),
                    );
                }
                let n = [h.exact.is_some(), h.prefix.is_some(), h.present.is_some()]
                    .iter()
                    .filter(|&&x| x)
                    .count();
                if n != 1 {
                    self.err(hp, "set exactly one of `exact`, `prefix`, `present`");
                }
            }
        }
        if let Some(r) = &m.prompt_tokens {
            match (r.min, r.max) {
                (None, None) => self.err(format!("{p}.promptTokens"), "set `min`, `max` or both"),
                (Some(a), Some(b)) if a > b => self.err(
                    format!("{p}.promptTokens"),
                    format!("`min` ({a}) is greater than `max` ({b})"),
                ),
                _ => {}
            }
        }
        if let Some(ps) = &m.pool_state {
            let pp = format!("{p}.poolState");
            if !set.pools.iter().any(|x| x.name == ps.pool) {
                self.err(format!("{pp}.pool"), format!("unknown pool `{}`", ps.pool));
            }
            for (field, t) in [
                ("saturationAbove", ps.saturation_above),
                ("saturationBelow", ps.saturation_below),
            ] {
                if let Some(t) = t {
                    if !(0.0..=1.0).contains(&t) {
                        self.err(
                            format!("{pp}.{field}"),
                            format!("threshold {t} is outside [0, 1]"),
                        );
                    }
                }
            }
            match (ps.saturation_above, ps.saturation_below) {
                (None, None) => self.err(pp, "set `saturationAbove`, `saturationBelow` or both"),
                (Some(a), Some(b)) if a >= b => self.err(
                    pp,
                    format!(
                        "empty band: saturationAbove ({a}) must be below saturationBelow ({b})"
                    ),
                ),
                _ => {}
            }
        }
    }

    fn action(&mut self, p: &str, a: &Action) {
        let set = self.set;
        let p = format!("{p}.{}", action_kind(a));
        match a {
            Action::Route(r) => match set.pools.iter().find(|x| x.name == r.pool) {
                None => self.err(format!("{p}.pool"), format!("unknown pool `{}`", r.pool)),
                Some(pool) => {
                    if let Some(m) = &r.rewrite_model {
                        if !pool.models.contains(m) {
                            self.err(
                                format!("{p}.rewriteModel"),
                                format!(
                                    "pool `{}` does not serve model `{m}` (it serves: {})",
                                    pool.name,
                                    pool.models.join(", ")
                                ),
                            );
                        }
                    }
                }
            },
            Action::Reject(r) => {
                if !(400..=599).contains(&r.status) {
                    self.err(
                        format!("{p}.status"),
                        format!("status {} is not a 4xx or 5xx code", r.status),
                    );
                }
                self.message(&p, &r.message);
            }
            Action::Provider(pa) => {
                if !set.providers.iter().any(|x| x.name == pa.provider) {
                    self.err(
                        format!("{p}.provider"),
                        format!("unknown provider `{}`", pa.provider),
                    );
                }
                if let Some(m) = &pa.rewrite_model {
                    if !is_model_name(m) {
                        self.err(format!("{p}.rewriteModel"), "a model name is non-empty and has no whitespace, control characters, `*` or `?`");
                    }
                }
            }
            Action::Shed(s) => {
                if !(1..=3600).contains(&s.retry_after_s) {
                    self.err(
                        format!("{p}.retryAfterS"),
                        format!("{} is outside 1..=3600 seconds", s.retry_after_s),
                    );
                }
                self.message(&p, &s.message);
            }
        }
    }

    fn message(&mut self, p: &str, m: &Option<String>) {
        if let Some(m) = m {
            if m.len() > 1024 || m.chars().any(|c| c.is_control() && c != '\n') {
                self.err(
                    format!("{p}.message"),
                    "at most 1024 bytes, no control characters",
                );
            }
        }
    }
}
