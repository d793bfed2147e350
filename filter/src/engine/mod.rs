//! The per-request flow, written against the small [`Host`] trait
//! ([`crate::host`]) so it runs (and is tested) natively; the proxy-wasm
//! glue implements [`Host`] with Envoy's host calls and forwards the SDK's
//! callbacks here.
//!
//! The flow only calls a host function in a state where Envoy accepts it:
//! request headers are changed only while the request is stopped (headers
//! or body callback, or the pick callback before resuming), the body only
//! in the final body callback or the pick callback before resuming (the
//! engine priority), nothing about the request after a local
//! reply or after it was resumed, and response headers only in the
//! response-headers callback. The tests drive it with a host that fails
//! the test on any call outside those states.
//!
//! A request on a stored Responses API response (`GET /v1/responses/{id}`,
//! `POST /v1/responses/{id}/cancel`) has no body to wait for: it is decided
//! and picked for at its headers, with the response id and no prompt. The
//! response side (usage, reports) is [`respond`]'s.

mod govern;
mod local;
mod picked;
mod respond;

use std::borrow::Cow;
use std::rc::Rc;

use kvasir_policy::{
    ApiKind, BudgetConfig, Decision, PoolConfig, ProviderConfig, RequestFacts, TenantError,
    TenantInput, TenantSourceKind,
};

use crate::governance::UsageCadence;
pub use crate::host::{DeferredCall, Host};
use crate::local_budget::LocalAdmission;
use crate::pick::{self, FailOpen, PickInput, Picked};
use crate::reply::{error_reply, shed_reply, LocalReply, Shape};
use crate::request::{
    api_for_path, content_encoding_error, parse_body, stored_response_request, ParsedRequest,
};
use crate::response::ResponseTracker;
use crate::rewrite::{rewrite_body, Rewrite};
pub use crate::shared::Shared;
use crate::stats::{tenant_model_prefix, RequestDecision, UNKNOWN_TENANT};
pub use picked::{pick_deadline_ms, pick_timeout_ms, RESPONSE_PICK_MIN_TIMEOUT_MS};

/// The model label of requests refused before their body was read.
pub const UNKNOWN_MODEL: &str = "unknown";

/// vLLM's request header for the scheduling priority, read over the
/// body's `priority` (`--scheduling-policy priority`).
pub const ENGINE_PRIORITY_HEADER: &str = "x-vllm-priority";

/// What a callback tells Envoy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Go on.
    Continue,
    /// Stop (buffer, wait for the pick, or a local reply was sent).
    Pause,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for request headers.
    Start,
    /// Headers seen, buffering the body.
    Body,
    /// Waiting for the pick's answer.
    Picking(u32),
    /// Forwarded upstream; watching the response.
    Forwarded,
    /// A local reply was sent.
    Replied,
    /// Not an inference request: passed through untouched.
    Passthrough,
    /// The response ended and was accounted.
    Done,
}

/// Where a routed request went, for the response path.
#[derive(Debug, Clone)]
struct Routed {
    pool_name: String,
    indexer_pool: String,
    indexer_cluster: String,
    /// The pool's `reportFirstToken` (or the shared setting's).
    report_first_token: bool,
    picked: Option<Picked>,
}

/// A buffered request body and what was parsed of it.
struct Body<'r, 'b> {
    req: &'r ParsedRequest<'b>,
    bytes: &'b [u8],
    /// The size Envoy reported.
    size: usize,
}

