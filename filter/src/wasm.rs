//! The proxy-wasm glue: Envoy's callbacks into [`crate::engine`] and
//! [`crate::session`], [`Host`] / [`Stats`] implemented with the SDK's host
//! calls, and what the session streams' decisions call for done with them.
//! Nothing is decided here that a native test could not see.
//!
//! The SDK's wrappers panic on any host status they do not expect, and a
//! panic kills the VM. So this module calls only the wrappers whose every
//! Envoy answer is handled (`get_buffer`, `get_map_bytes`, `get_property`,
//! `dispatch_grpc_call`, `open_grpc_stream`, `send_grpc_stream_message`,
//! `cancel_grpc_stream`, `call_foreign_function`, `set_effective_context`,
//! `get_shared_data`, `set_shared_data`,
//! `increment_metric`, ...), reads headers as bytes (the string readers
//! unwrap UTF-8), and leaves the "only in the right state" rule to the
//! engine, whose tests check it.

use std::cell::RefCell;
use std::rc::{Rc, Weak};
use std::time::{Duration, Instant};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};

use crate::engine::{Flow, Verdict};
use crate::host::{DeferredCall, Host, SharedData};
use crate::pick;
use crate::reply::{not_configured, LocalReply};
use crate::session::{self, Answer, Delivery, PickSent, PickStep, Sessions, StreamSend, Timer};
use crate::settings::PluginConfig;
use crate::shared::{Polls, Shared};
use crate::stats::{StatId, StatIds, Stats};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|id| -> Box<dyn RootContext> { Box::new(Root::new(id)) });
}}

thread_local! {
    static CLOCK_BASE: Instant = Instant::now();
}

fn now_ns() -> u64 {
    CLOCK_BASE.with(|b| u64::try_from(b.elapsed().as_nanos()).unwrap_or(u64::MAX))
}

/// A random seed for this VM's request ids: the runtime's random source
/// (WASI `random_get`, behind std's hasher keys) mixed with the wall clock.
fn id_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(wall);
    h.finish()
}

fn verdict(v: Verdict) -> Action {
    match v {
        Verdict::Continue => Action::Continue,
        Verdict::Pause => Action::Pause,
    }
}

/// Envoy metrics by name ([`StatIds`] decides when to define one).
struct EnvoyStats {
    ids: RefCell<StatIds>,
    dropped: RefCell<Option<u32>>,
}

impl EnvoyStats {
    fn new() -> EnvoyStats {
        EnvoyStats {
            ids: RefCell::new(StatIds::default()),
            dropped: RefCell::new(None),
        }
    }

    fn id(&self, name: &str, kind: MetricType) -> Option<u32> {
        let lookup = self.ids.borrow().lookup(name);
        match lookup {
            StatId::Known(id) => Some(id),
            StatId::Full => {
                if let Some(d) = *self.dropped.borrow() {
                    let _ = hostcalls::increment_metric(d, 1);
                }
                None
            }
            StatId::Define => {
                let id = hostcalls::define_metric(kind, name).ok()?;
                self.ids.borrow_mut().defined(name, id);
                Some(id)
            }
        }
    }
}

