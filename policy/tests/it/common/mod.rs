//! Shared helpers for the integration tests.
#![allow(dead_code)]

use std::cell::Cell;
use std::ops::ControlFlow;

use kvasir_policy::*;

/// A policy set around `policies` (a JSON array) and `default` (an action):
/// header tenants `a`, `b` (gold) and `c` (free), pools `main` (m1, m2) and
/// `alt` (m1), provider `ext` (default model `ext-small`).
pub fn base(policies: &str, default: &str) -> PolicySet {
    let doc = format!(
        r#"{{
      "tenantSource": {{"header": "x-tenant"}},
      "tenants": [
        {{"name": "a", "class": "gold"}},
        {{"name": "b", "class": "gold"}},
        {{"name": "c", "class": "free"}}
      ],
      "pools": [
        {{"name": "main", "models": ["m1", "m2"], "cluster": "main-cluster", "indexerCluster": "idx"}},
        {{"name": "alt", "models": ["m1"], "cluster": "alt-cluster", "indexerCluster": "idx"}}
      ],
      "providers": [
        {{"name": "ext", "cluster": "ext-cluster", "model": "ext-small",
          "auth": {{"header": "authorization", "secretRef": {{"name": "ext", "key": "api-key"}}}}}}
      ],
      "policies": {policies},
      "defaultAction": {default}
    }}"#
    );
    parse_json(&doc).unwrap_or_else(|e| panic!("{e}\n{doc}"))
}

/// Compiles `base(policies, default)`, panicking with the errors.
pub fn cfg(policies: &str, default: &str) -> FilterConfig {
    compile(&base(policies, default)).unwrap_or_else(|e| panic!("{e:?}"))
}

/// A request description with defaults (tenant `a`, chat, model `m1`, 10
/// tokens, no headers, text "hello").
#[derive(Clone)]
pub struct Req<'a> {
    pub tenant: Option<&'a str>,
    pub api: ApiKind,
    pub model: &'a str,
    pub headers: Vec<(&'a str, &'a str)>,
    pub tokens: u32,
    pub text: &'a str,
}

impl Default for Req<'_> {
    fn default() -> Self {
        Req {
            tenant: Some("a"),
            api: ApiKind::Chat,
            model: "m1",
            headers: Vec::new(),
            tokens: 10,
            text: "hello",
        }
    }
}

/// A prompt that counts how often it is read.
pub struct Counting<'a> {
    pub text: &'a str,
    pub visits: Cell<u32>,
}

impl PromptText for Counting<'_> {
    fn visit(&self, f: &mut dyn FnMut(&str) -> ControlFlow<()>) -> ControlFlow<()> {
        self.visits.set(self.visits.get() + 1);
        f(self.text)
    }
}

/// Evaluates `r` against `cfg` with `states` at time `now`; also returns
/// how many times the prompt was read.
pub fn eval_with<'c>(
    cfg: &'c FilterConfig,
    r: &Req<'_>,
    states: &PoolStates,
    now: u64,
) -> (Outcome<'c>, u32) {
    let prompt = Counting {
        text: r.text,
        visits: Cell::new(0),
    };
    let facts = RequestFacts {
        tenant: r.tenant,
        api: r.api,
        model: r.model,
        headers: &r.headers,
        estimated_prompt_tokens: r.tokens,
        prompt: &prompt,
    };
    let out = cfg.evaluate(&facts, states, now);
    (out, prompt.visits.get())
}

/// Evaluates with no pool state.
pub fn eval<'c>(cfg: &'c FilterConfig, r: &Req<'_>) -> Outcome<'c> {
    eval_with(cfg, r, &PoolStates::new(cfg), 0).0
}

/// The deciding policy's name.
pub fn who(cfg: &FilterConfig, r: &Req<'_>) -> String {
    eval(cfg, r).policy_name().to_owned()
}

/// Errors and warnings as display strings.
pub fn findings(set: &PolicySet) -> Vec<String> {
    check(set).iter().map(ToString::to_string).collect()
}
