//! What every handler shares: the simulator's state, and the guard that
//! aborts a request whose client went away. Below the handlers of each API
//! (chat and completions in `server`, Messages, Responses, the
//! instrumentation routes), which all read it.

use crate::faults::Faults;
use crate::metrics::StaticInfo;
use crate::publisher::{BoundEndpoints, PublisherCmd};
use crate::response_store::ResponseStore;
use crate::runner::{Command, EngineHandle};
use kvasir_tokenizer::ChatTokenizer;
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedSender;

/// Everything the handlers share.
pub struct AppState {
    /// Served model name.
    pub model: String,
    /// Longest prompt + completion.
    pub max_model_len: usize,
    /// The model's tokenizer and chat template.
    pub tokenizer: Arc<ChatTokenizer>,
    /// The engine thread.
    pub engine: EngineHandle,
    /// Fault switches.
    pub faults: Arc<Faults>,
    /// Facts for `/metrics` and `/sim/info`.
    pub info: StaticInfo,
    /// Where the KV-event sockets are.
    pub endpoints: BoundEndpoints,
    /// To restart the event sequence.
    pub publisher: UnboundedSender<PublisherCmd>,
    /// Text of each synthetic output token.
    pub piece_text: HashMap<u32, String>,
    /// Completion length when neither max_tokens nor the hint is given.
    pub default_output_tokens: u32,
    /// vLLM's `--enable-prompt-tokens-details`.
    pub prompt_tokens_details: bool,
    /// Request ids.
    pub next_id: AtomicU64,
    /// Requests failed by fault injection.
    pub failed: AtomicU64,
    /// Process start, for `created` fields.
    pub started: u64,
    /// What the Messages and Responses APIs need beyond chat's.
    pub apis: ApiState,
}

/// Seconds since the Unix epoch (vLLM's `created` fields).
pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Sends an abort when a request's handler or stream goes away early.
pub(crate) struct AbortGuard {
    pub(crate) engine: EngineHandle,
    pub(crate) id: u64,
    pub(crate) done: bool,
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        if !self.done {
            self.engine.send(Command::Abort(self.id));
        }
    }
}

/// Settings and state of the Messages, Responses and instrumentation
/// endpoints.
#[derive(Debug)]
pub struct ApiState {
    /// Whether inline system messages of `/v1/messages` are merged into the
    /// leading system prompt (vLLM probes the chat template for this).
    pub merge_inline_system: bool,
    /// The Responses API's in-memory store.
    pub store: ResponseStore,
    /// vLLM's `--enable-server-load-tracking`.
    pub load_tracking: bool,
    /// Requests in flight on the load-aware routes.
    pub server_load: AtomicI64,
    /// The body of `GET /kv_event_sources`.
    pub kv_event_sources: serde_json::Value,
}
