//! vLLM's OpenAI Responses API on its simple (non-harmony) path:
//! `POST /v1/responses` (streamed or not), `GET /v1/responses/{id}`,
//! `POST /v1/responses/{id}/cancel` and `POST /v1/responses/render`.
//!
//! Responses are kept only with the store on (see [`crate::response_store`]);
//! `store: true` is silently treated as false when it is off, as vLLM does.
//! Errors use vLLM's OpenAI shape.

use crate::apis::{plan_ceiling, random_uuid, sse_event, sse_stream, EventStream, Run};
use crate::engine::FinishReason;
use crate::openai::ApiError;
use crate::response_store::Cancel;
use crate::responses_input::{chat_messages, continues_final_message, encode, Previous};
use crate::state::{now_secs, AppState};
use crate::validation::{json_object, lax_int, Ty, Validator};
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvasir_tokenizer::ChatMessage;
use serde_json::{json, Map, Value};
use std::sync::Arc;

fn validate(obj: &Map<String, Value>) -> Result<(), ApiError> {
    let mut v = Validator::default();
    match obj.get("input") {
        None => v.error(
            &["input"],
            "missing",
            "Field required",
            &Value::Object(obj.clone()),
        ),
        Some(Value::String(_) | Value::Array(_)) => {}
        Some(other) => v.error(
            &["input"],
            "string_type",
            "Input should be a valid string",
            other,
        ),
    }
    for (f, ty) in [
        ("model", Ty::Str),
        ("instructions", Ty::Str),
        ("max_output_tokens", Ty::Int),
        ("previous_response_id", Ty::Str),
        ("store", Ty::Bool),
        ("stream", Ty::Bool),
        ("background", Ty::Bool),
        ("temperature", Ty::Num),
        ("top_p", Ty::Num),
        ("tools", Ty::List),
        ("metadata", Ty::Obj),
        ("text", Ty::Obj),
        ("reasoning", Ty::Obj),
        ("user", Ty::Str),
        ("request_id", Ty::Str),
        ("cache_salt", Ty::Str),
        ("parallel_tool_calls", Ty::Bool),
        ("max_tool_calls", Ty::Int),
        ("top_k", Ty::Int),
        ("include", Ty::List),
        ("chat_template_kwargs", Ty::Obj),
        ("presence_penalty", Ty::Num),
        ("frequency_penalty", Ty::Num),
    ] {
        v.field(obj, &[f], ty, false);
    }
    crate::priority::check(&mut v, obj.get("priority"));
    if let Some(t) = obj.get("truncation").filter(|t| !t.is_null()) {
        if !matches!(t.as_str(), Some("auto" | "disabled")) {
            v.error(
                &["truncation"],
                "literal_error",
                "Input should be 'auto' or 'disabled'",
                t,
            );
        }
    }
    if obj.get("background").and_then(Value::as_bool) == Some(true)
        && obj.get("store").and_then(Value::as_bool) == Some(false)
    {
        v.error(
            &["background"],
            "value_error",
            "Value error, background can only be used when `store` is true",
            &obj["background"],
        );
    }
    v.finish()
}

fn invalid(message: impl Into<String>, param: &str) -> ApiError {
    ApiError {
        kind: "invalid_request_error",
        ..ApiError::bad_param(param, message)
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        ..invalid(format!("Response with id '{id}' not found."), "response_id")
    }
}

/// What the simulator cannot render as vLLM would (tools and template
/// arguments change the prompt) or produce (logprobs).
fn check_supported(obj: &Map<String, Value>) -> Result<(), ApiError> {
    let unsupported = |what: &str, param: &str| {
        Err(ApiError::bad_param(
            param,
            format!("vllm-sim does not simulate {what} (vLLM would)"),
        ))
    };
    if obj
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty())
    {
        return unsupported("tools: its chat template takes text messages only", "tools");
    }
    if obj
        .get("reasoning")
        .and_then(|r| r.get("effort"))
        .is_some_and(|e| !e.is_null())
    {
        return unsupported(
            "reasoning.effort: it sets the template's enable_thinking",
            "reasoning",
        );
    }
    if obj
        .get("chat_template_kwargs")
        .and_then(Value::as_object)
        .is_some_and(|k| !k.is_empty())
    {
        return unsupported("chat_template_kwargs", "chat_template_kwargs");
    }
    if obj
        .get("include")
        .and_then(Value::as_array)
        .is_some_and(|i| i.iter().any(|x| x == "message.output_text.logprobs"))
    {
        return unsupported("logprobs", "include");
    }
    if obj.get("background").and_then(Value::as_bool) == Some(true) {
        return unsupported("background responses", "background");
    }
    Ok(())
}

