//! vLLM's Anthropic Messages API (`vllm/entrypoints/anthropic/`):
//! `/v1/messages`, `/v1/messages/count_tokens` and `/v1/messages/render`.
//!
//! vLLM turns a Messages request into a chat request (system text first,
//! content blocks flattened to text) and serves it with the chat template,
//! so the prompt, its prefix-cache blocks and KV events are those of the
//! equivalent chat conversation. Errors raised while serving come back in
//! Anthropic's shape; a body that does not fit the request model is
//! rejected before vLLM's handler, in vLLM's OpenAI shape (see
//! [`crate::validation`]).

use crate::apis::{plan_ceiling, random_uuid, sse_event, sse_stream, EventStream, Run};
use crate::engine::FinishReason;
use crate::openai::ApiError;
use crate::state::AppState;
use crate::validation::{json_object, lax_int, Ty, Validator};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvasir_tokenizer::{ChatMessage, ChatTokenizer};
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// Content block types vLLM's `AnthropicContentBlock` accepts.
const BLOCK_TYPES: &[&str] = &[
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
];

/// Claude Code's per-request attribution header, which vLLM drops from
/// system text because it would defeat prefix caching.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// Anthropic's `error.type` for an HTTP status (vLLM's
/// `translate_error_type`).
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

fn anthropic_error(e: ApiError) -> Response {
    let body =
        json!({"type": "error", "error": {"type": error_type(e.status), "message": e.message}});
    (e.status, Json(body)).into_response()
}

/// Whether the chat template rejects system messages after the first
/// (vLLM renders system, user, system, user once at startup; if that
/// fails, inline system messages are merged into the leading one).
pub fn template_needs_system_first(tok: &ChatTokenizer) -> bool {
    let probe: Vec<ChatMessage> = ["system", "user", "system", "user"]
        .iter()
        .map(|r| ChatMessage::new(*r, "t"))
        .collect();
    tok.render_chat(&probe, false).is_err()
}

fn validate_message(v: &mut Validator, i: usize, m: &Value) {
    let idx = i.to_string();
    let Some(o) = m.as_object() else {
        v.error(
            &["messages", &idx],
            "model_type",
            "Input should be a valid dictionary or instance of AnthropicMessage",
            m,
        );
        return;
    };
    if let Some(r) = v.field(o, &["messages", &idx, "role"], Ty::Str, true) {
        if !matches!(r.as_str(), Some("user" | "assistant" | "system")) {
            v.error(
                &["messages", &idx, "role"],
                "literal_error",
                "Input should be 'user', 'assistant' or 'system'",
                r,
            );
        }
    }
    match o.get("content") {
        None => v.error(
            &["messages", &idx, "content"],
            "missing",
            "Field required",
            m,
        ),
        Some(Value::String(_)) => {}
        Some(Value::Array(blocks)) => {
            for (j, b) in blocks.iter().enumerate() {
                let j = j.to_string();
                let t = b.get("type").and_then(Value::as_str);
                if !t.is_some_and(|t| BLOCK_TYPES.contains(&t)) {
                    v.error(
                        &["messages", &idx, "content", &j, "type"],
                        "literal_error",
                        "Input should be a valid content block type",
                        b.get("type").unwrap_or(&Value::Null),
                    );
                }
            }
        }
        Some(other) => v.error(
            &["messages", &idx, "content"],
            "string_type",
            "Input should be a valid string",
            other,
        ),
    }
}

