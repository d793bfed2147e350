//! The per-request matcher: what the filter runs for every request.
//!
//! Pure and allocation-free on the hot path: conditions are tested
//! cheapest first (tenant, API, model, tokens, headers, pool state), and the
//! prompt text is read only when a condition or the PII guard rule needs a
//! classification, at most once per kind per request.

use std::collections::{BTreeMap, HashMap};
use std::ops::ControlFlow;

use crate::config::*;
use crate::pii::{self, PiiKinds};
use crate::types::ApiKind;

/// Request headers, looked up by lowercase name.
pub trait Headers {
    /// The first value of the header `name` (given in lowercase).
    fn header(&self, name: &str) -> Option<&str>;
}

impl<K: AsRef<str>, V: AsRef<str>> Headers for [(K, V)] {
    fn header(&self, name: &str) -> Option<&str> {
        self.iter()
            .find(|(k, _)| k.as_ref().eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_ref())
    }
}

impl<K: AsRef<str>, V: AsRef<str>> Headers for Vec<(K, V)> {
    fn header(&self, name: &str) -> Option<&str> {
        self.as_slice().header(name)
    }
}

impl<K: AsRef<str>, V: AsRef<str>, const N: usize> Headers for [(K, V); N] {
    fn header(&self, name: &str) -> Option<&str> {
        self.as_slice().header(name)
    }
}

impl<T: Headers + ?Sized> Headers for &T {
    fn header(&self, name: &str) -> Option<&str> {
        (**self).header(name)
    }
}

/// Keys must be lowercase.
impl Headers for BTreeMap<String, String> {
    fn header(&self, name: &str) -> Option<&str> {
        self.get(name).map(String::as_str)
    }
}

/// Keys must be lowercase.
impl<S: std::hash::BuildHasher> Headers for HashMap<String, String, S> {
    fn header(&self, name: &str) -> Option<&str> {
        self.get(name).map(String::as_str)
    }
}

/// No headers at all.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHeaders;

impl Headers for NoHeaders {
    fn header(&self, _: &str) -> Option<&str> {
        None
    }
}

/// Access to the request's text for classification, visited piece by
/// piece so the filter can hand over what it parsed without concatenating
/// it.
///
/// Two views: [`PromptText::visit`] is the prompt proper (the message
/// contents, system prompt included), which the "easy" classification and
/// token estimates read; [`PromptText::visit_strings`] is every string the
/// request would carry to a provider (tool calls, names, tool schemas,
/// `user`, any field at any depth), which the PII scan reads.
pub trait PromptText {
    /// Calls `f` on each piece of prompt text until it breaks.
    fn visit(&self, f: &mut dyn FnMut(&str) -> ControlFlow<()>) -> ControlFlow<()>;

    /// Calls `f` on every string the request carries until it breaks, or
    /// says the request cannot be fully scanned as text (token ids, a body
    /// it cannot walk), which the PII scan counts as PII. By default the
    /// prompt text is all there is.
    fn visit_strings(
        &self,
        f: &mut dyn FnMut(&str) -> ControlFlow<()>,
    ) -> Result<ControlFlow<()>, Unscannable> {
        Ok(self.visit(f))
    }
}

/// A request holds something the PII scan cannot read as text: it counts
/// as containing PII ([`PiiKinds::UNSCANNABLE`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unscannable;

impl PromptText for str {
    fn visit(&self, f: &mut dyn FnMut(&str) -> ControlFlow<()>) -> ControlFlow<()> {
        f(self)
    }
}

impl PromptText for String {
    fn visit(&self, f: &mut dyn FnMut(&str) -> ControlFlow<()>) -> ControlFlow<()> {
        f(self)
    }
}

impl<T: AsRef<str>> PromptText for [T] {
    fn visit(&self, f: &mut dyn FnMut(&str) -> ControlFlow<()>) -> ControlFlow<()> {
        for s in self {
            f(s.as_ref())?;
        }
        ControlFlow::Continue(())
    }
}

impl<T: AsRef<str>> PromptText for Vec<T> {
    fn visit(&self, f: &mut dyn FnMut(&str) -> ControlFlow<()>) -> ControlFlow<()> {
        self.as_slice().visit(f)
    }
}

impl<T: AsRef<str>, const N: usize> PromptText for [T; N] {
    fn visit(&self, f: &mut dyn FnMut(&str) -> ControlFlow<()>) -> ControlFlow<()> {
        self.as_slice().visit(f)
    }
}

impl<T: PromptText + ?Sized> PromptText for &T {
    fn visit(&self, f: &mut dyn FnMut(&str) -> ControlFlow<()>) -> ControlFlow<()> {
        (**self).visit(f)
    }