/// One request's flow.
pub struct Flow {
    shared: Rc<Shared>,
    phase: Phase,
    start_ns: u64,
    api: Option<ApiKind>,
    headers: Vec<(String, String)>,
    tenant: Option<String>,
    model_label: String,
    request_id: String,
    routed: Option<Routed>,
    status: Option<u16>,
    served: Option<String>,
    tracker: Option<ResponseTracker>,
    pick_started_ns: u64,
    /// The upstream cut the response after it started (see `on_log`).
    cut: bool,
    /// The stored response the request is bound to (`previous_response_id`
    /// or the path's id).
    response_id: Option<String>,
    /// A `GET` or `cancel` of a stored response: its body repeats the
    /// stored usage, which is not charged again.
    stored: bool,
    /// Whether the engine's id for the response is reported (a Responses
    /// API request that did not set `store: false`).
    learn_response_id: bool,
    /// The budget key of a dispatched pick that carried the tenant's
    /// budget: every report of the request carries it.
    budget_key: Option<String>,
    /// The `x-ratelimit-*` headers of the pick's budget status, added to
    /// the response.
    rate_limit_headers: Vec<(&'static str, String)>,
    /// When the streaming response reports its usage so far.
    usage_cadence: UsageCadence,
    /// The size of the body Envoy holds, once read (after any rewrite):
    /// the pick's answer may rewrite it again ([`Flow::set_engine_priority`]).
    body_len: Option<usize>,
    /// The tenant's budget, for a routed request of a budgeted tenant.
    budget: Option<BudgetConfig>,
    /// The prompt's length as first estimated (from the body), then as the
    /// indexer counted it: what a response that ends without usage is
    /// charged for its prompt.
    prompt_estimate: u64,
    /// The request's own completion cap (0: none).
    max_tokens: u64,
    /// A pick was dispatched (so the indexer may account it).
    pick_dispatched: bool,
    /// The flow acted on the pick's answer (routed, or refused by it); a
    /// dispatched pick whose answer was not used is reported as admitted
    /// locally.
    answer_used: bool,
    /// The request was admitted against this Envoy's share of its tenant's
    /// budget (its pick failed open), until its end releases it.
    local: Option<LocalAdmission>,
    /// The request was admitted by the filter itself, its pick's answer
    /// unused: its reports say so (`ADMISSION_LOCAL`).
    admitted_locally: bool,
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
    h.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

fn tenant_error_code(e: &TenantError) -> &'static str {
    match e {
        TenantError::MissingCredentials => "missing_credentials",
        TenantError::UnknownApiKey => "invalid_api_key",
        TenantError::ConflictingCredentials => "conflicting_credentials",
        TenantError::UnknownTenant => "unknown_tenant",
        TenantError::TenantHeaderNotAllowed { .. } => "tenant_header_not_allowed",
    }
}

impl Flow {
    /// A new request's flow.
    pub fn new(shared: Rc<Shared>) -> Flow {
        Flow {
            shared,
            phase: Phase::Start,
            start_ns: 0,
            api: None,
            headers: Vec::new(),
            tenant: None,
            model_label: UNKNOWN_MODEL.into(),
            request_id: String::new(),
            routed: None,
            status: None,
            served: None,
            tracker: None,
            pick_started_ns: 0,
            cut: false,
            response_id: None,
            stored: false,
            learn_response_id: false,
            budget_key: None,
            rate_limit_headers: Vec::new(),
            usage_cadence: UsageCadence::default(),
            body_len: None,
            budget: None,
            prompt_estimate: 0,
            max_tokens: 0,
            pick_dispatched: false,
            answer_used: false,
            local: None,
            admitted_locally: false,
        }
    }

    fn prefix(&self) -> String {
        tenant_model_prefix(
            self.tenant.as_deref().unwrap_or(UNKNOWN_TENANT),
            &self.model_label,
        )
    }

    fn count(&self, rest: &str, n: u64) {
        if n > 0 {
            self.shared
                .stats
                .count(&format!("{}.{rest}", self.prefix()), n);
        }
    }

    fn reply(
        &mut self,
        host: &mut dyn Host,
        decision: RequestDecision,
        reply: &LocalReply,
    ) -> Verdict {
        self.count(&format!("requests.{}", decision.as_str()), 1);
        host.send_reply(reply);
        self.phase = Phase::Replied;
        Verdict::Pause
    }

    fn shape(&self) -> Shape {
        Shape::of(self.api)
    }

