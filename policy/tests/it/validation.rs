//! Validation: each finding with its exact path and message.

use crate::common;
use common::*;
use kvasir_policy::*;

const OK_DEFAULT: &str = r#"{"route": {"pool": "main"}}"#;
const H: &str = "sha256:f64df940e75359a440632480fb0bb219a66c8db9e108aa87fc8208436e460138";

fn errs(policies: &str) -> Vec<String> {
    findings(&base(policies, OK_DEFAULT))
}

fn pol(m: &str, action: &str) -> String {
    format!(r#"[{{"name": "p", "match": {m}, "action": {action}}}]"#)
}

#[test]
fn the_base_set_is_clean() {
    assert_eq!(errs("[]"), Vec::<String>::new());
    assert!(validate(&base("[]", OK_DEFAULT)).is_ok());
}

#[test]
fn match_references_and_lists() {
    assert_eq!(
        errs(&pol(r#"{"tenants": ["a", "nobody"], "tenantClasses": ["platinum"]}"#, OK_DEFAULT)),
        vec![
            "policies[0].match.tenants[1]: unknown tenant `nobody`",
            "policies[0].match.tenantClasses[0]: no tenant has class `platinum`",
            "policies[0].match: no tenant in `tenants` has a class in `tenantClasses` (both must hold): the policy never matches",
        ]
    );
    assert_eq!(
        errs(&pol(r#"{"tenants": ["c"], "tenantClasses": ["gold"]}"#, OK_DEFAULT)),
        vec!["policies[0].match: no tenant in `tenants` has a class in `tenantClasses` (both must hold): the policy never matches"]
    );
    assert_eq!(
        errs(&pol(r#"{"tenants": [], "models": [], "apis": [], "tenantClasses": []}"#, OK_DEFAULT)),
        vec![
            "policies[0].match.tenants: an empty list matches nothing; omit the field to match any tenant",
            "policies[0].match.tenantClasses: an empty list matches nothing; omit the field to match any class",
            "policies[0].match.models: an empty list matches nothing; omit the field to match any model",
            "policies[0].match.apis: an empty list matches nothing; omit the field to match any API",
        ]
    );
}

#[test]
fn bad_globs() {
    assert_eq!(
        errs(&pol(r#"{"models": ["ok-*", "llama-[38]b", "a**", "", "has space"]}"#, OK_DEFAULT)),
        vec![
            "policies[0].match.models[1]: bad glob `llama-[38]b`: `[` is not supported (only `*` and `?` are special)",
            "policies[0].match.models[2]: bad glob `a**`: `**` is not supported (use `*`)",
            "policies[0].match.models[3]: bad glob ``: empty pattern",
            "policies[0].match.models[4]: bad glob `has space`: whitespace or control characters are not allowed",
        ]
    );
}

#[test]
fn headers_tokens_and_pool_state() {
    assert_eq!(
        errs(&pol(
            r#"{"headers": [{"name": "bad header", "exact": "x"}, {"name": "x-a"}, {"name": "x-b", "exact": "1", "present": true}],
                "promptTokens": {"min": 9, "max": 3},
                "poolState": {"pool": "nope", "saturationAbove": 1.5, "saturationBelow": -0.1}}"#,
            OK_DEFAULT
        )),
        vec![
            "policies[0].match.headers[0].name: `bad header` is not a valid header name",
            "policies[0].match.headers[1]: set exactly one of `exact`, `prefix`, `present`",
            "policies[0].match.headers[2]: set exactly one of `exact`, `prefix`, `present`",
            "policies[0].match.promptTokens: `min` (9) is greater than `max` (3)",
            "policies[0].match.poolState.pool: unknown pool `nope`",
            "policies[0].match.poolState.saturationAbove: threshold 1.5 is outside [0, 1]",
            "policies[0].match.poolState.saturationBelow: threshold -0.1 is outside [0, 1]",
            "policies[0].match.poolState: empty band: saturationAbove (1.5) must be below saturationBelow (-0.1)",
        ]
    );
    assert_eq!(
        errs(&pol(
            r#"{"promptTokens": {}, "poolState": {"pool": "main"}}"#,
            OK_DEFAULT
        )),
        vec![
            "policies[0].match.promptTokens: set `min`, `max` or both",
            "policies[0].match.poolState: set `saturationAbove`, `saturationBelow` or both",
        ]
    );
}

#[test]
fn actions() {
    let cases = [
        (r#"{"route": {"pool": "gone"}}"#, "policies[0].action.route.pool: unknown pool `gone`"),
        (
            r#"{"route": {"pool": "alt", "rewriteModel": "m2"}}"#,
            "policies[0].action.route.rewriteModel: pool `alt` does not serve model `m2` (it serves: m1)",
        ),
        (r#"{"reject": {"status": 302}}"#, "policies[0].action.reject.status: status 302 is not a 4xx or 5xx code"),
        (r#"{"reject": {"status": 600}}"#, "policies[0].action.reject.status: status 600 is not a 4xx or 5xx code"),
        (
            r#"{"reject": {"status": 400, "message": "a\u0000b"}}"#,
            "policies[0].action.reject.message: at most 1024 bytes, no control characters",
        ),
        (r#"{"shed": {"retryAfterS": 0}}"#, "policies[0].action.shed.retryAfterS: 0 is outside 1..=3600 seconds"),
        (r#"{"provider": {"provider": "nobody"}}"#, "policies[0].action.provider.provider: unknown provider `nobody`"),
        (
            r#"{"provider": {"provider": "ext", "rewriteModel": "two words"}}"#,
            "policies[0].action.provider.rewriteModel: a model name is non-empty and has no whitespace, control characters, `*` or `?`",
        ),
    ];
    for (action, want) in cases {
        assert_eq!(
            errs(&pol(r#"{"models": ["m1"]}"#, action)),
            vec![want],
            "{action}"
        );
    }
    assert_eq!(
        findings(&base("[]", r#"{"route": {"pool": "gone"}}"#)),
        vec!["defaultAction.route.pool: unknown pool `gone`"]
    );
}

#[test]
fn policy_names_and_duplicates() {
    assert_eq!(
        errs(
            r#"[
              {"name": "Bad.Name", "match": {"models": ["m1"]}, "action": {"route": {"pool": "main"}}},
              {"name": "dup", "match": {"models": ["m2"]}, "action": {"route": {"pool": "main"}}},
              {"name": "dup", "match": {"models": ["m3"]}, "action": {"route": {"pool": "main"}}}
            ]"#
        ),
        vec![
            "policies[0].name: `Bad.Name` is not a valid policy name: use lowercase letters, digits and `-` (at most 63, starting and ending with a letter or digit)",
            "policies[2].name: duplicate policy `dup` (also policies[1])",
        ]
    );
}

#[test]
fn unreachable_after_a_catch_all() {
    assert_eq!(
        errs(
            r#"[
              {"name": "all", "action": {"route": {"pool": "main"}}},
              {"name": "later", "match": {"models": ["m1"]}, "action": {"reject": {"status": 403}}},
              {"name": "guard", "piiGuard": true, "match": {"tenants": ["a"]}, "action": {"route": {"pool": "alt"}}}
            ]"#
        ),
        vec![
            "policies[1]: unreachable: policies[0] (`all`) matches every request",
            "warning: policies[2]: never chosen: policies[0] (`all`) matches every request; as a PII guard its scope still keeps PII away from providers",
        ]
    );
    // A catch-all provider ends the list, except for guarded PII traffic.
    assert_eq!(
        errs(
            r#"[
              {"name": "all-out", "match": {}, "action": {"provider": {"provider": "ext"}}},
              {"name": "later", "match": {"models": ["m1"]}, "action": {"reject": {"status": 403}}}
            ]"#
        ),
        vec!["policies[1]: unreachable: policies[0] (`all-out`) sends every request to a provider"]
    );
    assert_eq!(
        errs(
            r#"[
              {"name": "all-out", "action": {"provider": {"provider": "ext"}}},
              {"name": "guard", "piiGuard": true, "match": {"tenants": ["a"]}, "action": {"route": {"pool": "alt"}}},
              {"name": "more-out", "match": {"models": ["m2"]}, "action": {"provider": {"provider": "ext"}}}
            ]"#
        ),
        vec![
            "warning: policies[0]: sends to a provider ahead of PII guard policies[1] (`guard`): PII requests in that guard's scope skip this policy",
            "warning: policies[1]: reached only by PII requests inside a PII guard's scope: policies[0] (`all-out`) sends every other request to a provider",
            "policies[2]: unreachable: policies[0] (`all-out`) sends every request to a provider",
        ]
    );
}

#[test]
fn pii_guard_rules() {
    assert_eq!(
        errs(r#"[{"name": "g", "piiGuard": true, "match": {"pii": false}, "action": {"provider": {"provider": "ext"}}}]"#),
        vec![
            "policies[0].piiGuard: a PII guard keeps PII inside, so its action cannot be `provider`",
            "warning: policies[0].match.pii: a PII guard with `pii: false` is never chosen for PII requests (its scope still keeps them from providers)",
        ]
    );
    // Provider ahead of an overlapping guard: a warning; a disjoint one: none.
    assert_eq!(
        errs(
            r#"[
              {"name": "out-gold", "match": {"tenantClasses": ["gold"], "easy": true}, "action": {"provider": {"provider": "ext"}}},
              {"name": "out-free", "match": {"tenants": ["c"]}, "action": {"provider": {"provider": "ext"}}},
              {"name": "out-m2", "match": {"models": ["m2"]}, "action": {"provider": {"provider": "ext"}}},
              {"name": "guard", "piiGuard": true, "match": {"tenants": ["a"], "models": ["m1", "x-*"], "pii": true}, "action": {"route": {"pool": "alt"}}},
              {"name": "out-after", "match": {"tenants": ["a"]}, "action": {"provider": {"provider": "ext"}}}
            ]"#
        ),
        vec!["warning: policies[0]: sends to a provider ahead of PII guard policies[3] (`guard`): PII requests in that guard's scope skip this policy"]
    );
}

fn with_tenants(tenants: &str, source: &str) -> Vec<String> {
    let mut set = base("[]", OK_DEFAULT);
    set.tenants = serde_json::from_str(tenants).unwrap();
    set.tenant_source = serde_json::from_str(source).unwrap();
    findings(&set)
}

#[test]
fn tenants() {
    assert_eq!(
        with_tenants(
            &format!(
                r#"[
                  {{"name": "acme", "class": "Gold", "apiKeyHashes": ["{H}", "sha256:ABC", "{H}"]}},
                  {{"name": "acme", "apiKeyHashes": ["{H}"]}},
                  {{"name": "-x", "apiKeyHashes": ["f64df940e75359a440632480fb0bb219a66c8db9e108aa87fc8208436e460138"]}}
                ]"#
            ),
            r#"{"apiKey": {}}"#
        ),
        vec![
            "tenants[0].class: `Gold` is not a valid class name: use lowercase letters, digits and `-` (at most 63, starting and ending with a letter or digit)",
            "tenants[0].apiKeyHashes[1]: must be `sha256:` followed by 64 lowercase hex digits (the SHA-256 of the key; never the key itself)",
            "tenants[0].apiKeyHashes[2]: duplicate key hash",
            "tenants[1].name: duplicate tenant `acme` (also tenants[0])",
            "tenants[1].name: tenant value `acme` also identifies tenants[0]",
            "tenants[1].apiKeyHashes[0]: the same key hash also belongs to tenants[0]: a key must identify one tenant",
            "tenants[2].name: `-x` is not a valid tenant name: use lowercase letters, digits and `-` (at most 63, starting and ending with a letter or digit)",
            "tenants[2].apiKeyHashes[0]: must be `sha256:` followed by 64 lowercase hex digits (the SHA-256 of the key; never the key itself)",
        ]
    );
    assert_eq!(
        with_tenants(
            r#"[{"name": "a", "headerValue": "team-b"}, {"name": "team-b"}, {"name": "c", "headerValue": " c"}]"#,
            r#"{"header": "x-tenant"}"#
        ),
        vec![
            "tenants[1].name: tenant value `team-b` also identifies tenants[0]",
            "tenants[2].headerValue: must be non-empty, without surrounding spaces or control characters",
        ]
    );
    assert_eq!(
        with_tenants(
            &format!(r#"[{{"name": "a", "apiKeyHashes": ["{H}"]}}, {{"name": "b"}}]"#),
            r#"{"header": "x-tenant"}"#
        ),
        vec!["warning: tenants[0].apiKeyHashes: unused: the tenant source is not `apiKey`"]
    );
    assert_eq!(
        with_tenants(r#"[{"name": "a"}]"#, r#"{"apiKey": {}}"#),
        vec![
            "warning: tenants[0].apiKeyHashes: no API key hashes: with the `apiKey` tenant source this tenant can never be identified",
            "warning: tenantSource: no tenant has API key hashes: every request will be rejected",
        ]
    );
}

#[test]
fn tenant_sources() {
    let t = r#"[{"name": "a"}, {"name": "b"}]"#;
    assert_eq!(
        with_tenants(t, "{}"),
        vec!["tenantSource: set exactly one of `header`, `apiKey`, `jwtClaim`"]
    );
    assert_eq!(
        with_tenants(t, r#"{"header": "x-tenant", "apiKey": {}}"#),
        vec![
            "warning: tenants[0].apiKeyHashes: no API key hashes: with the `apiKey` tenant source this tenant can never be identified",
            "warning: tenants[1].apiKeyHashes: no API key hashes: with the `apiKey` tenant source this tenant can never be identified",
            "tenantSource: set exactly one of `header`, `apiKey`, `jwtClaim`",
            "warning: tenantSource: no tenant has API key hashes: every request will be rejected",
        ]
    );
    assert_eq!(
        with_tenants(t, r#"{"header": "x tenant", "tenantHeader": "x-t", "onTenantHeader": "reject"}"#),
        vec![
            "tenantSource.header: `x tenant` is not a valid header name",
            "tenantSource.tenantHeader: only applies to the `apiKey` and `jwtClaim` sources (with `header`, that header is the source)",
            "tenantSource.onTenantHeader: only applies to the `apiKey` and `jwtClaim` sources (with `header`, that header is the source)",
        ]
    );
    assert_eq!(
        with_tenants(t, r#"{"jwtClaim": {"claim": "", "header": "X-Tenant"}}"#),
        vec![
            "tenantSource.jwtClaim.claim: the claim name is required",
            "tenantSource.jwtClaim.header: must differ from the client tenant header `x-tenant`, which is never trusted",
        ]
    );
    assert_eq!(
        with_tenants(
            t,
            r#"{"jwtClaim": {"claim": "org", "header": "x-org", "payloadInMetadata": "jwt"}}"#
        ),
        vec!["tenantSource.jwtClaim: set exactly one of `header`, `payloadInMetadata`"]
    );
    assert_eq!(
        with_tenants(t, r#"{"header": "x-tenant", "unknownTenant": "default"}"#),
        vec!["tenantSource.defaultTenant: required with `unknownTenant: default`"]
    );
    assert_eq!(
        with_tenants(
            t,
            r#"{"header": "x-tenant", "unknownTenant": "default", "defaultTenant": "zed"}"#
        ),
        vec!["tenantSource.defaultTenant: unknown tenant `zed`"]
    );
    assert_eq!(
        with_tenants(t, r#"{"header": "x-tenant", "defaultTenant": "a"}"#),
        vec!["tenantSource.defaultTenant: only used with `unknownTenant: default`"]
    );
}

#[test]
fn pools_and_providers() {
    let mut set = base("[]", OK_DEFAULT);
    set.pools = serde_json::from_str(
        r#"[
          {"name": "main", "models": [], "cluster": "", "indexerCluster": "idx"},
          {"name": "main", "models": ["m1", "m1", "bad model"], "cluster": "c 1", "indexerCluster": "", "indexerTimeoutMs": 0, "indexerPool": ""}
        ]"#,
    )
    .unwrap();
    set.providers = serde_json::from_str(
        r#"[
          {"name": "ext", "cluster": "", "authority": "a/b", "model": "",
           "auth": {"header": "x-key", "value": "a\r\nx-injected: 1"}},
          {"name": "ext", "cluster": "c", "auth": {"header": ":authority", "value": "v", "secretRef": {"name": "s", "key": "k"}}},
          {"name": "p3", "cluster": "c", "auth": {"header": "authorization", "secretRef": {"name": "", "key": ""}}}
        ]"#,
    )
    .unwrap();
    assert_eq!(
        findings(&set),
        vec![
            "pools[0].models: a pool serves at least one model",
            "pools[0].cluster: a pool needs an Envoy cluster",
            "pools[1].name: duplicate pool `main` (also pools[0])",
            "pools[1].models[1]: duplicate model `m1`",
            "pools[1].models[2]: a model name is non-empty and has no whitespace, control characters, `*` or `?`",
            "pools[1].cluster: `c 1` is not a valid Envoy cluster name",
            "pools[1].indexerCluster: a pool needs the Envoy cluster of its indexer",
            "pools[1].indexerPool: must not be empty (omit it to use the pool's name)",
            "pools[1].indexerTimeoutMs: 0 is outside 1..=5000 ms (the pick must be short; the filter fails open after it)",
            "providers[0].cluster: a provider needs an Envoy cluster",
            "providers[0].authority: `a/b` is not a valid host[:port]",
            "providers[0].model: a model name is non-empty and has no whitespace, control characters, `*` or `?`",
            "providers[0].auth.value: credentials are not allowed in a policy: they would be written in clear text into the filter configuration; reference a Secret with `secretRef` and let Envoy inject it (README, Security)",
            "providers[1].name: duplicate provider `ext` (also providers[0])",
            "providers[1].auth.header: `:authority` is not a valid header name",
            "providers[1].auth.value: credentials are not allowed in a policy: they would be written in clear text into the filter configuration; reference a Secret with `secretRef` and let Envoy inject it (README, Security)",
            "providers[2].auth.secretRef.name: must not be empty",
            "providers[2].auth.secretRef.key: must not be empty",
        ]
    );
    // The credential itself never appears in a message.
    assert!(findings(&set).iter().all(|f| !f.contains("x-injected")));
}

#[test]
fn classification_and_ages() {
    let mut set = base("[]", OK_DEFAULT);
    set.classification.pii_detectors = Some(vec![PiiKind::Email, PiiKind::Email]);
    set.classification.easy = Some(EasyRule {
        max_prompt_tokens: Some(0),
        no_code_fences: None,
    });
    set.pool_state_max_age_ms = Some(0);
    assert_eq!(
        findings(&set),
        vec![
            "classification.piiDetectors[1]: duplicate detector",
            "classification.easy.maxPromptTokens: must be at least 1",
            "poolStateMaxAgeMs: must be at least 1 ms",
        ]
    );
    set.classification.pii_detectors = Some(vec![]);
    set.classification.easy = None;
    set.pool_state_max_age_ms = None;
    assert_eq!(
        findings(&set),
        vec!["classification.piiDetectors: at least one detector (omit the field to run all)"]
    );
}

#[test]
fn validate_returns_errors_only_and_compile_agrees() {
    let set = base(
        r#"[
          {"name": "out", "match": {"easy": true}, "action": {"provider": {"provider": "ext"}}},
          {"name": "g", "piiGuard": true, "match": {"pii": true}, "action": {"route": {"pool": "alt"}}}
        ]"#,
        OK_DEFAULT,
    );
    // Warnings only: valid.
    assert_eq!(check(&set).len(), 1);
    assert_eq!(check(&set)[0].severity, Severity::Warning);
    assert!(validate(&set).is_ok());
    assert!(compile(&set).is_ok());

    let set = base(
        &pol("{}", r#"{"reject": {"status": 200}}"#),
        r#"{"route": {"pool": "x"}}"#,
    );
    let e = validate(&set).unwrap_err();
    assert_eq!(
        e.iter()
            .map(|e| (e.path.as_str(), e.severity))
            .collect::<Vec<_>>(),
        vec![
            ("policies[0].action.reject.status", Severity::Error),
            ("defaultAction.route.pool", Severity::Error)
        ]
    );
    assert_eq!(compile(&set).unwrap_err(), e);
}
