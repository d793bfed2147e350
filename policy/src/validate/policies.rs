//! What is done with a request: the classifier, the policies' matches and
//! actions, and the default action.

use std::collections::{BTreeMap, BTreeSet};

use super::*;

impl Checker<'_> {
    pub(super) fn classification(&mut self) {
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

    pub(super) fn policies(&mut self) {
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

    pub(super) fn match_(&mut self, p: &str, m: &Match) {
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

    pub(super) fn action(&mut self, p: &str, a: &Action) {
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

    pub(super) fn message(&mut self, p: &str, m: &Option<String>) {
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
