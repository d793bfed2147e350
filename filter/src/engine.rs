//! The per-request flow, written against the small [`Host`] trait
//! ([`crate::host`]) so it runs (and is tested) natively; the proxy-wasm
//! glue implements [`Host`] with Envoy's host calls and forwards the SDK's
//! callbacks here.
//!
//! The flow only calls a host function in a state where Envoy accepts it:
//! request headers are changed only while the request is stopped (headers
//! or body callback, or the pick callback before resuming), the body only
//! in the final body callback, nothing about the request after a local
//! reply or after it was resumed, and response headers only in the
//! response-headers callback. The tests drive it with a host that fails
//! the test on any call outside those states.

use std::rc::Rc;

use kvasir_policy::{
    ApiKind, Decision, PoolConfig, ProviderConfig, RequestFacts, TenantError, TenantInput,
    TenantSourceKind,
};
use kvasir_proto::v1::{Outcome, ReportPhase};

pub use crate::host::{DeferredCall, Host};
use crate::pick::{self, FailOpen, PickInput, PickOutcome, Picked, ReportInput};
use crate::reply::{error_reply, shed_reply, LocalReply, Shape};
use crate::request::{api_for_path, content_encoding_error, parse_body, ParsedRequest};
use crate::response::ResponseTracker;
use crate::rewrite::{rewrite_body, Rewrite};
pub use crate::shared::Shared;
use crate::stats::{
    ns_to_ms, pool_stat, response_class, tenant_model_prefix, RequestDecision, UNKNOWN_TENANT,
};

/// The model label of requests refused before their body was read.
pub const UNKNOWN_MODEL: &str = "unknown";

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
}

fn header<'a>(h: &'a [(String, String)], name: &str) -> Option<&'a str> {
    h.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