impl Stats for EnvoyStats {
    fn count(&self, name: &str, n: u64) {
        if n == 0 {
            return;
        }
        if let Some(id) = self.id(name, MetricType::Counter) {
            let _ = hostcalls::increment_metric(id, i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    fn gauge(&self, name: &str, value: u64) {
        if let Some(id) = self.id(name, MetricType::Gauge) {
            let _ = hostcalls::record_metric(id, value);
        }
    }

    fn record(&self, name: &str, value: u64) {
        if let Some(id) = self.id(name, MetricType::Histogram) {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}

/// Starts a call of the indexer's service (no initial metadata); its token.
fn dispatch(cluster: &str, method: &str, msg: &[u8], timeout_ms: u32) -> Result<u32, Status> {
    hostcalls::dispatch_grpc_call(
        cluster,
        pick::SERVICE,
        method,
        Vec::new(),
        Some(msg),
        Duration::from_millis(u64::from(timeout_ms)),
    )
}

/// Who waits for a stream pick: the request's context and its flow.
struct Waiter {
    context_id: u32,
    flow: Weak<RefCell<Flow>>,
}

/// What the root context and this VM's requests share: fire-and-forget
/// calls queued for the root's timer, the `Session` streams, and the
/// timer.
///
/// Queued calls: a first-token `Report` dispatched from the response's
/// first body callback would hold back the first token by the dispatch's
/// cost to the worker (measured: bench/results/filter_notes.md). Whatever
/// is still queued goes out earlier when a stream is logged or a request
/// of this VM starts ([`Host::take_deferred`]), so reports keep their
/// order and a done report never trails the next pick.
struct RootShared {
    root_id: u32,
    calls: RefCell<Vec<DeferredCall>>,
    sessions: RefCell<Sessions<Waiter>>,
    timer: Timer,
}

impl RootShared {
    fn set_tick(&self, ms: u64) {
        if hostcalls::set_tick_period(Duration::from_millis(ms)).is_ok() {
            self.timer.set(ms);
        }
    }

    fn tick_within(&self, ms: u64) {
        if let Some(p) = self.timer.within(ms) {
            self.set_tick(p);
        }
    }

    /// Sends on a stream as the root, which owns it; the caller restores
    /// its own context.
    fn send_on_stream(&self, send: &StreamSend) -> bool {
        hostcalls::set_effective_context(self.root_id).is_ok()
            && hostcalls::send_grpc_stream_message(send.stream, Some(&send.frame), false).is_ok()
    }

    /// Sends a fire-and-forget call on its cluster's stream when it may
    /// go there, else dispatches it as a unary call owned by the root.
    fn send_detached(&self, c: &DeferredCall) -> bool {
        let on_stream = self.sessions.borrow_mut().detached(c);
        if let Some(send) = on_stream {
            if self.send_on_stream(&send) {
                return true;
            }
            let cancel = self
                .sessions
                .borrow_mut()
                .send_failed(&c.cluster, send.stream, now_ns());
            let _ = hostcalls::cancel_grpc_stream(cancel);
        }
        if hostcalls::set_effective_context(self.root_id).is_err() {
            return false;
        }
        dispatch(&c.cluster, c.method, &c.msg, c.timeout_ms).is_ok()
    }
}

struct Root {
    id: u32,
    shared: Option<Rc<Shared>>,
    stats: Rc<EnvoyStats>,
    polls: Polls,
    state: Rc<RootShared>,
}

impl Root {
    fn new(id: u32) -> Root {
        Root {
            id,
            shared: None,
            stats: Rc::new(EnvoyStats::new()),
            polls: Polls::default(),
            state: Rc::new(RootShared {
                root_id: id,
                calls: RefCell::new(Vec::new()),
                sessions: RefCell::new(Sessions::default()),
                timer: Timer::default(),
            }),
        }
    }

    fn flush_deferred(&mut self) {
        let calls = std::mem::take(&mut *self.state.calls.borrow_mut());
        for c in calls {
            let sent = self.state.send_detached(&c);
            if let Some(shared) = &self.shared {
                shared.count_report(&c.pool_name, sent);
            }
        }
    }

    fn count(&self, name: &str) {
        self.stats.count(name, 1);
    }

    /// Hands a stream pick's outcome to its request, as that request's
    /// context (header set, request resumed).
    fn deliver(&self, d: Delivery<Waiter>) {
        let Some(flow) = d.waiter.flow.upgrade() else {
            return; // the request went away meanwhile
        };
        if hostcalls::set_effective_context(d.waiter.context_id).is_err() {
            return;
        }
        let mut host = EnvoyHost {
            id: d.waiter.context_id,
            root: Rc::clone(&self.state),
            me: d.waiter.flow,
            shared: EnvoyShared,
        };
        // Not re-entered: Envoy runs the resumed filter chain after this
        // callback returns.
        if let Ok(mut f) = flow.try_borrow_mut() {
            f.on_pick_outcome(&mut host, d.token, d.outcome);
        }
        let _ = hostcalls::set_effective_context(self.id);
    }

    fn sessions_tick(&mut self) {
        let now = now_ns();
        let up = self.state.sessions.borrow_mut().upkeep(now);
        for stream in up.cancel {
            let _ = hostcalls::cancel_grpc_stream(stream);
            self.count("kvasir.session.stalled");
        }
        for d in up.deliver {
            self.deliver(d);
        }
        for cluster in up.open {
            let r =
                hostcalls::open_grpc_stream(&cluster, pick::SERVICE, session::METHOD, Vec::new());
            let mut sessions = self.state.sessions.borrow_mut();
            match r {
                Ok(stream) => {
                    sessions.opened(cluster, stream);
                    self.count("kvasir.session.opened");
                }
                Err(_) => {
                    sessions.open_failed(&cluster, now);
                    self.count("kvasir.session.open_failed");
                }
            }
        }
    }

    fn retime(&self) {
        let st = &self.state;
        let streams = st.sessions.borrow().timer_need_ms(now_ns());
        let queued = !st.calls.borrow().is_empty();
        if let Some(p) = st.timer.retime(queued, streams, self.polls.period_ms()) {
            st.set_tick(p);
        }
    }
}

impl Context for Root {
    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
        // Only polls are answered here; reports are fire and forget.
        let Some(pool) = self.polls.answered(token_id) else {
            return;
        };
        let Some(shared) = &self.shared else { return };
        let body = if status_code == 0 {
            hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, response_size)
                .ok()
                .flatten()
        } else {
            None
        };
        shared.on_pool_state(pool, status_code, body.as_deref(), now_ns());
    }

    fn on_grpc_stream_message(&mut self, token_id: u32, message_size: usize) {
        let answer = self.state.sessions.borrow_mut().message(token_id, || {
            hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, message_size)
                .ok()
                .flatten()
        });
        match answer {
            Answer::Ignore => {}
            Answer::Unmatched => self.count("kvasir.session.unmatched"),
            Answer::Deliver(d) => self.deliver(d),
        }
    }

    fn on_grpc_stream_close(&mut self, token_id: u32, status_code: u32) {
        let ended = self
            .state
            .sessions
            .borrow_mut()
            .closed(token_id, status_code, now_ns());
        let Some(ended) = ended else {
            return;
        };
        self.count("kvasir.session.closed");
        let cluster = &ended.cluster;
        log::info!("kvasir: session stream to {cluster} ended (gRPC status {status_code}); picks use unary calls until it reopens");
        for d in ended.deliver {
            self.deliver(d);
        }
        self.retime();
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let bytes = hostcalls::get_buffer(
            BufferType::PluginConfiguration,
            0,
            plugin_configuration_size,
        )
        .ok()
        .flatten()
        .unwrap_or_default();
        let cfg = match PluginConfig::from_bytes(&bytes) {
            Ok(c) => c,
            Err(e) => {
                log::error!("kvasir: refusing the plugin configuration: {e}");
                return false;
            }
        };
        self.stats.ids.borrow_mut().set_max(cfg.settings.max_stats);
        if self.stats.dropped.borrow().is_none() {
            *self.stats.dropped.borrow_mut() =
                hostcalls::define_metric(MetricType::Counter, "kvasir.stats.dropped").ok();
        }
        log::info!(
            "kvasir: configured {} (tenants {}, pools {}, providers {}, policies {})",
            cfg.policy.fingerprint(),
            cfg.policy.tenants().len(),
            cfg.policy.pools().len(),
            cfg.policy.providers().len(),
            cfg.policy.policies().len()
        );
        let needs_polls = cfg.policy.pools_needing_state().next().is_some();
        self.polls
            .configure(needs_polls, cfg.settings.pool_state_poll_ms);
        self.state
            .sessions
            .borrow_mut()
            .set_enabled(cfg.settings.indexer_session);
        let stats: Rc<dyn Stats> = self.stats.clone();
        self.shared = Some(Rc::new(Shared::new(cfg, stats).with_id_seed(id_seed())));
        // A reconfiguration never leaves queued calls behind.
        self.flush_deferred();
        self.retime();
        true
    }

    fn on_tick(&mut self) {
        self.flush_deferred();
        self.sessions_tick();
        if self.polls.due(now_ns) {
            if let Some(shared) = self.shared.clone() {
                for (cluster, pool, msg, timeout_ms) in shared.pool_state_polls() {
                    if self.polls.out(pool) {
                        continue;
                    }
                    if let Ok(token) = dispatch(&cluster, pick::POOL_STATE, &msg, timeout_ms) {
                        self.polls.sent(token, pool);
                    }
                }
            }
        }
        self.retime();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Never None: the SDK panics on it. Without a configuration the
        // context answers 503 (fail closed: tenants are not checked).
        let flow = self
            .shared
            .as_ref()
            .map(|s| Rc::new(RefCell::new(Flow::new(Rc::clone(s)))));
        Some(Box::new(Http {
            host: EnvoyHost {
                id: context_id,
                root: Rc::clone(&self.state),
                me: flow.as_ref().map(Rc::downgrade).unwrap_or_default(),
                shared: EnvoyShared,
            },
            flow,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Http {
    host: EnvoyHost,
    /// Shared with the root, which hands it session picks' outcomes.
    flow: Option<Rc<RefCell<Flow>>>,
}

impl Http {
    /// Runs `f` on the flow; `None` without one (or, never expected,
    /// while the root holds it).
    fn with<T>(&mut self, f: impl FnOnce(&mut Flow, &mut EnvoyHost) -> T) -> Option<T> {
        let flow = self.flow.as_ref()?;
        let mut flow = flow.try_borrow_mut().ok()?;
        Some(f(&mut flow, &mut self.host))
    }
}

impl Context for Http {
    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
        self.with(|f, h| f.on_grpc_response(h, token_id, status_code, response_size));
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if let Some(v) = self.with(|f, h| f.on_request_headers(h, end_of_stream)) {
            return verdict(v);
        }
        self.host.send_reply(&not_configured());
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.with(|f, h| verdict(f.on_request_body(h, body_size, end_of_stream)))
            .unwrap_or(Action::Pause)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        self.with(|f, h| verdict(f.on_request_trailers(h)))
            .unwrap_or(Action::Pause)
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.with(|f, h| verdict(f.on_response_trailers(h)))
            .unwrap_or(Action::Continue)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        self.with(|f, h| verdict(f.on_response_headers(h, end_of_stream)))
            .unwrap_or(Action::Continue)
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        self.with(|f, h| verdict(f.on_response_body(h, body_size, end_of_stream)))
            .unwrap_or(Action::Continue)
    }

    fn on_log(&mut self) {
        self.with(|f, h| f.on_log(h));
    }
}

/// [`Host`] over Envoy's host calls for one HTTP context.
struct EnvoyHost {
    id: u32,
    root: Rc<RootShared>,
    /// This context's flow, for the root to hand a session pick back.
    me: Weak<RefCell<Flow>>,
    shared: EnvoyShared,
}

/// Envoy's shared data. Its wrappers panic only on a status Envoy never
/// answers these calls with (get: OK or NOT_FOUND; set: OK or
/// CAS_MISMATCH).
struct EnvoyShared;

impl SharedData for EnvoyShared {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        hostcalls::set_shared_data(key, Some(value), cas).is_ok()
    }
}

fn lossy(b: Vec<u8>) -> String {
    String::from_utf8(b).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

impl Host for EnvoyHost {
    fn now_ns(&self) -> u64 {
        now_ns()
    }

    fn request_headers(&self) -> Vec<(String, String)> {
        hostcalls::get_map_bytes(MapType::HttpRequestHeaders)
            .map(|m| m.into_iter().map(|(k, v)| (k, lossy(v))).collect())
            .unwrap_or_default()
    }

    fn set_request_header(&mut self, name: &str, value: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value));
    }

    fn remove_request_header(&mut self, name: &str) {
        let _ = hostcalls::set_map_value(MapType::HttpRequestHeaders, name, None);
    }

    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size)
            .ok()
            .flatten()
    }

    fn set_request_body(&mut self, size: usize, body: &[u8]) {
        let _ = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, size, body);
    }

    fn send_reply(&mut self, reply: &LocalReply) {
        let headers: Vec<(&str, &str)> = reply
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let _ = hostcalls::send_http_response(u32::from(reply.status), headers, Some(&reply.body));
    }

    fn clear_route_cache(&mut self) {
        let _ = hostcalls::call_foreign_function("clear_route_cache", None);
    }

    fn call(&mut self, cluster: &str, method: &str, msg: &[u8], timeout_ms: u32) -> Option<u32> {
        dispatch(cluster, method, msg, timeout_ms).ok()
    }

    fn pick(&mut self, cluster: &str, msg: &[u8], timeout_ms: u32) -> Option<u32> {
        let root = Rc::clone(&self.root);
        let step = root
            .sessions
            .borrow_mut()
            .pick(cluster, msg, timeout_ms, now_ns, || Waiter {
                context_id: self.id,
                flow: Weak::clone(&self.me),
            });
        match step {
            PickStep::Stream { id, send } => {
                let sent = root.send_on_stream(&send);
                let after =
                    root.sessions
                        .borrow_mut()
                        .pick_sent(cluster, send.stream, id, sent, now_ns);
                if let PickSent::Unary { cancel } = after {
                    // Still as the root, which owns the stream.
                    let _ = hostcalls::cancel_grpc_stream(cancel);
                }
                let _ = hostcalls::set_effective_context(self.id);
                if let PickSent::Waiting {
                    token,
                    tick_within_ms,
                } = after
                {
                    root.tick_within(tick_within_ms);
                    return Some(token);
                }
            }
            PickStep::Unary { tick_within_ms } => {
                if let Some(ms) = tick_within_ms {
                    root.tick_within(ms);
                }
            }
        }
        self.call(cluster, pick::PICK, msg, timeout_ms)
    }

    fn call_detached(&mut self, call: &DeferredCall) -> bool {
        // A unary call owned by this HTTP context is cancelled when the
        // stream is destroyed, which is right after the response ends: the
        // root owns it instead (its answer is dropped by the SDK: the
        // token maps to this context, which is gone or ignores it).
        let sent = self.root.send_detached(call);
        let _ = hostcalls::set_effective_context(self.id);
        sent
    }

    fn take_deferred(&mut self) -> Vec<DeferredCall> {
        std::mem::take(&mut *self.root.calls.borrow_mut())
    }

    fn defer_detached(&mut self, call: DeferredCall) -> Result<(), DeferredCall> {
        self.root.tick_within(1);
        self.root.calls.borrow_mut().push(call);
        Ok(())
    }

    fn grpc_response(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::GrpcReceiveBuffer, 0, size)
            .ok()
            .flatten()
    }

