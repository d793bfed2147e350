//! The HTTP API: vLLM's OpenAI-compatible endpoints plus the simulator's
//! admin endpoints under `/sim/`.

use crate::engine::{FinishReason, NewRequest, TokenOutput};
use crate::exposition::{render, CONTENT_TYPE};
use crate::faults::FaultSettings;
use crate::openai::{
    content_text, parse_prompt, prompt_of, type_name, ApiError, ChatRequest, CompletionRequest,
    Prompt, StreamOptions,
};
use crate::priority::request_priority;
use crate::publisher::PublisherCmd;
use crate::runner::Command;
pub use crate::state::AppState;
use crate::state::{now_secs, AbortGuard};
use crate::validation::Int;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvasir_tokenizer::ChatMessage;
use serde_json::{json, Value};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Request header that sets how many tokens a request generates before it
/// stops naturally (for benchmarks replaying traces). Capped by max_tokens.
pub const OUTPUT_TOKENS_HEADER: &str = "x-sim-output-tokens";

/// Builds the router; `admin`: with the admin endpoints that change the
/// engine (`/sim/faults`, `/sim/clear-cache`, `/sim/restart-events`,
/// `--enable-sim-admin`), else they are 404 as any unknown path.
pub fn router(state: Arc<AppState>, admin: bool) -> Router {
    use crate::{anthropic, instrumentator, responses};
    // vLLM counts these routes in /load (its `load_aware_call`).
    let load_aware = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{response_id}", get(responses::retrieve))
        .route(
            "/v1/responses/{response_id}/cancel",
            post(responses::cancel),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            instrumentator::track_load,
        ));
    let admin_routes = Router::new()
        .route("/sim/faults", get(get_faults).post(set_faults))
        .route("/sim/clear-cache", post(reset_prefix_cache))
        .route("/sim/restart-events", post(restart_events));
    Router::new()
        .merge(load_aware)
        .merge(if admin { admin_routes } else { Router::new() })
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/messages/render", post(anthropic::render))
        .route("/v1/responses/render", post(responses::render))
        .route("/load", get(instrumentator::load))
        .route("/version", get(instrumentator::version))
        .route(
            "/kv_event_sources",
            get(instrumentator::kv_event_sources_handler),
        )
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/sim/info", get(sim_info))
        .layer(DefaultBodyLimit::max(64 << 20))
        .with_state(state)
}

pub(crate) fn parse_json<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "malformed JSON"
        } else {
            "invalid request"
        };
        ApiError::bad_request(format!("{what}: {e}"))
    })
}

impl AppState {
    pub(crate) fn check_model(&self, m: &Option<String>) -> Result<(), ApiError> {
        match m {
            None => Ok(()),
            Some(m) if *m == self.model => Ok(()),
            Some(m) => Err(ApiError::not_found(format!(
                "The model `{m}` does not exist."
            ))),
        }
    }

    pub(crate) fn injected_failure(&self) -> Option<ApiError> {
        let r = self.faults.fail_rate();
        if r > 0.0 && rand::random::<f64>() < r {
            self.failed.fetch_add(1, Ordering::Relaxed);
            return Some(ApiError::internal("injected failure (vllm-sim fault)"));
        }
        None
    }

