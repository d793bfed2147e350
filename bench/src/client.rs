//! One streaming request through the proxy, measured.
//!
//! Sends an OpenAI `/v1/completions` (token-id prompt) or
//! `/v1/chat/completions` request with `stream: true` and
//! `stream_options.include_usage`, and times the SSE stream: the first
//! chunk carrying text is the first token, later ones give the
//! inter-token gaps, the usage chunk gives prompt / cached / completion
//! tokens. The simulated engine stops at exactly the asked length when told
//! so by `x-sim-output-tokens` (real vLLM: `ignore_eos` with `max_tokens`).

use std::time::Instant;

use futures::StreamExt;
use serde::Deserialize;
use serde_json::json;

use crate::record::{Outcome, Record};

/// Header the served endpoint comes back in (the Inference Extension's).
pub const SERVED_HEADER: &str = "x-gateway-destination-endpoint-served";
/// Header the benchmark names the tenant in.
pub const TENANT_HEADER: &str = "x-tenant";

/// Where requests go.
#[derive(Debug, Clone)]
pub struct Target {
    /// Base URL of the proxy, e.g. `http://127.0.0.1:10000`.
    pub url: String,
    /// Model to ask for.
    pub model: String,
    /// Wall seconds per simulated second: measured times are divided by it.
    pub time_scale: f64,
}

/// Where each unit of a workload (a trace request, a whole conversation)
/// is sent: spread over several proxies (replicas behind one Service), a
/// share of units straight to the engines instead (traffic the router
/// never sees). One proxy and no share is the plain single-proxy run.
#[derive(Debug, Clone, Default)]
pub struct Routes {
    /// Base URLs of the proxies, e.g. `http://127.0.0.1:10000`.
    pub proxies: Vec<String>,
    /// Base URLs of the engines for direct units.
    pub direct: Vec<String>,
    /// Share of units sent to `direct` (0..=1).
    pub direct_share: f64,
}