    fn resume_request(&mut self) {
        let _ = hostcalls::resume_http_request();
    }

    fn response_header(&self, name: &str) -> Option<String> {
        hostcalls::get_map_value_bytes(MapType::HttpResponseHeaders, name)
            .ok()
            .flatten()
            .map(lossy)
    }

    fn add_response_header(&mut self, name: &str, value: &str) {
        let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value);
    }

    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpResponseBody, 0, size)
            .ok()
            .flatten()
    }

    fn upstream_address(&self) -> Option<String> {
        hostcalls::get_property(vec!["upstream", "address"])
            .ok()
            .flatten()
            .map(lossy)
            .filter(|s| !s.is_empty())
    }

    fn response_code_details(&self) -> Option<String> {
        hostcalls::get_property(vec!["response", "code_details"])
            .ok()
            .flatten()
            .map(lossy)
    }

    fn shared_data(&mut self) -> Option<&mut dyn SharedData> {
        Some(&mut self.shared)
    }

    fn wall_ms(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    fn jwt_claim(&self, metadata_key: &str, claim: &str) -> Option<String> {
        hostcalls::get_property(vec![
            "metadata",
            "filter_metadata",
            "envoy.filters.http.jwt_authn",
            metadata_key,
            claim,
        ])
        .ok()
        .flatten()
        .map(lossy)
        .filter(|s| !s.is_empty())
    }
}
