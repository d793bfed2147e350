//! The engine driven through a fake Envoy that fails the test on any host
//! call made in a state where real Envoy would refuse it (and the SDK would
//! panic, killing the VM).

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use kvasir_proto::v1::{
    pick_request, Admission, Decision as PickDecision, PickRequest, PickResponse, PickedEndpoint,
    ReportRequest,
};
use prost::Message;
use serde_json::{json, Value};

use super::*;
use crate::session::{PickSent, PickStep, Sessions};

/// The id the filter gives a [`Shared`]'s first request (seed 0): the
/// client's `x-request-id` ("req-1" in [`Fake`]) is never used.
pub(super) const GATEWAY_ID: &str = "0000000000000000-0";
use crate::settings::PluginConfig;
use crate::stats::testing::MemStats;
use crate::stats::Stats;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cb {
    Idle,
    ReqHeaders,
    ReqBody,
    ReqTrailers,
    Grpc,
    RespHeaders,
    RespBody,
    Log,
}

struct Fake {
    cb: Cb,
    now: Cell<u64>,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    replied: Option<LocalReply>,
    resumed: bool,
    continued: bool,
    route_cleared: u32,
    dispatch_ok: bool,
    calls: Vec<(String, String, Vec<u8>, u32)>,
    detached: Vec<(String, String, Vec<u8>)>,
    /// Whether `defer_detached` queues (the wasm host with a free timer).
    defers: bool,
    deferred: Vec<DeferredCall>,
    grpc_body: Option<Vec<u8>>,
    resp_headers: Vec<(String, String)>,
    resp_chunk: Vec<u8>,
    added_resp: Vec<(String, String)>,
    upstream: Option<String>,
    code_details: Option<String>,
    /// The VM's session streams, when picks may go on one (as in the wasm
    /// host); the request is known to them as `waiter`.
    sessions: Option<Rc<RefCell<Sessions<u32>>>>,
    waiter: u32,
    /// Whether a send on a stream succeeds.
    stream_send_ok: bool,
    stream_sent: Vec<(u32, Vec<u8>)>,
    cancelled: Vec<u32>,
    /// The process's shared data, when the test gives it one.
    shared: Option<crate::host::MemShared>,
}