/// A fixed mix of `unit` (SplitMix64's finaliser): which units go direct
/// must not line up with the proxies' alternation nor change between modes.
fn mix(unit: usize) -> u64 {
    let mut z = (unit as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Routes {
    /// The base URL `unit` goes to, and whether it bypasses the proxies:
    /// the same for every mode, so all modes replay the same split.
    pub fn pick(&self, unit: usize) -> (&str, bool) {
        let h = mix(unit);
        let u = (h >> 11) as f64 / (1u64 << 53) as f64;
        if !self.direct.is_empty() && u < self.direct_share {
            return (&self.direct[(h as usize) % self.direct.len()], true);
        }
        (&self.proxies[unit % self.proxies.len()], false)
    }

    /// Whether more than the one proxy is in use (the run then says where
    /// its requests went).
    pub fn spread(&self) -> bool {
        self.proxies.len() > 1 || (self.direct_share > 0.0 && !self.direct.is_empty())
    }
}

/// `host:port` of a base URL (what the served-endpoint header holds).
pub fn host_of(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    rest.split('/').next().unwrap_or(rest)
}

/// What to send.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// `/v1/completions` with token ids.
    Tokens(Vec<u32>),
    /// `/v1/chat/completions` with (role, content) messages.
    Chat(Vec<(&'static str, String)>),
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<ChoiceChunk>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct ChoiceChunk {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    prompt_tokens_details: Option<Details>,
}

#[derive(Deserialize)]
struct Details {
    #[serde(default)]
    cached_tokens: u64,
}

/// The request body.
pub fn body(model: &str, prompt: &Prompt, output_tokens: u32) -> (&'static str, String) {
    request_body(model, prompt, Some(output_tokens))
}

/// The request body, with `max_tokens` only when given (the simulated
/// engine's length comes from `x-sim-output-tokens` either way).
pub fn request_body(
    model: &str,
    prompt: &Prompt,
    max_tokens: Option<u32>,
) -> (&'static str, String) {
    let common = |mut v: serde_json::Value| {
        v["model"] = json!(model);
        if let Some(n) = max_tokens {
            v["max_tokens"] = json!(n);
        }
        v["stream"] = json!(true);
        v["stream_options"] = json!({"include_usage": true});
        v.to_string()
    };
    match prompt {
        Prompt::Tokens(ids) => ("/v1/completions", common(json!({ "prompt": ids }))),
        Prompt::Chat(msgs) => {
            let m: Vec<_> = msgs
                .iter()
                .map(|(r, c)| json!({"role": r, "content": c}))
                .collect();
            ("/v1/chat/completions", common(json!({ "messages": m })))
        }
    }
}

/// Incremental SSE reader: feeds bytes, yields complete `data:` payloads.
#[derive(Default)]
pub struct SseReader {
    buf: Vec<u8>,
}

impl SseReader {
    /// Adds bytes; returns the data payloads of the events completed.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some((ev, sep)) = find_event_end(&self.buf) {
            let text = String::from_utf8_lossy(&self.buf[..ev]).into_owned();
            self.buf.drain(..ev + sep);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// Position and length of the first event separator (`\n\n` or `\r\n\r\n`).
fn find_event_end(b: &[u8]) -> Option<(usize, usize)> {
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(c)) => Some(if a.0 <= c.0 { a } else { c }),
        (a, c) => a.or(c),
    }
}

/// Sends one request for `rec`'s tenant and measures it into `rec` (made by
/// [`Record::unanswered`]); also returns the generated text, which a chat
/// sends back as the assistant's turn. Never panics; every failure is an
/// [`Outcome`] with its text.
pub async fn send(
    client: &reqwest::Client,
    target: &Target,
    rec: Record,
    prompt: &Prompt,
    output_tokens: u32,
) -> (Record, String) {
    send_as(client, target, rec, prompt, output_tokens, true).await
}

/// [`send`], with the body's `max_tokens` left out unless `with_max_tokens`
/// (a budget then reserves the tenant's learned output estimate).
pub async fn send_as(
    client: &reqwest::Client,
    target: &Target,
    mut rec: Record,
    prompt: &Prompt,
    output_tokens: u32,
    with_max_tokens: bool,
) -> (Record, String) {
    let max_tokens = with_max_tokens.then_some(output_tokens);
    let (path, body) = request_body(&target.model, prompt, max_tokens);
    let scale = if target.time_scale > 0.0 {
        target.time_scale
    } else {
        1.0
    };
    let sim_ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / scale;
    let mut text = String::new();
    let t0 = Instant::now();
    let resp = client
        .post(format!("{}{}", target.url, path))
        .header("content-type", "application/json")
        .header(TENANT_HEADER, &rec.tenant)
        .header("x-sim-output-tokens", output_tokens.to_string())
        .body(body)
        .send()
        .await;
    let resp = match resp {
        Ok(r) => r,
        Err(e) => {
            rec.error = format!("send: {e}");
            return (rec, text);
        }
    };
    rec.status = resp.status().as_u16();
    rec.endpoint = resp
        .headers()
        .get(SERVED_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    if !resp.status().is_success() {
        rec.outcome = Outcome::HttpError;
        let body = resp.text().await.unwrap_or_default();
        rec.error = body.chars().take(200).collect();
        return (rec, text);
    }
    let mut stream = resp.bytes_stream();
    let mut sse = SseReader::default();
    let (mut first, mut last, mut tokens) = (None::<Instant>, None::<Instant>, 0u64);
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let bytes = match chunk {
            Ok(b) => b,
            Err(e) => {
                rec.error = format!("stream: {e}");
                return (rec, text);
            }
        };
        let now = Instant::now();
        for data in sse.feed(&bytes) {
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let c: Chunk = match serde_json::from_str(&data) {
                Ok(c) => c,
                Err(e) => {
                    rec.error = format!("bad chunk: {e}");
                    return (rec, text);
                }
            };
            if let Some(u) = c.usage {
                rec.prompt_tokens = u.prompt_tokens;
                rec.completion_tokens = u.completion_tokens;
                rec.cached_tokens = u.prompt_tokens_details.map_or(0, |d| d.cached_tokens);
            }
            for ch in c.choices {
                let piece = ch.delta.and_then(|d| d.content).or(ch.text);
                if let Some(t) = piece.filter(|t| !t.is_empty()) {
                    text.push_str(&t);
                    tokens += 1;
                    first.get_or_insert(now);
                    last = Some(now);
                }
            }
        }
    }
    let end = Instant::now();
    if let Some(f) = first {
        rec.ttft_ms = sim_ms(f - t0);
        if let Some(l) = last.filter(|_| tokens > 1) {
            rec.itl_ms = sim_ms(l - f) / (tokens - 1) as f64;
        }
    }
    if !done {
        rec.error = "stream ended without [DONE]".into();
        return (rec, text);
    }
    rec.e2e_ms = sim_ms(end - t0);
    rec.outcome = Outcome::Ok;
    (rec, text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_reads() {
        let mut r = SseReader::default();
        assert!(r.feed(b"data: {\"a\"").is_empty());
        assert_eq!(r.feed(b":1}\n\ndata: [DONE]\n"), vec!["{\"a\":1}"]);
        assert_eq!(r.feed(b"\n"), vec!["[DONE]"]);
        assert_eq!(r.feed(b": comment\r\n\r\ndata:x\r\n\r\n"), vec!["x"]);
    }

    #[test]
    fn units_spread_over_proxies_and_a_share_goes_direct() {
        let r = Routes {
            proxies: vec!["http://a".into(), "http://b".into()],
            direct: vec!["http://e0".into(), "http://e1".into()],
            direct_share: 0.25,
        };
        let picks: Vec<(&str, bool)> = (0..4000).map(|u| r.pick(u)).collect();
        let direct = picks.iter().filter(|p| p.1).count();
        assert!((900..1100).contains(&direct), "{direct}");
        for name in ["http://a", "http://b", "http://e0", "http://e1"] {
            assert!(picks.iter().any(|p| p.0 == name), "{name} never picked");
        }
        // Proxied units alternate by unit, so both proxies share them.
        let a = picks.iter().filter(|p| p.0 == "http://a").count();
        let b = picks.iter().filter(|p| p.0 == "http://b").count();
        assert!(a.abs_diff(b) < 150, "{a} vs {b}");
        assert_eq!(r.pick(17), r.pick(17));
        let one = Routes {
            proxies: vec!["http://a".into()],
            ..Routes::default()
        };
        assert!(!one.spread() && (0..100).all(|u| one.pick(u) == ("http://a", false)));
        assert_eq!(host_of("http://127.0.0.1:8000/x"), "127.0.0.1:8000");
    }

    #[test]
    fn bodies_ask_for_streamed_usage() {
        let (p, b) = body("m", &Prompt::Tokens(vec![1, 2]), 5);
        assert_eq!(p, "/v1/completions");
        let v: serde_json::Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v["prompt"], json!([1, 2]));
        assert_eq!(v["max_tokens"], 5);
        assert_eq!(v["stream_options"]["include_usage"], true);
        let (p, b) = body(
            "m",
            &Prompt::Chat(vec![("system", "s".into()), ("user", "u".into())]),
            1,
        );
        assert_eq!(p, "/v1/chat/completions");
        let v: serde_json::Value = serde_json::from_str(&b).unwrap();
        assert_eq!(v["messages"][1], json!({"role": "user", "content": "u"}));
        assert_eq!(v["stream"], true);
        let (_, b) = request_body("m", &Prompt::Tokens(vec![1]), None);
        let v: serde_json::Value = serde_json::from_str(&b).unwrap();
        assert!(v.get("max_tokens").is_none() && v["stream"] == true);
    }
}
