//! `kvasirctl explain`: which policy a sample request matches, why each
//! earlier one did not, and what the filter would do.
//!
//! The decision is the filter's own: [`FilterConfig::evaluate`] on the
//! compiled configuration. The "why not" of each policy reuses the same
//! matcher on one-policy configurations (the policy alone, then each of its
//! conditions alone), so no matching logic is written twice.

use std::collections::BTreeMap;
use std::ops::ControlFlow;

use kvasir_api::Compiled;
use kvasir_policy::{
    compile, estimate_tokens, Action, ApiKind, Decision, FilterConfig, Match, Matched,
    Outcome as MatchOutcome, Policy, PolicySet, PoolStates, PromptText, RejectAction, RequestFacts,
    TenantInput, Unscannable,
};
use serde::Serialize;
use serde_json::{json, Value};

/// A sample request.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    /// The tenant by name (skips identification).
    pub tenant: Option<String>,
    /// Request headers, lowercase names (an `--api-key` becomes
    /// `authorization: Bearer <key>`).
    pub headers: Vec<(String, String)>,
    /// A verified JWT claim value (the `payloadInMetadata` source).
    pub jwt_claim: Option<String>,
    /// The API.
    pub api: Option<ApiKind>,
    /// The model (default: the body's `model`).
    pub model: Option<String>,
    /// The request body (JSON).
    pub body: Option<Value>,
    /// Pool saturation samples, 0..1, as if just learned.
    pub saturation: BTreeMap<String, f64>,
}

/// The body as the matcher sees it: the prompt (message contents) for the
/// "easy" rule and token estimate, every string and key for the PII scan.
struct Body<'a>(&'a Value);

fn content_texts<'v>(v: &'v Value, out: &mut Vec<&'v str>) {
    match v {
        Value::String(s) => out.push(s),
        Value::Array(parts) => {
            for p in parts {
                match p {
                    Value::String(s) => out.push(s),
                    _ => {
                        if let Some(t) = p.get("text").and_then(Value::as_str) {
                            out.push(t);
                        }
                    }
                }
            }
        }
        _ => {}
    }
}

impl Body<'_> {
    fn prompt(&self) -> Vec<&str> {
        let mut out = Vec::new();
        if let Some(s) = self.0.get("system") {
            content_texts(s, &mut out);
        }
        for m in self
            .0
            .get("messages")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(c) = m.get("content") {
                content_texts(c, &mut out);
            }
        }
        if let Some(p) = self.0.get("prompt") {
            content_texts(p, &mut out);
        }
        // The Responses API: `instructions`, and `input` as a string or a
        // list of items with their own content.
        if let Some(i) = self.0.get("instructions") {
            content_texts(i, &mut out);
        }
        match self.0.get("input") {
            Some(Value::Array(items)) => {
                for c in items.iter().filter_map(|it| it.get("content")) {
                    content_texts(c, &mut out);
                }
            }
            Some(i) => content_texts(i, &mut out),
            None => {}
        }
        out
    }

    fn has_token_ids(&self) -> bool {
        self.0
            .get("prompt")
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(|x| x.is_number() || x.is_array()))
    }
}

fn walk(v: &Value, f: &mut dyn FnMut(&str) -> ControlFlow<()>) -> ControlFlow<()> {
    match v {
        Value::String(s) => f(s),
        // Long integer literals may be card numbers; the filter scans them.
        Value::Number(n) if n.to_string().len() >= 13 => f(&n.to_string()),
        Value::Array(a) => a.iter().try_for_each(|x| walk(x, f)),
        Value::Object(o) => o.iter().try_for_each(|(k, x)| {
            f(k)?;
            walk(x, f)
        }),
        _ => ControlFlow::Continue(()),
    }
}

impl PromptText for Body<'_> {
    fn visit(&self, f: &mut dyn FnMut(&str) -> ControlFlow<()>) -> ControlFlow<()> {
        self.prompt().into_iter().try_for_each(f)
    }

    fn visit_strings(
        &self,
        f: &mut dyn FnMut(&str) -> ControlFlow<()>,
    ) -> Result<ControlFlow<()>, Unscannable> {
        if self.has_token_ids() {
            return Err(Unscannable);
        }
        Ok(walk(self.0, f))
    }
}

/// One policy's part in the decision.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyLine {
    /// The policy (its InferencePolicy name).
    pub name: String,
    /// `decided`, `notMatched`, `skippedForPii` or `notReached`.
    pub result: &'static str,
    /// The conditions that do not hold (`easy`, `poolState`, ...).
    pub failed: Vec<&'static str>,
}

/// The explanation.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Explanation {
    /// `namespace/Kind/name`.
    pub target: String,
    /// What the matcher knew about the request.
    pub request: Value,
    /// Each policy, in evaluation order.
    pub policies: Vec<PolicyLine>,
    /// `policy`, `default`, `piiGuardFallback` or `tenant` (identification
    /// failed: no policy ran).
    pub decided_by: String,
    /// The deciding policy's name, if any.
    pub policy: Option<String>,
    /// What the filter does.
    pub decision: Value,
}

