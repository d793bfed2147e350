//! Shared harness of the `service_*` and `ingest_sim` tests: real
//! `vllm-sim` processes and the `cache-indexer` binary (stderr kept, killed
//! on drop), an in-process indexer on port 0, a gRPC client, and bounded
//! waits.
//!
//! The simulator binary is `$VLLM_SIM_BIN` or `target/release/vllm-sim`;
//! the Qwen3 tokenizer is `$KVASIR_TOKENIZER_DIR` or
//! `.tools/tokenizers/qwen3` (both made by `make build`).
//!
//! Ports: a process started fresh binds port 0 and the harness reads the
//! ports it got from its `ready`/`started` log line, so no other process can
//! take a port between the choice and the bind. Only [`Sim::reserve`] (an
//! engine the indexer must know before it runs) picks ports up front.
//! Each child's stdout and stderr go to a file in the temp folder; a start
//! that fails shows its tail, and a test that fails keeps the files (their
//! paths are printed).
#![allow(dead_code)]

use std::ffi::{OsStr, OsString};
use std::fs::OpenOptions;
use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvasir_cache_indexer::config::{Config, EndpointConfig, PoolConfig, TokenizerSource};
use kvasir_cache_indexer::load::parse_sample;
use kvasir_cache_indexer::{start, Indexer};
use kvasir_proto::v1 as pb;
use kvasir_proto::v1::indexer_client::IndexerClient;
use serde_json::{json, Value};
use tonic::transport::Channel;

/// Model the simulators serve.
pub const MODEL: &str = "Qwen/Qwen3-8B";
/// Pool name used by the tests.
pub const POOL: &str = "sims";

/// How long one start attempt of a child process may take to become ready
/// (generous: the first start on a cold, busy 2-core machine is slow).
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Start attempts of a fresh process that exits before it is ready.
pub const START_ATTEMPTS: usize = 3;
/// Start attempts of a simulator on fixed ports (a restart, or reserved
/// ports the indexer already knows), a short pause apart.
pub const FIXED_PORT_ATTEMPTS: usize = 5;
/// Lines of a child's log shown when it fails.
const TAIL_LINES: usize = 25;

/// The simulator binary.
pub fn sim_bin() -> PathBuf {
    match std::env::var_os("VLLM_SIM_BIN") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/vllm-sim"),
    }
}

/// The `cache-indexer` binary (built by cargo for these tests).
pub fn indexer_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_cache-indexer"))
}

/// The Qwen3 tokenizer directory.
pub fn tokenizer_dir() -> PathBuf {
    match std::env::var_os("KVASIR_TOKENIZER_DIR") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/tokenizers/qwen3"),
    }
}

/// An HTTP client for 127.0.0.1 (never through a proxy).
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .expect("client")
}

/// `N` distinct free 127.0.0.1 ports (all bound at once, then released).
/// Someone else may bind one before its user does: only for ports that must
/// be known before the process runs.
fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<std::net::TcpListener> = (0..N)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0"))
        .collect();
    std::array::from_fn(|i| held[i].local_addr().expect("local addr").port())
}

/// A child process of a test, stdout and stderr appended to a log file in
/// the temp folder. Killed on drop; the log is removed then, unless the
/// thread is panicking (a failing test), when its path is printed instead.
pub struct Proc {
    what: String,
    child: Option<Child>,
    log: PathBuf,
    /// Where the current run's output starts in the log.
    run_start: u64,
}

impl Proc {
    /// A process slot named `what` (not started).
    pub fn new(what: &str) -> Proc {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "kvasir-test-{what}-{}-{}.log",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        Proc {
            what: what.to_string(),
            child: None,
            log: std::env::temp_dir().join(name),
            run_start: 0,
        }
    }