impl Fake {
    fn new(path: &str, headers: &[(&str, &str)], body: &str) -> Fake {
        let mut h = vec![
            (":method".to_string(), "POST".to_string()),
            (":path".to_string(), path.to_string()),
            ("x-request-id".to_string(), "req-1".to_string()),
            ("content-length".to_string(), body.len().to_string()),
        ];
        h.extend(headers.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        Fake {
            cb: Cb::Idle,
            now: Cell::new(1_000_000_000),
            headers: h,
            body: body.as_bytes().to_vec(),
            replied: None,
            resumed: false,
            continued: false,
            route_cleared: 0,
            dispatch_ok: true,
            calls: Vec::new(),
            detached: Vec::new(),
            defers: false,
            deferred: Vec::new(),
            grpc_body: None,
            resp_headers: Vec::new(),
            resp_chunk: Vec::new(),
            added_resp: Vec::new(),
            upstream: Some("127.0.0.1:9001".into()),
            code_details: None,
            sessions: None,
            waiter: 0,
            stream_send_ok: true,
            stream_sent: Vec::new(),
            cancelled: Vec::new(),
            shared: None,
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn request_mutable(&self, what: &str) {
        assert!(
            matches!(
                self.cb,
                Cb::ReqHeaders | Cb::ReqBody | Cb::ReqTrailers | Cb::Grpc
            ) && self.replied.is_none()
                && !self.resumed
                && !self.continued,
            "{what} in {:?} (replied {}, resumed {}, continued {})",
            self.cb,
            self.replied.is_some(),
            self.resumed,
            self.continued
        );
    }

    fn body_json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

impl Host for Fake {
    fn shared_data(&mut self) -> Option<&mut dyn crate::host::SharedData> {
        self.shared
            .as_mut()
            .map(|s| s as &mut dyn crate::host::SharedData)
    }

    fn now_ns(&self) -> u64 {
        let t = self.now.get();
        self.now.set(t + 1_000_000);
        t
    }
    fn request_headers(&self) -> Vec<(String, String)> {
        assert_eq!(self.cb, Cb::ReqHeaders);
        self.headers.clone()
    }
    fn set_request_header(&mut self, name: &str, value: &str) {
        self.request_mutable("set_request_header");
        self.headers.retain(|(k, _)| k != name);
        self.headers.push((name.into(), value.into()));
    }
    fn remove_request_header(&mut self, name: &str) {
        self.request_mutable("remove_request_header");
        self.headers.retain(|(k, _)| k != name);
    }
    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        // In its own callback, or in the pick's before the request resumes
        // (the body is buffered: the final body callback paused).
        assert!(
            self.cb == Cb::ReqBody || (self.cb == Cb::Grpc && !self.resumed),
            "body read in {:?} (resumed {})",
            self.cb,
            self.resumed
        );
        assert_eq!(size, self.body.len());
        Some(self.body.clone())
    }
    fn set_request_body(&mut self, size: usize, body: &[u8]) {
        self.request_mutable("set_request_body");
        assert!(
            matches!(self.cb, Cb::ReqBody | Cb::Grpc),
            "the body can only change in its own callback or the pick's"
        );
        assert_eq!(
            size,
            self.body.len(),
            "must replace exactly the whole buffer"
        );
        self.body = body.to_vec();
    }
    fn send_reply(&mut self, reply: &LocalReply) {
        self.request_mutable("send_reply");
        self.replied = Some(reply.clone());
    }
    fn clear_route_cache(&mut self) {
        self.request_mutable("clear_route_cache");
        self.route_cleared += 1;
    }
    fn call(&mut self, cluster: &str, method: &str, msg: &[u8], timeout_ms: u32) -> Option<u32> {
        self.request_mutable("call");
        if !self.dispatch_ok {
            return None;
        }
        self.calls
            .push((cluster.into(), method.into(), msg.to_vec(), timeout_ms));
        Some(7)
    }
    fn pick(&mut self, cluster: &str, msg: &[u8], timeout_ms: u32) -> Option<u32> {
        let Some(sessions) = self.sessions.clone() else {
            return self.call(cluster, pick::PICK, msg, timeout_ms);
        };
        // With the body, or at the headers for a request without one.
        assert!(
            matches!(self.cb, Cb::ReqBody | Cb::ReqHeaders),
            "picks start in a request callback"
        );
        // What the wasm host does with the session's steps.
        let waiter = self.waiter;
        let step =
            sessions
                .borrow_mut()
                .pick(cluster, msg, timeout_ms, || self.now_ns(), || waiter);
        if let PickStep::Stream { id, send } = step {
            let sent = self.stream_send_ok;
            if sent {
                self.stream_sent.push((send.stream, send.frame));
            }
            let after = sessions
                .borrow_mut()
                .pick_sent(cluster, send.stream, id, sent, || self.now_ns());
            match after {
                PickSent::Waiting { token, .. } => return Some(token),
                PickSent::Unary { cancel } => self.cancelled.push(cancel),
            }
        }
        self.call(cluster, pick::PICK, msg, timeout_ms)
    }
    fn call_detached(&mut self, call: &DeferredCall) -> bool {
        self.detached
            .push((call.cluster.clone(), call.method.into(), call.msg.clone()));
        true
    }
    fn defer_detached(&mut self, call: DeferredCall) -> Result<(), DeferredCall> {
        if !self.defers {
            return Err(call);
        }
        self.deferred.push(call);
        Ok(())
    }
    fn take_deferred(&mut self) -> Vec<DeferredCall> {
        std::mem::take(&mut self.deferred)
    }
    fn grpc_response(&self, _size: usize) -> Option<Vec<u8>> {
        assert_eq!(self.cb, Cb::Grpc);
        self.grpc_body.clone()
    }
    fn resume_request(&mut self) {
        assert_eq!(
            self.cb,
            Cb::Grpc,
            "resume only from the call-out's callback"
        );
        self.request_mutable("resume_request");
        self.resumed = true;
    }
    fn response_header(&self, name: &str) -> Option<String> {
        assert!(matches!(self.cb, Cb::RespHeaders));
        self.resp_headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    }
    fn add_response_header(&mut self, name: &str, value: &str) {
        assert_eq!(self.cb, Cb::RespHeaders);
        self.added_resp.push((name.into(), value.into()));
    }
    fn response_body(&self, _size: usize) -> Option<Vec<u8>> {
        assert_eq!(self.cb, Cb::RespBody);
        Some(self.resp_chunk.clone())
    }
    fn upstream_address(&self) -> Option<String> {
        self.upstream.clone()
    }
    fn jwt_claim(&self, _metadata_key: &str, _claim: &str) -> Option<String> {
        None
    }

    fn response_code_details(&self) -> Option<String> {
        assert_eq!(self.cb, Cb::Log, "code details are read when logged");
        self.code_details.clone()
    }
}

fn key_hash(k: &str) -> String {
    kvasir_policy::hash_api_key(k)
}

fn config(tenant_source: Value, settings: Value) -> (Rc<Shared>, Rc<MemStats>) {
    config_with_pool(tenant_source, settings, json!({}))
}

/// [`config`] with `pool_extra`'s fields added to the pool `main`.
fn config_with_pool(
    tenant_source: Value,
    settings: Value,
    pool_extra: Value,
) -> (Rc<Shared>, Rc<MemStats>) {
    let mut pool = json!({"name": "main", "models": ["qwen"], "cluster": "pool", "indexerCluster": "indexer", "indexerTimeoutMs": 40});
    if let (Some(p), Some(extra)) = (pool.as_object_mut(), pool_extra.as_object()) {
        p.extend(extra.clone());
    }
    let set = json!({
        "tenantSource": tenant_source,
        "tenants": [
            {"name": "acme", "apiKeyHashes": [key_hash("key-acme")]},
            {"name": "beta", "apiKeyHashes": [key_hash("key-beta")]}
        ],
        "pools": [pool],
        "providers": [{"name": "ext", "cluster": "ext-cluster", "authority": "api.example.com", "model": "ext-model",
                       "auth": {"header": "authorization", "secretRef": {"name": "ext", "key": "api-key"}}}],
        "policies": [
            {"name": "blocked", "match": {"models": ["blocked-model"]}, "action": {"reject": {"status": 403, "message": "not for you"}}},
            {"name": "busy", "match": {"models": ["shed-model"]}, "action": {"shed": {"retryAfterS": 3, "message": "busy"}}},
            {"name": "ext", "match": {"models": ["gpt-4o"]}, "action": {"provider": {"provider": "ext"}}},
            {"name": "alias", "match": {"models": ["alias"]}, "action": {"route": {"pool": "main", "rewriteModel": "qwen", "includeUsage": true}}}
        ],
        "defaultAction": {"route": {"pool": "main"}}
    });
    let set = kvasir_policy::parse_json(&set.to_string()).unwrap();
    let doc: Value =
        serde_json::from_slice(&kvasir_policy::compile(&set).unwrap().to_json()).unwrap();
    let bytes = serde_json::to_vec(&json!({"policy": doc, "filter": settings})).unwrap();
    let cfg = PluginConfig::from_bytes(&bytes).unwrap();
    let stats = Rc::new(MemStats::default());
    let s: Rc<dyn Stats> = stats.clone();
    (Rc::new(Shared::new(cfg, s)), stats)
}

fn api_key() -> Value {
    json!({"apiKey": {}})
}

fn chat(model: &str, stream: bool) -> String {
    json!({"model": model, "stream": stream, "max_tokens": 4,
           "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]})
    .to_string()
}

fn headers(flow: &mut Flow, h: &mut Fake) -> Verdict {
    h.cb = Cb::ReqHeaders;
    let v = flow.on_request_headers(h, false);
    h.continued = v == Verdict::Continue;
    h.cb = Cb::Idle;
    v
}

fn body(flow: &mut Flow, h: &mut Fake) -> Verdict {
    h.cb = Cb::ReqBody;
    let n = h.body.len();
    let v = flow.on_request_body(h, n, true);
    h.continued = v == Verdict::Continue;
    h.cb = Cb::Idle;
    v
}

fn grpc(flow: &mut Flow, h: &mut Fake, token: u32, status: u32, answer: Option<Vec<u8>>) {
    h.cb = Cb::Grpc;
    h.grpc_body = answer;
    let n = h.grpc_body.as_ref().map_or(0, Vec::len);
    flow.on_grpc_response(h, token, status, n);
    h.cb = Cb::Idle;
}

fn respond(flow: &mut Flow, h: &mut Fake, status: u16, content_type: &str, chunks: &[&str]) {
    h.resp_headers = vec![
        (":status".into(), status.to_string()),
        ("content-type".into(), content_type.into()),
    ];
    h.cb = Cb::RespHeaders;
    assert_eq!(flow.on_response_headers(h, false), Verdict::Continue);
    for (i, c) in chunks.iter().enumerate() {
        h.cb = Cb::RespBody;
        h.resp_chunk = c.as_bytes().to_vec();
        let last = i + 1 == chunks.len();
        assert_eq!(flow.on_response_body(h, c.len(), last), Verdict::Continue);
    }
    h.cb = Cb::Log;
    flow.on_log(h);
    h.cb = Cb::Idle;
}

fn pick_answer(addrs: &[&str], saturation: f64) -> Vec<u8> {
    PickResponse {
        endpoints: addrs
            .iter()
            .map(|a| PickedEndpoint {
                address: a.to_string(),
                ..Default::default()
            })
            .collect(),
        pool_saturation: saturation,
        decision: PickDecision::Prefix as i32,
        reason: "prefix".into(),
        ..Default::default()
    }
    .encode_to_vec()
}

fn reply_json(h: &Fake) -> (u16, Value) {
    let r = h.replied.as_ref().expect("a local reply");
    (r.status, serde_json::from_slice(&r.body).unwrap())
}

const P: &str = "kvasir.tenant.acme.model.qwen";

#[test]
fn routed_chat_picks_sets_the_endpoint_and_accounts_the_response() {
    let (shared, stats) = config(api_key(), json!({"exposeServedEndpoint": true}));
    let mut flow = Flow::new(shared.clone());
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[
            ("authorization", "Bearer key-acme"),
            ("x-tenant", "beta"),
            ("x-gateway-destination-endpoint", "10.9.9.9:1"),
            ("x-kvasir-cluster", "ext-cluster"),
        ],
        &chat("qwen", true),
    );
    assert_eq!(headers(&mut flow, &mut h), Verdict::Pause);
    // Client steering and the spoofed tenant are gone before anything else.
    assert_eq!(h.header("x-gateway-destination-endpoint"), None);
    assert_eq!(h.header("x-kvasir-cluster"), None);
    assert_eq!(h.header("x-tenant"), Some("acme"));
    assert_eq!(body(&mut flow, &mut h), Verdict::Pause);
    assert_eq!(h.header("x-kvasir-cluster"), Some("pool"));
    // Once for the removed client value, once for the filter's own.
    assert_eq!(h.route_cleared, 2);
    let (cluster, method, msg, timeout) = h.calls.pop().unwrap();
    assert_eq!(
        (cluster.as_str(), method.as_str(), timeout),
        ("indexer", "Pick", 40)
    );
    let pick = PickRequest::decode(msg.as_slice()).unwrap();
    assert_eq!(
        (
            pick.pool.as_str(),
            pick.tenant.as_str(),
            pick.request_id.as_str()
        ),
        ("main", "acme", GATEWAY_ID)
    );
    let Some(pick_request::Prompt::Chat(c)) = pick.prompt else {
        panic!()
    };
    assert_eq!(c.messages.len(), 2);
    // A stray token (e.g. a report's answer) is ignored.
    grpc(&mut flow, &mut h, 99, 0, None);
    assert!(!h.resumed);
    grpc(
        &mut flow,
        &mut h,
        7,
        0,
        Some(pick_answer(&["127.0.0.1:9001", "127.0.0.1:9002"], 0.4)),
    );
    assert!(h.resumed);
    assert_eq!(
        h.header("x-gateway-destination-endpoint"),
        Some("127.0.0.1:9001,127.0.0.1:9002")
    );
    assert_eq!(
        stats
            .gauges
            .borrow()
            .get("kvasir.pool.main.saturation_permille"),
        Some(&400)
    );
    respond(
        &mut flow,
        &mut h,
        200,
        "text/event-stream",
        &[
            "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":20,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":16}}}\n\ndata: [DONE]\n\n",
        ],
    );
    assert_eq!(
        h.added_resp,
        vec![(
            "x-gateway-destination-endpoint-served".to_string(),
            "127.0.0.1:9001".to_string()
        )]
    );
    assert_eq!(stats.counter(&format!("{P}.requests.route")), 1);
    assert_eq!(stats.counter(&format!("{P}.prompt_tokens.cached")), 16);
    assert_eq!(stats.counter(&format!("{P}.prompt_tokens.uncached")), 4);
    assert_eq!(stats.counter(&format!("{P}.completion_tokens")), 2);
    assert_eq!(stats.counter(&format!("{P}.responses.2xx")), 1);
    assert_eq!(stats.counter("kvasir.pool.main.pick.ok"), 1);
    let hist = stats.histograms.borrow();
    assert_eq!(hist[&format!("{P}.ttft_ms")].len(), 1);
    assert_eq!(hist[&format!("{P}.e2e_ms")].len(), 1);
    assert!(!hist[&format!("{P}.itl_ms")].is_empty());
    let (cluster, method, msg) = h.detached.pop().unwrap();
    assert_eq!((cluster.as_str(), method.as_str()), ("indexer", "Report"));
    let r = ReportRequest::decode(msg.as_slice()).unwrap();
    assert_eq!(
        (r.request_id.as_str(), r.endpoint.as_str(), r.cached_tokens),
        (GATEWAY_ID, "127.0.0.1:9001", 16)
    );
    assert_eq!(r.outcome, kvasir_proto::v1::Outcome::Success as i32);
    assert_eq!(stats.counter("kvasir.pool.main.report.sent"), 1);
    assert_eq!(
        stats.histograms.borrow()["kvasir.pool.main.pick_us"].len(),
        1
    );
}

#[test]
fn fail_open_on_indexer_errors_and_dispatch_failure() {
    for (status, answer, why) in [
        (14, None, "unavailable"),
        (4, None, "timeout"),
        (0, Some(b"\xff\xff".to_vec()), "bad_response"),
        (0, Some(pick_answer(&[], 1.0)), "no_endpoints"),
        (
            0,
            Some(pick_answer(&["not-an-address"], 0.0)),
            "bad_response",
        ),
    ] {
        let (shared, stats) = config(api_key(), json!({}));
        let mut flow = Flow::new(shared);
        let mut h = Fake::new(
            "/v1/chat/completions",
            &[("authorization", "Bearer key-acme")],
            &chat("qwen", false),
        );
        headers(&mut flow, &mut h);
        assert_eq!(body(&mut flow, &mut h), Verdict::Pause);
        grpc(&mut flow, &mut h, 7, status, answer);
        assert!(h.resumed, "{why}");
        assert_eq!(h.header("x-gateway-destination-endpoint"), None, "{why}");
        assert_eq!(
            stats.counter(&format!("kvasir.pool.main.pick.{why}")),
            1,
            "{why}"
        );
        assert_eq!(stats.counter("kvasir.pool.main.failopen"), 1);
        assert_eq!(stats.counter(&format!("{P}.failopen")), 1);
        respond(
            &mut flow,
            &mut h,
            200,
            "application/json",
            &[r#"{"usage":{"prompt_tokens":3,"completion_tokens":1}}"#],
        );
        // The pick was sent, and the indexer may still account it: its
        // end says the filter admitted the request without its answer.
        let sent: Vec<ReportRequest> = h
            .detached
            .iter()
            .map(|(_, _, m)| ReportRequest::decode(m.as_slice()).unwrap())
            .collect();
        assert_eq!(sent.len(), 1, "{why}");
        assert_eq!(sent[0].admission, Admission::Local as i32, "{why}");
        assert_eq!(sent[0].request_id, GATEWAY_ID, "{why}");
        assert_eq!(stats.counter(&format!("{P}.prompt_tokens.uncached")), 3);
    }
    let (shared, stats) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme")],
        &chat("qwen", false),
    );
    h.dispatch_ok = false;
    headers(&mut flow, &mut h);
    assert_eq!(body(&mut flow, &mut h), Verdict::Continue);
    assert_eq!(stats.counter("kvasir.pool.main.pick.dispatch"), 1);
}

#[path = "body_tests.rs"]
mod body;

#[path = "session_tests.rs"]
mod session;

#[path = "api_tests.rs"]
mod api;

#[path = "outcome_tests.rs"]
mod outcome;

#[path = "request_tests.rs"]
mod request;

#[path = "budget_tests.rs"]
mod budget;

#[path = "local_tests.rs"]
mod local;

#[path = "priority_tests.rs"]
mod priority;