/// One accepted request, ready to run.
struct Job {
    prompt: Vec<u32>,
    messages: Vec<ChatMessage>,
    plan: (u32, FinishReason),
    salt: Option<String>,
    priority: i64,
    store: bool,
    stream: bool,
    /// The response object as `ResponsesResponse.from_request` fills it,
    /// before status, output and usage.
    base: Map<String, Value>,
}

fn str_field(obj: &Map<String, Value>, k: &str) -> Option<String> {
    obj.get(k).and_then(Value::as_str).map(str::to_string)
}

/// The request's echo in the response, as vLLM's `from_request` makes it.
fn base_response(
    st: &AppState,
    obj: &Map<String, Value>,
    id: &str,
    max_tokens: usize,
) -> Map<String, Value> {
    let get = |k: &str| obj.get(k).cloned().unwrap_or(Value::Null);
    let num = |k: &str, d: f64| {
        obj.get(k)
            .and_then(Value::as_f64)
            .map_or(json!(d), |x| json!(x))
    };
    let tools = obj.get("tools").cloned().unwrap_or_else(|| json!([]));
    let tool_choice = match obj.get("tool_choice").filter(|t| !t.is_null()) {
        // Without tools, vLLM turns "auto" (the default) into "none".
        None => json!("none"),
        Some(t) if tools.as_array().is_none_or(Vec::is_empty) && (t == "auto" || t == "none") => {
            json!("none")
        }
        Some(t) => t.clone(),
    };
    let cache_options = obj
        .get("prompt_cache_options")
        .filter(|o| o.is_object())
        .map_or(Value::Null, |o| {
            json!({"mode": o.get("mode").cloned().unwrap_or(json!("implicit")),
               "ttl": o.get("ttl").cloned().unwrap_or(json!("30m")),
               "comparison_response_id": get_in(o, "comparison_response_id")})
        });
    let retention = match obj.get("prompt_cache_retention") {
        Some(v) if v == "in-memory" => json!("in_memory"),
        Some(v) => v.clone(),
        None => Value::Null,
    };
    let v = json!({
        "id": id, "created_at": now_secs(), "incomplete_details": null,
        "instructions": get("instructions"), "metadata": get("metadata"), "model": st.model,
        "object": "response", "output": [],
        "parallel_tool_calls": obj.get("parallel_tool_calls").and_then(Value::as_bool).unwrap_or(true),
        "temperature": num("temperature", 1.0), "tool_choice": tool_choice, "tools": tools,
        "top_p": num("top_p", 1.0), "background": obj.get("background").and_then(Value::as_bool).unwrap_or(false),
        "max_output_tokens": max_tokens, "max_tool_calls": get("max_tool_calls"),
        "previous_response_id": get("previous_response_id"), "prompt": null,
        "prompt_cache_options": cache_options, "prompt_cache_key": get("prompt_cache_key"),
        "prompt_cache_retention": retention, "reasoning": get("reasoning"),
        "safety_identifier": get("safety_identifier"),
        "service_tier": obj.get("service_tier").cloned().unwrap_or(json!("auto")),
        "status": "in_progress", "text": get("text"), "top_logprobs": null,
        "truncation": obj.get("truncation").filter(|t| !t.is_null()).cloned().unwrap_or(json!("disabled")),
        "usage": null, "user": get("user"),
        "presence_penalty": num("presence_penalty", 0.0), "frequency_penalty": num("frequency_penalty", 0.0),
        "kv_transfer_params": null, "ec_transfer_params": null,
        "input_messages": null, "output_messages": null,
    });
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

fn get_in(o: &Value, k: &str) -> Value {
    o.get(k).cloned().unwrap_or(Value::Null)
}

/// The prompt's messages: the previous response (looked up in the store)
/// first, then this request.
fn render_messages(st: &AppState, obj: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let previous = match str_field(obj, "previous_response_id") {
        Some(id) => Some(
            st.apis
                .store
                .get(&id)
                .ok_or_else(|| not_found(&id))
                .map(|r| (id, r))?,
        ),
        None => None,
    };
    let prev = previous.as_ref().map(|(id, r)| Previous {
        messages: st.apis.store.messages(id),
        output: &r["output"],
    });
    let instructions = str_field(obj, "instructions");
    chat_messages(
        instructions.as_deref(),
        obj.get("input").unwrap_or(&Value::Null),
        prev,
    )
}

fn prepare(st: &AppState, headers: &HeaderMap, obj: &Map<String, Value>) -> Result<Job, ApiError> {
    if let Some(e) = st.injected_failure() {
        return Err(e);
    }
    st.check_model(&str_field(obj, "model"))?;
    let asked_store = obj.get("store").and_then(Value::as_bool).unwrap_or(true);
    let background = obj.get("background").and_then(Value::as_bool) == Some(true);
    if asked_store && !st.apis.store.enabled() && background {
        return Err(invalid("This vLLM engine does not support `store=True` and therefore does not support the background mode. To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.", "background"));
    }
    check_supported(obj)?;
    // vLLM silently drops store=true when its store is off.
    let store = asked_store && st.apis.store.enabled();
    let messages = render_messages(st, obj)?;
    let input = obj.get("input").unwrap_or(&Value::Null);
    let prompt = encode(&st.tokenizer, &messages, continues_final_message(input))?;
    let (p, mml) = (prompt.len(), st.max_model_len);
    if p >= mml {
        return Err(invalid(format!("The engine prompt length {p} exceeds the max_model_len {mml}. Please reduce prompt."), "input"));
    }
    // `validate` has refused a value pydantic's lax `int` refuses.
    let limit = obj.get("max_output_tokens").and_then(|n| lax_int(n).ok());
    let plan = plan_ceiling(st, p, limit.as_ref(), headers)?;
    // `plan_ceiling` has refused a limit below 1 or past the room left.
    let max_tokens = limit
        .and_then(|m| m.as_i64())
        .map_or(mml - p, |m| (m as usize).min(mml - p));
    let id = str_field(obj, "request_id").unwrap_or_else(|| format!("resp_{}", random_uuid()));
    Ok(Job {
        base: base_response(st, obj, &id, max_tokens),
        prompt,
        messages,
        plan,
        salt: str_field(obj, "cache_salt"),
        // `validate` has refused a priority pydantic would.
        priority: crate::priority::request_priority(
            headers,
            crate::priority::body_priority(obj.get("priority")).unwrap_or(0),
        ),
        store,
        stream: obj.get("stream").and_then(Value::as_bool).unwrap_or(false),
    })
}

/// `POST /v1/responses`.
pub async fn create(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let job = json_object(&headers, &body)
        .and_then(|o| validate(&o).map(|()| o))
        .and_then(|o| prepare(&st, &headers, &o));
    let mut job = match job {
        Ok(j) => j,
        Err(e) => return e.into_response(),
    };
    let run = match Run::start(
        &st,
        std::mem::take(&mut job.prompt),
        job.plan,
        job.salt.take(),
        job.priority,
    ) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if job.store {
        let id = job.base["id"].as_str().unwrap_or_default().to_string();
        st.apis
            .store
            .put_messages(&id, std::mem::take(&mut job.messages));
    }
    if job.stream {
        return stream(st, run, job);
    }
    let mut run = run;
    match run.collect().await {
        Ok(text) => {
            let item = output_item(
                &format!("msg_{}", random_uuid()),
                &text,
                item_status(run.finish),
            );
            Json(finish(&st, &job, &run, vec![item])).into_response()
        }
        Err(e) => e.into_response(),
    }
}

fn item_status(f: Option<FinishReason>) -> &'static str {
    match f {
        Some(FinishReason::Length) => "incomplete",
        _ => "completed",
    }
}

