//! Where requests go: the pools of engines and the external providers.

use std::collections::{BTreeMap, BTreeSet};

use super::*;

impl Checker<'_> {
    pub(super) fn pools(&mut self) {
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

    pub(super) fn cluster(&mut self, path: String, c: &str, missing: &str) {
        if c.is_empty() {
            self.err(path, missing);
        } else if c
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
        {
            self.err(path, format!("`{c}` is not a valid Envoy cluster name"));
        }
    }

    pub(super) fn providers(&mut self) {
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
}
