//! The example policy sets in `examples/` (reused by `kvasirctl` and the
//! demo): they parse, validate with exactly the expected findings, compile,
//! and decide sample requests end to end (tenant resolution, then the
//! matcher).

use crate::common;
use common::*;
use kvasir_policy::*;

const MULTI: &str = include_str!("../../examples/multi-tenant-pii.json");
const BURST: &str = include_str!("../../examples/saturation-burst.json");
const JWT: &str = include_str!("../../examples/jwt-models.json");

/// Resolves the tenant from `headers`, then evaluates. (Flat arguments keep
/// each case one readable line.)
#[allow(clippy::too_many_arguments)]
fn decide<'c>(
    c: &'c FilterConfig,
    headers: &[(&str, &str)],
    api: ApiKind,
    model: &str,
    tokens: u32,
    text: &str,
    states: &PoolStates,
    now: u64,
) -> Outcome<'c> {
    let t = resolve_tenant(
        c,
        &TenantInput {
            headers: &headers,
            jwt_claim: None,
        },
    )
    .unwrap();
    let facts = RequestFacts {
        tenant: Some(t.name),
        api,
        model,
        headers: &headers,
        estimated_prompt_tokens: tokens,
        prompt: &text,
    };
    c.evaluate(&facts, states, now)
}

fn pool_of<'c>(o: &Outcome<'c>) -> &'c str {
    match o.decision {
        Decision::RoutePool { pool, .. } => &pool.name,
        d => panic!("not a route: {d:?}"),
    }
}

#[test]
fn examples_validate_with_expected_findings() {
    assert_eq!(
        findings(&parse_json(MULTI).unwrap()),
        vec!["warning: policies[1]: sends to a provider ahead of PII guard policies[2] (`keep-pii-inside`): PII requests in that guard's scope skip this policy"]
    );
    assert_eq!(findings(&parse_json(BURST).unwrap()), Vec::<String>::new());
    assert_eq!(findings(&parse_json(JWT).unwrap()), Vec::<String>::new());
}

#[test]
fn multi_tenant_with_pii_guard() {
    let c = compile(&parse_json(MULTI).unwrap()).unwrap();
    let main = c.pool_index("main").unwrap();
    let calm = PoolStates::new(&c);
    let mut busy = PoolStates::new(&c);
    busy.update(main, 0.9, 1000);
    let mut full = PoolStates::new(&c);
    full.update(main, 0.97, 1000);
    let acme = [("authorization", "Bearer sk-acme-0001")];
    let globex = [("x-api-key", "sk-globex-0001")];
    let initech = [("authorization", "Bearer sk-initech-0001")];
    let chat = ApiKind::Chat;
    let pii = "Please email the invoice to jane.doe@example.com";
    let clean = "Summarize: the meeting moved to Tuesday.";

    let o = decide(&c, &acme, chat, "qwen3-8b", 40, clean, &calm, 1000);
    assert_eq!(o.policy_name(), "gold-priority");
    assert!(matches!(
        o.decision,
        Decision::RoutePool {
            priority: -10,
            include_usage: true,
            ..
        }
    ));

    // Busy pool, easy prompt: gold traffic bursts out, unless it carries PII.
    let o = decide(&c, &acme, chat, "qwen3-8b", 40, clean, &busy, 1000);
    assert_eq!(o.policy_name(), "burst-easy-to-provider");
    match o.decision {
        Decision::Provider {
            provider,
            rewrite_model,
            include_usage,
        } => {
            assert_eq!(
                (provider.cluster.as_str(), provider.authority.as_deref()),
                ("openai-api", Some("api.openai.com"))
            );
            assert_eq!((rewrite_model, include_usage), (Some("gpt-4o-mini"), true));
        }
        d => panic!("{d:?}"),
    }
    let o = decide(&c, &acme, chat, "qwen3-8b", 40, pii, &busy, 1000);
    assert_eq!(
        (o.policy_name(), pool_of(&o)),
        ("keep-pii-inside", "secure")
    );
    assert!(o.provider_skipped_for_pii);
    assert_eq!(
        o.pii.unwrap().iter().collect::<Vec<_>>(),
        vec![PiiKind::Email]
    );

    // Regulated tenant: PII stays in `secure`; clean traffic takes the default.
    let o = decide(&c, &globex, chat, "qwen3-8b", 4000, pii, &calm, 1000);
    assert_eq!(
        (o.policy_name(), pool_of(&o)),
        ("keep-pii-inside", "secure")
    );
    let o = decide(&c, &globex, chat, "qwen3-8b", 4000, clean, &calm, 1000);
    assert_eq!((o.policy_name(), pool_of(&o)), ("default", "main"));

    // Free tier is outside the guard's scope: plain first match.
    let o = decide(&c, &initech, chat, "qwen3-8b", 40, pii, &busy, 1000);
    assert_eq!(o.policy_name(), "burst-easy-to-provider");
    let o = decide(&c, &initech, chat, "qwen3-8b", 4000, clean, &full, 1000);
    assert_eq!(
        o.decision,
        Decision::Shed {
            retry_after_s: 5,
            message: "the service is saturated; retry later"
        }
    );
    let o = decide(&c, &[], chat, "qwen3-8b", 4000, clean, &full, 1000);
    assert_eq!(
        o.policy_name(),
        "shed-free-when-saturated",
        "the default tenant is free too"
    );

    let o = decide(&c, &acme, chat, "gpt-3.5-turbo", 40, clean, &calm, 1000);
    assert_eq!(
        o.decision,
        Decision::Reject {
            status: 404,
            message: "this model is not served here"
        }
    );
}

