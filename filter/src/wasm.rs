//! The proxy-wasm glue: Envoy's callbacks into [`crate::engine`], and
//! [`Host`] / [`Stats`] implemented with the SDK's host calls.
//!
//! The SDK's wrappers panic on any host status they do not expect, and a
//! panic kills the VM. So this module calls only the wrappers whose every
//! Envoy answer is handled (`get_buffer`, `get_map_bytes`, `get_property`,
//! `dispatch_grpc_call`, `call_foreign_function`, `set_effective_context`,
//! `increment_metric`, ...), reads headers as bytes (the string readers
//! unwrap UTF-8), and leaves the "only in the right state" rule to the
//! engine, whose tests check it.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};

use crate::engine::{DeferredCall, Flow, Host, Shared, Verdict};
use crate::pick;
use crate::reply::{error_reply, LocalReply, Shape};
use crate::settings::PluginConfig;
use crate::stats::Stats;

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

fn verdict(v: Verdict) -> Action {
    match v {
        Verdict::Continue => Action::Continue,
        Verdict::Pause => Action::Pause,
    }
}

/// Envoy metrics by name, each defined once per VM (a define allocates a
/// new id every time) and bounded in number.
struct EnvoyStats {
    ids: RefCell<HashMap<String, u32>>,
    max: RefCell<usize>,
    dropped: RefCell<Option<u32>>,
}

impl EnvoyStats {
    fn new() -> EnvoyStats {
        EnvoyStats {
            ids: RefCell::new(HashMap::new()),
            max: RefCell::new(4096),
            dropped: RefCell::new(None),
        }
    }