    /// Request headers: strip steering headers, resolve the tenant, and
    /// stop to read the body of an inference request.
    pub fn on_request_headers(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Verdict {
        if self.phase != Phase::Start {
            return Verdict::Continue;
        }
        self.start_ns = host.now_ns();
        // Reports still queued for the root's tick go out before this
        // request is picked for, so the indexer has them first (they are
        // sent here, at the headers, to overlap with the body's arrival).
        self.send_queued(host);
        let settings = &self.shared.config.settings;
        let mut headers = host.request_headers();
        // A client must never steer: the endpoint list and the route's
        // cluster are the filter's alone.
        for name in [&settings.endpoint_header, &settings.route_header] {
            if header(&headers, name).is_some() {
                host.remove_request_header(name);
                headers.retain(|(k, _)| k != name);
                if name == &settings.route_header {
                    // The route was chosen with the client's value: choose
                    // again, whatever happens to this request next.
                    host.clear_route_cache();
                }
            }
        }
        let method = header(&headers, ":method").unwrap_or_default();
        let path = header(&headers, ":path").unwrap_or_default();
        let stored = stored_response_request(method, path).map(|(_, id)| id.into_owned());
        self.api = if stored.is_some() {
            Some(ApiKind::Responses)
        } else if method == "POST" {
            api_for_path(path)
        } else {
            None
        };
        let shared = Rc::clone(&self.shared);
        let policy = &shared.config.policy;
        let src = policy.tenant_source();
        let jwt = match (src.kind, &src.header, &src.jwt_metadata_key, &src.jwt_claim) {
            (TenantSourceKind::JwtClaim, None, Some(key), Some(claim)) => {
                host.jwt_claim(key, claim)
            }
            _ => None,
        };
        let resolved = policy.resolve_tenant(&TenantInput {
            headers: &headers,
            jwt_claim: jwt.as_deref(),
        });
        match resolved {
            Err(e) => {
                let r = error_reply(
                    self.shape(),
                    e.status(),
                    tenant_error_code(&e),
                    None,
                    &e.to_string(),
                );
                return self.reply(host, RequestDecision::Unauthorized, &r);
            }
            Ok(t) => {
                self.tenant = Some(t.name.to_string());
                if src.kind != TenantSourceKind::Header {
                    // Never believed; upstreams see the resolved tenant.
                    host.set_request_header(&src.tenant_header, t.name);
                    headers.retain(|(k, _)| k != &src.tenant_header);
                    headers.push((src.tenant_header.clone(), t.name.to_string()));
                }
            }
        }
        self.headers = headers;
        if let Some(id) = stored {
            return self.on_stored_response(host, id);
        }
        if self.api.is_none() {
            self.count(
                &format!("requests.{}", RequestDecision::Passthrough.as_str()),
                1,
            );
            self.phase = Phase::Passthrough;
            return Verdict::Continue;
        }
        if let Some(e) = content_encoding_error(header(&self.headers, "content-encoding")) {
            let r = error_reply(self.shape(), 415, e.code, e.param, &e.message);
            return self.reply(host, RequestDecision::Invalid, &r);
        }
        if end_of_stream {
            let r = error_reply(
                self.shape(),
                400,
                "invalid_json",
                None,
                "request body is empty: a JSON object is required",
            );
            return self.reply(host, RequestDecision::Invalid, &r);
        }
        self.phase = Phase::Body;
        Verdict::Pause
    }

    /// Request body: buffer it, then parse, decide and act.
    pub fn on_request_body(
        &mut self,
        host: &mut dyn Host,
        body_size: usize,
        end_of_stream: bool,
    ) -> Verdict {
        match self.phase {
            Phase::Body => {}
            Phase::Replied | Phase::Picking(_) => return Verdict::Pause,
            _ => return Verdict::Continue,
        }
        let limit = self.shared.config.settings.body_limit_bytes;
        if body_size > limit {
            let msg = format!("request body is larger than {limit} bytes");
            let r = error_reply(self.shape(), 413, "body_too_large", None, &msg);
            return self.reply(host, RequestDecision::TooLarge, &r);
        }
        if !end_of_stream {
            return Verdict::Pause;
        }
        let body = host.request_body(body_size).unwrap_or_default();
        let Some(api) = self.api else {
            return Verdict::Continue;
        };
        let shared = Rc::clone(&self.shared);
        let req = match parse_body(api, &body) {
            Ok(r) => r,
            Err(e) => {
                let r = error_reply(self.shape(), 400, e.code, e.param, &e.message);
                return self.reply(host, RequestDecision::Invalid, &r);
            }
        };
        self.model_label = shared.config.model_label(&req.model).to_string();
        self.learn_response_id = req.api == ApiKind::Responses && req.store;
        self.body_len = Some(body_size);
        let body = Body {
            req: &req,
            bytes: &body,
            size: body_size,
        };
        let decision = self.decide(&shared, &req, host.now_ns());
        self.act(host, &req, Some(&body), decision)
    }

    /// A `GET` or `cancel` of the stored response `id`: decided at the
    /// headers (there is no body to read), with no model and no prompt.
    fn on_stored_response(&mut self, host: &mut dyn Host, id: String) -> Verdict {
        self.stored = true;
        self.learn_response_id = true;
        let shared = Rc::clone(&self.shared);
        let req = ParsedRequest::stored_response(Cow::Owned(id));
        let decision = self.decide(&shared, &req, host.now_ns());
        self.act(host, &req, None, decision)
    }

    /// Does what the policies decided; `body` is `None` for a request
    /// without one (nothing to rewrite).
    fn act(
        &mut self,
        host: &mut dyn Host,
        req: &ParsedRequest<'_>,
        body: Option<&Body<'_, '_>>,
        decision: Decision<'_>,
    ) -> Verdict {
        match decision {
            Decision::Reject { status, message } => {
                let r = error_reply(self.shape(), status, "policy_rejected", None, message);
                self.reply(host, RequestDecision::Reject, &r)
            }
            Decision::Shed {
                retry_after_s,
                message,
            } => {
                let r = shed_reply(self.shape(), retry_after_s, message);
                self.reply(host, RequestDecision::Shed, &r)
            }
            Decision::Provider {
                provider,
                rewrite_model,
                include_usage,
            } => {
                if let Some(b) = body {
                    self.rewrite(host, b, rewrite_model, include_usage);
                }
                self.route_to_provider(host, provider)
            }
            Decision::RoutePool {
                pool,
                pool_index: _,
                rewrite_model,
                priority,
                include_usage,
            } => {
                if let Some(b) = body {
                    self.rewrite(host, b, rewrite_model, include_usage);
                }
                self.route_to_pool(host, req, pool, rewrite_model, priority)
            }
        }
    }

    /// The policies' decision for a parsed body.
    fn decide<'c>(&self, shared: &'c Shared, req: &ParsedRequest<'_>, now_ns: u64) -> Decision<'c> {
        let pools = shared.pools.borrow();
        let facts = RequestFacts {
            tenant: self.tenant.as_deref(),
            api: req.api,
            model: &req.model,
            headers: &self.headers,
            estimated_prompt_tokens: req.estimated_prompt_tokens(),
            prompt: req,
        };
        shared
            .config
            .policy
            .evaluate(&facts, &pools, now_ns / 1_000_000)
            .decision
    }

    /// A provider decision: its cluster (and authority), never the
    /// client's credentials.
    fn route_to_provider(&mut self, host: &mut dyn Host, provider: &ProviderConfig) -> Verdict {
        let s = &self.shared.config.settings;
        host.set_request_header(&s.route_header, &provider.cluster);
        if let Some(a) = &provider.authority {
            host.set_request_header(":authority", a);
        }
        // The client's credentials (its Kvasir key) never leave; the
        // provider's own are injected by Envoy on the provider's cluster
        // (credential_injector, an SDS secret), so they are in no filter
        // configuration.
        for h in ["authorization", "x-api-key"] {
            if header(&self.headers, h).is_some() {
                host.remove_request_header(h);
            }
        }
        host.clear_route_cache();
        self.count(
            &format!("requests.{}", RequestDecision::Provider.as_str()),
            1,
        );
        self.phase = Phase::Forwarded;
        Verdict::Continue
    }

    /// A pool decision: its cluster, then the pick (the request waits for
    /// it) or, when no pick can be made, Envoy's own choice.
    fn route_to_pool(
        &mut self,
        host: &mut dyn Host,
        req: &ParsedRequest<'_>,
        pool: &PoolConfig,
        rewrite_model: Option<&str>,
        priority: i32,
    ) -> Verdict {
        let shared = Rc::clone(&self.shared);
        let s = &shared.config.settings;
        host.set_request_header(&s.route_header, &pool.cluster);
        host.clear_route_cache();
        self.count(&format!("requests.{}", RequestDecision::Route.as_str()), 1);
        self.routed = Some(Routed {
            pool_name: pool.name.clone(),
            indexer_pool: pool.indexer_pool.clone(),
            indexer_cluster: pool.indexer_cluster.clone(),
            report_first_token: s.report_first_token || pool.report_first_token,
            picked: None,
        });
        self.phase = Phase::Forwarded;
        if req.api == ApiKind::AnthropicCountTokens {
            // Counting runs the tokenizer on the engine's API server, not
            // the model: no prefix cache to find and no load on the engine
            // worth accounting. Envoy's least-request balancing picks,
            // without an indexer round trip and without a fail-open.
            return Verdict::Continue;
        }
        self.response_id = req.response_id.as_ref().map(|id| id.to_string());
        // The gateway's own id keys the indexer's accounting; a client's
        // `x-request-id` is never trusted with it (a repeated id would
        // share one reservation).
        self.request_id = shared.request_ids.next();
        self.prompt_estimate = u64::from(req.estimated_prompt_tokens());
        self.max_tokens = req.max_tokens;
        let tenant = self.tenant.as_deref().unwrap_or_default();
        let tenant_cfg = shared
            .config
            .policy
            .tenant_index(tenant)
            .and_then(|i| shared.config.policy.tenants().get(i));
        // A read of a stored response generates nothing: not budgeted.
        let budget = tenant_cfg
            .and_then(|t| t.budget.as_ref())
            .filter(|_| !self.stored);
        self.budget = budget.copied();
        let input = PickInput {
            pool: &pool.indexer_pool,
            model: rewrite_model.unwrap_or(&req.model),
            tenant,
            request_id: &self.request_id,
            priority,
            max_endpoints: s.max_endpoints,
            budget,
            weight: tenant_cfg.map_or(1, |t| t.weight),
            max_wait_ms: pool.max_queue_wait_ms,
        };
        let Some(msg) = pick::pick_request(req, &input) else {
            self.budget_key = budget.map(|_| tenant.to_string()).filter(|k| !k.is_empty());
            return self.without_pick(host, FailOpen::Unsupported);
        };
        self.budget_key = budget.map(|_| tenant.to_string()).filter(|k| !k.is_empty());
        let timeout_ms = pick_deadline_ms(pool, self.response_id.is_some());
        match host.pick(&pool.indexer_cluster, &msg, timeout_ms) {
            Some(token) => {
                self.phase = Phase::Picking(token);
                self.pick_started_ns = host.now_ns();
                self.pick_dispatched = true;
                Verdict::Pause
            }
            None => self.without_pick(host, FailOpen::Dispatch),
        }
    }

    /// Request trailers. LLM APIs never send them, and continuing here
    /// would forward a body the filter never decided on (a policy bypass),
    /// so a request that ends in trailers is refused.
    pub fn on_request_trailers(&mut self, host: &mut dyn Host) -> Verdict {
        match self.phase {
            Phase::Body => {
                let r = error_reply(
                    self.shape(),
                    400,
                    "unsupported_trailers",
                    None,
                    "request trailers are not supported",
                );
                self.reply(host, RequestDecision::Invalid, &r)
            }
            Phase::Replied | Phase::Picking(_) => Verdict::Pause,
            _ => Verdict::Continue,
        }
    }

    /// Splices the body for a model rewrite or `include_usage`, if needed.
    fn rewrite(
        &mut self,
        host: &mut dyn Host,
        body: &Body<'_, '_>,
        model: Option<&str>,
        include_usage: bool,
    ) {
        let req = body.req;
        let rw = Rewrite {
            model: model.filter(|m| *m != req.model),
            include_usage: include_usage
                && req.stream
                && matches!(req.api, ApiKind::Chat | ApiKind::Completions)
                && req.include_usage != Some(true),
            priority: None,
        };
        if rw.is_noop() {
            return;
        }
        if let Some(new) = rewrite_body(body.bytes, &rw) {
            // The size Envoy reported: replacing exactly the whole buffer.
            host.set_request_body(body.size, &new);
            if header(&self.headers, "content-length").is_some() {
                host.set_request_header("content-length", &new.len().to_string());
            }
            self.body_len = Some(new.len());
        }
    }

    /// Gives the engine the pick's engine priority, replacing the
    /// client's: vLLM's `x-vllm-priority` header (which vLLM reads over the
    /// body's field, and the only way on its Anthropic route), and the
    /// body's `priority` of an OpenAI chat or completions request (read
    /// alone where the header is not known). The pick's answer is the first
    /// moment it is known (fixed when a queued pick is released); the
    /// request is still stopped, its body buffered. Other APIs' bodies are
    /// left as they are.
    fn set_engine_priority(&mut self, host: &mut dyn Host, priority: i32) {
        host.set_request_header(ENGINE_PRIORITY_HEADER, &priority.to_string());
        if !matches!(self.api, Some(ApiKind::Chat | ApiKind::Completions)) || self.stored {
            return;
        }
        let Some(len) = self.body_len else {
            return;
        };
        let Some(body) = host.request_body(len) else {
            return;
        };
        let rw = Rewrite {
            priority: Some(priority),
            ..Rewrite::default()
        };
        let Some(new) = rewrite_body(&body, &rw) else {
            return;
        };
        host.set_request_body(len, &new);
        if header(&self.headers, "content-length").is_some() {
            host.set_request_header("content-length", &new.len().to_string());
        }
        self.body_len = Some(new.len());
    }
}

#[cfg(test)]
mod tests;
