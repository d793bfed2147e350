//! The PII guard rule: a PII request inside a guard's scope never goes to a
//! provider, whatever the order of the policies; everything else is plain
//! first match.

use crate::common;
use common::*;
use kvasir_policy::*;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::ops::ControlFlow;

const PII: &str = "my card is 4111 1111 1111 1111";
const CLEAN: &str = "what is the capital of France?";

fn is_provider(o: &Outcome<'_>) -> bool {
    matches!(o.decision, Decision::Provider { .. })
}

#[test]
fn provider_before_guard_is_skipped_for_pii_in_scope() {
    let c = cfg(
        r#"[
          {"name": "burst", "match": {}, "action": {"provider": {"provider": "ext"}}},
          {"name": "guard", "piiGuard": true, "match": {"tenantClasses": ["gold"]}, "action": {"route": {"pool": "alt"}}}
        ]"#,
        r#"{"route": {"pool": "main"}}"#,
    );
    // PII, gold tenant: the guard decides.
    let out = eval(
        &c,
        &Req {
            tenant: Some("a"),
            text: PII,
            ..Req::default()
        },
    );
    assert_eq!(out.policy_name(), "guard");
    assert!(out.provider_skipped_for_pii);
    assert!(out.pii.is_some_and(|p| p.contains(PiiKind::PaymentCard)));
    // No PII: the order decides.
    let out = eval(
        &c,
        &Req {
            tenant: Some("a"),
            text: CLEAN,
            ..Req::default()
        },
    );
    assert_eq!(out.policy_name(), "burst");
    assert!(!out.provider_skipped_for_pii);
    // PII outside the guard's scope (free tenant): the order decides.
    let out = eval(
        &c,
        &Req {
            tenant: Some("c"),
            text: PII,
            ..Req::default()
        },
    );
    assert_eq!(out.policy_name(), "burst");
}

#[test]
fn guard_scope_ignores_situational_conditions() {
    // The guard only matches when `alt` is not saturated and with a header,
    // but its scope (gold tenants, model m1) protects regardless.
    let c = cfg(
        r#"[
          {"name": "burst", "match": {"poolState": {"pool": "main", "saturationAbove": 0.5}}, "action": {"provider": {"provider": "ext"}}},
          {"name": "guard", "piiGuard": true,
           "match": {"tenantClasses": ["gold"], "models": ["m1"], "headers": [{"name": "x-secure", "present": true}],
                     "poolState": {"pool": "alt", "saturationBelow": 0.5}},
           "action": {"route": {"pool": "alt"}}},
          {"name": "rest", "match": {"tenants": ["a"]}, "action": {"route": {"pool": "main", "priority": 1}}}
        ]"#,
        r#"{"reject": {"status": 503}}"#,
    );
    let mut s = PoolStates::new(&c);
    s.update(c.pool_index("main").unwrap(), 0.9, 0);
    s.update(c.pool_index("alt").unwrap(), 0.9, 0);
    let (out, _) = eval_with(
        &c,
        &Req {
            tenant: Some("a"),
            text: PII,
            ..Req::default()
        },
        &s,
        0,
    );
    assert_eq!(
        out.policy_name(),
        "rest",
        "burst skipped, guard does not match, next inside policy"
    );
    let (out, _) = eval_with(
        &c,
        &Req {
            tenant: Some("b"),
            text: PII,
            ..Req::default()
        },
        &s,
        0,
    );
    assert_eq!(out.policy_name(), "default");
    assert_eq!(
        out.decision,
        Decision::Reject {
            status: 503,
            message: "request rejected by policy"
        }
    );
    // Another model is outside the scope.
    let (out, _) = eval_with(
        &c,
        &Req {
            tenant: Some("b"),
            model: "m2",
            text: PII,
            ..Req::default()
        },
        &s,
        0,
    );
    assert_eq!(out.policy_name(), "burst");
}

