//! The response side: time to first token, inter-token gaps and end to
//! end time, the token counts of `usage`, read from the final JSON or
//! from the SSE stream (OpenAI's usage chunk, Anthropic's `message_start`
//! and `message_delta` events, the Responses API's `response.completed`
//! or `response.incomplete`), and the id of a Responses API response (the
//! body's `id`, or the `response.id` of the first event that has one,
//! `response.created`).
//!
//! The response is never held back: chunks are looked at as they pass.
//! Only SSE lines that mention `"usage"` are parsed with serde; a
//! non-streaming body is kept (up to a limit) just long enough to read its
//! `usage` at the end.

use serde::Deserialize;

use crate::pick::Usage;

#[derive(Debug, Clone, Copy, Default, Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// `usage` as OpenAI or Anthropic write it (all fields optional; each
/// event carries some of them).
#[derive(Debug, Clone, Copy, Default, Deserialize)]
struct RawUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    /// The Responses API's: its `input_tokens` include the cached ones.
    #[serde(default)]
    input_tokens_details: Option<Details>,
}

impl RawUsage {
    /// Newer fields win; fields a later event leaves out keep their value
    /// (Anthropic's `message_delta` only carries `output_tokens`).
    fn merge(&mut self, n: RawUsage) {
        macro_rules! take {
            ($($f:ident),*) => {$( if n.$f.is_some() { self.$f = n.$f; } )*};
        }
        take!(
            prompt_tokens,
            completion_tokens,
            prompt_tokens_details,
            input_tokens,
            output_tokens,
            cache_read_input_tokens,
            cache_creation_input_tokens,
            input_tokens_details
        );
    }

    fn usage(&self) -> Option<Usage> {
        if let Some(p) = self.prompt_tokens {
            let cached = self
                .prompt_tokens_details
                .and_then(|d| d.cached_tokens)
                .unwrap_or(0);
            return Some(Usage {
                prompt_tokens: p,
                cached_tokens: cached.min(p),
                completion_tokens: self.completion_tokens.unwrap_or(0),
            });
        }
        if let (Some(input), Some(d)) = (self.input_tokens, self.input_tokens_details) {
            let cached = d.cached_tokens.unwrap_or(0);
            return Some(Usage {
                prompt_tokens: input,
                cached_tokens: cached.min(input),
                completion_tokens: self.output_tokens.unwrap_or(0),
            });
        }
        if self.input_tokens.is_some() || self.output_tokens.is_some() {
            // Anthropic's input_tokens leaves out cache reads and writes.
            let read = self.cache_read_input_tokens.unwrap_or(0);
            let prompt = self.input_tokens.unwrap_or(0)
                + read
                + self.cache_creation_input_tokens.unwrap_or(0);
            return Some(Usage {
                prompt_tokens: prompt,
                cached_tokens: read,
                completion_tokens: self.output_tokens.unwrap_or(0),
            });
        }
        None
    }
}

#[derive(Deserialize)]
struct Inner {
    #[serde(default)]
    usage: Option<RawUsage>,
}

#[derive(Deserialize)]
struct WithUsage {
    #[serde(default)]
    usage: Option<RawUsage>,
    /// Anthropic's `message_start` nests it under `message`.
    #[serde(default)]
    message: Option<Inner>,
    /// The Responses API's terminal events nest it under `response`.
    #[serde(default)]
    response: Option<Inner>,
}

#[derive(Deserialize)]
struct IdOnly {
    #[serde(default)]
    id: Option<String>,
}

/// A streamed Responses API event: `response.id`.
#[derive(Deserialize)]
struct EventWithId {
    #[serde(default)]
    response: Option<IdOnly>,
}

