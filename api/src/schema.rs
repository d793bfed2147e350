//! OpenAPI schemas for the `kvasir-policy` types the CRDs embed (`match`,
//! `action`, `tenantSource`, `classification`, `budget`, `classBudgets`).
//!
//! Written by hand rather than derived, for two reasons: the policy crate
//! stays serde-only (it builds for wasm32 and knows nothing of Kubernetes),
//! and the API server can then reject what `kvasir_policy::validate` would
//! reject wherever OpenAPI can say it: enums, ranges, patterns, required
//! fields, and `x-kubernetes-validations` CEL rules for the one-of fields
//! (a structural schema cannot use `oneOf` for that). What needs the whole
//! set (unknown pools, unreachable policies, PII-guard rules) stays with
//! `kvasir_policy::validate`, reported in the resources' status.
//!
//! A test (`schema_matches_policy_types`) checks that every property listed
//! here is one serde accepts, so the schemas cannot drift from the types.

use kvasir_policy::budget::{MAX_CONCURRENT, MAX_OUTPUT_TOKENS, MAX_PER_MINUTE};
use kvasir_policy::flow::MAX_WEIGHT;
use schemars::{json_schema, Schema, SchemaGenerator};
use serde_json::{json, Value};

/// A DNS-1123 label: tenant, pool, provider, policy and class names.
pub const LABEL_PATTERN: &str = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$";
/// An HTTP header name (RFC 9110 token), or a pseudo-header.
pub const HEADER_PATTERN: &str = "^:?[A-Za-z0-9!#$%&'*+.^_`|~-]+$";
/// A model name: no whitespace, `*` or `?`.
pub const MODEL_PATTERN: &str = "^[^\\s*?]+$";

fn label() -> Value {
    json!({"type": "string", "maxLength": 63, "pattern": LABEL_PATTERN})
}

fn header_name() -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": 256, "pattern": HEADER_PATTERN})
}

fn model() -> Value {
    json!({"type": "string", "minLength": 1, "maxLength": 256, "pattern": MODEL_PATTERN})
}

fn message() -> Value {
    json!({"type": "string", "maxLength": 1024})
}

fn list(items: Value) -> Value {
    json!({"type": "array", "minItems": 1, "maxItems": 64, "items": items})
}

/// A CEL rule: exactly one of `fields` is set.
pub fn one_of_rule(fields: &[&str]) -> Value {
    let has: Vec<String> = fields.iter().map(|f| format!("has(self.{f})")).collect();
    let names: Vec<String> = fields.iter().map(|f| format!("`{f}`")).collect();
    json!({
        "rule": format!("[{}].exists_one(x, x)", has.join(", ")),
        "message": format!("set exactly one of {}", names.join(", ")),
    })
}

fn schema(v: Value) -> Schema {
    match Schema::try_from(v) {
        Ok(s) => s,
        // Only object literals reach here; an object is always a schema.
        Err(_) => json_schema!({"type": "object"}),
    }
}

fn match_value() -> Value {
    let header = json!({
        "type": "object",
        "required": ["name"],
        "properties": {
            "name": header_name(),
            "exact": {"type": "string", "maxLength": 4096},
            "prefix": {"type": "string", "maxLength": 4096},
            "present": {"type": "boolean"},
        },
        "x-kubernetes-validations": [one_of_rule(&["exact", "prefix", "present"])],
    });
    let u32_ = json!({"type": "integer", "format": "int64", "minimum": 0, "maximum": u32::MAX});
    let fraction = json!({"type": "number", "format": "double", "minimum": 0.0, "maximum": 1.0});
    json!({
        "description": "The conditions; all that are set must hold (lists are alternatives). An empty match matches every request.",
        "type": "object",
        "properties": {
            "tenants": list(label()),
            "tenantClasses": list(label()),
            "models": list(json!({"type": "string", "minLength": 1, "maxLength": 256})),
            "apis": list(json!({"type": "string", "enum": ["chat", "completions", "anthropicMessages", "anthropicCountTokens", "responses"]})),
            "headers": list(header),
            "promptTokens": {
                "type": "object",
                "properties": {"min": u32_, "max": u32_},
                "x-kubernetes-validations": [
                    {"rule": "has(self.min) || has(self.max)", "message": "set `min`, `max` or both"},
                    {"rule": "!has(self.min) || !has(self.max) || self.min <= self.max", "message": "`min` is greater than `max`"},
                ],
            },
            "pii": {"type": "boolean"},
            "easy": {"type": "boolean"},
            "poolState": {
                "type": "object",
                "required": ["pool"],
                "properties": {
                    "pool": label(),
                    "saturationAbove": fraction,
                    "saturationBelow": fraction,
                },
                "x-kubernetes-validations": [
                    {"rule": "has(self.saturationAbove) || has(self.saturationBelow)", "message": "set `saturationAbove`, `saturationBelow` or both"},
                    {"rule": "!has(self.saturationAbove) || !has(self.saturationBelow) || self.saturationAbove < self.saturationBelow", "message": "empty band: saturationAbove must be below saturationBelow"},
                ],
            },
        },
    })
}