    /// Starts `cmd` (killing a previous process first), output to the log.
    pub fn spawn(&mut self, cmd: &mut Command) {
        self.kill();
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap_or_else(|e| panic!("open {}: {e}", self.log.display()));
        let _ = writeln!(log, "--- test harness: starting {cmd:?}");
        self.run_start = log.metadata().map_or(0, |m| m.len());
        let out = log.try_clone().expect("clone log file");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.what));
        self.child = Some(child);
    }

    /// `None` while the process runs; otherwise why it does not.
    pub fn not_running(&mut self) -> Option<String> {
        match self.child.as_mut().map(|c| c.try_wait()) {
            None => Some("not started".into()),
            Some(Ok(None)) => None,
            Some(Ok(Some(status))) => Some(format!("exited ({status})")),
            Some(Err(e)) => Some(format!("cannot be waited for: {e}")),
        }
    }

    /// The exit status, if it has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits (bounded) for the process to exit.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait() {
                return Some(s);
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Process id (0 if not started).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, |c| c.id())
    }

    /// What the current run (since the last spawn) wrote so far.
    pub fn log_text(&self) -> String {
        let mut b = std::fs::read(&self.log).unwrap_or_default();
        b.drain(..(self.run_start as usize).min(b.len()));
        String::from_utf8_lossy(&b).into_owned()
    }

    /// The last lines of the current run's output, indented, for a panic
    /// message.
    pub fn tail(&self) -> String {
        let text = self.log_text();
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(TAIL_LINES);
        let mut out = format!("{} output ({}):", self.what, self.log.display());
        for l in &lines[from..] {
            out.push_str("\n    ");
            out.push_str(l);
        }
        if lines.is_empty() {
            out.push_str(" (empty)");
        }
        out
    }

    /// Kills the process (if running) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            if self.log.exists() {
                eprintln!("{} log kept: {}", self.what, self.log.display());
            }
        } else {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// The port of `key=...:PORT` in a log line (`Some("tcp://h:p")` and
/// quotes allowed).
fn logged_port(line: &str, key: &str) -> Option<u16> {
    let at = line.find(&format!(" {key}="))? + key.len() + 2;
    let value = line[at..].split_whitespace().next()?;
    let value = value.trim_start_matches("Some(").trim_end_matches(')');
    value.trim_matches('"').rsplit(':').next()?.parse().ok()
}

/// The first log line containing `marker`.
fn log_line(text: &str, marker: &str) -> Option<String> {
    text.lines()
        .find(|l| l.contains(marker))
        .map(str::to_string)
}

/// One simulator process, killed on drop.
pub struct Sim {
    proc: Proc,
    /// HTTP port (0 until a fresh start has read it from the log).
    pub http: u16,
    /// KV-events PUB port.
    pub events: u16,
    /// Replay ROUTER port (0: none).
    pub replay: u16,
    args: Vec<String>,
    client: reqwest::Client,
}

impl Sim {
    fn unstarted(extra: &[&str], [http, events, replay]: [u16; 3]) -> Sim {
        Sim {
            proc: Proc::new("vllm-sim"),
            http,
            events,
            replay,
            args: extra.iter().map(|s| s.to_string()).collect(),
            client: http_client(),
        }
    }

    /// Reserves ports without starting the process, for an engine the
    /// indexer must be configured with before it runs; start it with
    /// [`Sim::spawn`] and [`Sim::wait_healthy`]. (The ports are released
    /// until then: prefer [`Sim::start`].)
    pub fn reserve(extra: &[&str]) -> Sim {
        Sim::unstarted(extra, free_ports())
    }

    /// Starts a fast simulator (zero latency profile, no waiting) on ports
    /// it picks itself.
    pub async fn start(extra: &[&str]) -> Sim {
        Sim::start_all(&[extra]).await.pop().expect("one sim")
    }

    /// Starts `n` fast simulators concurrently.
    pub async fn start_many(n: usize) -> Vec<Sim> {
        Sim::start_all(&vec![&[][..]; n]).await
    }

    /// Starts one simulator per argument list, concurrently, each on ports
    /// it picks itself. One that exits before it is healthy is started
    /// again ([`START_ATTEMPTS`] in all); one that stays up but unhealthy
    /// for [`START_TIMEOUT`] fails the test. Either way the panic shows the
    /// simulator's output.
    pub async fn start_all(extra: &[&[&str]]) -> Vec<Sim> {
        let mut sims: Vec<Sim> = extra.iter().map(|a| Sim::unstarted(a, [0; 3])).collect();
        for s in &mut sims {
            s.launch();
        }
        for s in &mut sims {
            let mut failures = Vec::new();
            for attempt in 1..=START_ATTEMPTS {
                if attempt > 1 {
                    (s.http, s.events, s.replay) = (0, 0, 0);
                    s.launch();
                }
                match s.wait_up().await {
                    Ok(()) => break,
                    Err(e) => failures.push(format!("attempt {attempt}: {e}")),
                }
            }
            assert!(
                failures.len() < START_ATTEMPTS,
                "vllm-sim {:?} would not start:\n{}",
                s.args,
                failures.join("\n")
            );
        }
        sims
    }

    /// (Re)starts the process on its ports (no wait): after [`Sim::kill`]
    /// or [`Sim::reserve`].
    pub fn spawn(&mut self) {
        assert!(
            self.http != 0,
            "Sim::spawn needs known ports: use Sim::start or Sim::reserve"
        );
        self.launch();
    }

    /// Starts the process on `self`'s ports (0: it picks them).
    fn launch(&mut self) {
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
        // The `vllm-sim ready` line (with the bound ports) is at info; the
        // fault endpoints (POST /sim/faults, ...) the tests use are on.
        cmd.args(&self.args)
            .env("RUST_LOG", "info")
            .env("VLLM_SIM_ENABLE_ADMIN", "1");
        self.proc.spawn(&mut cmd);
    }

    /// One start attempt: waits until `/health` answers, reading the ports
    /// from the ready line first if they are not known. `Err` if the process
    /// exits first; a panic (with its output) after [`START_TIMEOUT`].
    async fn wait_up(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Some(why) = self.proc.not_running() {
                return Err(format!("{why} before it was healthy; {}", self.proc.tail()));
            }
            if self.http == 0 {
                if let Some(l) = log_line(&self.proc.log_text(), "vllm-sim ready") {
                    self.http = logged_port(&l, "http").expect("http= in the ready line");
                    self.events = logged_port(&l, "kv_events").unwrap_or(0);
                    self.replay = logged_port(&l, "kv_events_replay").unwrap_or(0);
                }
            }
            if self.http != 0 {
                let health = self
                    .client
                    .get(format!("{}/health", self.url()))
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await;
                if health.is_ok_and(|r| r.status().is_success()) {
                    return Ok(());
                }
            }
            assert!(
                Instant::now() < deadline,
                "vllm-sim {:?} (pid {}, http port {}) did not become healthy within {START_TIMEOUT:?}; {}",
                self.args,
                self.proc.pid(),
                self.http,
                self.proc.tail()
            );
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }

    /// Waits (bounded) for `/health` after [`Sim::spawn`]. The ports are
    /// fixed (the indexer knows them): a process that exits at once is
    /// started again on the same ports, [`FIXED_PORT_ATTEMPTS`] in all.
    pub async fn wait_healthy(&mut self) {
        let mut failures = Vec::new();
        for attempt in 1..=FIXED_PORT_ATTEMPTS {
            if attempt > 1 {
                tokio::time::sleep(Duration::from_millis(200)).await;
                self.launch();
            }
            match self.wait_up().await {
                Ok(()) => return,
                Err(e) => failures.push(format!("attempt {attempt}: {e}")),
            }
        }
        panic!(
            "vllm-sim {:?} would not start on its fixed ports (http {}, events {}, replay {}):\n{}",
            self.args,
            self.http,
            self.events,
            self.replay,
            failures.join("\n")
        );
    }

    /// Kills the process.
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// The simulator's output so far, for a panic message.
    pub fn tail(&self) -> String {
        self.proc.tail()
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
            replay: (self.replay != 0).then(|| format!("tcp://127.0.0.1:{}", self.replay)),
            metrics: None,
            topic: String::new(),
        }
    }

    /// POSTs `body` as JSON to `path`; returns the response, or panics with
    /// the simulator's output if it does not answer.
    pub async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.url()))
            .json(body)
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path} to vllm-sim: {e}; {}", self.tail()))
    }

    /// A non-streaming chat completion; returns the response JSON.
    pub async fn chat(&self, messages: &[(&str, String)], max_tokens: u32) -> Value {
        let msgs: Vec<Value> = messages
            .iter()
            .map(|(r, c)| json!({"role": r, "content": c}))
            .collect();
        let r = self
            .post(
                "/v1/chat/completions",
                &json!({"model": MODEL, "messages": msgs, "max_tokens": max_tokens}),
            )
            .await;
        assert!(r.status().is_success(), "chat failed: {}", r.status());
        r.json().await.expect("chat json")
    }
}

