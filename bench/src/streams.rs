//! Held streams: `concurrency` clients, each sending one streamed chat
//! request after another through the proxy for a while (closed loop), each
//! read to its end. The load under which a gateway's overload behaviour is
//! judged: how many streams it holds at once, what each was answered, how
//! long they took. Tenants' keys are dealt over the clients in turn. A
//! client answered 429 waits its `retry-after` (at most
//! [`MAX_RETRY_AFTER`]) before its next request, as a well-behaved client
//! does; without it the refused clients would spin and the run would
//! measure a flood of refusals instead of held streams.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;
use serde_json::json;
use tokio::sync::Mutex;

/// Longest a refused client waits before its next request.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(2);

/// What the clients send.
#[derive(Debug, Clone)]
pub struct StreamsConfig {
    /// Base URL of the proxy.
    pub url: String,
    /// Model to ask for.
    pub model: String,
    /// API keys, dealt over the clients in turn.
    pub keys: Vec<String>,
    /// Clients holding a stream each.
    pub concurrency: usize,
    /// How long the clients keep sending.
    pub duration: Duration,
    /// Completion tokens per request.
    pub max_tokens: u32,
    /// Words of each request's prompt.
    pub prompt_words: usize,
    /// Longest a request may take before it is counted as a timeout.
    pub request_timeout: Duration,
}

/// What came back, per key (tenant).
#[derive(Debug, Clone, Default, Serialize)]
pub struct KeyCounts {
    /// Requests sent.
    pub sent: u64,
    /// Answers by status code.
    pub by_status: BTreeMap<u16, u64>,
    /// Requests with no answer (connection failed, timed out, cut).
    pub failed: u64,
}

/// A run's summary.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StreamsSummary {
    /// Clients.
    pub concurrency: usize,
    /// Seconds the clients sent for.
    pub duration_s: f64,
    /// Requests sent.
    pub sent: u64,
    /// Answers by status code.
    pub by_status: BTreeMap<u16, u64>,
    /// Requests with no answer.
    pub failed: u64,
    /// Why requests failed (error kinds), counted.
    pub failures: BTreeMap<String, u64>,
    /// Per key, by its index in the config's list.
    pub per_key: Vec<KeyCounts>,
    /// Mean end-to-end seconds of 200s.
    pub mean_ok_s: f64,
    /// 99th percentile end-to-end seconds of 200s.
    pub p99_ok_s: f64,
    /// Most requests that were open at once.
    pub peak_open: usize,
}

#[derive(Default)]
struct Tally {
    summary: StreamsSummary,
    ok_s: Vec<f64>,
    open: usize,
}

fn body(cfg: &StreamsConfig, client: usize, n: u64) -> serde_json::Value {
    let words: Vec<String> = (0..cfg.prompt_words)
        .map(|i| format!("w{}", (i * 7 + client) % 997))
        .collect();
    json!({
        "model": cfg.model,
        "messages": [{"role": "user", "content": format!("client {client} request {n}: {}", words.join(" "))}],
        "stream": true,
        "max_tokens": cfg.max_tokens,
    })
}

/// One request to its end: the status and its `retry-after` (seconds), or
/// why none came.
async fn one(
    http: &reqwest::Client,
    cfg: &StreamsConfig,
    key: &str,
    body: &serde_json::Value,
) -> Result<(u16, Option<u64>), String> {
    let send = http
        .post(format!("{}/v1/chat/completions", cfg.url))
        .bearer_auth(key)
        .json(body)
        .send();
    let r = tokio::time::timeout(cfg.request_timeout, async {
        let resp = send.await.map_err(|e| kind(&e))?;
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse().ok());
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            chunk.map_err(|e| kind(&e))?;
        }
        Ok((status, retry_after))
    })
    .await;
    r.unwrap_or_else(|_| Err("timeout".into()))
}