    fn chat_prompt(
        &self,
        messages: &[crate::openai::ChatMessageIn],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, ApiError> {
        if messages.is_empty() {
            return Err(ApiError::bad_param(
                "messages",
                "messages must contain at least one message",
            ));
        }
        let msgs = messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                Ok(ChatMessage {
                    role: m.role.clone(),
                    content: content_text(i, &m.content)?,
                })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        self.tokenizer
            .encode_chat(&msgs, add_generation_prompt)
            .map_err(|e| ApiError::bad_param("messages", format!("chat template failed: {e}")))
    }

    fn check_tokens(&self, ids: &[u32]) -> Result<(), ApiError> {
        let v = self.tokenizer.vocab_size() as u32;
        if let Some((i, t)) = ids.iter().enumerate().find(|(_, t)| **t >= v) {
            return Err(ApiError::bad_param(
                "prompt",
                format!("Token id {t} at prompt[{i}] is out of vocabulary (size {v})"),
            ));
        }
        Ok(())
    }

    /// The request's output limit as the engine checks it: below 1 is
    /// refused as vLLM's `SamplingParams` refuses it, and so is a limit that
    /// does not fit the context after the prompt. `param` is the field.
    pub(crate) fn output_limit(
        &self,
        prompt_len: usize,
        m: &Int,
        param: &str,
    ) -> Result<u32, ApiError> {
        if m.below(1) {
            return Err(ApiError::bad_param(
                param,
                format!("max_tokens must be at least 1, got {m}."),
            ));
        }
        let mml = self.max_model_len;
        let room = mml.saturating_sub(prompt_len);
        match m.as_i64().and_then(|m| usize::try_from(m).ok()) {
            Some(n) if n <= room => Ok(n as u32),
            _ => Err(ApiError::bad_param(param, format!(
                "'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's maximum context length is {mml} tokens and your request has {prompt_len} input tokens ({m} > {mml} - {prompt_len})."
            ))),
        }
    }

    /// Decides the completion length and its finish reason, vLLM-style
    /// length checks included.
    pub(crate) fn plan_output(
        &self,
        prompt_len: usize,
        max_tokens: Option<&Int>,
        headers: &HeaderMap,
    ) -> Result<(u32, FinishReason), ApiError> {
        let mml = self.max_model_len;
        if prompt_len == 0 {
            return Err(ApiError::bad_param(
                "prompt",
                "The prompt must not be empty",
            ));
        }
        if prompt_len >= mml {
            return Err(ApiError::bad_request(format!(
                "This model's maximum context length is {mml} tokens. However, your request has {prompt_len} input tokens. Please reduce the length of the input messages."
            )));
        }
        let max_tokens = max_tokens
            .map(|m| self.output_limit(prompt_len, m, "max_tokens"))
            .transpose()?;
        let hint = match headers.get(OUTPUT_TOKENS_HEADER) {
            None => None,
            Some(v) => Some(
                v.to_str()
                    .ok()
                    .and_then(|s| s.trim().parse::<u32>().ok())
                    .filter(|n| *n > 0)
                    .ok_or_else(|| {
                        ApiError::bad_request(format!(
                            "header {OUTPUT_TOKENS_HEADER} must be a positive integer"
                        ))
                    })?,
            ),
        };
        let room = (mml - prompt_len) as u32;
        Ok(match (hint, max_tokens) {
            (Some(h), Some(m)) if h < m => (h, FinishReason::Stop),
            (_, Some(m)) => (m, FinishReason::Length),
            (Some(h), None) => (h.min(room), FinishReason::Stop),
            (None, None) => (
                self.default_output_tokens.min(room).max(1),
                FinishReason::Stop,
            ),
        })
    }

    pub(crate) fn submit(
        &self,
        prompt: Vec<u32>,
        max_tokens: u32,
        finish: FinishReason,
        salt: Option<String>,
        priority: i64,
    ) -> Result<(u64, UnboundedReceiver<TokenOutput>), ApiError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = unbounded_channel();
        let req = NewRequest {
            id,
            prompt,
            max_tokens,
            finish_reason: finish,
            cache_salt: salt,
            arrival: 0.0,
            priority,
            sink: tx,
        };
        if !self.engine.send(Command::Add(req, Instant::now())) {
            return Err(ApiError::unavailable("engine is not running"));
        }
        Ok((id, rx))
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

struct Job {
    kind: Kind,
    prompt: Vec<u32>,
    max_tokens: u32,
    finish: FinishReason,
    salt: Option<String>,
    priority: i64,
    stream: bool,
    stream_options: StreamOptions,
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match chat_job(&st, &headers, &body) {
        Ok(job) => run_job(st, job).await,
        Err(e) => e.into_response(),
    }
}

fn check_n(n: Option<&Int>) -> Result<(), ApiError> {
    match n {
        None | Some(Int::I64(1)) => Ok(()),
        Some(n) => Err(ApiError::bad_param(
            "n",
            format!("vllm-sim generates one choice per request; n = {n} is not supported"),
        )),
    }
}

fn chat_job(st: &AppState, headers: &HeaderMap, body: &Bytes) -> Result<Job, ApiError> {
    if let Some(e) = st.injected_failure() {
        return Err(e);
    }
    let req: ChatRequest = parse_json(body)?;
    let ints = req.ints()?;
    let priority = request_priority(headers, ints.priority);
    st.check_model(&req.model)?;
    check_n(ints.n.as_ref())?;
    let prompt = st.chat_prompt(&req.messages, req.add_generation_prompt.unwrap_or(true))?;
    let (max_tokens, finish) = st.plan_output(prompt.len(), ints.max_tokens.as_ref(), headers)?;
    Ok(Job {
        kind: Kind::Chat,
        prompt,
        max_tokens,
        finish,
        salt: req.cache_salt,
        priority,
        stream: req.stream,
        stream_options: req.stream_options.unwrap_or_default(),
    })
}

async fn completions(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    match completion_job(&st, &headers, &body) {
        Ok(job) => run_job(st, job).await,
        Err(e) => e.into_response(),
    }
}

fn completion_job(st: &AppState, headers: &HeaderMap, body: &Bytes) -> Result<Job, ApiError> {
    if let Some(e) = st.injected_failure() {
        return Err(e);
    }
    let req: CompletionRequest = parse_json(body)?;
    let (prompt, ints) = req.check()?;
    let priority = request_priority(headers, ints.priority);
    st.check_model(&req.model)?;
    check_n(ints.n.as_ref())?;
    let prompt = match prompt_of(prompt)? {
        Prompt::Text(t) => st.tokenizer.encode(&t),
        Prompt::Tokens(ids) => {
            st.check_tokens(&ids)?;
            ids
        }
    };
    // OpenAI's completions default of 16 tokens is in `ints`.
    let (max_tokens, finish) = st.plan_output(prompt.len(), ints.max_tokens.as_ref(), headers)?;
    Ok(Job {
        kind: Kind::Completion,
        prompt,
        max_tokens,
        finish,
        salt: req.cache_salt,
        priority,
        stream: req.stream,
        stream_options: req.stream_options.unwrap_or_default(),
    })
}

fn usage(prompt: usize, completion: u32, cached: u32, details: bool) -> Value {
    let mut u = json!({
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion as usize,
        "completion_tokens": completion,
    });
    u["prompt_tokens_details"] = if details {
        json!({"cached_tokens": cached})
    } else {
        Value::Null
    };
    u
}

async fn run_job(st: Arc<AppState>, job: Job) -> Response {
    let prompt_len = job.prompt.len();
    let (id, mut rx) = match st.submit(
        job.prompt,
        job.max_tokens,
        job.finish,
        job.salt,
        job.priority,
    ) {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let guard = AbortGuard {
        engine: st.engine.clone(),
        id,
        done: false,
    };
    let (prefix, object) = match job.kind {
        Kind::Chat => ("chatcmpl", "chat.completion"),
        Kind::Completion => ("cmpl", "text_completion"),
    };
    let rid = format!("{prefix}-{:016x}{id:08x}", st.started);
    let created = now_secs();
    if !job.stream {
        let mut guard = guard;
        let mut text = String::new();
        let (mut n, mut cached, mut reason) = (0u32, 0u32, None);
        while let Some(t) = rx.recv().await {
            text.push_str(st.piece_text.get(&t.token_id).map_or("", String::as_str));
            n += 1;
            cached = t.cached_tokens;
            if let Some(r) = t.finished {
                reason = Some(r);
                break;
            }
        }
        guard.done = true;
        let Some(reason) = reason else {
            return ApiError::internal("engine stopped before the request finished")
                .into_response();
        };
        let choice = match job.kind {
            Kind::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": null, "tool_calls": []}, "logprobs": null, "finish_reason": reason.as_str(), "stop_reason": null})
            }
            Kind::Completion => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": reason.as_str(), "stop_reason": null})
            }
        };
        let body = json!({"id": rid, "object": object, "created": created, "model": st.model, "choices": [choice], "usage": usage(prompt_len, n, cached, st.prompt_tokens_details)});
        return Json(body).into_response();
    }

    // Streaming: one SSE event per token, then usage (if asked), then [DONE].
    let chunk_object = match job.kind {
        Kind::Chat => "chat.completion.chunk",
        Kind::Completion => "text_completion",
    };
    struct S {
        st: Arc<AppState>,
        rx: UnboundedReceiver<TokenOutput>,
        guard: AbortGuard,
        sent_role: bool,
        n: u32,
        cached: u32,
        finished: bool,
        ended: bool,
        prompt_len: usize,
    }
    let state = S {
        st,
        rx,
        guard,
        sent_role: false,
        n: 0,
        cached: 0,
        finished: false,
        ended: false,
        prompt_len,
    };
    let kind = job.kind;
    let opts = job.stream_options;
    let model_name = state.st.model.clone();
    let base = move |choices: Value| json!({"id": rid, "object": chunk_object, "created": created, "model": model_name, "choices": choices});
    let stream = futures::stream::unfold((state, base), move |(mut s, base)| async move {
        if s.ended {
            return None;
        }
        let mut out = String::new();
        let push = |out: &mut String, v: &Value| {
            out.push_str("data: ");
            out.push_str(&v.to_string());
            out.push_str("\n\n");
        };
        if kind == Kind::Chat && !s.sent_role {
            s.sent_role = true;
            let mut c = base(
                json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
            );
            if opts.include_usage && opts.continuous_usage_stats {
                c["usage"] = usage(s.prompt_len, 0, 0, s.st.prompt_tokens_details);
            }
            push(&mut out, &c);
        }
        // Tokens that are already there go out in one write: at high speed a
        // step delivers many at once, and one syscall per token is waste.
        let mut first = true;
        while !s.finished {
            let next = if first {
                s.rx.recv().await
            } else {
                match s.rx.try_recv() {
                    Ok(t) => Some(t),
                    Err(_) => break,
                }
            };
            first = false;
            match next {
                Some(t) => {
                    s.n += 1;
                    s.cached = t.cached_tokens;
                    let piece = s.st.piece_text.get(&t.token_id).map_or("", String::as_str);
                    let reason = t.finished.map(FinishReason::as_str);
                    let choice = match kind {
                        Kind::Chat => {
                            json!({"index": 0, "delta": {"content": piece}, "logprobs": null, "finish_reason": reason})
                        }
                        Kind::Completion => {
                            json!({"index": 0, "text": piece, "logprobs": null, "finish_reason": reason, "stop_reason": null})
                        }
                    };
                    let mut c = base(json!([choice]));
                    if opts.include_usage && opts.continuous_usage_stats {
                        c["usage"] = usage(s.prompt_len, s.n, s.cached, s.st.prompt_tokens_details);
                    }
                    push(&mut out, &c);
                    if t.finished.is_some() {
                        s.finished = true;
                        s.guard.done = true;
                    }
                }
                None => {
                    // The engine went away mid-stream: end with an error event as vLLM does.
                    let e = ApiError::internal("engine stopped before the request finished").body();
                    push(&mut out, &e);
                    s.finished = true;
                }
            }
        }
        if !s.finished {
            return Some((
                Ok::<_, std::convert::Infallible>(Bytes::from(out)),
                (s, base),
            ));
        }
        if opts.include_usage {
            let mut c = base(json!([]));
            c["usage"] = usage(s.prompt_len, s.n, s.cached, s.st.prompt_tokens_details);
            push(&mut out, &c);
        }
        out.push_str("data: [DONE]\n\n");
        s.ended = true;
        Some((Ok(Bytes::from(out)), (s, base)))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| ApiError::internal("response build failed").into_response())
}

fn json_or_error(r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn render_chat(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let r = (|| -> Result<Value, ApiError> {
        let req: ChatRequest = parse_json(&body)?;
        st.check_model(&req.model)?;
        let ids = st.chat_prompt(&req.messages, req.add_generation_prompt.unwrap_or(true))?;
        Ok(
            json!({"model": st.model, "prompt": st.tokenizer.decode(&ids), "token_ids": ids, "count": ids.len()}),
        )
    })();
    json_or_error(r)
}

async fn tokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let r = (|| -> Result<Value, ApiError> {
        let v: Value = parse_json(&body)?;
        let model = match v.get("model") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(o) => {
                return Err(ApiError::bad_param(
                    "model",
                    format!("model must be a string, got {}", type_name(o)),
                ))
            }
        };
        st.check_model(&model)?;
        let ids = if v.get("messages").is_some() {
            let req: ChatRequest = serde_json::from_value(v.clone())
                .map_err(|e| ApiError::bad_request(format!("invalid request: {e}")))?;
            st.chat_prompt(&req.messages, req.add_generation_prompt.unwrap_or(true))?
        } else {
            match v.get("prompt") {
                Some(Value::String(s)) => st.tokenizer.encode(s),
                Some(o) => {
                    return Err(ApiError::bad_param(
                        "prompt",
                        format!("prompt must be a string, got {}", type_name(o)),
                    ))
                }
                None => {
                    return Err(ApiError::bad_request(
                        "either prompt or messages is required",
                    ))
                }
            }
        };
        Ok(
            json!({"count": ids.len(), "max_model_len": st.max_model_len, "tokens": ids, "token_strs": null}),
        )
    })();
    json_or_error(r)
}

async fn detokenize(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let r = (|| -> Result<Value, ApiError> {
        let v: Value = parse_json(&body)?;
        let toks = v
            .get("tokens")
            .ok_or_else(|| ApiError::bad_request("tokens is required"))?;
        let Prompt::Tokens(ids) = parse_prompt(toks)
            .map_err(|_| ApiError::bad_param("tokens", "tokens must be a list of token ids"))?
        else {
            return Err(ApiError::bad_param(
                "tokens",
                "tokens must be a list of token ids",
            ));
        };
        st.check_tokens(&ids)
            .map_err(|e| ApiError::bad_param("tokens", e.message))?;
        Ok(json!({"prompt": st.tokenizer.decode(&ids)}))
    })();
    json_or_error(r)
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [{
        "id": st.model, "object": "model", "created": st.started, "owned_by": "vllm",
        "root": st.model, "parent": null, "max_model_len": st.max_model_len,
    }]}))
}