fn states(cfg: &FilterConfig, s: &Sample) -> Result<PoolStates, String> {
    let mut st = PoolStates::new(cfg);
    for (pool, sat) in &s.saturation {
        if !st.update_by_name(cfg, pool, *sat, 0) {
            let known: Vec<_> = cfg.pools().iter().map(|p| p.name.as_str()).collect();
            return Err(format!(
                "--saturation: unknown pool `{pool}` (this target's pools: {})",
                known.join(", ")
            ));
        }
    }
    Ok(st)
}

/// The decision as JSON; a route's hints are what the filter sends with
/// its pick (the tenant's fair-share `weight`, the pool's
/// `maxQueueWaitMs`).
fn decision_json(d: &Decision<'_>, weight: u32) -> Value {
    match d {
        Decision::RoutePool {
            pool,
            rewrite_model,
            priority,
            include_usage,
            ..
        } => json!({
            "action": "route", "pool": pool.name, "cluster": pool.cluster,
            "rewriteModel": rewrite_model,
            "hints": {"indexerPool": pool.indexer_pool, "priority": priority,
                      "weight": weight, "maxQueueWaitMs": pool.max_queue_wait_ms},
            "includeUsage": include_usage,
        }),
        Decision::Provider {
            provider,
            rewrite_model,
            include_usage,
        } => json!({
            "action": "provider", "provider": provider.name, "cluster": provider.cluster,
            "authority": provider.authority,
            "model": rewrite_model.or(provider.model.as_deref()),
            "includeUsage": include_usage,
        }),
        Decision::Reject { status, message } => {
            json!({"action": "reject", "status": status, "message": message})
        }
        Decision::Shed {
            retry_after_s,
            message,
        } => {
            json!({"action": "shed", "status": 429, "retryAfterS": retry_after_s, "message": message})
        }
    }
}

/// The conditions set in a match, each as a match of its own.
fn conditions(m: &Match) -> Vec<(&'static str, Match)> {
    let mut out = Vec::new();
    let one = |f: &dyn Fn(&mut Match)| {
        let mut x = Match::default();
        f(&mut x);
        x
    };
    if m.tenants.is_some() {
        out.push(("tenants", one(&|x| x.tenants = m.tenants.clone())));
    }
    if m.tenant_classes.is_some() {
        out.push((
            "tenantClasses",
            one(&|x| x.tenant_classes = m.tenant_classes.clone()),
        ));
    }
    if m.models.is_some() {
        out.push(("models", one(&|x| x.models = m.models.clone())));
    }
    if m.apis.is_some() {
        out.push(("apis", one(&|x| x.apis = m.apis.clone())));
    }
    if m.headers.is_some() {
        out.push(("headers", one(&|x| x.headers = m.headers.clone())));
    }
    if m.prompt_tokens.is_some() {
        out.push(("promptTokens", one(&|x| x.prompt_tokens = m.prompt_tokens)));
    }
    if m.pii.is_some() {
        out.push(("pii", one(&|x| x.pii = m.pii)));
    }
    if m.easy.is_some() {
        out.push(("easy", one(&|x| x.easy = m.easy)));
    }
    if m.pool_state.is_some() {
        out.push(("poolState", one(&|x| x.pool_state = m.pool_state.clone())));
    }
    out
}

/// Whether `m` holds, by the matcher, in a configuration holding only it.
fn holds(set: &PolicySet, m: &Match, facts: &RequestFacts<'_>, s: &Sample) -> Result<bool, String> {
    let mut one = set.clone();
    one.policies = vec![Policy {
        name: "probe".into(),
        match_: m.clone(),
        action: Action::Reject(RejectAction {
            status: 599,
            message: None,
        }),
        pii_guard: false,
    }];
    let cfg = compile(&one).map_err(|e| format!("cannot probe a condition: {e:?}"))?;
    let out = cfg.evaluate(facts, &states(&cfg, s)?, 0);
    Ok(matches!(out.matched, Matched::Policy { .. }))
}

fn lines(
    c: &Compiled,
    facts: &RequestFacts<'_>,
    s: &Sample,
    out: &MatchOutcome<'_>,
) -> Result<Vec<PolicyLine>, String> {
    let decided = match out.matched {
        Matched::Policy { index, .. } => Some(index),
        _ => None,
    };
    let mut v = Vec::new();
    for (i, p) in c.set.policies.iter().enumerate() {
        let result = if decided == Some(i) {
            "decided"
        } else if decided.is_some_and(|d| i > d) {
            "notReached"
        } else if holds(&c.set, &p.match_, facts, s)? {
            // It matched but did not decide: only the PII rule does that.
            "skippedForPii"
        } else {
            "notMatched"
        };
        let mut failed = Vec::new();
        if result == "notMatched" {
            for (name, m) in conditions(&p.match_) {
                if !holds(&c.set, &m, facts, s)? {
                    failed.push(name);
                }
            }
        }
        v.push(PolicyLine {
            name: p.name.clone(),
            result,
            failed,
        });
    }
    Ok(v)
}

