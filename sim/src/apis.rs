//! What the Anthropic Messages and OpenAI Responses endpoints share: one
//! request's run on the engine, the SSE stream, and vLLM's usage figures
//! (their settings are `state::ApiState`).

use crate::engine::{FinishReason, TokenOutput};
use crate::openai::ApiError;
use crate::state::{AbortGuard, AppState};
use crate::validation::Int;
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use std::future::Future;
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;

/// A streamed answer: chunks of SSE events until its last one.
pub trait EventStream: Send + 'static {
    /// Whether the last chunk was sent.
    fn ended(&self) -> bool;
    /// The next chunk of events (waits for the engine's next tokens).
    fn next_events(&mut self) -> impl Future<Output = String> + Send;
}

/// The streaming response of `events`, with vLLM's headers.
pub fn sse_stream<S: EventStream>(events: S) -> Response {
    let body = futures::stream::unfold(events, |mut s| async move {
        if s.ended() {
            return None;
        }
        let chunk = s.next_events().await;
        Some((Ok::<_, std::convert::Infallible>(Bytes::from(chunk)), s))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| ApiError::internal("response build failed").into_response())
}

/// A random UUID4 in hex, as Python's `uuid.uuid4().hex` (vLLM's
/// `random_uuid`).
pub fn random_uuid() -> String {
    let mut b: u128 = rand::random();
    b = (b & !(0xF << 76)) | (0x4 << 76);
    b = (b & !(0x3 << 62)) | (0x2 << 62);
    format!("{b:032x}")
}

/// One server-sent event with a name, as vLLM writes them.
pub fn sse_event(out: &mut String, event: &str, data: &serde_json::Value) {
    out.push_str("event: ");
    out.push_str(event);
    out.push_str("\ndata: ");
    out.push_str(&data.to_string());
    out.push_str("\n\n");
}

/// The completion length of a Messages or Responses request: the model's
/// natural length (the output-tokens header, else the default), cut at
/// the request's limit. Both APIs treat their limit as a ceiling (Anthropic
/// requires one on every request), unlike the simulator's chat endpoints,
/// where `max_tokens` is the length. vLLM's length checks apply as for chat.
pub fn plan_ceiling(
    st: &AppState,
    prompt_len: usize,
    limit: Option<&Int>,
    headers: &HeaderMap,
) -> Result<(u32, FinishReason), ApiError> {
    st.plan_output(prompt_len, limit, headers)?;
    let limit = limit
        .map(|m| st.output_limit(prompt_len, m, "max_tokens"))
        .transpose()?;
    let (natural, _) = st.plan_output(prompt_len, None, headers)?;
    Ok(match limit {
        Some(m) if natural >= m => (m, FinishReason::Length),
        _ => (natural, FinishReason::Stop),
    })
}

/// One request on the engine: its tokens as they come, and the prompt
/// figures vLLM reports for it. Dropping it early aborts the request.
pub struct Run {
    st: Arc<AppState>,
    rx: UnboundedReceiver<TokenOutput>,
    guard: AbortGuard,
    /// Prompt length in tokens.
    pub prompt_len: usize,
    /// Tokens generated so far.
    pub output_tokens: u32,
    /// Prompt tokens served from the prefix cache (known with the first token).
    pub cached: u32,
    /// Why it finished, once it has.
    pub finish: Option<FinishReason>,
}

impl Run {
    /// Submits a request.
    pub fn start(
        st: &Arc<AppState>,
        prompt: Vec<u32>,
        plan: (u32, FinishReason),
        salt: Option<String>,
        priority: i64,
    ) -> Result<Run, ApiError> {
        let prompt_len = prompt.len();
        let (id, rx) = st.submit(prompt, plan.0, plan.1, salt, priority)?;
        Ok(Run {
            st: st.clone(),
            rx,
            guard: AbortGuard {
                engine: st.engine.clone(),
                id,
                done: false,
            },
            prompt_len,
            output_tokens: 0,
            cached: 0,
            finish: None,
        })
    }

    /// The text of the tokens the engine has delivered: waits for one, then
    /// takes what else is already there. `Ok(None)` once finished; an error
    /// if the engine went away first.
    pub async fn next_pieces(&mut self) -> Result<Option<Vec<String>>, ApiError> {
        if self.finish.is_some() {
            return Ok(None);
        }
        let mut pieces = Vec::new();
        let mut next = self.rx.recv().await;
        loop {
            let Some(t) = next else {
                return Err(ApiError::internal(
                    "engine stopped before the request finished",
                ));
            };
            self.output_tokens += 1;
            self.cached = t.cached_tokens;
            pieces.push(
                self.st
                    .piece_text
                    .get(&t.token_id)
                    .cloned()
                    .unwrap_or_default(),
            );
            if let Some(r) = t.finished {
                self.finish = Some(r);
                self.guard.done = true;
                return Ok(Some(pieces));
            }
            match self.rx.try_recv() {
                Ok(t) => next = Some(t),
                Err(_) => return Ok(Some(pieces)),
            }
        }
    }

    /// Runs to the end and returns the whole completion text.
    pub async fn collect(&mut self) -> Result<String, ApiError> {
        let mut text = String::new();
        while let Some(pieces) = self.next_pieces().await? {
            pieces.iter().for_each(|p| text.push_str(p));
        }
        Ok(text)
    }

    /// vLLM's `num_cache_creation_tokens`: prompt tokens in full blocks
    /// that this request hashed into the prefix cache, less those it found
    /// there (the scheduler's `PrefillStats.finalize` at the first output).
    pub fn cache_write(&self) -> u32 {
        if !self.st.info.enable_prefix_caching {
            return 0;
        }
        let bs = self.st.info.block_size.max(1);
        let hashed = (self.prompt_len / bs * bs) as u32;
        hashed.saturating_sub(self.cached)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_version_4_hex() {
        let u = random_uuid();
        assert_eq!(u.len(), 32);
        assert!(u.chars().all(|c| c.is_ascii_hexdigit()));
        assert_eq!(&u[12..13], "4");
        assert!(matches!(&u[16..17], "8" | "9" | "a" | "b"));
        assert_ne!(u, random_uuid());
    }

    #[test]
    fn sse_events_are_named() {
        let mut s = String::new();
        sse_event(&mut s, "ping", &serde_json::json!({"type": "ping"}));
        assert_eq!(s, "event: ping\ndata: {\"type\":\"ping\"}\n\n");
    }
}