/// The `id` of a JSON object whose first member is `id` (vLLM writes a
/// response's `id` first), read from the start of a body that may not have
/// fully arrived; `None` until the whole string is there, or when the body
/// does not start that way.
fn leading_id(body: &[u8]) -> Option<String> {
    let ws = |b: &[u8]| b.iter().take_while(|c| c.is_ascii_whitespace()).count();
    let mut i = ws(body);
    i += usize::from(body.get(i) == Some(&b'{'));
    i += ws(&body[i.min(body.len())..]);
    let rest = body.get(i..)?.strip_prefix(b"\"id\"")?;
    let rest = &rest[ws(rest)..];
    let rest = rest.strip_prefix(b":")?;
    let mut d = serde_json::Deserializer::from_slice(rest);
    String::deserialize(&mut d).ok()
}

/// What one response chunk told the tracker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ChunkEvents {
    /// This is the first body byte: TTFT is known now.
    pub first: bool,
    /// The mean gap per token event since the previous chunk that carried
    /// events (ns), for the inter-token latency histogram. One sample per
    /// chunk: a chunk with several events gets their mean gap.
    pub itl_ns: Option<u64>,
    /// A Responses API response's id became known in this chunk
    /// ([`ResponseTracker::response_id`]).
    pub response_id: bool,
}

/// Watches one response.
#[derive(Debug, Clone)]
pub struct ResponseTracker {
    start_ns: u64,
    streaming: bool,
    first_ns: Option<u64>,
    last_event_ns: Option<u64>,
    carry: Vec<u8>,
    body: Vec<u8>,
    limit: usize,
    overflow: bool,
    raw: RawUsage,
    seen_usage: bool,
    events: u64,
    /// Events that carry generated content (a lower bound of completion
    /// tokens; see [`content_event`]).
    content_events: u64,
    want_id: bool,
    response_id: Option<String>,
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

impl ResponseTracker {
    /// A tracker for a response to a request that started at `start_ns`.
    /// `streaming`: the response is SSE (`text/event-stream`). `limit`:
    /// the most bytes kept of a non-streaming body or of one SSE line.
    pub fn new(start_ns: u64, streaming: bool, limit: usize) -> ResponseTracker {
        ResponseTracker {
            start_ns,
            streaming,
            first_ns: None,
            last_event_ns: None,
            carry: Vec::new(),
            body: Vec::new(),
            limit,
            overflow: false,
            raw: RawUsage::default(),
            seen_usage: false,
            events: 0,
            content_events: 0,
            want_id: false,
            response_id: None,
        }
    }

    /// Also looks for the id of a Responses API response.
    pub fn with_response_id(mut self) -> ResponseTracker {
        self.want_id = true;
        self
    }

    /// The response's id, once seen (only with [`Self::with_response_id`]).
    pub fn response_id(&self) -> Option<&str> {
        self.response_id.as_deref()
    }

    fn wants_id(&self) -> bool {
        self.want_id && self.response_id.is_none()
    }

    /// Whether the response is SSE.
    pub fn streaming(&self) -> bool {
        self.streaming
    }

    /// Feeds a body chunk seen at `now_ns`.
    pub fn feed(&mut self, chunk: &[u8], now_ns: u64) -> ChunkEvents {
        let mut ev = ChunkEvents::default();
        if chunk.is_empty() {
            return ev;
        }
        if self.first_ns.is_none() {
            self.first_ns = Some(now_ns);
            ev.first = true;
        }
        let had_id = !self.wants_id();
        if !self.streaming {
            if !self.overflow {
                if self.body.len() + chunk.len() > self.limit {
                    self.overflow = true;
                    self.body = Vec::new();
                } else {
                    self.body.extend_from_slice(chunk);
                }
            }
            if self.wants_id() {
                self.response_id = leading_id(&self.body);
            }
            ev.response_id = !had_id && self.response_id.is_some();
            return ev;
        }
        let n = self.scan_sse(chunk);
        ev.response_id = !had_id && self.response_id.is_some();
        if n > 0 {
            if let Some(last) = self.last_event_ns {
                ev.itl_ns = now_ns.saturating_sub(last).checked_div(n);
            }
            self.last_event_ns = Some(now_ns);
            self.events += n;
        }
        ev
    }