async fn health(State(st): State<Arc<AppState>>) -> StatusCode {
    if st.faults.unhealthy() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let text = render(
        &st.engine.snapshot(),
        &st.info,
        st.failed.load(Ordering::Relaxed),
    );
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response()
}

async fn reset_prefix_cache(State(st): State<Arc<AppState>>) -> Response {
    let (tx, rx) = tokio::sync::oneshot::channel();
    if !st.engine.send(Command::ResetCache(tx)) {
        return ApiError::unavailable("engine is not running").into_response();
    }
    match rx.await {
        Ok(true) => Json(json!({"reset": true})).into_response(),
        Ok(false) => (StatusCode::CONFLICT, Json(json!({"reset": false, "reason": "requests are running; the prefix cache can only be reset when idle"}))).into_response(),
        Err(_) => ApiError::unavailable("engine is not running").into_response(),
    }
}

async fn sim_info(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "model": st.model,
        "max_model_len": st.max_model_len,
        "block_size": st.info.block_size,
        "num_gpu_blocks": st.info.num_gpu_blocks,
        "profile": st.info.profile,
        "time_scale": st.info.time_scale,
        "scheduling_policy": st.info.scheduling_policy,
        "kv_events_endpoint": st.endpoints.publish,
        "kv_events_replay_endpoint": st.endpoints.replay,
    }))
}

async fn get_faults(State(st): State<Arc<AppState>>) -> Json<FaultSettings> {
    Json(st.faults.current())
}

async fn set_faults(State(st): State<Arc<AppState>>, body: Bytes) -> Response {
    let s: FaultSettings = match parse_json(&body) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    match st.faults.apply(&s) {
        Ok(()) => {
            tracing::warn!(faults = ?st.faults.current(), "fault settings changed");
            Json(st.faults.current()).into_response()
        }
        Err(m) => ApiError::bad_request(m).into_response(),
    }
}

async fn restart_events(State(st): State<Arc<AppState>>) -> Response {
    let _ = st.publisher.send(PublisherCmd::RestartSequence);
    Json(json!({"restarted": true})).into_response()
}