    fn id(&self, name: &str, kind: MetricType) -> Option<u32> {
        if let Some(id) = self.ids.borrow().get(name) {
            return Some(*id);
        }
        if self.ids.borrow().len() >= *self.max.borrow() {
            if let Some(d) = *self.dropped.borrow() {
                let _ = hostcalls::increment_metric(d, 1);
            }
            return None;
        }
        let id = hostcalls::define_metric(kind, name).ok()?;
        self.ids.borrow_mut().insert(name.to_string(), id);
        Some(id)
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

/// Fire-and-forget calls the HTTP contexts left for the root to dispatch
/// on its next tick ([`Host::defer_detached`]): a first-token `Report`
/// dispatched from the response's first body callback would hold back the
/// first token by the dispatch's ~0.1 ms. Whatever is still queued goes
/// out earlier when a stream is logged or a request of this VM starts
/// ([`Host::take_deferred`]), so reports keep their order and a done
/// report never trails the next pick.
struct Deferred {
    calls: RefCell<Vec<DeferredCall>>,
    /// The root's timer is free for this: no `PoolState` polls use it.
    enabled: Cell<bool>,
    /// A 1 ms tick is set and has not fired yet.
    armed: Cell<bool>,
}

struct Root {
    id: u32,
    shared: Option<Rc<Shared>>,
    stats: Rc<EnvoyStats>,
    /// In-flight `PoolState` polls: token -> pool index.
    polls: HashMap<u32, usize>,
    /// Whether the timer polls `PoolState` (else it only flushes deferred calls).
    polling: bool,
    deferred: Rc<Deferred>,
}

impl Root {
    fn new(id: u32) -> Root {
        Root {
            id,
            shared: None,
            stats: Rc::new(EnvoyStats::new()),
            polls: HashMap::new(),
            polling: false,
            deferred: Rc::new(Deferred {
                calls: RefCell::new(Vec::new()),
                enabled: Cell::new(false),
                armed: Cell::new(false),
            }),
        }
    }

    fn flush_deferred(&mut self) {
        if self.deferred.armed.replace(false) {
            let _ = hostcalls::set_tick_period(Duration::ZERO);
        }
        let calls = std::mem::take(&mut *self.deferred.calls.borrow_mut());
        for c in calls {
            let sent = dispatch(&c.cluster, c.method, &c.msg, c.timeout_ms).is_ok();
            if let Some(shared) = &self.shared {
                shared.count_report(&c.pool_name, sent);
            }
        }
    }
}

impl Context for Root {
    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
        // Only polls are answered here; reports are fire and forget.
        let Some(pool) = self.polls.remove(&token_id) else {
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
        *self.stats.max.borrow_mut() = cfg.settings.max_stats;
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
        let poll_ms = cfg.settings.pool_state_poll_ms;
        let needs_polls = cfg.policy.pools_needing_state().next().is_some();
        let stats: Rc<dyn Stats> = self.stats.clone();
        self.shared = Some(Rc::new(Shared::new(cfg, stats)));
        self.polling = poll_ms > 0 && needs_polls;
        // A reconfiguration never leaves queued calls behind.
        self.flush_deferred();
        self.deferred.enabled.set(!self.polling);
        if self.polling {
            let _ = hostcalls::set_tick_period(Duration::from_millis(u64::from(poll_ms)));
        }
        true
    }

    fn on_tick(&mut self) {
        self.flush_deferred();
        if !self.polling {
            return;
        }
        let Some(shared) = &self.shared else { return };
        for (cluster, pool, msg, timeout_ms) in shared.pool_state_polls() {
            if self.polls.values().any(|&p| p == pool) {
                continue; // the last poll of this pool is still out
            }
            if let Ok(token) = dispatch(&cluster, pick::POOL_STATE, &msg, timeout_ms) {
                self.polls.insert(token, pool);
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Never None: the SDK panics on it. Without a configuration the
        // context answers 503 (fail closed: tenants are not checked).
        Some(Box::new(Http {
            host: EnvoyHost {
                id: context_id,
                root_id: self.id,
                deferred: Rc::clone(&self.deferred),
            },
            flow: self.shared.as_ref().map(|s| Flow::new(Rc::clone(s))),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct Http {
    host: EnvoyHost,
    flow: Option<Flow>,
}

impl Context for Http {
    fn on_grpc_call_response(&mut self, token_id: u32, status_code: u32, response_size: usize) {
        if let Some(f) = &mut self.flow {
            f.on_grpc_response(&mut self.host, token_id, status_code, response_size);
        }
    }
}

impl HttpContext for Http {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        match &mut self.flow {
            Some(f) => verdict(f.on_request_headers(&mut self.host, end_of_stream)),
            None => {
                let r = error_reply(
                    Shape::OpenAi,
                    503,
                    "not_configured",
                    None,
                    "the gateway filter is not configured",
                );
                self.host.send_reply(&r);
                Action::Pause
            }
        }
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        match &mut self.flow {
            Some(f) => verdict(f.on_request_body(&mut self.host, body_size, end_of_stream)),
            None => Action::Pause,
        }
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        match &mut self.flow {
            Some(f) => verdict(f.on_request_trailers(&mut self.host)),
            None => Action::Pause,
        }
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        match &mut self.flow {
            Some(f) => verdict(f.on_response_trailers(&mut self.host)),
            None => Action::Continue,
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        match &mut self.flow {
            Some(f) => verdict(f.on_response_headers(&mut self.host, end_of_stream)),
            None => Action::Continue,
        }
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        match &mut self.flow {
            Some(f) => verdict(f.on_response_body(&mut self.host, body_size, end_of_stream)),
            None => Action::Continue,
        }
    }

    fn on_log(&mut self) {
        if let Some(f) = &mut self.flow {
            f.on_log(&mut self.host);
        }
    }
}

/// [`Host`] over Envoy's host calls for one HTTP context.
struct EnvoyHost {
    id: u32,
    root_id: u32,
    deferred: Rc<Deferred>,
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

    fn call_detached(&mut self, cluster: &str, method: &str, msg: &[u8], timeout_ms: u32) -> bool {
        // A call owned by this HTTP context is cancelled when the stream is
        // destroyed, which is right after the response ends: make the root
        // context own it instead. Its answer is dropped by the SDK (the
        // token maps to this context, which is gone or ignores it).
        if hostcalls::set_effective_context(self.root_id).is_err() {
            return false;
        }
        let sent = dispatch(cluster, method, msg, timeout_ms).is_ok();
        let _ = hostcalls::set_effective_context(self.id);
        sent
    }

    fn take_deferred(&mut self) -> Vec<DeferredCall> {
        // The armed tick stays set: it fires, finds nothing and disarms.
        std::mem::take(&mut *self.deferred.calls.borrow_mut())
    }

    fn defer_detached(&mut self, call: DeferredCall) -> Result<(), DeferredCall> {
        let d = &self.deferred;
        if !d.enabled.get() {
            return Err(call);
        }
        if !d.armed.get() {
            // The HTTP context's tick period is its root's.
            if hostcalls::set_tick_period(Duration::from_millis(1)).is_err() {
                return Err(call);
            }
            d.armed.set(true);
        }
        d.calls.borrow_mut().push(call);
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