fn action_value() -> Value {
    json!({
        "description": "What to do: exactly one of `route`, `reject`, `provider`, `shed`.",
        "type": "object",
        "properties": {
            "route": {
                "type": "object",
                "required": ["pool"],
                "properties": {
                    "pool": label(),
                    "rewriteModel": model(),
                    "priority": {"type": "integer", "format": "int32"},
                    "includeUsage": {"type": "boolean"},
                },
            },
            "reject": {
                "type": "object",
                "required": ["status"],
                "properties": {
                    "status": {"type": "integer", "format": "int32", "minimum": 400, "maximum": 599},
                    "message": message(),
                },
            },
            "provider": {
                "type": "object",
                "required": ["provider"],
                "properties": {
                    "provider": label(),
                    "rewriteModel": model(),
                    "includeUsage": {"type": "boolean"},
                },
            },
            "shed": {
                "type": "object",
                "required": ["retryAfterS"],
                "properties": {
                    "retryAfterS": {"type": "integer", "format": "int32", "minimum": 1, "maximum": 3600},
                    "message": message(),
                },
            },
        },
        "x-kubernetes-validations": [one_of_rule(&["route", "reject", "provider", "shed"])],
    })
}

fn tenant_source_value() -> Value {
    json!({
        "description": "Where a request's tenant comes from: exactly one of `header`, `apiKey`, `jwtClaim`.",
        "type": "object",
        "properties": {
            "header": header_name(),
            "apiKey": {"type": "object"},
            "jwtClaim": {
                "type": "object",
                "required": ["claim"],
                "properties": {
                    "claim": {"type": "string", "minLength": 1, "maxLength": 256},
                    "header": header_name(),
                    "payloadInMetadata": {"type": "string", "minLength": 1, "maxLength": 256},
                },
                "x-kubernetes-validations": [one_of_rule(&["header", "payloadInMetadata"])],
            },
            "unknownTenant": {"type": "string", "enum": ["reject", "default"]},
            "defaultTenant": label(),
            "tenantHeader": header_name(),
            "onTenantHeader": {"type": "string", "enum": ["ignore", "reject"]},
        },
        "x-kubernetes-validations": [
            one_of_rule(&["header", "apiKey", "jwtClaim"]),
            {"rule": "(has(self.unknownTenant) && self.unknownTenant == 'default') == has(self.defaultTenant)", "message": "`defaultTenant` is required with `unknownTenant: default` and only used with it"},
        ],
    })
}

fn classification_value() -> Value {
    json!({
        "description": "Settings of the prompt classifiers.",
        "type": "object",
        "properties": {
            "piiDetectors": {
                "type": "array",
                "minItems": 1,
                "maxItems": 5,
                "x-kubernetes-list-type": "set",
                "items": {"type": "string", "enum": ["email", "phone", "paymentCard", "iban", "nationalId"]},
            },
            "easy": {
                "type": "object",
                "properties": {
                    "maxPromptTokens": {"type": "integer", "format": "int64", "minimum": 1, "maximum": u32::MAX},
                    "noCodeFences": {"type": "boolean"},
                },
            },
        },
    })
}