fn kind(e: &reqwest::Error) -> String {
    if e.is_connect() {
        "connect".into()
    } else if e.is_timeout() {
        "timeout".into()
    } else if e.is_body() || e.is_decode() {
        "body".into()
    } else {
        "request".into()
    }
}

/// Runs the clients and sums up what came back.
pub async fn run(cfg: StreamsConfig) -> anyhow::Result<StreamsSummary> {
    anyhow::ensure!(!cfg.keys.is_empty(), "at least one key is needed");
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(cfg.concurrency)
        .build()?;
    let tally = Arc::new(Mutex::new(Tally {
        summary: StreamsSummary {
            concurrency: cfg.concurrency,
            per_key: vec![KeyCounts::default(); cfg.keys.len()],
            ..StreamsSummary::default()
        },
        ..Tally::default()
    }));
    let cfg = Arc::new(cfg);
    let started = Instant::now();
    let until = started + cfg.duration;
    let clients = (0..cfg.concurrency).map(|c| {
        let (http, cfg, tally) = (http.clone(), Arc::clone(&cfg), Arc::clone(&tally));
        tokio::spawn(async move {
            let k = c % cfg.keys.len();
            let mut n = 0u64;
            while Instant::now() < until {
                n += 1;
                let b = body(&cfg, c, n);
                {
                    let mut t = tally.lock().await;
                    t.open += 1;
                    t.summary.peak_open = t.summary.peak_open.max(t.open);
                }
                let at = Instant::now();
                let r = one(&http, &cfg, &cfg.keys[k], &b).await;
                let took = at.elapsed().as_secs_f64();
                let wait = match r {
                    Ok((429, after)) => {
                        Duration::from_secs(after.unwrap_or(1)).min(MAX_RETRY_AFTER)
                    }
                    _ => Duration::ZERO,
                };
                let mut t = tally.lock().await;
                t.open -= 1;
                t.summary.sent += 1;
                t.summary.per_key[k].sent += 1;
                match r {
                    Ok((status, _)) => {
                        *t.summary.by_status.entry(status).or_default() += 1;
                        *t.summary.per_key[k].by_status.entry(status).or_default() += 1;
                        if status == 200 {
                            t.ok_s.push(took);
                        }
                    }
                    Err(why) => {
                        t.summary.failed += 1;
                        t.summary.per_key[k].failed += 1;
                        *t.summary.failures.entry(why).or_default() += 1;
                    }
                }
                drop(t);
                let left = until.saturating_duration_since(Instant::now());
                tokio::time::sleep(wait.min(left)).await;
            }
        })
    });
    let handles: Vec<_> = clients.collect();
    for h in handles {
        h.await?;
    }
    let mut t = Arc::try_unwrap(tally)
        .map_err(|_| anyhow::anyhow!("clients still running"))?
        .into_inner();
    t.summary.duration_s = started.elapsed().as_secs_f64();
    t.ok_s.sort_by(f64::total_cmp);
    if !t.ok_s.is_empty() {
        t.summary.mean_ok_s = t.ok_s.iter().sum::<f64>() / t.ok_s.len() as f64;
        let i = ((t.ok_s.len() as f64 * 0.99).ceil() as usize).clamp(1, t.ok_s.len()) - 1;
        t.summary.p99_ok_s = t.ok_s[i];
    }
    Ok(t.summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_differ_by_client_and_request_and_ask_for_a_stream() {
        let cfg = StreamsConfig {
            url: String::new(),
            model: "m".into(),
            keys: vec!["k".into()],
            concurrency: 2,
            duration: Duration::ZERO,
            max_tokens: 7,
            prompt_words: 3,
            request_timeout: Duration::from_secs(1),
        };
        let a = body(&cfg, 0, 1);
        assert_eq!(a["stream"], true);
        assert_eq!(a["max_tokens"], 7);
        assert_ne!(a, body(&cfg, 1, 1));
        assert_ne!(a, body(&cfg, 0, 2));
    }
}
