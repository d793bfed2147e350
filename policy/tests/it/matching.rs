//! The matcher: every condition kind, first-match order, the default,
//! actions and lazy classification.

use crate::common;
use common::*;
use kvasir_policy::*;

const ROUTE: &str = r#"{"route": {"pool": "main"}}"#;
const DEFAULT: &str = r#"{"route": {"pool": "alt"}}"#;

/// One policy `p` with `match` = `m`, routing to main; default routes to alt.
fn one(m: &str) -> FilterConfig {
    cfg(
        &format!(r#"[{{"name": "p", "match": {m}, "action": {ROUTE}}}]"#),
        DEFAULT,
    )
}

fn hit(c: &FilterConfig, r: Req<'_>) -> bool {
    who(c, &r) == "p"
}

#[test]
fn tenants_by_name() {
    let c = one(r#"{"tenants": ["a", "c"]}"#);
    assert!(hit(
        &c,
        Req {
            tenant: Some("a"),
            ..Req::default()
        }
    ));
    assert!(hit(
        &c,
        Req {
            tenant: Some("c"),
            ..Req::default()
        }
    ));
    assert!(!hit(
        &c,
        Req {
            tenant: Some("b"),
            ..Req::default()
        }
    ));
    assert!(!hit(
        &c,
        Req {
            tenant: None,
            ..Req::default()
        }
    ));
    assert!(!hit(
        &c,
        Req {
            tenant: Some("zz"),
            ..Req::default()
        }
    ));
}

#[test]
fn tenants_by_class() {
    let c = one(r#"{"tenantClasses": ["gold"]}"#);
    assert!(hit(
        &c,
        Req {
            tenant: Some("a"),
            ..Req::default()
        }
    ));
    assert!(hit(
        &c,
        Req {
            tenant: Some("b"),
            ..Req::default()
        }
    ));
    assert!(!hit(
        &c,
        Req {
            tenant: Some("c"),
            ..Req::default()
        }
    ));
    assert!(!hit(
        &c,
        Req {
            tenant: None,
            ..Req::default()
        }
    ));
}

#[test]
fn tenants_and_classes_both_hold() {
    let c = one(r#"{"tenants": ["a", "c"], "tenantClasses": ["gold"]}"#);
    assert!(hit(
        &c,
        Req {
            tenant: Some("a"),
            ..Req::default()
        }
    ));
    assert!(!hit(
        &c,
        Req {
            tenant: Some("b"),
            ..Req::default()
        }
    ));
    assert!(!hit(
        &c,
        Req {
            tenant: Some("c"),
            ..Req::default()
        }
    ));
}

#[test]
fn models_exact_and_glob() {
    let c = one(r#"{"models": ["m2", "llama-*", "gpt-4?"]}"#);
    for (m, want) in [
        ("m2", true),
        ("m1", false),
        ("m22", false),
        ("llama-3-8b", true),
        ("llama", false),
        ("gpt-4o", true),
        ("gpt-4", false),
        ("gpt-4oo", false),
    ] {
        assert_eq!(
            hit(
                &c,
                Req {
                    model: m,
                    ..Req::default()
                }
            ),
            want,
            "{m}"
        );
    }
}

#[test]
fn api_kinds() {
    let c = one(r#"{"apis": ["completions", "anthropicMessages"]}"#);
    assert!(!hit(
        &c,
        Req {
            api: ApiKind::Chat,
            ..Req::default()
        }
    ));
    assert!(hit(
        &c,
        Req {
            api: ApiKind::Completions,
            ..Req::default()
        }
    ));
    assert!(hit(
        &c,
        Req {
            api: ApiKind::AnthropicMessages,
            ..Req::default()
        }
    ));
    // count_tokens and the Responses API are kinds of their own.
    for api in [ApiKind::AnthropicCountTokens, ApiKind::Responses] {
        assert!(!hit(
            &c,
            Req {
                api,
                ..Req::default()
            }
        ));
    }
    let c = one(r#"{"apis": ["responses", "anthropicCountTokens"]}"#);
    for (api, hits) in [
        (ApiKind::Responses, true),
        (ApiKind::AnthropicCountTokens, true),
        (ApiKind::AnthropicMessages, false),
        (ApiKind::Chat, false),
    ] {
        assert_eq!(
            hit(
                &c,
                Req {
                    api,
                    ..Req::default()
                }
            ),
            hits,
            "{api:?}"
        );
    }
}

#[test]
fn headers_exact_prefix_present_absent() {
    let c = one(r#"{"headers": [
            {"name": "X-Env", "exact": "prod"},
            {"name": "user-agent", "prefix": "openai-python/"},
            {"name": "x-debug", "present": false},
            {"name": "x-team", "present": true}
        ]}"#);
    let good = vec![
        ("x-env", "prod"),
        ("User-Agent", "openai-python/1.40"),
        ("x-team", ""),
    ];
    assert!(hit(
        &c,
        Req {
            headers: good.clone(),
            ..Req::default()
        }
    ));
    let mut bad = good.clone();
    bad[0].1 = "production";
    assert!(
        !hit(
            &c,
            Req {
                headers: bad,
                ..Req::default()
            }
        ),
        "exact is exact"
    );
    let mut bad = good.clone();
    bad[1].1 = "curl/8";
    assert!(
        !hit(
            &c,
            Req {
                headers: bad,
                ..Req::default()
            }
        ),
        "prefix"
    );
    let mut bad = good.clone();
    bad.push(("x-debug", "1"));
    assert!(
        !hit(
            &c,
            Req {
                headers: bad,
                ..Req::default()
            }
        ),
        "absent"
    );
    let bad: Vec<_> = good.iter().copied().filter(|h| h.0 != "x-team").collect();
    assert!(
        !hit(
            &c,
            Req {
                headers: bad,
                ..Req::default()
            }
        ),
        "present"
    );
}

#[test]
fn prompt_token_range_is_inclusive() {
    let c = one(r#"{"promptTokens": {"min": 100, "max": 200}}"#);
    for (t, want) in [
        (99, false),
        (100, true),
        (150, true),
        (200, true),
        (201, false),
    ] {
        assert_eq!(
            hit(
                &c,
                Req {
                    tokens: t,
                    ..Req::default()
                }
            ),
            want,
            "{t}"
        );
    }
    let c = one(r#"{"promptTokens": {"min": 100}}"#);
    assert!(hit(
        &c,
        Req {
            tokens: u32::MAX,
            ..Req::default()
        }
    ));
    let c = one(r#"{"promptTokens": {"max": 5}}"#);
    assert!(hit(
        &c,
        Req {
            tokens: 0,
            ..Req::default()
        }
    ));
    assert!(!hit(
        &c,
        Req {
            tokens: 6,
            ..Req::default()
        }
    ));
}

#[test]
fn pii_condition() {
    let c = one(r#"{"pii": true}"#);
    assert!(hit(
        &c,
        Req {
            text: "mail me: jane@example.com",
            ..Req::default()
        }
    ));
    assert!(hit(
        &c,
        Req {
            text: "card 4111 1111 1111 1111",
            ..Req::default()
        }
    ));
    assert!(!hit(
        &c,
        Req {
            text: "card 4111 1111 1111 1112",
            ..Req::default()
        }
    ));
    assert!(!hit(
        &c,
        Req {
            text: "what is 2+2?",
            ..Req::default()
        }
    ));
    let c = one(r#"{"pii": false}"#);
    assert!(!hit(
        &c,
        Req {
            text: "SSN 123-45-6789",
            ..Req::default()
        }
    ));
    assert!(hit(
        &c,
        Req {
            text: "SSN 666-45-6789",
            ..Req::default()
        }
    ));
    let out = eval(
        &c,
        &Req {
            text: "IBAN DE89370400440532013000 and x@y.org",
            ..Req::default()
        },
    );
    assert_eq!(
        out.pii.unwrap().iter().collect::<Vec<_>>(),
        vec![PiiKind::Email, PiiKind::Iban]
    );
}

#[test]
fn pii_detectors_can_be_limited() {
    let mut set = base(
        r#"[{"name": "p", "match": {"pii": true}, "action": {"route": {"pool": "main"}}}]"#,
        DEFAULT,
    );
    set.classification.pii_detectors = Some(vec![PiiKind::PaymentCard]);
    let c = compile(&set).unwrap();
    assert!(!hit(
        &c,
        Req {
            text: "jane@example.com",
            ..Req::default()
        }
    ));
    assert!(hit(
        &c,
        Req {
            text: "4111111111111111",
            ..Req::default()
        }
    ));
}

#[test]
fn easy_rule() {
    let c = one(r#"{"easy": true}"#);
    assert!(hit(
        &c,
        Req {
            tokens: 512,
            text: "What is the capital of France?",
            ..Req::default()
        }
    ));
    assert!(
        !hit(
            &c,
            Req {
                tokens: 513,
                ..Req::default()
            }
        ),
        "too long"
    );
    assert!(
        !hit(
            &c,
            Req {
                tokens: 20,
                text: "fix this:\n```rust\nfn main() {}\n```",
                ..Req::default()
            }
        ),
        "code fence"
    );
    let c = one(r#"{"easy": false}"#);
    assert!(hit(
        &c,
        Req {
            tokens: 5000,
            ..Req::default()
        }
    ));

    // A configured rule: 64 tokens, fences allowed.
    let mut set = base(
        r#"[{"name": "p", "match": {"easy": true}, "action": {"route": {"pool": "main"}}}]"#,
        DEFAULT,
    );
    set.classification.easy = Some(EasyRule {
        max_prompt_tokens: Some(64),
        no_code_fences: Some(false),
    });
    let c = compile(&set).unwrap();
    assert!(hit(
        &c,
        Req {
            tokens: 64,
            text: "```x```",
            ..Req::default()
        }
    ));
    assert!(!hit(
        &c,
        Req {
            tokens: 65,
            ..Req::default()
        }
    ));
    let (out, visits) = eval_with(
        &c,
        &Req {
            tokens: 3,
            text: "```",
            ..Req::default()
        },
        &PoolStates::new(&c),
        0,
    );
    assert_eq!(
        (out.easy, visits),
        (Some(true), 0),
        "no text read without the fence rule"
    );
}

#[test]
fn pool_state_above_below_band_and_staleness() {
    let c = one(r#"{"poolState": {"pool": "alt", "saturationAbove": 0.8}}"#);
    let alt = c.pool_index("alt").unwrap();
    let mut s = PoolStates::new(&c);
    let at = |s: &PoolStates, now| {
        eval_with(&c, &Req::default(), s, now)
            .0
            .policy_name()
            .to_owned()
    };
    assert_eq!(at(&s, 0), "default", "unknown state never matches");
    s.update(alt, 0.9, 1_000);
    assert_eq!(at(&s, 1_000), "p");
    assert_eq!(at(&s, 6_000), "p", "5000 ms old is still fresh");
    assert_eq!(at(&s, 6_001), "default", "stale state never matches");
    s.update(alt, 0.8, 1_000);
    assert_eq!(at(&s, 1_000), "default", "above is strict");
    s.update(alt, f64::NAN, 1_000);
    assert_eq!(at(&s, 1_000), "default", "NaN is unknown");
    s.update(alt, 0.9, 1_000);
    s.clear(alt);
    assert_eq!(at(&s, 1_000), "default");
    assert!(s.update_by_name(&c, "alt", 0.99, 0));
    assert!(!s.update_by_name(&c, "nope", 0.99, 0));
    assert_eq!(at(&s, 0), "p");

    let c =
        one(r#"{"poolState": {"pool": "main", "saturationAbove": 0.2, "saturationBelow": 0.5}}"#);
    let main = c.pool_index("main").unwrap();
    for (v, want) in [
        (0.1, false),
        (0.2, false),
        (0.3, true),
        (0.5, false),
        (0.9, false),
    ] {
        let mut s = PoolStates::new(&c);
        s.update(main, v, 0);
        assert_eq!(
            eval_with(&c, &Req::default(), &s, 0).0.policy_name() == "p",
            want,
            "{v}"
        );
    }
    assert_eq!(c.pools_needing_state().collect::<Vec<_>>(), vec![main]);
}

#[test]
fn pool_state_age_is_configurable() {
    let mut set = base(
        r#"[{"name": "p", "match": {"poolState": {"pool": "main", "saturationBelow": 0.5}}, "action": {"route": {"pool": "main"}}}]"#,
        DEFAULT,
    );
    set.pool_state_max_age_ms = Some(100);
    let c = compile(&set).unwrap();
    let mut s = PoolStates::new(&c);
    s.update(c.pool_index("main").unwrap(), 0.1, 1000);
    assert_eq!(
        eval_with(&c, &Req::default(), &s, 1100).0.policy_name(),
        "p"
    );
    assert_eq!(
        eval_with(&c, &Req::default(), &s, 1101).0.policy_name(),
        "default"
    );
    // A sample from the future (another VM's clock) counts as fresh.
    assert_eq!(eval_with(&c, &Req::default(), &s, 900).0.policy_name(), "p");
}

#[test]
fn first_match_wins_then_default() {
    let c = cfg(
        r#"[
          {"name": "first", "match": {"tenants": ["a"]}, "action": {"reject": {"status": 403}}},
          {"name": "second", "match": {"tenantClasses": ["gold"]}, "action": {"route": {"pool": "alt"}}},
          {"name": "third", "match": {"models": ["m1"]}, "action": {"shed": {"retryAfterS": 3}}}
        ]"#,
        r#"{"route": {"pool": "main", "priority": 7}}"#,
    );
    assert_eq!(
        who(
            &c,
            &Req {
                tenant: Some("a"),
                ..Req::default()
            }
        ),
        "first"
    );
    assert_eq!(
        who(
            &c,
            &Req {
                tenant: Some("b"),
                ..Req::default()
            }
        ),
        "second"
    );
    assert_eq!(
        who(
            &c,
            &Req {
                tenant: Some("c"),
                ..Req::default()
            }
        ),
        "third"
    );
    let out = eval(
        &c,
        &Req {
            tenant: Some("c"),
            model: "m2",
            ..Req::default()
        },
    );
    assert_eq!(out.matched, Matched::Default);
    assert_eq!(out.policy_name(), "default");
    match out.decision {
        Decision::RoutePool { pool, priority, .. } => {
            assert_eq!((pool.name.as_str(), priority), ("main", 7))
        }
        d => panic!("{d:?}"),
    }
    let out = eval(
        &c,
        &Req {
            tenant: Some("b"),
            ..Req::default()
        },
    );
    assert_eq!(
        out.matched,
        Matched::Policy {
            index: 1,
            name: "second"
        }
    );
}

#[test]
fn empty_match_matches_everything() {
    let c = one("{}");
    assert!(hit(
        &c,
        Req {
            tenant: None,
            api: ApiKind::Completions,
            model: "anything",
            ..Req::default()
        }
    ));
}

#[test]
fn actions_carry_their_fields() {
    let c = cfg(
        r#"[
          {"name": "route", "match": {"models": ["r"]}, "action": {"route": {"pool": "main", "rewriteModel": "m2", "priority": -3, "includeUsage": true}}},
          {"name": "reject", "match": {"models": ["x"]}, "action": {"reject": {"status": 451, "message": "no"}}},
          {"name": "reject-default-msg", "match": {"models": ["y"]}, "action": {"reject": {"status": 400}}},
          {"name": "shed", "match": {"models": ["s"]}, "action": {"shed": {"retryAfterS": 30}}},
          {"name": "prov", "match": {"models": ["p"]}, "action": {"provider": {"provider": "ext", "includeUsage": true}}},
          {"name": "prov-rewrite", "match": {"models": ["q"]}, "action": {"provider": {"provider": "ext", "rewriteModel": "ext-large"}}}
        ]"#,
        DEFAULT,
    );
    let d = |m| {
        eval(
            &c,
            &Req {
                model: m,
                ..Req::default()
            },
        )
        .decision
    };
    match d("r") {
        Decision::RoutePool {
            pool,
            pool_index,
            rewrite_model,
            priority,
            include_usage,
        } => {
            assert_eq!(pool.name, "main");
            assert_eq!(pool.cluster, "main-cluster");
            assert_eq!(pool.indexer_cluster, "idx");
            assert_eq!(pool.indexer_timeout_ms, 50);
            assert_eq!(pool_index, c.pool_index("main").unwrap());
            assert_eq!(
                (rewrite_model, priority, include_usage),
                (Some("m2"), -3, true)
            );
        }
        x => panic!("{x:?}"),
    }
    assert_eq!(
        d("x"),
        Decision::Reject {
            status: 451,
            message: "no"
        }
    );
    assert_eq!(
        d("y"),
        Decision::Reject {
            status: 400,
            message: "request rejected by policy"
        }
    );
    assert_eq!(
        d("s"),
        Decision::Shed {
            retry_after_s: 30,
            message: "the service is saturated; retry later"
        }
    );
    match d("p") {
        Decision::Provider {
            provider,
            rewrite_model,
            include_usage,
        } => {
            assert_eq!(provider.name, "ext");
            assert_eq!(provider.cluster, "ext-cluster");
            assert_eq!(
                (rewrite_model, include_usage),
                (Some("ext-small"), true),
                "provider default model"
            );
        }
        x => panic!("{x:?}"),
    }
    match d("q") {
        Decision::Provider {
            rewrite_model,
            include_usage,
            ..
        } => {
            assert_eq!(
                (rewrite_model, include_usage),
                (Some("ext-large"), false),
                "action overrides"
            );
        }
        x => panic!("{x:?}"),
    }
    assert_eq!(d("r").kind(), "route");
    assert_eq!(d("x").kind(), "reject");
    assert_eq!(d("s").kind(), "shed");
    assert_eq!(d("p").kind(), "provider");
}

#[test]
fn classification_is_lazy_and_done_once() {
    // No policy needs the text: never read.
    let c = cfg(
        r#"[{"name": "p", "match": {"tenants": ["b"]}, "action": {"route": {"pool": "main"}}}]"#,
        DEFAULT,
    );
    assert!(!c.needs_prompt_text());
    let (out, visits) = eval_with(
        &c,
        &Req {
            text: "jane@example.com",
            ..Req::default()
        },
        &PoolStates::new(&c),
        0,
    );
    assert_eq!((out.pii, out.easy, visits), (None, None, 0));

    // Two PII conditions: scanned once.
    let c = cfg(
        r#"[
          {"name": "p1", "match": {"tenants": ["b"], "pii": true}, "action": {"route": {"pool": "main"}}},
          {"name": "p2", "match": {"pii": false, "models": ["m2"]}, "action": {"route": {"pool": "main"}}},
          {"name": "p3", "match": {"pii": true}, "action": {"route": {"pool": "main"}}}
        ]"#,
        DEFAULT,
    );
    let (out, visits) = eval_with(
        &c,
        &Req {
            tenant: Some("b"),
            text: "a@b.io",
            ..Req::default()
        },
        &PoolStates::new(&c),
        0,
    );
    assert_eq!((out.policy_name(), visits), ("p1", 1));
    let (out, visits) = eval_with(
        &c,
        &Req {
            text: "a@b.io",
            ..Req::default()
        },
        &PoolStates::new(&c),
        0,
    );
    assert_eq!((out.policy_name(), visits), ("p3", 1));

    // A cheap condition that fails first spares the scan.
    let (out, visits) = eval_with(
        &c,
        &Req {
            tenant: Some("c"),
            model: "m9",
            text: "a@b.io",
            ..Req::default()
        },
        &PoolStates::new(&c),
        0,
    );
    assert_eq!(out.policy_name(), "p3");
    assert_eq!(visits, 1);
    let c = one(r#"{"tenants": ["b"], "pii": true}"#);
    let (_, visits) = eval_with(
        &c,
        &Req {
            tenant: Some("a"),
            text: "a@b.io",
            ..Req::default()
        },
        &PoolStates::new(&c),
        0,
    );
    assert_eq!(visits, 0, "tenant condition fails before the scan");
}

#[test]
fn prompt_text_of_several_pieces() {
    let c = one(r#"{"pii": true}"#);
    let pieces = vec![
        "system: be nice".to_owned(),
        "my iban is GB82WEST12345698765432".to_owned(),
    ];
    let facts = RequestFacts {
        tenant: Some("a"),
        api: ApiKind::Chat,
        model: "m1",
        headers: &NoHeaders,
        estimated_prompt_tokens: 20,
        prompt: &pieces,
    };
    let out = c.evaluate(&facts, &PoolStates::new(&c), 0);
    assert_eq!(out.policy_name(), "p");
    let facts = RequestFacts {
        prompt: &NoText,
        ..facts
    };
    assert_eq!(
        c.evaluate(&facts, &PoolStates::new(&c), 0).policy_name(),
        "default"
    );
}

#[test]
fn estimate_tokens_rounds_up() {
    assert_eq!(estimate_tokens(0), 0);
    assert_eq!(estimate_tokens(1), 1);
    assert_eq!(estimate_tokens(8), 2);
    assert_eq!(estimate_tokens(9), 3);
}