fn budget_value() -> Value {
    let rate =
        json!({"type": "integer", "format": "int64", "minimum": 1, "maximum": MAX_PER_MINUTE});
    let limits = [
        "tokensPerMinute",
        "promptTokensPerMinute",
        "completionTokensPerMinute",
        "requestsPerMinute",
        "maxConcurrent",
    ];
    let any_limit: Vec<String> = limits.iter().map(|f| format!("has(self.{f})")).collect();
    json!({
        "description": "A token budget: rates per minute, reserved when a request is admitted (prompt tokens plus an output estimate) and settled to the real usage. At least one limit.",
        "type": "object",
        "properties": {
            "tokensPerMinute": rate,
            "promptTokensPerMinute": rate,
            "completionTokensPerMinute": rate,
            "requestsPerMinute": rate,
            "maxConcurrent": {"type": "integer", "format": "int32", "minimum": 1, "maximum": MAX_CONCURRENT},
            "cachedTokenWeight": {"type": "number", "format": "double", "minimum": 0.0, "maximum": 1.0},
            "defaultOutputTokens": {"type": "integer", "format": "int64", "minimum": 1, "maximum": MAX_OUTPUT_TOKENS},
        },
        "x-kubernetes-validations": [{
            "rule": any_limit.join(" || "),
            "message": format!("set one or more of {}", limits.map(|f| format!("`{f}`")).join(", ")),
        }],
    })
}

fn class_budgets_value() -> Value {
    json!({
        "description": "Default budgets by tenant class: a tenant of the class without a budget of its own gets this one, in a bucket of its own.",
        "type": "array",
        "maxItems": 64,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["class"],
        "items": {
            "type": "object",
            "required": ["class", "budget"],
            "properties": {"class": label(), "budget": budget_value()},
        },
    })
}

fn class_weights_value() -> Value {
    json!({
        "description": "Default fair-share weights by tenant class: a tenant of the class without a weight of its own gets this one.",
        "type": "array",
        "maxItems": 64,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["class"],
        "items": {
            "type": "object",
            "required": ["class", "weight"],
            "properties": {
                "class": label(),
                "weight": {"type": "integer", "format": "int32", "minimum": 1, "maximum": MAX_WEIGHT},
            },
        },
    })
}

/// Schema of `Option<Vec<kvasir_policy::ClassWeight>>`.
pub fn class_weights(_: &mut SchemaGenerator) -> Schema {
    schema(class_weights_value())
}

/// Schema of `Option<kvasir_policy::Budget>`.
pub fn budget(_: &mut SchemaGenerator) -> Schema {
    schema(budget_value())
}

/// Schema of `Option<Vec<kvasir_policy::ClassBudget>>`.
pub fn class_budgets(_: &mut SchemaGenerator) -> Schema {
    schema(class_budgets_value())
}

/// Schema of `kvasir_policy::Match`.
pub fn match_(_: &mut SchemaGenerator) -> Schema {
    schema(match_value())
}

/// Schema of `kvasir_policy::Action`.
pub fn action(_: &mut SchemaGenerator) -> Schema {
    schema(action_value())
}

/// Schema of `kvasir_policy::TenantSource`.
pub fn tenant_source(_: &mut SchemaGenerator) -> Schema {
    schema(tenant_source_value())
}