/// The checks of vLLM's request models that the simulator relies on;
/// `generate` adds the fields only a Messages request has.
fn validate(obj: &Map<String, Value>, generate: bool) -> Result<(), ApiError> {
    let mut v = Validator::default();
    if let Some(m) = v.field(obj, &["model"], Ty::Str, true) {
        if m.as_str() == Some("") {
            v.error(
                &["model"],
                "value_error",
                "Value error, Model is required",
                m,
            );
        }
    }
    if let Some(Value::Array(msgs)) = v.field(obj, &["messages"], Ty::List, true) {
        for (i, m) in msgs.iter().enumerate() {
            validate_message(&mut v, i, m);
        }
    }
    if let Some(s) = obj.get("system") {
        if !(s.is_string() || s.is_array() || s.is_null()) {
            v.error(
                &["system"],
                "string_type",
                "Input should be a valid string",
                s,
            );
        }
    }
    for (f, ty) in [
        ("tools", Ty::List),
        ("tool_choice", Ty::Obj),
        ("thinking", Ty::Obj),
        ("output_config", Ty::Obj),
        ("chat_template_kwargs", Ty::Obj),
    ] {
        v.field(obj, &[f], ty, false);
    }
    if generate {
        if let Some(n) = v.field(obj, &["max_tokens"], Ty::Int, true) {
            // The validator sees the parsed int: `"0"` is refused too.
            if lax_int(n).is_ok_and(|i| i.below(1)) {
                v.error(
                    &["max_tokens"],
                    "value_error",
                    "Value error, max_tokens must be positive",
                    n,
                );
            }
        }
        for (f, ty) in [
            ("stream", Ty::Bool),
            ("stop_sequences", Ty::List),
            ("temperature", Ty::Num),
            ("top_p", Ty::Num),
            ("top_k", Ty::Int),
            ("metadata", Ty::Obj),
        ] {
            v.field(obj, &[f], ty, false);
        }
        if let Some(s) = v.field(obj, &["cache_salt"], Ty::Str, false) {
            let n = s.as_str().map_or(0, |s| s.chars().count());
            if n == 0 {
                v.error(
                    &["cache_salt"],
                    "string_too_short",
                    "String should have at least 1 character",
                    s,
                );
            } else if n > 1024 {
                v.error(
                    &["cache_salt"],
                    "string_too_long",
                    "String should have at most 1024 characters",
                    s,
                );
            }
        }
    }
    v.finish()
}

/// Refuses what would change vLLM's rendering in ways the simulator's
/// tokenizer (text messages, no template arguments) cannot reproduce: a
/// different prompt would mean different prefix-cache blocks.
fn check_renderable(obj: &Map<String, Value>) -> Result<(), ApiError> {
    let unsupported = |what: &str| {
        Err(ApiError::bad_request(format!(
            "vllm-sim cannot render {what}: its chat template takes text messages only (vLLM would render it)"
        )))
    };
    if obj
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty())
    {
        return unsupported("tools");
    }
    if matches!(
        obj.get("thinking")
            .and_then(|t| t.get("type"))
            .and_then(Value::as_str),
        Some("disabled" | "between_tools")
    ) {
        return unsupported("thinking.type disabled (it sets the template's enable_thinking)");
    }
    if obj
        .get("output_config")
        .and_then(|o| o.get("effort"))
        .is_some_and(|e| !e.is_null())
    {
        return unsupported("output_config.effort (it sets the template's reasoning_effort)");
    }
    if obj
        .get("chat_template_kwargs")
        .and_then(Value::as_object)
        .is_some_and(|k| !k.is_empty())
    {
        return unsupported("chat_template_kwargs");
    }
    Ok(())
}

/// Text of a system message or system blocks: text blocks joined without
/// a separator, the billing header dropped (vLLM's `_extract_system_text`).
fn system_text(content: &Value) -> String {
    match content {
        Value::String(s) if s.starts_with(BILLING_HEADER) => String::new(),
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter(|b| b["type"] == "text")
            .filter_map(|b| b["text"].as_str())
            .filter(|t| !t.is_empty() && !t.starts_with(BILLING_HEADER))
            .collect(),
        _ => String::new(),
    }
}

/// A user or assistant message's blocks as chat content: text blocks
/// (empty ones skipped) joined with newlines as vLLM's chat parser joins
/// text parts; `None` when there is none.
fn block_text(i: usize, blocks: &[Value]) -> Result<Option<String>, ApiError> {
    let mut parts = Vec::new();
    for b in blocks {
        match b["type"].as_str().unwrap_or_default() {
            "text" => {
                if let Some(t) = b["text"].as_str().filter(|t| !t.is_empty()) {
                    parts.push(t);
                }
            }
            // vLLM accepts and skips these (an echoed assistant message).
            "redacted_thinking" | "tool_reference" => {}
            other => {
                return Err(ApiError::bad_request(format!(
                    "vllm-sim cannot render messages[{i}]'s {other} block: its chat template takes text only (vLLM would render it)"
                )))
            }
        }
    }
    Ok((!parts.is_empty()).then(|| parts.join("\n")))
}