fn text_part(text: &str, logprobs: Value) -> Value {
    json!({"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs})
}

/// An assistant message output item (no content when the text is empty).
fn output_item(id: &str, text: &str, status: &str) -> Value {
    let content = if text.is_empty() {
        json!([])
    } else {
        json!([text_part(text, Value::Null)])
    };
    json!({"id": id, "content": content, "role": "assistant", "status": status, "type": "message", "phase": null})
}

/// vLLM's `ResponseUsage` for the simple path: cached tokens are reported
/// whatever `--enable-prompt-tokens-details` says; per-turn lists stay empty.
pub fn usage(prompt: usize, output: u32, cached: u32, write: u32) -> Value {
    json!({
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": write,
                                 "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
        "total_tokens": prompt + output as usize,
    })
}

/// The finished response (stored when the request asked and the store is
/// on): "incomplete" when the output limit cut it.
fn finish(st: &AppState, job: &Job, run: &Run, output: Vec<Value>) -> Value {
    let mut r = job.base.clone();
    let status = item_status(run.finish);
    r.insert("status".into(), json!(status));
    if status == "incomplete" {
        r.insert(
            "incomplete_details".into(),
            json!({"reason": "max_output_tokens"}),
        );
    }
    r.insert("output".into(), Value::Array(output));
    r.insert(
        "usage".into(),
        usage(
            run.prompt_len,
            run.output_tokens,
            run.cached,
            run.cache_write(),
        ),
    );
    let r = Value::Object(r);
    if job.store {
        st.apis.store.put_response(r.clone());
    }
    r
}

struct StreamState {
    st: Arc<AppState>,
    run: Run,
    job: Job,
    seq: u64,
    item_id: String,
    text: String,
    opened: bool,
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
    fn emit(&mut self, out: &mut String, mut event: Value) {
        event["sequence_number"] = json!(self.seq);
        self.seq += 1;
        let kind = event["type"].as_str().unwrap_or("unknown").to_string();
        sse_event(out, &kind, &event);
    }

    fn start(&mut self, out: &mut String) {
        let r = Value::Object(self.job.base.clone());
        self.emit(out, json!({"response": r, "type": "response.created"}));
        self.emit(out, json!({"response": r, "type": "response.in_progress"}));
    }

    fn open_message(&mut self, out: &mut String) {
        self.opened = true;
        let id = self.item_id.clone();
        self.emit(out, json!({"item": {"id": id, "content": [], "role": "assistant", "status": "in_progress", "type": "message", "phase": null},
                              "output_index": 0, "type": "response.output_item.added"}));
        self.emit(out, json!({"content_index": 0, "item_id": id, "output_index": 0, "part": text_part("", json!([])),
                              "type": "response.content_part.added"}));
    }

    fn close(&mut self, out: &mut String) {
        let (id, text) = (self.item_id.clone(), self.text.clone());
        let mut output = Vec::new();
        if self.opened {
            let status = item_status(self.run.finish);
            self.emit(out, json!({"content_index": 0, "item_id": id, "logprobs": [], "output_index": 0, "text": text,
                                  "type": "response.output_text.done"}));
            self.emit(out, json!({"content_index": 0, "item_id": id, "output_index": 0, "part": text_part(&text, Value::Null),
                                  "type": "response.content_part.done"}));
            let item = output_item(&id, &text, status);
            self.emit(
                out,
                json!({"item": item, "output_index": 0, "type": "response.output_item.done"}),
            );
            output.push(item);
        }
        let r = finish(&self.st, &self.job, &self.run, output);
        let kind = if r["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.emit(out, json!({"response": r, "type": kind}));
    }

    /// The events for what the engine delivers next (vLLM's
    /// `SimpleStreamingEventProcessor`, content only).
    async fn next_chunk(&mut self) -> String {
        let mut out = String::new();
        if self.seq == 0 {
            self.start(&mut out);
            return out;
        }
        match self.run.next_pieces().await {
            Ok(Some(pieces)) => {
                for p in pieces.iter().filter(|p| !p.is_empty()) {
                    if !self.opened {
                        self.open_message(&mut out);
                    }
                    self.text.push_str(p);
                    let id = self.item_id.clone();
                    self.emit(&mut out, json!({"content_index": 0, "delta": p, "item_id": id, "logprobs": [],
                                               "output_index": 0, "type": "response.output_text.delta"}));
                }
                if self.run.finish.is_some() {
                    self.close(&mut out);
                    self.ended = true;
                }
            }
            Ok(None) => self.ended = true,
            Err(e) => {
                self.emit(&mut out, json!({"code": e.status.as_u16().to_string(), "message": e.message, "param": null, "type": "error"}));
                self.ended = true;
            }
        }
        out
    }
}

fn stream(st: Arc<AppState>, run: Run, job: Job) -> Response {
    let item_id = format!("msg_{}", random_uuid());
    let state = StreamState {
        st,
        run,
        job,
        seq: 0,
        item_id,
        text: String::new(),
        opened: false,
        ended: false,
    };
    sse_stream(state)
}

/// `GET /v1/responses/{id}`: a stored response, else vLLM's 404.
pub async fn retrieve(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if let Some(e) = st.injected_failure() {
        return e.into_response();
    }
    match st.apis.store.get(&id) {
        Some(r) => Json(r).into_response(),
        None => not_found(&id).into_response(),
    }
}

/// `POST /v1/responses/{id}/cancel`: only queued or in-progress
/// (background) responses can be; a finished one is a 400.
pub async fn cancel(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if let Some(e) = st.injected_failure() {
        return e.into_response();
    }
    match st.apis.store.cancel(&id) {
        Cancel::Cancelled(r) => Json(r).into_response(),
        Cancel::NotFound => not_found(&id).into_response(),
        Cancel::NotCancellable => {
            invalid("Cannot cancel a synchronous response.", "response_id").into_response()
        }
    }
}

/// `POST /v1/responses/render`: the prompt a stateless Responses request
/// renders to, in the shape of the simulator's other render endpoints.
pub async fn render(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let ids = json_object(&headers, &body)
        .and_then(|o| validate(&o).map(|()| o))
        .and_then(|o| {
            st.check_model(&str_field(&o, "model"))?;
            if o.get("previous_response_id").is_some_and(|p| !p.is_null()) {
                return Err(invalid(
                    "previous_response_id is not supported by the stateless render endpoint.",
                    "previous_response_id",
                ));
            }
            check_supported(&o)?;
            let messages = render_messages(&st, &o)?;
            encode(
                &st.tokenizer,
                &messages,
                continues_final_message(o.get("input").unwrap_or(&Value::Null)),
            )
        });
    match ids {
        Ok(ids) => Json(json!({"model": st.model, "prompt": st.tokenizer.decode(&ids), "token_ids": ids, "count": ids.len()})).into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_has_vllms_fields() {
        let u = usage(100, 8, 64, 32);
        assert_eq!(u["input_tokens_details"]["cached_tokens"], 64);
        assert_eq!(u["input_tokens_details"]["cache_write_tokens"], 32);
        assert_eq!(u["total_tokens"], 108);
        assert_eq!(u["output_tokens_details"]["reasoning_tokens"], 0);
    }

    #[test]
    fn errors_have_vllms_shape() {
        let b = not_found("resp_x").body();
        assert_eq!(
            b,
            json!({"error": {"message": "Response with id 'resp_x' not found.", "type": "invalid_request_error", "param": "response_id", "code": 404}})
        );
        let b = invalid("Cannot cancel a synchronous response.", "response_id");
        assert_eq!(b.status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn output_items_drop_empty_text() {
        assert_eq!(output_item("msg_1", "", "completed")["content"], json!([]));
        let i = output_item("msg_1", "hi", "incomplete");
        assert_eq!(
            i["content"][0],
            json!({"annotations": [], "text": "hi", "type": "output_text", "logprobs": null})
        );
        assert_eq!(i["status"], "incomplete");
    }
}