    fn visit_strings(
        &self,
        f: &mut dyn FnMut(&str) -> ControlFlow<()>,
    ) -> Result<ControlFlow<()>, Unscannable> {
        (**self).visit_strings(f)
    }
}

/// No text at all: classifies as no PII, no code.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoText;

impl PromptText for NoText {
    fn visit(&self, _: &mut dyn FnMut(&str) -> ControlFlow<()>) -> ControlFlow<()> {
        ControlFlow::Continue(())
    }
}

/// What the matcher knows about one request.
pub struct RequestFacts<'a> {
    /// The resolved tenant's name (see [`crate::resolve_tenant`]); `None`
    /// matches no tenant condition.
    pub tenant: Option<&'a str>,
    /// The API used.
    pub api: ApiKind,
    /// The `model` of the body.
    pub model: &'a str,
    /// Request headers.
    pub headers: &'a dyn Headers,
    /// Estimated prompt size in tokens (e.g. [`estimate_tokens`]).
    pub estimated_prompt_tokens: u32,
    /// The prompt text, read only if classification is needed.
    pub prompt: &'a dyn PromptText,
}

/// A cheap prompt-size estimate: about 4 bytes of text per token for
/// English and code, which is what "easy" thresholds are written against.
pub fn estimate_tokens(text_bytes: usize) -> u32 {
    u32::try_from(text_bytes.div_ceil(4)).unwrap_or(u32::MAX)
}

/// A pool's saturation as last learned from the indexer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolSample {
    /// Saturation, 0..1.
    pub saturation: f64,
    /// When it was learned (the filter's clock, ms).
    pub at_ms: u64,
}

/// Saturation per pool (by pool index), with the time each was learned, so
/// stale values can be ignored.
#[derive(Debug, Clone, Default)]
pub struct PoolStates {
    samples: Vec<Option<PoolSample>>,
}

impl PoolStates {
    /// An empty table sized for `cfg`'s pools.
    pub fn new(cfg: &FilterConfig) -> PoolStates {
        PoolStates {
            samples: vec![None; cfg.pools().len()],
        }
    }

    /// Records pool `pool`'s saturation at `at_ms`. A non-finite value
    /// clears the sample (unknown state).
    pub fn update(&mut self, pool: usize, saturation: f64, at_ms: u64) {
        if self.samples.len() <= pool {
            self.samples.resize(pool + 1, None);
        }
        self.samples[pool] = saturation.is_finite().then_some(PoolSample {
            saturation: saturation.clamp(0.0, 1.0),
            at_ms,
        });
    }

    /// [`PoolStates::update`] by pool name; false for an unknown pool.
    pub fn update_by_name(
        &mut self,
        cfg: &FilterConfig,
        pool: &str,
        saturation: f64,
        at_ms: u64,
    ) -> bool {
        match cfg.pool_index(pool) {
            Some(i) => {
                self.update(i, saturation, at_ms);
                true
            }
            None => false,
        }
    }

    /// Forgets a pool's state.
    pub fn clear(&mut self, pool: usize) {
        if let Some(s) = self.samples.get_mut(pool) {
            *s = None;
        }
    }

    /// The last sample of a pool.
    pub fn sample(&self, pool: usize) -> Option<PoolSample> {
        self.samples.get(pool).copied().flatten()
    }

    /// The saturation if it is at most `max_age_ms` old at `now_ms`.
    pub fn fresh_saturation(&self, pool: usize, now_ms: u64, max_age_ms: u32) -> Option<f64> {
        self.sample(pool)
            .filter(|s| now_ms.saturating_sub(s.at_ms) <= u64::from(max_age_ms))
            .map(|s| s.saturation)
    }
}

/// What to do with a request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision<'c> {
    /// Pick an endpoint of `pool` through the indexer.
    RoutePool {
        /// The pool.
        pool: &'c PoolConfig,
        /// Its index (for [`PoolStates`] and stats arrays).
        pool_index: usize,
        /// Rewrite the body's `model` to this.
        rewrite_model: Option<&'c str>,
        /// Priority for the indexer's `Hints`.
        priority: i32,
        /// Inject `stream_options.include_usage`.
        include_usage: bool,
    },
    /// Answer with an error.
    Reject {
        /// HTTP status.
        status: u16,
        /// Message for the error body.
        message: &'c str,
    },
    /// Send to an external provider (its cluster, authority and auth header
    /// are in `provider`).
    Provider {
        /// The provider.
        provider: &'c ProviderConfig,
        /// Rewrite the body's `model` to this.
        rewrite_model: Option<&'c str>,
        /// Inject `stream_options.include_usage`.
        include_usage: bool,
    },
    /// Answer 429 with `Retry-After`.
    Shed {
        /// Seconds for `Retry-After`.
        retry_after_s: u32,
        /// Message for the error body.
        message: &'c str,
    },
}