/// Schema of `Option<kvasir_policy::Classification>`.
pub fn classification(_: &mut SchemaGenerator) -> Schema {
    schema(classification_value())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_policy::{Action, Budget, ClassBudget, Classification, Match, TenantSource};
    use serde::de::DeserializeOwned;

    /// Every property in `schema` (recursively) must be accepted by `T`'s
    /// serde (which denies unknown fields), with a minimal value for each.
    fn accepts<T: DeserializeOwned>(schema: &Value, sample: Value) {
        let props = schema["properties"].as_object().expect("properties");
        for name in props.keys() {
            let mut v = sample.clone();
            if v.get(name).is_none() {
                continue;
            }
            v = json!({name: v[name].clone()});
            if let Err(e) = serde_json::from_value::<T>(v) {
                panic!("property `{name}`: {e}");
            }
        }
        let sample_keys: Vec<_> = sample.as_object().unwrap().keys().collect();
        let schema_keys: Vec<_> = props.keys().collect();
        assert_eq!(
            sample_keys, schema_keys,
            "schema and sample list the same fields"
        );
    }

    #[test]
    fn the_apis_enum_is_every_api_kind() {
        use kvasir_policy::ApiKind;
        let listed: Vec<ApiKind> =
            serde_json::from_value(match_value()["properties"]["apis"]["items"]["enum"].clone())
                .expect("every listed api is an ApiKind");
        // A match on ApiKind: a new kind fails to compile here until the
        // CRD's enum lists it too.
        for k in &listed {
            match k {
                ApiKind::Chat
                | ApiKind::Completions
                | ApiKind::AnthropicMessages
                | ApiKind::AnthropicCountTokens
                | ApiKind::Responses => {}
            }
        }
        assert_eq!(listed.len(), 5, "{listed:?}");
    }

    #[test]
    fn schema_matches_policy_types() {
        accepts::<Match>(
            &match_value(),
            json!({
                "tenants": ["a"], "tenantClasses": ["b"], "models": ["m"], "apis": ["chat"],
                "headers": [{"name": "x", "exact": "y"}], "promptTokens": {"min": 1},
                "pii": true, "easy": true, "poolState": {"pool": "p", "saturationAbove": 0.5},
            }),
        );
        for a in [
            json!({"route": {"pool": "p", "rewriteModel": "m", "priority": 1, "includeUsage": true}}),
            json!({"reject": {"status": 403, "message": "no"}}),
            json!({"provider": {"provider": "p", "rewriteModel": "m", "includeUsage": true}}),
            json!({"shed": {"retryAfterS": 3, "message": "busy"}}),
        ] {
            let key = a.as_object().unwrap().keys().next().unwrap().clone();
            let fields: Vec<_> = action_value()["properties"][&key]["properties"]
                .as_object()
                .unwrap()
                .keys()
                .cloned()
                .collect();
            let given: Vec<_> = a[&key].as_object().unwrap().keys().cloned().collect();
            let (mut f, mut g) = (fields, given);
            f.sort();
            g.sort();
            assert_eq!(f, g, "action `{key}` fields");
            serde_json::from_value::<Action>(a).unwrap();
        }
        accepts::<TenantSource>(
            &tenant_source_value(),
            json!({
                "header": "x-tenant", "apiKey": {}, "jwtClaim": {"claim": "c", "header": "h"},
                "unknownTenant": "default", "defaultTenant": "t", "tenantHeader": "x-t",
                "onTenantHeader": "ignore",
            }),
        );
        accepts::<Classification>(
            &classification_value(),
            json!({"piiDetectors": ["email", "phone", "paymentCard", "iban", "nationalId"],
                   "easy": {"maxPromptTokens": 5, "noCodeFences": false}}),
        );
        accepts::<Budget>(
            &budget_value(),
            json!({"tokensPerMinute": 1, "promptTokensPerMinute": 1, "completionTokensPerMinute": 1,
                   "requestsPerMinute": 1, "maxConcurrent": 1, "cachedTokenWeight": 0.5,
                   "defaultOutputTokens": 1}),
        );
        // Both fields are required, so the sample is read whole.
        let item = &class_budgets_value()["items"];
        let sample = json!({"class": "gold", "budget": {"maxConcurrent": 1}});
        let keys: Vec<_> = item["properties"].as_object().unwrap().keys().collect();
        assert_eq!(keys, sample.as_object().unwrap().keys().collect::<Vec<_>>());
        serde_json::from_value::<ClassBudget>(sample).unwrap();
        let item = &class_weights_value()["items"];
        let sample = json!({"class": "gold", "weight": 2});
        let keys: Vec<_> = item["properties"].as_object().unwrap().keys().collect();
        assert_eq!(keys, sample.as_object().unwrap().keys().collect::<Vec<_>>());
        serde_json::from_value::<kvasir_policy::ClassWeight>(sample).unwrap();
    }

    #[test]
    fn one_of_rule_is_cel_shaped() {
        let r = one_of_rule(&["a", "b"]);
        assert_eq!(r["rule"], "[has(self.a), has(self.b)].exists_one(x, x)");
    }
}
