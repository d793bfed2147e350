//! # kvasir-policy
//!
//! Kvasir's tenants and routing policies: the types the Kubernetes
//! resources and `kvasirctl` carry ([`PolicySet`]), validation with exact
//! error paths ([`validate()`], [`check`]), compilation into the one
//! versioned document the Envoy filter reads ([`compile()`],
//! [`FilterConfig`]), and the matcher the filter runs for every request
//! ([`FilterConfig::evaluate`], [`resolve_tenant`]).
//!
//! The crate is pure (serde, serde_json, serde_path_to_error, sha2,
//! thiserror), has no I/O and no clock, and builds for `wasm32-wasip1`: the
//! decision logic runs the same in the filter and in host unit tests.
//!
//! ```
//! use kvasir_policy::*;
//!
//! let set = parse_json(r#"{
//!   "tenantSource": {"header": "x-tenant"},
//!   "tenants": [{"name": "acme", "class": "gold"}],
//!   "pools": [{"name": "main", "models": ["llama-3-8b"],
//!              "cluster": "vllm", "indexerCluster": "kvasir-indexer"}],
//!   "policies": [
//!     {"name": "gold-first", "match": {"tenantClasses": ["gold"]},
//!      "action": {"route": {"pool": "main", "priority": -1}}}
//!   ],
//!   "defaultAction": {"reject": {"status": 403}}
//! }"#).unwrap();
//! let cfg = compile(&set).unwrap();
//! let bytes = cfg.to_json(); // what the controller writes
//! let cfg = FilterConfig::from_json(&bytes).unwrap(); // the filter's on_configure
//!
//! let headers = [("x-tenant", "acme")];
//! let tenant = resolve_tenant(&cfg, &TenantInput { headers: &headers, jwt_claim: None }).unwrap();
//! let facts = RequestFacts {
//!     tenant: Some(tenant.name),
//!     api: ApiKind::Chat,
//!     model: "llama-3-8b",
//!     headers: &headers,
//!     estimated_prompt_tokens: 12,
//!     prompt: &"hello",
//! };
//! let out = cfg.evaluate(&facts, &PoolStates::new(&cfg), 0);
//! assert_eq!(out.policy_name(), "gold-first");
//! assert!(matches!(out.decision, Decision::RoutePool { priority: -1, .. }));
//! ```
//!
//! ## Evaluation
//!
//! Policies are tried in order; a policy matches when every condition it
//! sets holds (lists inside one condition are alternatives). The first
//! match decides; when none matches, `defaultAction` decides. Conditions:
//! tenants / tenant classes, model (exact or `*`/`?` glob), API kind,
//! request headers (exact, prefix, present/absent), estimated prompt token
//! range, PII (`pii: true|false`), easy (`easy: true|false`), and pool
//! saturation (`poolState`, above and/or below a threshold, from the
//! indexer). A pool-state condition never holds while the pool's state is
//! unknown or older than `poolStateMaxAgeMs`: when the indexer is silent,
//! saturation-driven policies fall through instead of acting on old data.
//! The prompt is classified lazily: only when a condition (or the PII guard
//! rule) needs it, and at most once per request.
//!
//! ## PII guard
//!
//! A policy with `piiGuard: true` is a *PII guard*. Its action must keep the
//! request inside (`route`, `reject` or `shed`; validation refuses
//! `provider`). Its **scope** is the who/what part of its match: its
//! `tenants`, `tenantClasses`, `models` and `apis` conditions (absent ones
//! meaning "any"). The situational conditions (headers, prompt tokens, PII,
//! easy, pool state) are not part of the scope, so a client cannot leave a
//! guard's scope by sending a header, and a guard keeps protecting when its
//! pool is saturated.
//!
//! A request is **guarded** when it contains PII (any enabled detector
//! fires) and it is inside the scope of at least one guard, wherever that
//! guard sits in the list. "Contains" means anywhere it would carry to a
//! provider: the scan reads [`PromptText::visit_strings`], which in the
//! filter is every string value and object key of the body at any depth
//! (tool-call arguments, message names, tool descriptions, `user`, any
//! content part, Anthropic `tool_use` inputs and `tool_result`s), and
//! integer literals long enough to be a card number. A request that cannot
//! be fully scanned (a token-id prompt, a body the walk cannot finish)
//! counts as PII ([`PiiKinds::UNSCANNABLE`]): what cannot be read stays
//! inside. The same scan answers `pii` conditions. For a guarded request:
//!
//! 1. every policy whose action is `provider` is skipped, even when it
//!    matches and comes first;
//! 2. otherwise first-match order is unchanged: the first matching
//!    non-provider policy decides (it may be the guard, or an earlier
//!    `route`/`reject`/`shed` policy, all of which keep the request inside);
//! 3. if none matches and `defaultAction` is a provider, the first guard (in
//!    list order) whose scope holds decides with its own action
//!    ([`Matched::PiiGuardFallback`]); a non-provider default decides as
//!    usual.
//!
//! Hence the guarantee: **a guarded request never gets
//! [`Decision::Provider`], for any order of the policies.** Requests that
//! are not guarded (no PII, or outside every guard's scope) are evaluated
//! by plain first match. [`Outcome::provider_skipped_for_pii`] says when the
//! rule changed a decision. Validation warns when a provider policy comes
//! before a guard whose scope it overlaps (the order suggests the provider
//! wins; it does not for PII traffic), and treats a catch-all provider
//! policy as ending the list except for guarded traffic.
//!
//! The PII scan runs only when needed: when a policy has a `pii` condition,
//! or when a provider policy (or a provider default) matches a request that
//! is inside some guard's scope.
//!
//! ## Tenants
//!
//! See [`mod@tenant`]: the tenant comes from one source (trusted header, API
//! key, JWT claim); with a key or JWT a client-sent tenant header is
//! ignored or rejected, never believed. API keys are stored only as
//! `sha256:<hex>` hashes.
//!
//! ## Budgets
//!
//! A tenant may carry a token `budget` (tokens, prompt tokens, completion
//! tokens and requests per minute, concurrent requests, the weight of a
//! cached prompt token, the output estimate before any is learned);
//! `classBudgets` gives every tenant of a class without its own budget the
//! class's, each in a bucket of its own. See [`mod@budget`]. The compiled
//! tenant carries it with every default filled in ([`BudgetConfig`]); the
//! arithmetic is `kvasir-budget`'s, and where it is enforced is described
//! in that crate's README.
//!
//! ## Fair share and flow control
//!
//! A tenant's `weight` (1..=1000, default its class's from `classWeights`,
//! else 1) is its share of a saturated pool within a priority band,
//! counted in tokens. A pool's `flowControl` (`enabled`, `threshold`,
//! `maxQueued`, `maxQueuedPerTenant`, `maxWaitMs`: the indexer's
//! `pools[].flowControl`, same keys and defaults) makes picks wait at the
//! indexer instead of in an engine's queue; it compiles into the filter's
//! `maxQueueWaitMs` (`maxWaitMs` when enabled, else 0) and, through
//! [`flow::resolve`], into the indexer's section, so the two cannot
//! disagree. See [`mod@flow`].
//!
//! ## The compiled document
//!
//! [`FilterConfig::to_json`] gives canonical bytes: the same policy set
//! (whatever the order of its tenants, pools, providers, hashes, list
//! entries or JSON keys) gives the same bytes. Shape, abbreviated:
//!
//! ```json
//! {"version":"kvasir.filter/v1",
//!  "tenantSource":{"kind":"apiKey","unknownTenant":"reject","tenantHeader":"x-tenant","onTenantHeader":"ignore"},
//!  "tenants":[{"name":"acme","class":"gold","budget":{"tokensPerMinute":100000,"cachedTokenWeightPermille":1000,"defaultOutputTokens":512},"weight":1}],
//!  "apiKeys":[{"hash":"sha256:…","tenant":"acme"}],
//!  "pools":[{"name":"main","models":["llama-3-8b"],"cluster":"vllm","indexerCluster":"kvasir-indexer","indexerPool":"main","indexerTimeoutMs":50,"maxQueueWaitMs":0}],
//!  "providers":[{"name":"openai","cluster":"openai","authority":"api.openai.com","auth":{"header":"authorization","secretRef":{"name":"openai","key":"api-key"}}}],
//!  "classification":{"piiDetectors":["email","phone","paymentCard","iban","nationalId"],"easyMaxPromptTokens":512,"easyNoCodeFences":true},
//!  "poolStateMaxAgeMs":5000,
//!  "policies":[{"name":"keep-pii","piiGuard":true,"match":{"tenants":["acme"]},"action":{"route":{"pool":"main","priority":0,"includeUsage":false}}}],
//!  "defaultAction":{"reject":{"status":403,"message":"request rejected by policy"}}}
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod bounds;
pub mod budget;
pub mod compile;
pub mod config;
mod diagnostic;
pub mod flow;
pub mod glob;
mod json_error;
pub mod matcher;
pub mod parse;
pub mod pii;
mod scope;
mod syntax;
pub mod tenant;
pub mod types;
pub mod validate;

pub use compile::compile;
pub use config::{
    ActionConfig, BudgetConfig, ConfigError, FilterConfig, PoolConfig, ProviderConfig,
    TenantConfig, TenantSourceConfig, TenantSourceKind, FILTER_CONFIG_VERSION,
};
pub use diagnostic::{Severity, ValidationError};
pub use glob::{Glob, GlobError};
pub use matcher::{
    estimate_tokens, Decision, Headers, Matched, NoHeaders, NoText, Outcome, PoolSample,
    PoolStates, PromptText, RequestFacts, Unscannable,
};
pub use parse::{deserialize_with_path, parse_json, parse_json_slice, ParseError, PathError};
pub use pii::PiiKinds;
pub use tenant::{hash_api_key, resolve_tenant, TenantError, TenantInput, TenantMatch, TenantVia};
pub use types::*;
pub use validate::{check, validate};