impl Decision<'_> {
    /// A short word for stats labels: `route`, `reject`, `provider`, `shed`.
    pub fn kind(&self) -> &'static str {
        match self {
            Decision::RoutePool { .. } => "route",
            Decision::Reject { .. } => "reject",
            Decision::Provider { .. } => "provider",
            Decision::Shed { .. } => "shed",
        }
    }
}

/// Which rule decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Matched<'c> {
    /// A policy matched (first match).
    Policy {
        /// Its index in the policy list.
        index: usize,
        /// Its name.
        name: &'c str,
    },
    /// No policy matched: the default action.
    Default,
    /// The request is PII inside a guard's scope, no non-provider policy
    /// matched and the default action is a provider: the first guard whose
    /// scope holds decided instead.
    PiiGuardFallback {
        /// The guard's index.
        index: usize,
        /// The guard's name.
        name: &'c str,
    },
}

/// The matcher's answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome<'c> {
    /// What to do.
    pub decision: Decision<'c>,
    /// Which rule decided.
    pub matched: Matched<'c>,
    /// PII kinds found, if the prompt was scanned (`None`: not needed).
    pub pii: Option<PiiKinds>,
    /// The easy verdict, if it was needed.
    pub easy: Option<bool>,
    /// Whether some provider policy matched but was skipped because the
    /// request is PII inside a guard's scope.
    pub provider_skipped_for_pii: bool,
}

impl<'c> Outcome<'c> {
    /// The deciding policy's name, or `default` (a stats label).
    pub fn policy_name(&self) -> &'c str {
        match self.matched {
            Matched::Policy { name, .. } | Matched::PiiGuardFallback { name, .. } => name,
            Matched::Default => "default",
        }
    }
}

/// Lazy per-request state.
struct Cx<'c, 'r> {
    cfg: &'c FilterConfig,
    req: &'r RequestFacts<'r>,
    tenant: Option<u32>,
    pools: &'r PoolStates,
    now_ms: u64,
    pii: Option<PiiKinds>,
    easy: Option<bool>,
    guarded: Option<bool>,
}