#[test]
fn provider_default_falls_back_to_the_guard() {
    let c = cfg(
        r#"[
          {"name": "g-free", "piiGuard": true, "match": {"tenantClasses": ["free"], "pii": true}, "action": {"reject": {"status": 422, "message": "no PII on the free tier"}}},
          {"name": "g-gold", "piiGuard": true, "match": {"tenantClasses": ["gold"], "pii": true, "promptTokens": {"max": 5}}, "action": {"route": {"pool": "alt"}}}
        ]"#,
        r#"{"provider": {"provider": "ext"}}"#,
    );
    // Gold PII with a long prompt: g-gold does not match, the default is a
    // provider, so g-gold's action decides.
    let out = eval(
        &c,
        &Req {
            tenant: Some("a"),
            tokens: 100,
            text: PII,
            ..Req::default()
        },
    );
    assert_eq!(
        out.matched,
        Matched::PiiGuardFallback {
            index: 1,
            name: "g-gold"
        }
    );
    assert!(matches!(out.decision, Decision::RoutePool { pool, .. } if pool.name == "alt"));
    assert!(out.provider_skipped_for_pii);
    // Free PII: matched by its guard directly.
    let out = eval(
        &c,
        &Req {
            tenant: Some("c"),
            text: PII,
            ..Req::default()
        },
    );
    assert_eq!(
        out.matched,
        Matched::Policy {
            index: 0,
            name: "g-free"
        }
    );
    // Not PII: the provider default.
    let out = eval(
        &c,
        &Req {
            tenant: Some("a"),
            tokens: 100,
            text: CLEAN,
            ..Req::default()
        },
    );
    assert_eq!(out.matched, Matched::Default);
    assert!(is_provider(&out));
}

#[test]
fn scan_only_when_a_provider_could_win() {
    let c = cfg(
        r#"[
          {"name": "inside", "match": {"models": ["m2"]}, "action": {"route": {"pool": "main"}}},
          {"name": "burst", "match": {"models": ["m1"]}, "action": {"provider": {"provider": "ext"}}},
          {"name": "guard", "piiGuard": true, "match": {"tenants": ["a"]}, "action": {"route": {"pool": "alt"}}}
        ]"#,
        r#"{"route": {"pool": "main"}}"#,
    );
    assert!(c.needs_pii_scan());
    let s = PoolStates::new(&c);
    // The first policy decides: no scan.
    let (out, visits) = eval_with(
        &c,
        &Req {
            model: "m2",
            text: PII,
            ..Req::default()
        },
        &s,
        0,
    );
    assert_eq!((out.policy_name(), visits, out.pii), ("inside", 0, None));
    // A provider matches, tenant outside every scope: no scan either.
    let (out, visits) = eval_with(
        &c,
        &Req {
            tenant: Some("b"),
            text: PII,
            ..Req::default()
        },
        &s,
        0,
    );
    assert_eq!((out.policy_name(), visits), ("burst", 0));
    // A provider matches inside a scope: one scan.
    let (out, visits) = eval_with(
        &c,
        &Req {
            text: PII,
            ..Req::default()
        },
        &s,
        0,
    );
    assert_eq!((out.policy_name(), visits), ("guard", 1));
}

