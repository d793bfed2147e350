//! Shared harness of the `service_*` tests: real `vllm-sim` processes on
//! free 127.0.0.1 ports (killed on drop), an in-process indexer on port 0,
//! a gRPC client, and bounded waits.
//!
//! The simulator binary is `$VLLM_SIM_BIN` or `target/release/vllm-sim`;
//! the Qwen3 tokenizer is `$KVASIR_TOKENIZER_DIR` or
//! `.tools/tokenizers/qwen3` (both made by `make build`).
#![allow(dead_code)]

use std::future::Future;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvasir_cache_indexer::app::{self, Indexer};
use kvasir_cache_indexer::config::{Config, EndpointConfig, PoolConfig, TokenizerSource};
use kvasir_proto::v1 as pb;
use kvasir_proto::v1::indexer_client::IndexerClient;
use serde_json::{json, Value};
use tonic::transport::Channel;

/// Model the simulators serve.
pub const MODEL: &str = "Qwen/Qwen3-8B";
/// Pool name used by the tests.
pub const POOL: &str = "sims";

/// The simulator binary.
pub fn sim_bin() -> PathBuf {
    match std::env::var_os("VLLM_SIM_BIN") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/vllm-sim"),
    }
}

/// The Qwen3 tokenizer directory.
pub fn tokenizer_dir() -> PathBuf {
    match std::env::var_os("KVASIR_TOKENIZER_DIR") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/tokenizers/qwen3"),
    }
}

/// A free 127.0.0.1 port (bind 0, read it, release it).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

/// One simulator process, killed on drop.
pub struct Sim {
    child: Option<Child>,
    /// HTTP port.
    pub http: u16,
    /// KV-events PUB port.
    pub events: u16,
    /// Replay ROUTER port.
    pub replay: u16,
    args: Vec<String>,
    client: reqwest::Client,
}

impl Sim {
    /// Reserves ports without starting the process.
    pub fn reserve(extra: &[&str]) -> Sim {
        Sim {
            child: None,
            http: free_port(),
            events: free_port(),
            replay: free_port(),
            args: extra.iter().map(|s| s.to_string()).collect(),
            client: reqwest::Client::builder()
                .no_proxy()
                .build()
                .expect("client"),
        }
    }

    /// Starts a fast simulator (zero latency profile, no waiting).
    pub async fn start(extra: &[&str]) -> Sim {
        let mut s = Sim::reserve(extra);
        s.spawn();
        s.wait_healthy().await;
        s
    }

    /// Starts `n` fast simulators concurrently.
    pub async fn start_many(n: usize) -> Vec<Sim> {
        let mut sims: Vec<Sim> = (0..n).map(|_| Sim::reserve(&[])).collect();
        for s in &mut sims {
            s.spawn();
        }
        for s in &sims {
            s.wait_healthy().await;
        }
        sims
    }

    /// (Re)starts the process on the same ports (no wait).
    pub fn spawn(&mut self) {
        let bin = sim_bin();
        assert!(
            bin.exists(),
            "{} not found: run `cargo build --release -p vllm-sim` or set VLLM_SIM_BIN",
            bin.display()
        );
        let mut cmd = Command::new(&bin);
        cmd.args(["--host", "127.0.0.1"])
            .args(["--port", &self.http.to_string()])
            .args(["--kv-events-port", &self.events.to_string()])
            .args(["--kv-events-replay-port", &self.replay.to_string()])
            .arg("--enable-prompt-tokens-details")
            .arg("--tokenizer")
            .arg(tokenizer_dir());
        if !self.args.iter().any(|a| a == "--profile") {
            cmd.args(["--profile", "zero", "--time-scale", "0"]);
        }
        let child = cmd
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn vllm-sim");
        self.child = Some(child);
    }

    /// Waits (bounded) for `/health`.
    pub async fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = self
                .client
                .get(format!("{}/health", self.url()))
                .send()
                .await
            {
                if r.status().is_success() {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "vllm-sim on {} did not become healthy",
                self.http
            );
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }

