//! What the filter asks of Envoy: the [`Host`] trait the per-request flow
//! (`engine::Flow`) is written against, so it runs and is tested natively;
//! the proxy-wasm glue implements it with Envoy's host calls.

use crate::pick;
use crate::reply::LocalReply;

/// What the filter asks of Envoy. Every method must be safe to call in the
/// states the flow calls it in (see `engine`'s docs); implementations never
/// panic.
pub trait Host {
    /// A monotonic clock, nanoseconds.
    fn now_ns(&self) -> u64;
    /// All request headers (names lowercase; values lossily UTF-8).
    fn request_headers(&self) -> Vec<(String, String)>;
    /// Sets (replaces) a request header.
    fn set_request_header(&mut self, name: &str, value: &str);
    /// Removes a request header.
    fn remove_request_header(&mut self, name: &str);
    /// The buffered request body (`size` bytes from the start).
    fn request_body(&self, size: usize) -> Option<Vec<u8>>;
    /// Replaces the buffered request body.
    fn set_request_body(&mut self, size: usize, body: &[u8]);
    /// Sends a local reply instead of forwarding the request.
    fn send_reply(&mut self, reply: &LocalReply);
    /// Makes Envoy re-select the route (after changing the route header).
    fn clear_route_cache(&mut self);
    /// Dispatches a gRPC call whose answer comes back to this request
    /// (`Flow::on_grpc_response`); `None` when it could not be dispatched.
    fn call(&mut self, cluster: &str, method: &str, msg: &[u8], timeout_ms: u32) -> Option<u32>;
    /// Starts a `Pick` whose outcome comes back to this request, through
    /// `Flow::on_grpc_response` or `Flow::on_pick_outcome` with the
    /// returned token; `None` when it could not be started. By default a
    /// unary call.
    fn pick(&mut self, cluster: &str, msg: &[u8], timeout_ms: u32) -> Option<u32> {
        self.call(cluster, pick::PICK, msg, timeout_ms)
    }
    /// Dispatches a fire-and-forget gRPC call that must outlive the
    /// request (it is owned by the root context); false when it could not.
    fn call_detached(&mut self, call: &DeferredCall) -> bool;
    /// Queues a fire-and-forget call to be dispatched on a later turn of
    /// Envoy's event loop (by the root context), i.e. after the response's
    /// last bytes were written to the client, not before: a dispatch costs
    /// the worker a new HTTP/2 stream's setup (measured:
    /// bench/results/filter_notes.md). The root then counts it with
    /// `Shared::count_report`. Gives the call back when this host cannot
    /// defer (the caller dispatches it at once with [`Host::call_detached`]).
    fn defer_detached(&mut self, call: DeferredCall) -> Result<(), DeferredCall> {
        Err(call)
    }
    /// Takes the calls [`Host::defer_detached`] queued and the root has not
    /// dispatched yet (none where the host does not defer).
    fn take_deferred(&mut self) -> Vec<DeferredCall> {
        Vec::new()
    }
    /// The body of the gRPC answer being delivered.
    fn grpc_response(&self, size: usize) -> Option<Vec<u8>>;
    /// Resumes a request paused in its body callback.
    fn resume_request(&mut self);
    /// A response header.
    fn response_header(&self, name: &str) -> Option<String>;
    /// Adds a response header (response-headers callback only).
    fn add_response_header(&mut self, name: &str, value: &str);
    /// The current response body chunk (`size` bytes).
    fn response_body(&self, size: usize) -> Option<Vec<u8>>;
    /// The address of the upstream host that served (`upstream.address`).
    fn upstream_address(&self) -> Option<String>;
    /// A JWT claim from `jwt_authn`'s `payload_in_metadata` entry.
    fn jwt_claim(&self, metadata_key: &str, claim: &str) -> Option<String>;
    /// Envoy's process-wide shared data (every worker's VM of this plugin
    /// sees it), when the host has it.
    fn shared_data(&mut self) -> Option<&mut dyn SharedData> {
        None
    }
    /// The wall clock, Unix milliseconds: the one clock every VM of the
    /// process agrees on (state in shared data is kept on it).
    fn wall_ms(&self) -> u64 {
        self.now_ns() / 1_000_000
    }
    /// Envoy's response code details (`response.code_details`), read when
    /// the stream is logged: says whether an unfinished response was cut
    /// by the upstream or abandoned by the client.
    fn response_code_details(&self) -> Option<String> {
        None
    }
}

/// Envoy's process-wide shared data: values under keys, each with a
/// version for compare-and-swap.
pub trait SharedData {
    /// The value under `key` and its version (`None`, `None` when absent).
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>);
    /// Writes `value` under `key` if its version is still `cas` (`None`:
    /// unconditionally; Envoy checks no version for a key that does not
    /// exist yet); false when it changed meanwhile or the write failed.
    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> bool;
}

/// Values and their versions, by key.
#[cfg(test)]
type SharedMap = std::collections::HashMap<String, (Vec<u8>, u32)>;

/// Shared data in memory for host tests: clones of one [`MemShared`] (its
/// [`MemShared::same_process`]) see the same values, as VMs of one Envoy
/// do.
#[cfg(test)]
#[derive(Debug, Default, Clone)]
pub(crate) struct MemShared {
    map: std::rc::Rc<std::cell::RefCell<SharedMap>>,
    fail: std::rc::Rc<std::cell::Cell<bool>>,
}

#[cfg(test)]
impl MemShared {
    /// Another VM of the same process.
    pub(crate) fn same_process(&self) -> MemShared {
        self.clone()
    }

    /// Makes every write fail (or succeed again).
    pub(crate) fn fail_writes(&self, fail: bool) {
        self.fail.set(fail);
    }
}

#[cfg(test)]
impl SharedData for MemShared {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        match self.map.borrow().get(key) {
            Some((v, cas)) => (Some(v.clone()), Some(*cas)),
            None => (None, None),
        }
    }

    fn set(&mut self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        if self.fail.get() {
            return false;
        }
        let mut m = self.map.borrow_mut();
        // As Envoy's: a version is checked only against a value that
        // exists (the first write of a key is never refused).
        let current = m.get(key).map(|(_, c)| *c);
        if cas.is_some() && current.is_some() && cas != current {
            return false;
        }
        let next = current.map_or(1, |c| c.wrapping_add(1));
        m.insert(key.to_string(), (value.to_vec(), next));
        true
    }
}

/// A fire-and-forget call waiting for the root context
/// ([`Host::defer_detached`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeferredCall {
    /// The gRPC cluster.
    pub cluster: String,
    /// The method (`Report`).
    pub method: &'static str,
    /// The encoded message.
    pub msg: Vec<u8>,
    /// The call's timeout.
    pub timeout_ms: u32,
    /// The pool whose `report.*` stat counts it.
    pub pool_name: String,
}
