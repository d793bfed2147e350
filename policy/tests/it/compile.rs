//! Compilation: deterministic bytes, the JSON round trip, and the loader's
//! refusals.

use crate::common;
use common::*;
use kvasir_policy::*;
use serde_json::Value;

const EXAMPLES: [&str; 3] = [
    include_str!("../../examples/multi-tenant-pii.json"),
    include_str!("../../examples/saturation-burst.json"),
    include_str!("../../examples/jwt-models.json"),
];

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

/// Writes `v` as JSON text with every object's keys in a random order (so
/// the test does not depend on serde_json's map ordering).
fn write_shuffled(v: &Value, r: &mut Rng, out: &mut String) {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<_> = m.keys().collect();
            r.shuffle(&mut keys);
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&serde_json::to_string(k).unwrap());
                out.push(':');
                write_shuffled(&m[k.as_str()], r, out);
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_shuffled(x, r, out);
            }
            out.push(']');
        }
        x => out.push_str(&serde_json::to_string(x).unwrap()),
    }
}

/// Shuffles every list that is a set (not `policies`).
fn shuffle_sets(v: &mut Value, r: &mut Rng) {
    let sh = |x: Option<&mut Value>, r: &mut Rng| {
        if let Some(Value::Array(a)) = x {
            r.shuffle(a);
        }
    };
    for k in ["tenants", "pools", "providers"] {
        sh(v.get_mut(k), r);
    }
    sh(v.pointer_mut("/classification/piiDetectors"), r);
    for t in v["tenants"].as_array_mut().unwrap() {
        sh(t.get_mut("apiKeyHashes"), r);
    }
    for p in v["pools"].as_array_mut().unwrap() {
        sh(p.get_mut("models"), r);
    }
    for p in v["policies"].as_array_mut().unwrap() {
        if let Some(m) = p.get_mut("match") {
            for k in ["tenants", "tenantClasses", "models", "apis", "headers"] {
                sh(m.get_mut(k), r);
            }
        }
    }
}

#[test]
fn same_meaning_same_bytes() {
    let mut r = Rng(0x1234_5678_9abc_def1);
    for ex in EXAMPLES {
        let want = compile(&parse_json(ex).unwrap()).unwrap().to_json();
        let mut v: Value = serde_json::from_str(ex).unwrap();
        // Make sure the piiDetectors list exists so its order is shuffled too.
        v["classification"]["piiDetectors"] =
            serde_json::json!(["email", "phone", "paymentCard", "iban", "nationalId"]);
        let want_full = compile(&serde_json::from_value(v.clone()).unwrap())
            .unwrap()
            .to_json();
        assert_eq!(want, want_full, "all detectors is the default");
        for _ in 0..50 {
            shuffle_sets(&mut v, &mut r);
            let mut text = String::new();
            write_shuffled(&v, &mut r, &mut text);
            let got = compile(&parse_json(&text).unwrap()).unwrap().to_json();
            assert_eq!(
                String::from_utf8(got).unwrap(),
                String::from_utf8(want.clone()).unwrap()
            );
        }
    }
}

#[test]
fn policy_order_is_meaning() {
    let mut v: Value = serde_json::from_str(EXAMPLES[2]).unwrap();
    let a = compile(&serde_json::from_value(v.clone()).unwrap())
        .unwrap()
        .to_json();
    v["policies"].as_array_mut().unwrap().swap(2, 3);
    let b = compile(&serde_json::from_value(v).unwrap())
        .unwrap()
        .to_json();
    assert_ne!(a, b);
}

#[test]
fn json_round_trip() {
    for ex in EXAMPLES {
        let c = compile(&parse_json(ex).unwrap()).unwrap();
        let bytes = c.to_json();
        let back = FilterConfig::from_json(&bytes).unwrap();
        assert_eq!(back, c);
        assert_eq!(back.to_json(), bytes);
        assert_eq!(
            FilterConfig::from_json(c.to_json_pretty().as_bytes()).unwrap(),
            c
        );
        assert_eq!(back.fingerprint(), c.fingerprint());
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["version"], "kvasir.filter/v1");
    }
}

#[test]
fn the_index_survives_the_round_trip() {
    // Decisions are identical before and after serialization.
    let c = compile(&parse_json(EXAMPLES[1]).unwrap()).unwrap();
    let back = FilterConfig::from_json(&c.to_json()).unwrap();
    let mut s1 = PoolStates::new(&c);
    let mut s2 = PoolStates::new(&back);
    s1.update(0, 0.8, 0);
    s2.update(0, 0.8, 0);
    for text in ["hi", "a@b.io", "```x```"] {
        for tenant in [Some("team-a"), Some("trial"), None] {
            for tokens in [10, 5000] {
                let r = Req {
                    tenant,
                    model: "llama-3.1-8b-instruct",
                    text,
                    tokens,
                    ..Req::default()
                };
                let (a, _) = eval_with(&c, &r, &s1, 0);
                let (b, _) = eval_with(&back, &r, &s2, 0);
                assert_eq!(a, b);
            }
        }
    }
}