/// A random match: some scope conditions, some situational ones.
fn random_match(r: &mut StdRng) -> String {
    let mut parts = Vec::new();
    if r.random_ratio(40, 100) {
        parts.push(
            [
                "\"tenants\": [\"a\"]",
                "\"tenants\": [\"b\", \"c\"]",
                "\"tenantClasses\": [\"gold\"]",
                "\"tenantClasses\": [\"free\"]",
            ][r.random_range(0..4usize)]
            .to_owned(),
        );
    }
    if r.random_ratio(30, 100) {
        parts.push(
            [
                "\"models\": [\"m1\"]",
                "\"models\": [\"m*\"]",
                "\"models\": [\"m2\", \"x?\"]",
            ][r.random_range(0..3usize)]
            .to_owned(),
        );
    }
    if r.random_ratio(20, 100) {
        parts.push(
            [
                "\"apis\": [\"chat\"]",
                "\"apis\": [\"completions\", \"anthropicMessages\"]",
            ][r.random_range(0..2usize)]
            .to_owned(),
        );
    }
    if r.random_ratio(25, 100) {
        parts.push(["\"pii\": true", "\"pii\": false"][r.random_range(0..2usize)].to_owned());
    }
    if r.random_ratio(25, 100) {
        parts.push(["\"easy\": true", "\"easy\": false"][r.random_range(0..2usize)].to_owned());
    }
    if r.random_ratio(25, 100) {
        parts.push(
            [
                "\"poolState\": {\"pool\": \"main\", \"saturationAbove\": 0.5}",
                "\"poolState\": {\"pool\": \"alt\", \"saturationBelow\": 0.5}",
            ][r.random_range(0..2usize)]
            .to_owned(),
        );
    }
    if r.random_ratio(20, 100) {
        parts.push(
            [
                "\"promptTokens\": {\"max\": 100}",
                "\"promptTokens\": {\"min\": 50}",
            ][r.random_range(0..2usize)]
            .to_owned(),
        );
    }
    if r.random_ratio(15, 100) {
        parts.push("\"headers\": [{\"name\": \"x-burst\", \"present\": true}]".to_owned());
    }
    format!("{{{}}}", parts.join(", "))
}

fn random_action(r: &mut StdRng, provider_pct: u32) -> String {
    if r.random_ratio(provider_pct, 100) {
        return r#"{"provider": {"provider": "ext"}}"#.to_owned();
    }
    [
        r#"{"route": {"pool": "main"}}"#,
        r#"{"route": {"pool": "alt", "priority": 2}}"#,
        r#"{"reject": {"status": 403}}"#,
        r#"{"shed": {"retryAfterS": 2}}"#,
    ][r.random_range(0..4usize)]
    .to_owned()
}