fn tenant_error_code(e: &TenantError) -> &'static str {
    match e {
        TenantError::MissingCredentials => "missing_credentials",
        TenantError::UnknownApiKey => "invalid_api_key",
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
        let post = header(&headers, ":method") == Some("POST");
        self.api = if post {
            header(&headers, ":path").and_then(api_for_path)
        } else {
            None
        };
        self.request_id = header(&headers, &settings.request_id_header)
            .unwrap_or_default()
            .to_string();
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
        let body = Body {
            req: &req,
            bytes: &body,
            size: body_size,
        };
        match self.decide(&shared, &req, host.now_ns()) {
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
                self.rewrite(host, &body, rewrite_model, include_usage);
                self.route_to_provider(host, provider)
            }
            Decision::RoutePool {
                pool,
                pool_index: _,
                rewrite_model,
                priority,
                include_usage,
            } => {
                self.rewrite(host, &body, rewrite_model, include_usage);
                self.route_to_pool(host, &req, pool, rewrite_model, priority)
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
            picked: None,
        });
        self.phase = Phase::Forwarded;
        let input = PickInput {
            pool: &pool.indexer_pool,
            model: rewrite_model.unwrap_or(&req.model),
            tenant: self.tenant.as_deref().unwrap_or_default(),
            request_id: &self.request_id,
            priority,
            max_endpoints: s.max_endpoints,
        };
        let Some(msg) = pick::pick_request(req, &input) else {
            self.fail_open(FailOpen::Unsupported);
            return Verdict::Continue;
        };
        match host.pick(&pool.indexer_cluster, &msg, pool.indexer_timeout_ms) {
            Some(token) => {
                self.phase = Phase::Picking(token);
                self.pick_started_ns = host.now_ns();
                Verdict::Pause
            }
            None => {
                self.fail_open(FailOpen::Dispatch);
                Verdict::Continue
            }
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
        &self,
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
                && req.api != ApiKind::AnthropicMessages
                && req.include_usage != Some(true),
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
        }
    }

    fn fail_open(&self, why: FailOpen) {
        if let Some(r) = &self.routed {
            let s = &self.shared.stats;
            s.count(
                &pool_stat(&r.pool_name, &format!("pick.{}", why.as_str())),
                1,
            );
            s.count(&pool_stat(&r.pool_name, "failopen"), 1);
        }
        self.count("failopen", 1);
    }

    /// A gRPC answer for this request (the pick; anything else is
    /// ignored).
    pub fn on_grpc_response(&mut self, host: &mut dyn Host, token: u32, status: u32, size: usize) {
        if self.phase != Phase::Picking(token) {
            return;
        }
        let body = if status == 0 {
            host.grpc_response(size)
        } else {
            None
        };
        self.on_pick_outcome(host, token, pick::pick_outcome(status, body.as_deref()));
    }

    /// The pick's outcome, however it came ([`Host::pick`]'s token): sets
    /// the endpoint header or fails open, then resumes the request.
    pub fn on_pick_outcome(&mut self, host: &mut dyn Host, token: u32, outcome: PickOutcome) {
        if self.phase != Phase::Picking(token) {
            return;
        }
        let now = host.now_ns();
        if let Some(r) = &self.routed {
            // The pick's round trip as Envoy saw it (indexer + network).
            let us = now.saturating_sub(self.pick_started_ns) / 1000;
            self.shared
                .stats
                .record(&pool_stat(&r.pool_name, "pick_us"), us);
        }
        let pool_index = self
            .routed
            .as_ref()
            .and_then(|r| self.shared.config.policy.pool_index(&r.pool_name));
        if let (Some(s), Some(i)) = (outcome.saturation, pool_index) {
            self.shared.learn_saturation(i, s, now);
        }
        match outcome.result {
            Ok(p) => {
                host.set_request_header(&self.shared.config.settings.endpoint_header, &p.header);
                if let Some(r) = &mut self.routed {
                    self.shared
                        .stats
                        .count(&pool_stat(&r.pool_name, "pick.ok"), 1);
                    r.picked = Some(p);
                }
            }
            Err(why) => self.fail_open(why),
        }
        self.phase = Phase::Forwarded;
        host.resume_request();
    }

    /// Response headers: status, streaming or not, which endpoint served.
    pub fn on_response_headers(&mut self, host: &mut dyn Host, end_of_stream: bool) -> Verdict {
        if self.phase != Phase::Forwarded {
            return Verdict::Continue;
        }
        let s = &self.shared.config.settings;
        self.status = host.response_header(":status").and_then(|v| v.parse().ok());
        let streaming = host.response_header("content-type").is_some_and(|c| {
            c.trim_start()
                .to_ascii_lowercase()
                .starts_with("text/event-stream")
        });
        let upstream_said = host.response_header(&s.served_header);
        self.served = upstream_said
            .clone()
            .or_else(|| host.upstream_address())
            .or_else(|| {
                self.routed
                    .as_ref()
                    .and_then(|r| r.picked.as_ref())
                    .map(|p| p.first.clone())
            });
        if s.expose_served_endpoint && upstream_said.is_none() {
            if let Some(addr) = &self.served {
                host.add_response_header(&s.served_header, addr);
            }
        }
        self.tracker = Some(ResponseTracker::new(
            self.start_ns,
            streaming,
            s.response_body_limit_bytes,
        ));
        if end_of_stream {
            self.finish(host, true);
        }
        Verdict::Continue
    }

    fn ok_status(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s))
    }

    /// A response body chunk.
    pub fn on_response_body(
        &mut self,
        host: &mut dyn Host,
        size: usize,
        end_of_stream: bool,
    ) -> Verdict {
        if self.phase != Phase::Forwarded {
            return Verdict::Continue;
        }
        let chunk = if size > 0 {
            host.response_body(size).unwrap_or_default()
        } else {
            Vec::new()
        };
        let now = host.now_ns();
        let mut first = false;
        if let Some(t) = &mut self.tracker {
            let ev = t.feed(&chunk, now);
            first = ev.first;
            if let (Some(itl), true) = (ev.itl_ns, self.ok_status()) {
                self.shared
                    .stats
                    .record(&format!("{}.itl_ms", self.prefix()), ns_to_ms(itl));
            }
        }
        if first && self.ok_status() && self.shared.config.settings.report_first_token {
            self.report(
                host,
                ReportPhase::FirstToken,
                Outcome::Unspecified,
                None,
                now,
            );
        }
        if end_of_stream {
            self.finish(host, true);
        }
        Verdict::Continue
    }

    /// Response trailers: the response ended (gRPC-style upstreams end
    /// with trailers instead of an end-of-stream body chunk).
    pub fn on_response_trailers(&mut self, host: &mut dyn Host) -> Verdict {
        if self.phase == Phase::Forwarded && self.tracker.is_some() {
            self.finish(host, true);
        }
        Verdict::Continue
    }

    /// The stream is done (always called): accounts a response that did not
    /// end normally (client gone, reset).
    pub fn on_log(&mut self, host: &mut dyn Host) {
        if self.phase == Phase::Forwarded || matches!(self.phase, Phase::Picking(_)) {
            // Response bytes already went to the client, so Envoy could
            // not retry: the engine (or the connection to it) cut the
            // stream. Counted apart from clients that went away.
            self.cut = self.tracker.is_some()
                && host
                    .response_code_details()
                    .is_some_and(|d| d.starts_with("upstream_reset_after_response_started"));
            self.finish(host, false);
        }
        // The stream is complete: its done report (queued at the
        // response's end) and anything else still queued go now.
        self.send_queued(host);
    }

    fn finish(&mut self, host: &mut dyn Host, completed: bool) {
        if self.phase == Phase::Done {
            return;
        }
        self.phase = Phase::Done;
        let now = host.now_ns();
        let e2e = now.saturating_sub(self.start_ns);
        let class = if self.cut {
            "cut"
        } else {
            response_class(self.status, completed)
        };
        self.count(&format!("responses.{class}"), 1);
        let ok = completed && self.ok_status();
        let (usage, ttft) = match &mut self.tracker {
            Some(t) => (t.usage(), t.ttft_ns()),
            None => (None, None),
        };
        if ok {
            let stats = Rc::clone(&self.shared.stats);
            let p = self.prefix();
            if let Some(t) = ttft {
                stats.record(&format!("{p}.ttft_ms"), ns_to_ms(t));
            }
            stats.record(&format!("{p}.e2e_ms"), ns_to_ms(e2e));
        }
        if let Some(u) = usage {
            self.count("prompt_tokens.cached", u.cached_tokens);
            self.count(
                "prompt_tokens.uncached",
                u.prompt_tokens.saturating_sub(u.cached_tokens),
            );
            self.count("completion_tokens", u.completion_tokens);
        }
        let outcome = if self.cut {
            Outcome::Error
        } else if !completed {
            Outcome::Cancelled
        } else if self.status == Some(504) {
            Outcome::Timeout
        } else if ok {
            Outcome::Success
        } else if self.status.is_some_and(|s| (400..500).contains(&s)) {
            // The request's fault, not the engine's: a tenant sending
            // invalid requests must not make an engine look failing.
            Outcome::ClientError
        } else {
            Outcome::Error
        };
        self.report(host, ReportPhase::Done, outcome, usage, now);
    }

    /// Dispatches the calls still queued for the root's tick (this VM's,
    /// any request's), in order.
    fn send_queued(&self, host: &mut dyn Host) {
        for call in host.take_deferred() {
            let sent = host.call_detached(&call);
            self.shared.count_report(&call.pool_name, sent);
        }
    }

    fn report(
        &self,
        host: &mut dyn Host,
        phase: ReportPhase,
        outcome: Outcome,
        usage: Option<pick::Usage>,
        now: u64,
    ) {
        let s = &self.shared.config.settings;
        let Some(r) = &self.routed else { return };
        if !s.report || r.picked.is_none() || self.request_id.is_empty() {
            return;
        }
        let ttft = self.tracker.as_ref().and_then(ResponseTracker::ttft_ns);
        let ms = |ns: u64| ns as f64 / 1e6;
        let msg = pick::report_request(&ReportInput {
            pool: &r.indexer_pool,
            request_id: &self.request_id,
            endpoint: self.served.as_deref().unwrap_or_default(),
            usage,
            ttft_ms: ttft.map(ms).unwrap_or(0.0),
            e2e_ms: if phase == ReportPhase::Done {
                ms(now.saturating_sub(self.start_ns))
            } else {
                0.0
            },
            outcome,
            phase,
        });
        let call = DeferredCall {
            cluster: r.indexer_cluster.clone(),
            method: pick::REPORT,
            msg,
            timeout_ms: s.report_timeout_ms,
            pool_name: r.pool_name.clone(),
        };
        // Reports are queued, not dispatched, from the response's
        // callbacks: a dispatch there (~0.1 ms) runs before Envoy writes the
        // bytes, holding back the first token or the response's end. The
        // first-token report goes on the root's next tick; the done report
        // when the stream is logged (`on_log`), which is also what a
        // follow-up needs: until it arrives the request counts as load on
        // its endpoint, and an agent's next turn sent the moment this
        // response ends would be picked against that stale load, away
        // from its own prefix.
        let Err(call) = host.defer_detached(call) else {
            return; // counted when it is dispatched
        };
        let sent = host.call_detached(&call);
        self.shared.count_report(&r.pool_name, sent);
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