/// The `cache-indexer` binary on ports it picks itself (read from its
/// `cache-indexer started` line), output kept; killed on drop.
pub struct IndexerBin {
    /// The process.
    pub proc: Proc,
    /// gRPC address.
    pub grpc: SocketAddr,
    /// HTTP address.
    pub http: SocketAddr,
    /// HTTP client.
    pub client: reqwest::Client,
}

impl IndexerBin {
    /// Starts the binary with `args` plus `--grpc-addr`/`--http-addr` on
    /// port 0 and waits (bounded) for it to listen. One that exits first is
    /// started again ([`START_ATTEMPTS`] in all); the panic shows its
    /// output.
    pub async fn start<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> IndexerBin {
        let args: Vec<OsString> = args.into_iter().map(|a| a.as_ref().to_owned()).collect();
        let mut proc = Proc::new("cache-indexer");
        let mut failures = Vec::new();
        for attempt in 1..=START_ATTEMPTS {
            let mut cmd = Command::new(indexer_bin());
            cmd.args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
                .args(&args)
                // The `cache-indexer started` line (with the addresses) is at info.
                .env("RUST_LOG", "info");
            proc.spawn(&mut cmd);
            let deadline = Instant::now() + START_TIMEOUT;
            let started = loop {
                if let Some(why) = proc.not_running() {
                    break Err(format!("{why} before it listened; {}", proc.tail()));
                }
                if let Some(l) = log_line(&proc.log_text(), "cache-indexer started") {
                    let port = |key| {
                        let p =
                            logged_port(&l, key).unwrap_or_else(|| panic!("no {key}= in `{l}`"));
                        SocketAddr::from(([127, 0, 0, 1], p))
                    };
                    break Ok((port("grpc_addr"), port("http_addr")));
                }
                assert!(
                    Instant::now() < deadline,
                    "cache-indexer {args:?} (pid {}) did not log `cache-indexer started` within {START_TIMEOUT:?}; {}",
                    proc.pid(),
                    proc.tail()
                );
                tokio::time::sleep(Duration::from_millis(30)).await;
            };
            match started {
                Ok((grpc, http)) => {
                    return IndexerBin {
                        proc,
                        grpc,
                        http,
                        client: http_client(),
                    }
                }
                Err(e) => failures.push(format!("attempt {attempt}: {e}")),
            }
        }
        panic!(
            "cache-indexer {args:?} would not start:\n{}",
            failures.join("\n")
        );
    }