    /// Scans complete SSE lines; returns how many token events (data lines
    /// other than `[DONE]` and usage-only chunks) it saw.
    fn scan_sse(&mut self, chunk: &[u8]) -> u64 {
        let mut data = std::mem::take(&mut self.carry);
        data.extend_from_slice(chunk);
        let mut n = 0;
        let mut start = 0;
        while let Some(off) = data[start..].iter().position(|&b| b == b'\n') {
            let line = &data[start..start + off];
            start += off + 1;
            n += self.sse_line(line);
        }
        if data.len() - start <= self.limit {
            data.drain(..start);
            self.carry = data;
        }
        n
    }

    fn sse_line(&mut self, line: &[u8]) -> u64 {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(payload) = line.strip_prefix(b"data:") else {
            return 0;
        };
        let payload = payload.trim_ascii();
        if payload.is_empty() || payload == b"[DONE]" {
            return 0;
        }
        if self.wants_id() && contains(payload, b"\"response\"") {
            if let Ok(EventWithId { response: Some(r) }) = serde_json::from_slice(payload) {
                self.response_id = r.id;
            }
        }
        if contains(payload, b"\"usage\"") {
            if let Ok(w) = serde_json::from_slice::<WithUsage>(payload) {
                let mut any = false;
                for u in [
                    w.message.and_then(|m| m.usage),
                    w.response.and_then(|r| r.usage),
                    w.usage,
                ]
                .into_iter()
                .flatten()
                {
                    self.raw.merge(u);
                    any = true;
                }
                self.seen_usage |= any;
                // OpenAI's final usage chunk has `"choices":[]`: no token.
                if any && contains(payload, b"\"choices\":[]") {
                    return 0;
                }
            }
        }
        self.content_events += u64::from(content_event(payload));
        1
    }

    /// Time to first token (ns), if a body byte arrived.
    pub fn ttft_ns(&self) -> Option<u64> {
        self.first_ns.map(|f| f.saturating_sub(self.start_ns))
    }

    /// The usage the response carried, once it ended (call after the last
    /// chunk).
    pub fn usage(&mut self) -> Option<Usage> {
        if !self.streaming && !self.overflow && !self.body.is_empty() {
            let body = std::mem::take(&mut self.body);
            if let Ok(w) = serde_json::from_slice::<WithUsage>(&body) {
                if let Some(u) = w.usage {
                    self.raw.merge(u);
                    self.seen_usage = true;
                }
            }
            if self.wants_id() {
                // Another server may write `id` later in the object.
                self.response_id = serde_json::from_slice::<IdOnly>(&body)
                    .ok()
                    .and_then(|o| o.id);
            }
        }
        if self.streaming && !self.carry.is_empty() {
            // A last line without its newline.
            let rest = std::mem::take(&mut self.carry);
            self.sse_line(&rest);
        }
        if self.seen_usage {
            self.raw.usage()
        } else {
            None
        }
    }

    /// Token events seen in an SSE response.
    pub fn events(&self) -> u64 {
        self.events
    }

    /// Events of an SSE response that carried generated content.
    pub fn content_events(&self) -> u64 {
        self.content_events
    }