/// Plain first match on the policy set, for the non-guarded cases: the
/// policy's match is evaluated by compiling it alone in front of a marker.
fn first_match_reference(
    c: &FilterConfig,
    policies: &[String],
    default: &str,
    req: &Req<'_>,
    s: &[(usize, f64)],
) -> String {
    for (i, p) in policies.iter().enumerate() {
        // Strip the guard flag so the reference never applies the rule.
        let alone = p.replace("\"piiGuard\": true, ", "");
        let one = cfg(&format!("[{alone}]"), r#"{"reject": {"status": 599}}"#);
        let mut st = PoolStates::new(&one);
        for &(k, v) in s {
            st.update(k, v, 0);
        }
        let (out, _) = eval_with(&one, req, &st, 0);
        if out.matched != Matched::Default {
            return c.policies()[i].name.clone();
        }
    }
    let _ = default;
    "default".to_owned()
}

#[test]
fn pii_in_a_guard_scope_never_goes_to_a_provider_in_any_order() {
    // Seeded: every run explores the same cases.
    let mut r = StdRng::seed_from_u64(0x9e37_79b9_7f4a_7c15);
    let texts = [
        PII,
        CLEAN,
        "mail jane@example.com",
        "```fn main(){}```",
        "SSN 123-45-6789",
    ];
    let tenants = [Some("a"), Some("b"), Some("c"), None];
    let models = ["m1", "m2", "xy", "zz"];
    let apis = [
        ApiKind::Chat,
        ApiKind::Completions,
        ApiKind::AnthropicMessages,
    ];
    let mut guarded_cases = 0;
    let mut skipped_cases = 0;
    let mut compiled = 0;
    for round in 0..300 {
        // 2-7 policies, at least one guard; providers are common.
        let n = 2 + r.random_range(0..6usize);
        let mut policies: Vec<String> = (0..n)
            .map(|i| {
                let guard = i == 0 || r.random_ratio(20, 100);
                let action = if guard {
                    random_action(&mut r, 0)
                } else {
                    random_action(&mut r, 50)
                };
                let g = if guard { "\"piiGuard\": true, " } else { "" };
                format!(
                    r#"{{"name": "p{i}", {g}"match": {}, "action": {action}}}"#,
                    random_match(&mut r)
                )
            })
            .collect();
        let default = random_action(&mut r, 50);
        for _ordering in 0..4 {
            policies.shuffle(&mut r);
            let set = base(&format!("[{}]", policies.join(",")), &default);
            // Random sets can be invalid (unreachable after a catch-all...):
            // the guarantee is about sets that compile.
            let Ok(c) = compile(&set) else { continue };
            compiled += 1;
            for _req in 0..12 {
                let req = Req {
                    tenant: tenants[r.random_range(0..tenants.len())],
                    api: apis[r.random_range(0..apis.len())],
                    model: models[r.random_range(0..models.len())],
                    headers: if r.random_ratio(30, 100) {
                        vec![("x-burst", "1")]
                    } else {
                        vec![]
                    },
                    tokens: [10, 60, 200, 1000][r.random_range(0..4usize)],
                    text: texts[r.random_range(0..texts.len())],
                };
                let mut sat: Vec<(usize, f64)> = Vec::new();
                for k in 0..2 {
                    if r.random_ratio(70, 100) {
                        sat.push((k, [0.1, 0.6, 0.99][r.random_range(0..3usize)]));
                    }
                }
                let mut st = PoolStates::new(&c);
                for &(k, v) in &sat {
                    st.update(k, v, 0);
                }
                let (out, _) = eval_with(&c, &req, &st, 0);
                let is_pii = !pii::scan(req.text, PiiKinds::all()).is_empty();
                let in_scope = c.policies().iter().filter(|p| p.pii_guard).any(|g| {
                    let m = &g.match_;
                    m.tenants
                        .as_ref()
                        .is_none_or(|t| req.tenant.is_some_and(|x| t.iter().any(|y| y == x)))
                        && m.apis.as_ref().is_none_or(|a| a.contains(&req.api))
                        && m.models.as_ref().is_none_or(|ms| {
                            ms.exact.iter().any(|e| e == req.model)
                                || ms
                                    .globs
                                    .iter()
                                    .any(|g| Glob::parse(g).unwrap().matches(req.model))
                        })
                });
                if is_pii && in_scope {
                    guarded_cases += 1;
                    assert!(
                        !is_provider(&out),
                        "round {round}: guarded PII went to a provider via {}\npolicies: {policies:#?}\ndefault: {default}\nreq: tenant {:?} model {} api {:?} text {:?} sat {sat:?}",
                        out.policy_name(), req.tenant, req.model, req.api, req.text
                    );
                    skipped_cases += usize::from(out.provider_skipped_for_pii);
                } else {
                    // Not guarded: exactly plain first match.
                    assert!(!out.provider_skipped_for_pii);
                    let want = first_match_reference(
                        &c,
                        &policies_in_order(&c, &policies),
                        &default,
                        &req,
                        &sat,
                    );
                    assert_eq!(out.policy_name(), want, "round {round}");
                }
            }
        }
    }
    // The generator must actually exercise the rule.
    assert!(guarded_cases > 500, "{guarded_cases}");
    assert!(skipped_cases > 50, "{skipped_cases}");
    assert!(compiled > 400, "{compiled} of 1200 sets compiled");
    println!("{compiled} sets, {guarded_cases} guarded requests, {skipped_cases} with a provider skipped");
}

/// The policy JSON snippets in the compiled order (the names say which).
fn policies_in_order(c: &FilterConfig, policies: &[String]) -> Vec<String> {
    c.policies()
        .iter()
        .map(|p| {
            policies
                .iter()
                .find(|s| s.contains(&format!("\"name\": \"{}\"", p.name)))
                .unwrap()
                .clone()
        })
        .collect()
}

use kvasir_policy::pii;

/// A request whose prompt is clean but which carries more: the PII scan
/// reads `visit_strings`, the easy classification `visit`.
struct Body<'a> {
    prompt: &'a str,
    strings: Result<&'a [&'a str], Unscannable>,
}