/// vLLM's `to_chat_completion_request` for text conversations: the system
/// field (plus inline system messages when the template needs them
/// first) as one leading system message, then the messages in order.
pub fn to_chat(
    obj: &Map<String, Value>,
    merge_inline_system: bool,
) -> Result<Vec<ChatMessage>, ApiError> {
    check_renderable(obj)?;
    let msgs = obj
        .get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut system = obj.get("system").map(system_text).unwrap_or_default();
    if merge_inline_system {
        for m in msgs.iter().filter(|m| m["role"] == "system") {
            system.push_str(&system_text(&m["content"]));
        }
    }
    let mut out = Vec::new();
    if !system.is_empty() {
        out.push(ChatMessage::new("system", system));
    }
    for (i, m) in msgs.iter().enumerate() {
        let role = m["role"].as_str().unwrap_or_default();
        let content = match (role, &m["content"]) {
            ("system", _) if merge_inline_system => continue,
            ("system", c) => Some(system_text(c)).filter(|t| !t.is_empty()),
            (_, Value::String(s)) => Some(s.clone()),
            (_, Value::Array(blocks)) => block_text(i, blocks)?,
            _ => None,
        };
        match content {
            Some(c) => out.push(ChatMessage::new(role, c)),
            // An assistant message without content still renders (empty);
            // a user message without any is left out, as vLLM does.
            None if role == "assistant" => out.push(ChatMessage::new(role, "")),
            None => {}
        }
    }
    Ok(out)
}

/// Anthropic usage from vLLM's figures: `input_tokens` excludes cache
/// reads and writes, which are reported only with
/// `--enable-prompt-tokens-details` (vLLM's `_build_anthropic_usage`).
pub fn usage(prompt: usize, output: u32, cached: u32, write: u32, details: bool) -> Value {
    if !details {
        return json!({"input_tokens": prompt, "output_tokens": output});
    }
    let input = (prompt as u64).saturating_sub(u64::from(cached) + u64::from(write));
    json!({"input_tokens": input, "output_tokens": output,
           "cache_creation_input_tokens": write, "cache_read_input_tokens": cached})
}

fn stop_reason(f: Option<FinishReason>) -> &'static str {
    match f {
        Some(FinishReason::Length) => "max_tokens",
        _ => "end_turn",
    }
}

struct Job {
    prompt: Vec<u32>,
    plan: (u32, FinishReason),
    salt: Option<String>,
    stream: bool,
    id: String,
}

fn prepare(st: &AppState, headers: &HeaderMap, obj: &Map<String, Value>) -> Result<Job, ApiError> {
    if let Some(e) = st.injected_failure() {
        return Err(e);
    }
    st.check_model(&obj.get("model").and_then(Value::as_str).map(str::to_string))?;
    let msgs = to_chat(obj, st.apis.merge_inline_system)?;
    let prompt = st
        .tokenizer
        .encode_chat(&msgs, true)
        .map_err(|e| ApiError::bad_request(format!("chat template failed: {e}")))?;
    // `validate` has refused a value pydantic's lax `int` refuses.
    let limit = obj.get("max_tokens").and_then(|n| lax_int(n).ok());
    let plan = plan_ceiling(st, prompt.len(), limit.as_ref(), headers)?;
    let id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map_or_else(random_uuid, str::to_string);
    Ok(Job {
        prompt,
        plan,
        salt: obj
            .get("cache_salt")
            .and_then(Value::as_str)
            .map(str::to_string),
        stream: obj.get("stream").and_then(Value::as_bool).unwrap_or(false),
        id: format!("chatcmpl-{id}"),
    })
}

/// `POST /v1/messages`.
pub async fn messages(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let obj = match json_object(&headers, &body).and_then(|o| validate(&o, true).map(|()| o)) {
        Ok(o) => o,
        Err(e) => return e.into_response(),
    };
    let job = match prepare(&st, &headers, &obj) {
        Ok(j) => j,
        Err(e) => return anthropic_error(e),
    };
    // vLLM's Messages request has no `priority`; the chat handler it goes
    // through still reads the X-Vllm-Priority header.
    let priority = crate::priority::request_priority(&headers, 0);
    let run = match Run::start(&st, job.prompt, job.plan, job.salt, priority) {
        Ok(r) => r,
        Err(e) => return anthropic_error(e),
    };
    if job.stream {
        return stream(st, run, job.id);
    }
    full(st, run, job.id).await
}

async fn full(st: Arc<AppState>, mut run: Run, id: String) -> Response {
    let text = match run.collect().await {
        Ok(t) => t,
        Err(e) => return anthropic_error(e),
    };
    let u = usage(
        run.prompt_len,
        run.output_tokens,
        run.cached,
        run.cache_write(),
        st.prompt_tokens_details,
    );
    Json(json!({
        "id": id, "type": "message", "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": st.model, "stop_reason": stop_reason(run.finish), "usage": u,
    }))
    .into_response()
}

struct StreamState {
    st: Arc<AppState>,
    run: Run,
    id: String,
    started: bool,
    block_open: bool,
    ended: bool,
}

impl EventStream for StreamState {
    fn ended(&self) -> bool {
        self.ended
    }

    fn next_events(&mut self) -> impl std::future::Future<Output = String> + Send {
        self.next_chunk()
    }
}