/// Explains one sample request against a compiled target.
pub fn explain(target: &str, c: &Compiled, s: &Sample) -> Result<Explanation, String> {
    let cfg = &c.config;
    let body = s.body.clone().unwrap_or(Value::Null);
    let model = s
        .model
        .clone()
        .or_else(|| body.get("model").and_then(Value::as_str).map(str::to_owned))
        .ok_or("no model: give --model or a --body with `model`")?;
    let api = s.api.unwrap_or(ApiKind::Chat);
    let text = Body(&body);
    let prompt_bytes: usize = text.prompt().iter().map(|t| t.len()).sum();
    let tenant = match &s.tenant {
        Some(t) => {
            let i = cfg
                .tenant_index(t)
                .ok_or(format!("--tenant: unknown tenant `{t}`"))?;
            Ok((cfg.tenants()[i].name.as_str(), "given"))
        }
        None => cfg
            .resolve_tenant(&TenantInput {
                headers: &s.headers,
                jwt_claim: s.jwt_claim.as_deref(),
            })
            .map(|m| (m.name, via(m.via))),
    };
    let mut request = json!({
        "api": api, "model": model, "estimatedPromptTokens": estimate_tokens(prompt_bytes),
        "saturation": s.saturation,
    });
    let (tenant, tenant_via) = match tenant {
        Ok(t) => t,
        Err(e) => {
            request["tenant"] = Value::Null;
            return Ok(Explanation {
                target: target.to_owned(),
                request,
                policies: Vec::new(),
                decided_by: "tenant".into(),
                policy: None,
                decision: json!({"action": "reject", "status": e.status(), "message": e.to_string()}),
            });
        }
    };
    request["tenant"] = json!(tenant);
    request["tenantVia"] = json!(tenant_via);
    let weight = cfg
        .tenant_index(tenant)
        .map_or(1, |i| cfg.tenants()[i].weight);
    let facts = RequestFacts {
        tenant: Some(tenant),
        api,
        model: &model,
        headers: &s.headers,
        estimated_prompt_tokens: estimate_tokens(prompt_bytes),
        prompt: &text,
    };
    let out = cfg.evaluate(&facts, &states(cfg, s)?, 0);
    request["pii"] = json!(out.pii.map(|k| {
        let mut v: Vec<String> = k
            .iter()
            .map(|x| json!(x).as_str().unwrap_or("").to_owned())
            .collect();
        if k.is_unscannable() {
            v.push("unscannable".into());
        }
        v
    }));
    request["easy"] = json!(out.easy);
    let decided_by = match out.matched {
        Matched::Policy { .. } => "policy",
        Matched::Default => "default",
        Matched::PiiGuardFallback { .. } => "piiGuardFallback",
    };
    Ok(Explanation {
        target: target.to_owned(),
        request,
        policies: lines(c, &facts, s, &out)?,
        decided_by: decided_by.into(),
        policy: (decided_by != "default").then(|| out.policy_name().to_owned()),
        decision: decision_json(&out.decision, weight),
    })
}

fn via(v: kvasir_policy::TenantVia) -> &'static str {
    match v {
        kvasir_policy::TenantVia::Header => "header",
        kvasir_policy::TenantVia::ApiKey => "apiKey",
        kvasir_policy::TenantVia::JwtClaim => "jwtClaim",
        kvasir_policy::TenantVia::Default => "default",
    }
}

impl Explanation {
    /// The explanation for people.
    pub fn text(&self) -> String {
        let mut out = format!("target: {}\nrequest: {}\n", self.target, self.request);
        for p in &self.policies {
            let why = match p.result {
                "decided" => "matched: decides".to_owned(),
                "notReached" => "not reached".to_owned(),
                "skippedForPii" => "matched, skipped: provider action and the request has PII inside a PII guard's scope".to_owned(),
                _ if p.failed.is_empty() => "did not match".to_owned(),
                _ => format!("did not match: {} not met", p.failed.join(", ")),
            };
            out.push_str(&format!("  {:<32} {why}\n", p.name));
        }
        let by = match (&self.policy, self.decided_by.as_str()) {
            (_, "tenant") => "tenant identification (no policy ran)".to_owned(),
            (Some(p), "piiGuardFallback") => {
                format!("PII guard `{p}` (the default would send PII to a provider)")
            }
            (Some(p), _) => format!("policy `{p}`"),
            (None, _) => "defaultAction (no policy matched)".to_owned(),
        };
        out.push_str(&format!("decided by: {by}\ndecision: {}\n", self.decision));
        out
    }
}