impl PromptText for Body<'_> {
    fn visit(&self, f: &mut dyn FnMut(&str) -> ControlFlow<()>) -> ControlFlow<()> {
        f(self.prompt)
    }

    fn visit_strings(
        &self,
        f: &mut dyn FnMut(&str) -> ControlFlow<()>,
    ) -> Result<ControlFlow<()>, Unscannable> {
        let strings = self.strings?;
        if f(self.prompt).is_break() {
            return Ok(ControlFlow::Break(()));
        }
        Ok(strings.visit(f))
    }
}

fn eval_body<'c>(c: &'c FilterConfig, body: &Body<'_>) -> Outcome<'c> {
    let facts = RequestFacts {
        tenant: Some("a"),
        api: ApiKind::Chat,
        model: "m1",
        headers: &NoHeaders,
        estimated_prompt_tokens: 10,
        prompt: body,
    };
    c.evaluate(&facts, &PoolStates::new(c), 0)
}

#[test]
fn the_guard_scans_every_string_not_just_the_prompt() {
    let c = cfg(
        r#"[
          {"name": "burst", "match": {"easy": true}, "action": {"provider": {"provider": "ext"}}},
          {"name": "guard", "piiGuard": true, "match": {"tenantClasses": ["gold"]}, "action": {"route": {"pool": "alt"}}}
        ]"#,
        r#"{"route": {"pool": "main"}}"#,
    );
    let clean: &[&str] = &[
        "lookup",
        "{\"city\":\"Paris\"}",
        "```code in a tool schema```",
    ];
    let out = eval_body(
        &c,
        &Body {
            prompt: CLEAN,
            strings: Ok(clean),
        },
    );
    // Code fences outside the prompt do not make it hard: easy reads the prompt.
    assert_eq!((out.policy_name(), out.easy), ("burst", Some(true)));
    let leaky: &[&str] = &["lookup", "{\"email\":\"jane.doe@example.com\"}"];
    let out = eval_body(
        &c,
        &Body {
            prompt: CLEAN,
            strings: Ok(leaky),
        },
    );
    assert_eq!(out.policy_name(), "guard");
    assert!(out.provider_skipped_for_pii && !is_provider(&out));
    assert_eq!(
        out.pii.map(|p| p.iter().collect::<Vec<_>>()),
        Some(vec![PiiKind::Email])
    );
}

#[test]
fn what_cannot_be_scanned_counts_as_pii() {
    let c = cfg(
        r#"[
          {"name": "clean-out", "match": {"pii": false}, "action": {"provider": {"provider": "ext"}}},
          {"name": "burst", "match": {}, "action": {"provider": {"provider": "ext"}}},
          {"name": "guard", "piiGuard": true, "match": {"tenantClasses": ["gold"]}, "action": {"route": {"pool": "alt"}}}
        ]"#,
        r#"{"provider": {"provider": "ext"}}"#,
    );
    let out = eval_body(
        &c,
        &Body {
            prompt: CLEAN,
            strings: Err(Unscannable),
        },
    );
    assert_eq!(out.policy_name(), "guard");
    assert!(!is_provider(&out));
    let pii = out.pii.unwrap();
    assert!(pii.is_unscannable() && !pii.is_empty());
    assert_eq!(pii.iter().count(), 0, "no kind was actually found");
    // Scannable and clean: out it goes.
    let out = eval_body(
        &c,
        &Body {
            prompt: CLEAN,
            strings: Ok(&[]),
        },
    );
    assert_eq!(out.policy_name(), "clean-out");
    assert!(!out.pii.unwrap().is_unscannable());
}