#[test]
fn saturation_burst_to_an_external_provider() {
    let c = compile(&parse_json(BURST).unwrap()).unwrap();
    let model = "llama-3.1-8b-instruct";
    let chat = ApiKind::Chat;
    let mut s = PoolStates::new(&c);
    s.update(0, 0.8, 10_000);
    let team_a = [("x-tenant", "team-a")];
    let trial = [("x-tenant", "trial-users")];

    let o = decide(
        &c,
        &team_a,
        chat,
        model,
        30,
        "card 4111-1111-1111-1111 please",
        &s,
        10_000,
    );
    assert_eq!(o.policy_name(), "pii-never-leaves");
    let o = decide(&c, &team_a, chat, model, 30, "hi there", &s, 10_000);
    match o.decision {
        Decision::Provider {
            provider,
            rewrite_model,
            ..
        } => {
            assert_eq!(provider.name, "anthropic");
            assert_eq!(rewrite_model, Some("claude-3-5-haiku-latest"));
        }
        d => panic!("{d:?}"),
    }
    // Code is never easy: stays inside.
    let o = decide(
        &c,
        &team_a,
        chat,
        model,
        30,
        "```py\nprint(1)\n```",
        &s,
        10_000,
    );
    assert_eq!(o.policy_name(), "default");
    // 3 s later the sample is stale: no burst.
    let o = decide(&c, &team_a, chat, model, 30, "hi there", &s, 13_001);
    assert_eq!(o.policy_name(), "default");
    assert!(matches!(
        o.decision,
        Decision::RoutePool {
            include_usage: true,
            ..
        }
    ));

    s.update(0, 0.95, 10_000);
    let o = decide(&c, &trial, chat, model, 5000, "long", &s, 10_000);
    assert_eq!(
        o.decision,
        Decision::Shed {
            retry_after_s: 10,
            message: "trial capacity is full; retry in a few seconds"
        }
    );
    s.update(0, 0.1, 10_000);
    let o = decide(&c, &trial, chat, model, 5000, "long", &s, 10_000);
    assert_eq!(
        o.decision,
        Decision::Reject {
            status: 413,
            message: "trial prompts are limited to 4000 tokens"
        }
    );
    let o = decide(&c, &trial, chat, model, 4000, "long", &s, 10_000);
    assert_eq!(o.policy_name(), "default");
}

#[test]
fn jwt_tenants_and_model_routing() {
    let c = compile(&parse_json(JWT).unwrap()).unwrap();
    let s = PoolStates::new(&c);
    let red = [("x-jwt-org", "red"), ("x-kvasir-debug", "1")];
    let green = [("x-jwt-org", "org-green")];
    let o = decide(
        &c,
        &green,
        ApiKind::AnthropicMessages,
        "llama-3.1-8b-instruct",
        10,
        "",
        &s,
        0,
    );
    assert_eq!(
        o.decision,
        Decision::Reject {
            status: 403,
            message: "the Anthropic API is for enterprise plans"
        }
    );
    let o = decide(
        &c,
        &red,
        ApiKind::AnthropicMessages,
        "llama-3.1-70b-instruct",
        10,
        "",
        &s,
        0,
    );
    assert_eq!(o.policy_name(), "enterprise-debug");
    assert!(matches!(
        o.decision,
        Decision::RoutePool {
            priority: -5,
            include_usage: true,
            ..
        }
    ));
    let o = decide(
        &c,
        &green,
        ApiKind::Chat,
        "llama-3.1-8b-instruct",
        10,
        "",
        &s,
        0,
    );
    assert_eq!((o.policy_name(), pool_of(&o)), ("llama-family", "llama"));
    let o = decide(&c, &green, ApiKind::Completions, "qwen", 10, "", &s, 0);
    match o.decision {
        Decision::RoutePool {
            pool,
            rewrite_model,
            ..
        } => {
            assert_eq!(
                (
                    pool.name.as_str(),
                    pool.indexer_pool.as_str(),
                    rewrite_model
                ),
                ("qwen", "qwen3", Some("qwen3-8b"))
            );
        }
        d => panic!("{d:?}"),
    }
    let o = decide(&c, &green, ApiKind::Chat, "mistral-7b", 10, "", &s, 0);
    assert_eq!(
        (o.matched, o.decision),
        (
            Matched::Default,
            Decision::Reject {
                status: 404,
                message: "unknown model"
            }
        )
    );
}