    /// The usage known so far while an SSE response streams: the latest
    /// `usage` it carried (vLLM's continuous usage, Anthropic's
    /// `message_start`), with completion tokens at least the content events
    /// seen (each carries one token or more). A lower bound of the final
    /// usage in every field; `None` before any content or usage.
    pub fn usage_so_far(&self) -> Option<Usage> {
        let u = if self.seen_usage {
            self.raw.usage()
        } else {
            None
        };
        if u.is_none() && self.content_events == 0 {
            return None;
        }
        let mut u = u.unwrap_or_default();
        u.completion_tokens = u.completion_tokens.max(self.content_events);
        Some(u)
    }
}

/// Whether an SSE event's data carries generated content, judged without
/// parsing: Anthropic's `content_block_delta`, a Responses API `*.delta`
/// event, or an OpenAI chunk (it has `choices`) whose delta is not empty.
/// Errs towards "no" (role-only and finish chunks, `message_start`, pings,
/// `response.created`), so the count never exceeds the tokens generated.
fn content_event(payload: &[u8]) -> bool {
    if contains(payload, b"\"content_block_delta\"") {
        return true;
    }
    if contains(payload, b"\"type\":\"response.") {
        return contains(payload, b".delta\"");
    }
    if !contains(payload, b"\"choices\":[{") {
        return false;
    }
    // An OpenAI chunk: vLLM's first (role) and last (finish) chunks have
    // empty text; a chunk whose only delta is empty carries no token.
    !(contains(payload, b"\"content\":\"\"")
        || contains(payload, b"\"text\":\"\"")
        || contains(payload, b"\"delta\":{}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_json_usage() {
        let mut t = ResponseTracker::new(100, false, 1 << 20);
        let body = br#"{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":40,"completion_tokens":3,"total_tokens":43,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        let ev = t.feed(&body[..20], 150);
        assert!(ev.first);
        assert!(!t.feed(&body[20..], 160).first);
        assert_eq!(t.ttft_ns(), Some(50));
        assert_eq!(
            t.usage(),
            Some(Usage {
                prompt_tokens: 40,
                cached_tokens: 32,
                completion_tokens: 3
            })
        );
    }

    #[test]
    fn openai_sse_usage_chunk_split_across_chunks() {
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
            "data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n",
            "data: [DONE]\n\n"
        )
        .as_bytes();
        let mut t = ResponseTracker::new(0, true, 1 << 20);
        let mut itl = Vec::new();
        for (i, piece) in stream.chunks(17).enumerate() {
            let ev = t.feed(piece, 1000 * (i as u64 + 1));
            itl.extend(ev.itl_ns);
        }
        assert_eq!(t.ttft_ns(), Some(1000));
        assert_eq!(t.events(), 3);
        assert!(!itl.is_empty());
        assert_eq!(
            t.usage(),
            Some(Usage {
                prompt_tokens: 10,
                cached_tokens: 0,
                completion_tokens: 2
            })
        );
    }

    #[test]
    fn itl_is_the_mean_gap_per_event() {
        let mut t = ResponseTracker::new(0, true, 1 << 20);
        t.feed(b"data: {\"x\":1}\n\n", 10);
        let ev = t.feed(b"data: {\"x\":2}\n\ndata: {\"x\":3}\n\n", 30);
        assert_eq!(ev.itl_ns, Some(10));
    }

    #[test]
    fn continuous_usage_last_wins_and_no_usage_is_none() {
        let mut t = ResponseTracker::new(0, true, 1 << 20);
        t.feed(
            b"data: {\"choices\":[{}],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n",
            1,
        );
        t.feed(
            b"data: {\"choices\":[{}],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n",
            2,
        );
        assert_eq!(t.usage().unwrap().completion_tokens, 2);
        let mut t = ResponseTracker::new(0, true, 1 << 20);
        t.feed(b"data: {\"choices\":[{}],\"usage\":null}\n", 1);
        assert_eq!(t.usage(), None);
        let mut t = ResponseTracker::new(0, false, 1 << 20);
        t.feed(b"not json", 1);
        assert_eq!(t.usage(), None);
    }

    #[test]
    fn anthropic_stream_and_json() {
        let mut t = ResponseTracker::new(0, true, 1 << 20);
        t.feed(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":7,\"cache_read_input_tokens\":16,\"output_tokens\":1}}}\n\n", 1);
        t.feed(b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"x\"}}\n\n", 2);
        t.feed(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":4}}", 3);
        assert_eq!(
            t.usage(),
            Some(Usage {
                prompt_tokens: 23,
                cached_tokens: 16,
                completion_tokens: 4
            })
        );
        let mut t = ResponseTracker::new(0, false, 1 << 20);
        t.feed(
            br#"{"type":"message","usage":{"input_tokens":3,"output_tokens":2}}"#,
            1,
        );
        assert_eq!(t.usage().unwrap().prompt_tokens, 3);
    }

    #[test]
    fn responses_json_usage_and_id() {
        let body = br#"{"id":"resp_abc","object":"response","status":"completed","usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":32,"cache_write_tokens":null},"output_tokens":3,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":43}}"#;
        let mut t = ResponseTracker::new(0, false, 1 << 20).with_response_id();
        // The id is known as soon as its string is complete.
        assert!(!t.feed(&body[..12], 1).response_id);
        assert_eq!(t.response_id(), None);
        assert!(t.feed(&body[12..20], 2).response_id);
        assert_eq!(t.response_id(), Some("resp_abc"));
        assert!(!t.feed(&body[20..], 3).response_id);
        assert_eq!(
            t.usage(),
            Some(Usage {
                prompt_tokens: 40,
                cached_tokens: 32,
                completion_tokens: 3
            })
        );
        // `id` later in the object: read at the end.
        let mut t = ResponseTracker::new(0, false, 1 << 20).with_response_id();
        t.feed(br#"{"object":"response","id":"resp_z"}"#, 1);
        assert_eq!(t.response_id(), None);
        t.usage();
        assert_eq!(t.response_id(), Some("resp_z"));
        // Not asked for: never read.
        let mut t = ResponseTracker::new(0, false, 1 << 20);
        t.feed(body, 1);
        assert_eq!(t.response_id(), None);
    }

    #[test]
    fn responses_stream_id_and_usage() {
        let stream = concat!(
            "event: response.created\ndata: {\"response\":{\"id\":\"resp_s\",\"status\":\"in_progress\",\"usage\":null},\"sequence_number\":0,\"type\":\"response.created\"}\n\n",
            "event: response.in_progress\ndata: {\"response\":{\"id\":\"resp_s\",\"usage\":null},\"sequence_number\":1,\"type\":\"response.in_progress\"}\n\n",
            "event: response.output_text.delta\ndata: {\"delta\":\"hi\",\"type\":\"response.output_text.delta\"}\n\n",
            "event: response.completed\ndata: {\"response\":{\"id\":\"resp_s\",\"usage\":{\"input_tokens\":20,\"input_tokens_details\":{\"cached_tokens\":16},\"output_tokens\":2}},\"sequence_number\":3,\"type\":\"response.completed\"}\n\n",
        )
        .as_bytes();
        let mut t = ResponseTracker::new(0, true, 1 << 20).with_response_id();
        let mut seen_at = None;
        for (i, piece) in stream.chunks(25).enumerate() {
            if t.feed(piece, i as u64).response_id {
                assert_eq!(seen_at, None, "reported once");
                seen_at = Some(i);
            }
        }
        assert!(seen_at.is_some_and(|i| i * 25 < 200), "{seen_at:?}");
        assert_eq!(t.response_id(), Some("resp_s"));
        assert_eq!(
            t.usage(),
            Some(Usage {
                prompt_tokens: 20,
                cached_tokens: 16,
                completion_tokens: 2
            })
        );
    }

    #[test]
    fn vllm_anthropic_usage_with_cache_reads_in_both_events() {
        // vLLM's message_delta repeats the whole usage, cache reads included.
        let mut t = ResponseTracker::new(0, true, 1 << 20);
        t.feed(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":4,\"output_tokens\":0,\"cache_read_input_tokens\":16}}}\n\n", 1);
        t.feed(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":4,\"output_tokens\":9,\"cache_read_input_tokens\":16}}\n\n", 2);
        assert_eq!(
            t.usage(),
            Some(Usage {
                prompt_tokens: 20,
                cached_tokens: 16,
                completion_tokens: 9
            })
        );
        // count_tokens' answer is no usage.
        let mut t = ResponseTracker::new(0, false, 1 << 20);
        t.feed(
            br#"{"input_tokens":12,"context_management":{"original_input_tokens":12}}"#,
            1,
        );
        assert_eq!(t.usage(), None);
    }

    #[test]
    fn oversized_bodies_are_dropped_not_kept() {
        let mut t = ResponseTracker::new(0, false, 8);
        t.feed(b"0123456789", 1);
        assert_eq!(t.usage(), None);
        let mut t = ResponseTracker::new(0, true, 8);
        t.feed(b"data: 0123456789012345", 1);
        assert!(t.carry.len() <= 8);
    }
}