    /// Kills the process.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Base URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.http)
    }

    /// HTTP address as the indexer names it.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.http)
    }

    /// The endpoint's config entry.
    pub fn endpoint(&self) -> EndpointConfig {
        EndpointConfig {
            address: self.address(),
            events: Some(format!("tcp://127.0.0.1:{}", self.events)),
            replay: Some(format!("tcp://127.0.0.1:{}", self.replay)),
            metrics: None,
            topic: String::new(),
        }
    }

    /// A non-streaming chat completion; returns the response JSON.
    pub async fn chat(&self, messages: &[(&str, String)], max_tokens: u32) -> Value {
        let msgs: Vec<Value> = messages
            .iter()
            .map(|(r, c)| json!({"role": r, "content": c}))
            .collect();
        let r = self
            .client
            .post(format!("{}/v1/chat/completions", self.url()))
            .json(&json!({"model": MODEL, "messages": msgs, "max_tokens": max_tokens}))
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .expect("chat request");
        assert!(r.status().is_success(), "chat failed: {}", r.status());
        r.json().await.expect("chat json")
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `usage.prompt_tokens_details.cached_tokens` of a response.
pub fn cached_tokens(resp: &Value) -> u64 {
    resp["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("usage.prompt_tokens_details.cached_tokens")
}

/// `usage.prompt_tokens` of a response.
pub fn prompt_tokens(resp: &Value) -> u64 {
    resp["usage"]["prompt_tokens"]
        .as_u64()
        .expect("usage.prompt_tokens")
}

/// The assistant text of a response.
pub fn reply(resp: &Value) -> String {
    resp["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// A one-pool config over `sims` with the Qwen3 tokenizer, ports 0 and a
/// 100 ms scrape interval.
pub fn config(sims: &[&Sim]) -> Config {
    let mut pool = PoolConfig::new(POOL);
    pool.model = MODEL.to_string();
    pool.tokenizer = TokenizerSource::Dir(tokenizer_dir());
    pool.endpoints = sims.iter().map(|s| s.endpoint()).collect();
    pool.scrape.interval_ms = 100;
    pool.scrape.timeout_ms = 100;
    Config {
        grpc_addr: "127.0.0.1:0".parse().expect("addr"),
        http_addr: "127.0.0.1:0".parse().expect("addr"),
        pools: vec![pool],
    }
}

/// A running in-process indexer and a client to it.
pub struct Running {
    /// The indexer.
    pub indexer: Indexer,
    /// gRPC client.
    pub client: IndexerClient<Channel>,
    /// HTTP client.
    pub http: reqwest::Client,
}

impl Running {
    /// Base URL of its HTTP side.
    pub fn http_url(&self) -> String {
        format!("http://{}", self.indexer.http_addr)
    }

    /// `PoolState` of the test pool.
    pub async fn state(&self) -> pb::PoolStateResponse {
        self.client
            .clone()
            .pool_state(pb::PoolStateRequest { pool: POOL.into() })
            .await
            .expect("PoolState")
            .into_inner()
    }

    /// One endpoint's state.
    pub async fn endpoint_state(&self, address: &str) -> pb::EndpointState {
        self.state()
            .await
            .endpoints
            .into_iter()
            .find(|e| e.address == address)
            .unwrap_or_else(|| panic!("no endpoint {address} in PoolState"))
    }

    /// `Pick`, expecting success.
    pub async fn pick(&self, req: pb::PickRequest) -> pb::PickResponse {
        self.client
            .clone()
            .pick(req)
            .await
            .expect("Pick")
            .into_inner()
    }

    /// `Report`, expecting success.
    pub async fn report(&self, req: pb::ReportRequest) -> pb::ReportResponse {
        self.client
            .clone()
            .report(req)
            .await
            .expect("Report")
            .into_inner()
    }

    /// Waits until every endpoint is healthy and in sync.
    pub async fn wait_ready(&self) {
        let http = self.http.clone();
        let url = format!("{}/readyz", self.http_url());
        let me = self;
        wait_for(
            "indexer ready (all in sync, all healthy)",
            Duration::from_secs(20),
            || {
                let (http, url) = (http.clone(), url.clone());
                async move {
                    let ready = http
                        .get(&url)
                        .send()
                        .await
                        .is_ok_and(|r| r.status().is_success());
                    ready && me.state().await.endpoints.iter().all(|e| e.healthy)
                }
            },
        )
        .await;
    }

    /// Waits until the index holds blocks for `address` and the count has
    /// not moved for a few scrape-free moments (events all applied).
    pub async fn wait_settled(&self, address: &str) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut last = 0;
        let mut stable = 0;
        loop {
            let n = self.endpoint_state(address).await.indexed_blocks;
            if n > 0 && n == last {
                stable += 1;
                if stable >= 3 {
                    return n;
                }
            } else {
                stable = 0;
            }
            last = n;
            assert!(
                Instant::now() < deadline,
                "index for {address} did not settle (last {n})"
            );
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
    }
}

/// Starts an indexer for `cfg` and connects a client.
pub async fn start_indexer(cfg: &Config) -> Running {
    cfg.validate().expect("test config is valid");
    let indexer = app::start(cfg).await.expect("indexer starts");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", indexer.grpc_addr))
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("connect to indexer");
    Running {
        indexer,
        client: IndexerClient::new(channel),
        http: reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("client"),
    }
}

/// Polls `f` every 30 ms until it is true; panics after `timeout`.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
}

/// A chat `PickRequest` for the test pool.
pub fn chat_pick(request_id: &str, messages: &[(&str, String)]) -> pb::PickRequest {
    pb::PickRequest {
        pool: POOL.into(),
        model: MODEL.into(),
        request_id: request_id.into(),
        prompt: Some(pb::pick_request::Prompt::Chat(pb::Chat {
            messages: messages
                .iter()
                .map(|(r, c)| pb::ChatMessage {
                    role: r.to_string(),
                    content: c.clone(),
                })
                .collect(),
        })),
        ..Default::default()
    }
}

/// Deterministic English-ish filler of about `words` words.
pub fn filler(seed: u64, words: usize) -> String {
    const W: [&str; 24] = [
        "router", "cache", "prefix", "token", "engine", "block", "event", "stream", "replica",
        "latency", "request", "model", "pool", "endpoint", "score", "load", "queue", "prefill",
        "decode", "batch", "memory", "index", "kernel", "tensor",
    ];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = String::with_capacity(words * 7);
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            out.push(if i % 13 == 0 { '.' } else { ' ' });
            if i % 13 == 0 {
                out.push(' ');
            }
        }
        out.push_str(W[(x % W.len() as u64) as usize]);
    }
    out
}