#[test]
fn fingerprint_is_sha256_of_the_bytes() {
    let c = compile(&parse_json(EXAMPLES[0]).unwrap()).unwrap();
    let f = c.fingerprint();
    assert!(f.starts_with("sha256:") && f.len() == 71, "{f}");
    assert_eq!(f, hash_api_key(std::str::from_utf8(&c.to_json()).unwrap()));
}

#[test]
fn provider_credentials_never_reach_the_filter_config() {
    let set = parse_json(EXAMPLES[0]).unwrap();
    let auth = set.providers[0]
        .auth
        .as_ref()
        .expect("the example names one");
    assert!(auth.secret_ref.is_some());
    let c = compile(&set).unwrap();
    let json = String::from_utf8(c.to_json()).unwrap();
    assert!(!json.contains("\"auth\""), "{json}");
    assert!(!json.contains(&auth.secret_ref.as_ref().unwrap().name));
}

#[test]
fn a_credential_in_the_policy_is_refused_without_being_echoed() {
    let mut set = base("[]", r#"{"route": {"pool": "main"}}"#);
    set.providers[0].auth = Some(ProviderAuth {
        header: "X-Api-Key".into(),
        value: Some(Secret("sk-live-123".into())),
        secret_ref: None,
    });
    let e = compile(&set).unwrap_err();
    let msgs: Vec<_> = e.iter().map(ToString::to_string).collect();
    assert_eq!(msgs.len(), 1, "{msgs:?}");
    assert!(
        msgs[0].starts_with("providers[0].auth.value: credentials are not allowed in a policy"),
        "{msgs:?}"
    );
    assert!(!msgs[0].contains("sk-live-123"));
    assert!(!format!("{set:?}").contains("sk-live-123"));
}

#[test]
fn compiled_defaults_and_precomputation() {
    let c = compile(&parse_json(EXAMPLES[0]).unwrap()).unwrap();
    // Classes expanded, sorted.
    let guard = &c.policies()[2];
    assert_eq!(guard.match_.tenants.as_deref().unwrap(), ["acme", "globex"]);
    // Globs separated from exact names.
    let m = c.policies()[0].match_.models.as_ref().unwrap();
    assert!(m.exact.is_empty());
    assert_eq!(m.globs, ["gpt-3*"]);
    // Defaults written out.
    assert_eq!(
        c.pools()
            .iter()
            .map(|p| p.indexer_timeout_ms)
            .collect::<Vec<_>>(),
        [50, 30]
    );
    assert_eq!(c.pool_state_max_age_ms(), 5000);
    assert_eq!(c.tenant_source().tenant_header, "x-tenant");
    assert_eq!(c.tenant_source().on_tenant_header, OnTenantHeader::Ignore);
    assert_eq!(
        c.tenants()
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>(),
        ["acme", "anonymous", "globex", "initech"]
    );
    assert!(c.needs_pii_scan());
    assert!(c.needs_easy());
    assert!(c.needs_prompt_text());
    assert_eq!(
        c.pools_needing_state().collect::<Vec<_>>(),
        [c.pool_index("main").unwrap()]
    );
    assert!(matches!(c.default_action(), ActionConfig::Route(r) if r.pool == "main"));
    let c = compile(&parse_json(EXAMPLES[2]).unwrap()).unwrap();
    assert!(!c.needs_pii_scan(), "no pii condition, no provider");
    assert!(!c.needs_prompt_text());
}

fn compiled_value() -> Value {
    serde_json::from_slice(
        &compile(&parse_json(EXAMPLES[0]).unwrap())
            .unwrap()
            .to_json(),
    )
    .unwrap()
}

fn load(v: &Value) -> Result<FilterConfig, ConfigError> {
    FilterConfig::from_json(&serde_json::to_vec(v).unwrap())
}

#[test]
fn loader_refuses_bad_documents() {
    assert_eq!(
        FilterConfig::from_json(b"{\"version\": \"kvasir.filter/v1\",\n \"tenants\": 5}"),
        Err(ConfigError::Json {
            path: "tenants".into(),
            line: 2,
            column: 13,
            message: "invalid type: integer `5`, expected a sequence".into()
        })
    );
    assert_eq!(
        FilterConfig::from_json(b"{\"version\": \"kvasir.filter/v1\",\n \"tenants\": 5}").unwrap_err().to_string(),
        "invalid filter config at `tenants` (line 2, column 13): invalid type: integer `5`, expected a sequence"
    );
    assert_eq!(
        FilterConfig::from_json(b"true").unwrap_err().to_string(),
        "invalid filter config (line 1, column 4): invalid type: boolean `true`, expected struct Doc"
    );
    let mut v = compiled_value();
    v["version"] = "kvasir.filter/v2".into();
    v["tenants"] = 5.into();
    assert_eq!(
        load(&v),
        Err(ConfigError::Version {
            found: "kvasir.filter/v2".into()
        })
    );
    assert_eq!(
        load(&v).unwrap_err().to_string(),
        "unsupported filter config version `kvasir.filter/v2` (this filter reads `kvasir.filter/v1`)"
    );

    let mut v = compiled_value();
    v["defaultAction"]["route"]["pool"] = "nope".into();
    assert_eq!(
        load(&v).unwrap_err().to_string(),
        "invalid filter config at `defaultAction.route.pool`: unknown pool `nope`"
    );
    let mut v = compiled_value();
    v["apiKeys"][1]["hash"] = "sha256:xyz".into();
    assert_eq!(
        load(&v).unwrap_err().to_string(),
        "invalid filter config at `apiKeys[1].hash`: not `sha256:` + 64 lowercase hex digits"
    );
    let mut v = compiled_value();
    v["policies"][0]["match"]["models"]["globs"][0] = "a[b".into();
    assert_eq!(
        load(&v).unwrap_err().to_string(),
        "invalid filter config at `policies[0].match.models.globs[0]`: bad glob: `[` is not supported (only `*` and `?` are special)"
    );
    let mut v = compiled_value();
    v["providers"][0]["auth"] = serde_json::json!({"header": "authorization", "value": "Bearer x"});
    let e = load(&v).unwrap_err().to_string();
    assert!(e.contains("unknown field `auth`"), "{e}");
    assert!(!e.contains("Bearer x"), "{e}");
    let mut v = compiled_value();
    v["policies"][3]["action"] =
        serde_json::json!({"provider": {"provider": "openai", "includeUsage": false}});
    v["policies"][2]["action"] =
        serde_json::json!({"provider": {"provider": "openai", "includeUsage": false}});
    assert_eq!(
        load(&v).unwrap_err().to_string(),
        "invalid filter config at `policies[2].piiGuard`: a PII guard cannot send to a provider"
    );
    let mut v = compiled_value();
    v["policies"][1]["match"]["poolState"]["above"] = 2.0.into();
    assert_eq!(
        load(&v).unwrap_err().to_string(),
        "invalid filter config at `policies[1].match.poolState`: thresholds must be in [0, 1]"
    );
    let bytes = [
        serde_json::to_vec(&compiled_value()).unwrap(),
        b" x".to_vec(),
    ]
    .concat();
    assert!(matches!(
        FilterConfig::from_json(&bytes),
        Err(ConfigError::Json { .. })
    ));
    assert!(matches!(
        FilterConfig::from_json(b""),
        Err(ConfigError::Json { .. })
    ));
    assert!(matches!(
        FilterConfig::from_json(&[0xff, 0xfe]),
        Err(ConfigError::Json { .. })
    ));
}

#[test]
fn loader_ignores_unknown_fields_within_v1() {
    // Additive changes within v1: an older filter reads a newer document.
    let mut v = compiled_value();
    v["futureSetting"] = serde_json::json!({"x": 1});
    v["policies"][0]["futureField"] = true.into();
    let c = load(&v).unwrap();
    assert_eq!(c, load(&compiled_value()).unwrap());
}

#[test]
fn loader_normalizes_hand_written_order() {
    // A hand-edited document with unsorted tables still resolves right.
    let mut v = compiled_value();
    v["tenants"].as_array_mut().unwrap().reverse();
    v["apiKeys"].as_array_mut().unwrap().reverse();
    v["pools"].as_array_mut().unwrap().reverse();
    let c = load(&v).unwrap();
    assert_eq!(
        String::from_utf8(c.to_json()).unwrap(),
        String::from_utf8(load(&compiled_value()).unwrap().to_json()).unwrap()
    );
    let headers = [("authorization", "Bearer sk-globex-0001")];
    let t = resolve_tenant(
        &c,
        &TenantInput {
            headers: &headers,
            jwt_claim: None,
        },
    )
    .unwrap();
    assert_eq!(t.name, "globex");
}

#[test]
fn loader_never_panics_on_mangled_documents() {
    // Flip, drop and duplicate bytes of a real document: every result is
    // Ok or Err, never a panic.
    let good = compile(&parse_json(EXAMPLES[0]).unwrap())
        .unwrap()
        .to_json();
    let mut r = Rng(7);
    for _ in 0..3000 {
        let mut b = good.clone();
        for _ in 0..1 + r.below(4) {
            let i = r.below(b.len());
            match r.below(3) {
                0 => b[i] = b"{}[]\",:0a-\\ "[r.below(12)],
                1 => {
                    b.remove(i);
                }
                _ => b.insert(i, b[i]),
            }
        }
        let _ = FilterConfig::from_json(&b);
    }
}
