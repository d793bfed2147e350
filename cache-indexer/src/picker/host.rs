//! The filter's [`Host`] over one ext_proc exchange: what the filter's
//! request flow (`kvasir_filter::engine::Flow`) asks of Envoy, answered from
//! the `ProcessingRequest`s Envoy sent and collected into the
//! `ProcessingResponse`s the picker sends back. The same flow decides here
//! as in the wasm filter (tenant, policies, body rewrites, budgets, the
//! pick, the reports); this adapter only records what it wants done.

use std::sync::OnceLock;
use std::time::Instant;

use kvasir_filter::host::{DeferredCall, Host};
use kvasir_filter::reply::LocalReply;

/// A pick the flow asked for, to run against the pool.
#[derive(Debug, Clone, PartialEq)]
pub struct PickCall {
    /// The token the flow waits on.
    pub token: u32,
    /// The encoded `PickRequest`.
    pub msg: Vec<u8>,
    /// Its deadline, ms.
    pub timeout_ms: u32,
}

/// Nanoseconds on the one clock every exchange of the process reads. The
/// flow keeps what it learns across requests (each pool's saturation, with
/// when it was learned) and ages it by this clock, so it cannot restart per
/// exchange: a sample learned a minute ago would read as just learned.
pub fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// What the flow did to the request or response, and what it asked for.
#[derive(Debug)]
pub struct ExchangeHost {
    /// The request's headers (lower-case names), as Envoy sent them.
    pub request_headers: Vec<(String, String)>,
    /// Headers the flow set on the request, in order.
    pub set_request: Vec<(String, String)>,
    /// Headers the flow removed from the request.
    pub removed_request: Vec<String>,
    /// The request body received so far.
    pub body: Vec<u8>,
    /// The body the flow replaced it with, if it did.
    pub new_body: Option<Vec<u8>>,
    /// A reply the flow sent instead of forwarding.
    pub reply: Option<LocalReply>,
    /// The pick the flow is waiting for.
    pub pick: Option<PickCall>,
    /// Reports the flow dispatched (encoded `ReportRequest`s).
    pub reports: Vec<Vec<u8>>,
    /// The flow resumed the request after its pick.
    pub resumed: bool,
    /// The response's headers, once they came.
    pub response_headers: Vec<(String, String)>,
    /// Headers the flow added to the response.
    pub added_response: Vec<(String, String)>,
    /// The response chunk being delivered.
    pub response_chunk: Vec<u8>,
    /// The endpoint that served, as the gateway said.
    pub served: Option<String>,
    /// JWT claims the gateway forwarded: (metadata key, claim, value).
    pub jwt_claims: Vec<(String, String, String)>,
    next_token: u32,
}

impl ExchangeHost {
    /// A host for a new exchange.
    pub fn new() -> ExchangeHost {
        ExchangeHost {
            request_headers: Vec::new(),
            set_request: Vec::new(),
            removed_request: Vec::new(),
            body: Vec::new(),
            new_body: None,
            reply: None,
            pick: None,
            reports: Vec::new(),
            resumed: false,
            response_headers: Vec::new(),
            added_response: Vec::new(),
            response_chunk: Vec::new(),
            served: None,
            jwt_claims: Vec::new(),
            next_token: 1,
        }
    }

    /// The value the flow last set for request header `name`, if any.
    pub fn set_value(&self, name: &str) -> Option<&str> {
        self.set_request
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Takes the request mutations made so far: (set, removed).
    pub fn take_request_mutations(&mut self) -> (Vec<(String, String)>, Vec<String>) {
        (
            std::mem::take(&mut self.set_request),
            std::mem::take(&mut self.removed_request),
        )
    }

    /// Takes the response headers added so far.
    pub fn take_response_mutations(&mut self) -> Vec<(String, String)> {
        std::mem::take(&mut self.added_response)
    }
}

impl Host for ExchangeHost {
    fn now_ns(&self) -> u64 {
        now_ns()
    }

    fn wall_ms(&self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    fn request_headers(&self) -> Vec<(String, String)> {
        let mut h = self.request_headers.clone();
        for name in &self.removed_request {
            h.retain(|(k, _)| k != name);
        }
        for (k, v) in &self.set_request {
            h.retain(|(n, _)| n != k);
            h.push((k.clone(), v.clone()));
        }
        h
    }

    fn set_request_header(&mut self, name: &str, value: &str) {
        self.removed_request.retain(|n| n != name);
        self.set_request.push((name.to_string(), value.to_string()));
    }

    fn remove_request_header(&mut self, name: &str) {
        self.set_request.retain(|(k, _)| k != name);
        self.removed_request.push(name.to_string());
    }

    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        let b = self.new_body.as_ref().unwrap_or(&self.body);
        Some(b[..size.min(b.len())].to_vec())
    }

    fn set_request_body(&mut self, _size: usize, body: &[u8]) {
        self.new_body = Some(body.to_vec());
    }

    fn send_reply(&mut self, reply: &LocalReply) {
        self.reply = Some(reply.clone());
    }

    fn clear_route_cache(&mut self) {
        // The gateway routed the request to the pool before asking: the
        // picker changes its endpoint, never its route.
    }

    fn call(&mut self, _cluster: &str, method: &str, msg: &[u8], timeout_ms: u32) -> Option<u32> {
        if method != kvasir_filter::pick::PICK {
            return None;
        }
        self.pick(_cluster, msg, timeout_ms)
    }

    fn pick(&mut self, _cluster: &str, msg: &[u8], timeout_ms: u32) -> Option<u32> {
        let token = self.next_token;
        self.next_token = self.next_token.wrapping_add(1).max(1);
        self.pick = Some(PickCall {
            token,
            msg: msg.to_vec(),
            timeout_ms,
        });
        Some(token)
    }

    fn call_detached(&mut self, call: &DeferredCall) -> bool {
        if call.method != kvasir_filter::pick::REPORT {
            return false;
        }
        self.reports.push(call.msg.clone());
        true
    }

    fn grpc_response(&self, _size: usize) -> Option<Vec<u8>> {
        // Picks are answered in process (`Flow::on_pick_outcome`).
        None
    }

    fn resume_request(&mut self) {
        self.resumed = true;
    }

    fn response_header(&self, name: &str) -> Option<String> {
        self.response_headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    }

    fn add_response_header(&mut self, name: &str, value: &str) {
        self.added_response
            .push((name.to_string(), value.to_string()));
    }

    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        Some(self.response_chunk[..size.min(self.response_chunk.len())].to_vec())
    }

    fn upstream_address(&self) -> Option<String> {
        self.served.clone()
    }

    fn jwt_claim(&self, metadata_key: &str, claim: &str) -> Option<String> {
        self.jwt_claims
            .iter()
            .find(|(k, c, _)| k == metadata_key && c == claim)
            .map(|(_, _, v)| v.clone())
    }
}
