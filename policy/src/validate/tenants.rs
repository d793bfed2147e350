//! Who a request is for: the tenants, their keys and classes, and where
//! the tenant is read from.

use std::collections::BTreeMap;

use super::*;

impl Checker<'_> {
    pub(super) fn tenants(&mut self) {
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

    pub(super) fn tenant_source(&mut self) {
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
}