    /// Base URL of its HTTP side.
    pub fn http_url(&self) -> String {
        format!("http://{}", self.http)
    }

    /// Waits until `/readyz` is 200.
    pub async fn wait_ready(&self) {
        let url = format!("{}/readyz", self.http_url());
        wait_for("binary ready", Duration::from_secs(20), || {
            let (c, u) = (self.client.clone(), url.clone());
            async move { c.get(u).send().await.is_ok_and(|r| r.status().is_success()) }
        })
        .await;
    }

    /// The `/metrics` page.
    pub async fn metrics(&self) -> String {
        metrics_text(&self.client, &self.http_url()).await
    }

    /// A gRPC client.
    pub async fn grpc_client(&self) -> IndexerClient<Channel> {
        IndexerClient::new(connect(self.grpc).await)
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
        ..Config::default()
    }
}

/// A gRPC channel to `addr` (bounded connect).
pub async fn connect(addr: SocketAddr) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("connect to indexer")
}

/// Adds `authorization: Bearer <token>` to every call (none: nothing).
#[derive(Debug, Clone)]
pub struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl Bearer {
    /// The interceptor for `token`.
    pub fn new(token: Option<&str>) -> Bearer {
        Bearer(token.map(|t| format!("Bearer {t}").parse().expect("ascii token")))
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A client whose calls carry `token` (see [`Bearer`]).
pub type AuthedClient =
    IndexerClient<tonic::service::interceptor::InterceptedService<Channel, Bearer>>;

/// An [`AuthedClient`] on `channel`.
pub fn authed_client(channel: Channel, token: Option<&str>) -> AuthedClient {
    IndexerClient::with_interceptor(channel, Bearer::new(token))
}

/// A token file in the temp folder holding `token`; removed on drop.
pub struct TokenFile(pub PathBuf);

impl TokenFile {
    /// Writes `token` (plus a newline, as `kubectl create secret` files
    /// often have) to a fresh file.
    pub fn new(token: &str) -> TokenFile {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "kvasir-test-token-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let f = TokenFile(path);
        f.write(&format!("{token}\n"));
        f
    }

    /// Replaces the content.
    pub fn write(&self, text: &str) {
        std::fs::write(&self.0, text).unwrap_or_else(|e| panic!("write {}: {e}", self.0.display()));
    }
}

impl Drop for TokenFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The `/metrics` page under `base_url`.
pub async fn metrics_text(client: &reqwest::Client, base_url: &str) -> String {
    client
        .get(format!("{base_url}/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .expect("body")
}

/// The value of the first sample in `text` whose line starts with `prefix`.
pub fn metric_value(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| parse_sample(l).ok())
        .map(|s| s.value)
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

    /// The `/metrics` page.
    pub async fn metrics(&self) -> String {
        metrics_text(&self.http, &self.http_url()).await
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

/// Starts an indexer for `cfg`, waits (bounded) until every pool is warm
/// (scraped once: picks are served) and connects a client.
pub async fn start_indexer(cfg: &Config) -> Running {
    cfg.validate().expect("test config is valid");
    let indexer = start(cfg).await.expect("indexer starts");
    let life = std::sync::Arc::clone(&indexer.lifecycle);
    wait_for("every pool warm", Duration::from_secs(10), || {
        let warm = life.all_warm();
        async move { warm }
    })
    .await;
    let channel = connect(indexer.grpc_addr).await;
    Running {
        indexer,
        client: IndexerClient::new(channel),
        http: http_client(),
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

/// The DONE report of a request the engine at `endpoint` served with
/// `resp` (its usage: prompt and cached tokens) and `completion_tokens`.
pub fn served_done(
    request_id: &str,
    endpoint: &str,
    resp: &Value,
    completion_tokens: u32,
) -> pb::ReportRequest {
    pb::ReportRequest {
        pool: POOL.into(),
        request_id: request_id.into(),
        endpoint: endpoint.into(),
        prompt_tokens: prompt_tokens(resp) as u32,
        cached_tokens: cached_tokens(resp) as u32,
        completion_tokens,
        outcome: pb::Outcome::Success as i32,
        phase: pb::ReportPhase::Done as i32,
        ..Default::default()
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

/// A token-ids `PickRequest` for the test pool.
pub fn ids_pick(request_id: &str, ids: Vec<u32>) -> pb::PickRequest {
    pb::PickRequest {
        pool: POOL.into(),
        model: MODEL.into(),
        request_id: request_id.into(),
        prompt: Some(pb::pick_request::Prompt::TokenIds(pb::TokenIds { ids })),
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