impl StreamState {
    /// The events for what the engine delivers next (vLLM's
    /// `message_stream_converter` over the chat stream).
    async fn next_chunk(&mut self) -> String {
        let mut out = String::new();
        let details = self.st.prompt_tokens_details;
        match self.run.next_pieces().await {
            Ok(Some(pieces)) => {
                if !self.started {
                    self.started = true;
                    let u = usage(
                        self.run.prompt_len,
                        0,
                        self.run.cached,
                        self.run.cache_write(),
                        details,
                    );
                    sse_event(
                        &mut out,
                        "message_start",
                        &json!({"type": "message_start", "message": {
                        "id": self.id, "type": "message", "role": "assistant", "content": [],
                        "model": self.st.model, "stop_reason": null, "stop_sequence": null, "usage": u}}),
                    );
                }
                for p in pieces.iter().filter(|p| !p.is_empty()) {
                    if !self.block_open {
                        self.block_open = true;
                        sse_event(
                            &mut out,
                            "content_block_start",
                            &json!({"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}),
                        );
                    }
                    sse_event(
                        &mut out,
                        "content_block_delta",
                        &json!({"type": "content_block_delta", "delta": {"type": "text_delta", "text": p}, "index": 0}),
                    );
                }
                if self.run.finish.is_some() {
                    self.close_block(&mut out);
                    let u = usage(
                        self.run.prompt_len,
                        self.run.output_tokens,
                        self.run.cached,
                        self.run.cache_write(),
                        details,
                    );
                    sse_event(
                        &mut out,
                        "message_delta",
                        &json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(self.run.finish), "stop_sequence": null}, "usage": u}),
                    );
                    sse_event(&mut out, "message_stop", &json!({"type": "message_stop"}));
                    self.ended = true;
                }
            }
            Ok(None) => self.ended = true,
            Err(e) => {
                self.close_block(&mut out);
                sse_event(
                    &mut out,
                    "error",
                    &json!({"type": "error", "error": {"type": error_type(e.status), "message": e.message}}),
                );
                self.ended = true;
            }
        }
        out
    }

    fn close_block(&mut self, out: &mut String) {
        if std::mem::take(&mut self.block_open) {
            sse_event(
                out,
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": 0}),
            );
        }
    }
}

fn stream(st: Arc<AppState>, run: Run, id: String) -> Response {
    let state = StreamState {
        st,
        run,
        id,
        started: false,
        block_open: false,
        ended: false,
    };
    sse_stream(state)
}

/// Why a render was refused: the body did not fit the request model
/// (answered in vLLM's OpenAI shape everywhere), or serving it failed.
enum Refusal {
    Schema(ApiError),
    Serving(ApiError),
}

fn rendered(
    st: &AppState,
    headers: &HeaderMap,
    body: &[u8],
    generate: bool,
) -> Result<Vec<u32>, Refusal> {
    let obj = json_object(headers, body)
        .and_then(|o| validate(&o, generate).map(|()| o))
        .map_err(Refusal::Schema)?;
    st.check_model(&obj.get("model").and_then(Value::as_str).map(str::to_string))
        .and_then(|()| to_chat(&obj, st.apis.merge_inline_system))
        .and_then(|msgs| {
            st.tokenizer
                .encode_chat(&msgs, true)
                .map_err(|e| ApiError::bad_request(format!("chat template failed: {e}")))
        })
        .map_err(Refusal::Serving)
}

/// `POST /v1/messages/count_tokens`: the rendered prompt's length, with no
/// context-length limit (vLLM counts like `/tokenize`).
pub async fn count_tokens(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match rendered(&st, &headers, &body, false) {
        Ok(ids) => Json(json!({"input_tokens": ids.len(), "context_management": {"original_input_tokens": ids.len()}})).into_response(),
        Err(Refusal::Schema(e)) => e.into_response(),
        Err(Refusal::Serving(e)) => anthropic_error(e),
    }
}

/// `POST /v1/messages/render`: the prompt a Messages request renders to,
/// in the shape of the simulator's `/v1/chat/completions/render`. (vLLM
/// serves its render endpoints only with `--enable-scale-out`, answering
/// a `GenerateRequest`, and errors in the OpenAI shape.)
pub async fn render(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    match rendered(&st, &headers, &body, true) {
        Ok(ids) => Json(json!({"model": st.model, "prompt": st.tokenizer.decode(&ids), "token_ids": ids, "count": ids.len()})).into_response(),
        Err(Refusal::Schema(e) | Refusal::Serving(e)) => e.into_response(),
    }
}

#[cfg(test)]
#[path = "anthropic_tests.rs"]
mod tests;