impl Cx<'_, '_> {
    fn pii(&mut self) -> PiiKinds {
        if let Some(p) = self.pii {
            return p;
        }
        let enabled = self.cfg.idx.pii;
        let mut found = PiiKinds::NONE;
        if !enabled.is_empty() {
            // Every string that would leave, not just the prompt: PII in a
            // tool call's arguments leaks as surely as in a message.
            let walked = self.req.prompt.visit_strings(&mut |s| {
                for k in pii::scan(s, enabled).iter() {
                    found.insert(k);
                }
                if found.contains_all(enabled) {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            });
            if walked.is_err() {
                // What cannot be read cannot be cleared.
                found = found.union(PiiKinds::UNSCANNABLE);
            }
        }
        self.pii = Some(found);
        found
    }

    fn easy(&mut self) -> bool {
        if let Some(e) = self.easy {
            return e;
        }
        let c = &self.cfg.doc.classification;
        let mut e = self.req.estimated_prompt_tokens <= c.easy_max_prompt_tokens;
        if e && c.easy_no_code_fences {
            let _ = self.req.prompt.visit(&mut |s| {
                if s.contains("```") {
                    e = false;
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            });
        }
        self.easy = Some(e);
        e
    }

    fn tenant_ok(&self, p: &RtPolicy) -> bool {
        match &p.tenants {
            None => true,
            Some(ts) => self.tenant.is_some_and(|t| ts.binary_search(&t).is_ok()),
        }
    }

    fn api_ok(&self, p: &RtPolicy) -> bool {
        p.apis == 0 || p.apis & api_bit(self.req.api) != 0
    }

    fn model_ok(&self, i: usize, p: &RtPolicy) -> bool {
        if !p.models {
            return true;
        }
        let model = self.req.model;
        let exact = self.cfg.doc.policies[i]
            .match_
            .models
            .as_ref()
            .is_some_and(|m| m.exact.binary_search_by(|x| x.as_str().cmp(model)).is_ok());
        exact || p.globs.iter().any(|g| g.matches(model))
    }

    /// The scope conditions: who and what, never the situation.
    fn in_scope(&self, i: usize) -> bool {
        let p = &self.cfg.idx.policies[i];
        self.tenant_ok(p) && self.api_ok(p) && self.model_ok(i, p)
    }

    fn matches(&mut self, i: usize) -> bool {
        let cfg = self.cfg;
        let p = &cfg.idx.policies[i];
        if !self.in_scope(i) {
            return false;
        }
        if let Some((min, max)) = p.tokens {
            let t = self.req.estimated_prompt_tokens;
            if t < min || t > max {
                return false;
            }
        }
        let m = &cfg.doc.policies[i].match_;
        for h in &m.headers {
            let v = self.req.headers.header(&h.name);
            let ok = if let Some(x) = &h.exact {
                v == Some(x.as_str())
            } else if let Some(x) = &h.prefix {
                v.is_some_and(|v| v.starts_with(x.as_str()))
            } else {
                v.is_some() == h.present.unwrap_or(true)
            };
            if !ok {
                return false;
            }
        }
        if let Some((pool, above, below)) = p.pool_state {
            let Some(s) = self.pools.fresh_saturation(
                pool as usize,
                self.now_ms,
                self.cfg.doc.pool_state_max_age_ms,
            ) else {
                return false;
            };
            if above.is_some_and(|a| s <= a) || below.is_some_and(|b| s >= b) {
                return false;
            }
        }
        if let Some(want) = m.easy {
            if self.easy() != want {
                return false;
            }
        }
        if let Some(want) = m.pii {
            if self.pii().is_empty() == want {
                return false;
            }
        }
        true
    }

    /// Whether the request is PII inside some guard's scope.
    fn guarded(&mut self) -> bool {
        if let Some(g) = self.guarded {
            return g;
        }
        let in_some_scope = self
            .cfg
            .idx
            .guards
            .iter()
            .any(|&g| self.in_scope(g as usize));
        let g = in_some_scope && !self.pii().is_empty();
        self.guarded = Some(g);
        g
    }
}

impl FilterConfig {
    /// Decides what to do with a request: the first policy whose match
    /// holds, else the default action, with the PII guard rule applied (see
    /// the crate docs). `now_ms` is compared with the pool samples' times.
    pub fn evaluate<'c>(
        &'c self,
        req: &RequestFacts<'_>,
        pools: &PoolStates,
        now_ms: u64,
    ) -> Outcome<'c> {
        let mut cx = Cx {
            cfg: self,
            req,
            tenant: req
                .tenant
                .and_then(|t| self.tenant_index(t))
                .map(|i| i as u32),
            pools,
            now_ms,
            pii: None,
            easy: None,
            guarded: None,
        };
        let mut skipped = false;
        for i in 0..self.idx.policies.len() {
            if !cx.matches(i) {
                continue;
            }
            if matches!(self.idx.policies[i].action, RtAction::Provider(_)) && cx.guarded() {
                skipped = true;
                continue;
            }
            let p = &self.doc.policies[i];
            return Outcome {
                decision: self.decision(&p.action, self.idx.policies[i].action),
                matched: Matched::Policy {
                    index: i,
                    name: &p.name,
                },
                pii: cx.pii,
                easy: cx.easy,
                provider_skipped_for_pii: skipped,
            };
        }
        if matches!(self.idx.default_action, RtAction::Provider(_)) && cx.guarded() {
            // `guarded` means some guard's scope holds.
            if let Some(&g) = self.idx.guards.iter().find(|&&g| cx.in_scope(g as usize)) {
                let p = &self.doc.policies[g as usize];
                return Outcome {
                    decision: self.decision(&p.action, self.idx.policies[g as usize].action),
                    matched: Matched::PiiGuardFallback {
                        index: g as usize,
                        name: &p.name,
                    },
                    pii: cx.pii,
                    easy: cx.easy,
                    provider_skipped_for_pii: true,
                };
            }
        }
        Outcome {
            decision: self.decision(&self.doc.default_action, self.idx.default_action),
            matched: Matched::Default,
            pii: cx.pii,
            easy: cx.easy,
            provider_skipped_for_pii: skipped,
        }
    }

    fn decision<'c>(&'c self, a: &'c ActionConfig, rt: RtAction) -> Decision<'c> {
        match (a, rt) {
            (ActionConfig::Route(r), RtAction::Route(k)) => Decision::RoutePool {
                pool: &self.doc.pools[k as usize],
                pool_index: k as usize,
                rewrite_model: r.rewrite_model.as_deref(),
                priority: r.priority,
                include_usage: r.include_usage,
            },
            (ActionConfig::Provider(p), RtAction::Provider(k)) => Decision::Provider {
                provider: &self.doc.providers[k as usize],
                rewrite_model: p.rewrite_model.as_deref(),
                include_usage: p.include_usage,
            },
            (ActionConfig::Shed(s), _) => Decision::Shed {
                retry_after_s: s.retry_after_s,
                message: &s.message,
            },
            (ActionConfig::Reject(r), _) => Decision::Reject {
                status: r.status,
                message: &r.message,
            },
            // The index is built from the same action; a mismatch cannot
            // happen, but a request must never panic: refuse it.
            _ => Decision::Reject {
                status: 500,
                message: "internal policy error",
            },
        }
    }
}
