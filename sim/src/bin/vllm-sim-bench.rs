//! Benchmark of the simulator itself: how many chat requests per second one
//! `vllm-sim` process sustains at time scale 0 with ~2k-token prompts, and
//! its memory with a full cache of 25k blocks. Starts its own simulator on
//! loopback, writes JSON results. Not a test: run by `make bench`.
#![forbid(unsafe_code)]

use anyhow::{bail, Context, Result};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(
    about = "Benchmark one vllm-sim process (throughput at time scale 0, memory at 25k cached blocks)"
)]
struct Args {
    /// The vllm-sim binary (default: next to this one).
    #[arg(long)]
    sim: Option<PathBuf>,
    /// Seconds measured per scenario.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Concurrent client connections.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Completion tokens per request.
    #[arg(long, default_value_t = 16)]
    max_tokens: u32,
    /// Where to write the JSON results.
    #[arg(long, default_value = "bench/results/sim.json")]
    out: PathBuf,
}

struct Sim {
    child: Child,
    port: u16,
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

async fn start_sim(bin: &PathBuf, extra: &[&str]) -> Result<Sim> {
    let port = free_port()?;
    let child = Command::new(bin)
        .args(["--port", &port.to_string()])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let sim = Sim { child, port };
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Ok(r) = client
            .get(format!("http://127.0.0.1:{port}/health"))
            .send()
            .await
        {
            if r.status().is_success() {
                return Ok(sim);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("vllm-sim did not become healthy in 30 s")
}

/// CPU seconds (user + system) a process has used so far.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the parenthesised command name; utime and stime are 14 and 15.
    let rest = s.rsplit_once(')').map(|(_, r)| r).context("stat format")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f
        .get(11)
        .and_then(|v| v.parse::<f64>().ok())
        .context("utime")?
        + f.get(12)
            .and_then(|v| v.parse::<f64>().ok())
            .context("stime")?;
    // USER_HZ is 100 on Linux.
    Ok(ticks / 100.0)
}

fn rss_kib(pid: u32) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("VmRSS not found")
}

const WORDS: &[&str] = &[
    "cache",
    "prefix",
    "token",
    "router",
    "engine",
    "latency",
    "batch",
    "queue",
    "tenant",
    "policy",
    "model",
    "request",
    "stream",
    "block",
    "memory",
    "kernel",
    "attention",
    "decode",
    "prefill",
    "cluster",
    "gateway",
    "envoy",
    "filter",
    "metric",
    "budget",
    "schedule",
    "replica",
    "shard",
    "index",
    "vector",
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "with",
    "as",
    "on",
    "when",
    "every",
    "system",
    "answer",
    "question",
    "data",
    "time",
    "first",
    "state",
];

fn text(rng: &mut StdRng, words: usize) -> String {
    let mut s = String::with_capacity(words * 7);
    for i in 0..words {
        if i > 0 {
            s.push(if i % 17 == 0 { '\n' } else { ' ' });
        }
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
        if i % 11 == 10 {
            s.push_str(&rng.random_range(0..1000).to_string());
        }
    }
    s
}

/// A scenario's requests: chats of about `sys_words + user_words` words,
/// the system prompt one of `tenants` shared ones (0 = every system prompt
/// fresh), the user turn always fresh. Bodies are generated per request so
/// nothing repeats and no tokenizer cache sees the same user text twice.
struct Workload {
    systems: Vec<String>,
    sys_words: usize,
    user_words: usize,
    max_tokens: u32,
    stream: bool,
}

impl Workload {
    fn new(
        tenants: usize,
        sys_words: usize,
        user_words: usize,
        max_tokens: u32,
        stream: bool,
    ) -> Self {
        let mut rng = StdRng::seed_from_u64(42);
        let systems = (0..tenants).map(|_| text(&mut rng, sys_words)).collect();
        Workload {
            systems,
            sys_words,
            user_words,
            max_tokens,
            stream,
        }
    }

    fn body(&self, rng: &mut StdRng, i: u64) -> bytes::Bytes {
        let system = if self.systems.is_empty() {
            text(rng, self.sys_words)
        } else {
            self.systems[i as usize % self.systems.len()].clone()
        };
        let mut b = json!({
            "model": "Qwen/Qwen3-8B",
            "max_tokens": self.max_tokens,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": format!("request {i}: {}", text(rng, self.user_words))},
            ],
        });
        if self.stream {
            b["stream"] = json!(true);
            b["stream_options"] = json!({"include_usage": true});
        }
        bytes::Bytes::from(b.to_string())
    }
}

async fn prompt_tokens(port: u16, body: &bytes::Bytes) -> Result<u64> {
    let v: Value = serde_json::from_slice(body)?;
    let r: Value = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/tokenize"))
        .json(&json!({"messages": v["messages"]}))
        .send()
        .await?
        .json()
        .await?;
    r["count"].as_u64().context("tokenize count")
}

/// Closed-loop load: `concurrency` workers each send the next body as soon
/// as the previous answer is read in full; returns the scenario's numbers.
async fn run_load(
    port: u16,
    pid: u32,
    work: Arc<Workload>,
    concurrency: usize,
    seconds: u64,
    label: &str,
) -> Result<Value> {
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency)
        .build()?;
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let next = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let lat = Arc::new(parking_lot::Mutex::new(Vec::<f64>::new()));
    let mut tasks = Vec::new();
    for w in 0..concurrency {
        let (client, url, work, next, done, errors, measuring, stop, lat) = (
            client.clone(),
            url.clone(),
            work.clone(),
            next.clone(),
            done.clone(),
            errors.clone(),
            measuring.clone(),
            stop.clone(),
            lat.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(1000 + w as u64);
            while !stop.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let body = work.body(&mut rng, i);
                let t0 = Instant::now();
                let ok = match client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await
                {
                    Ok(r) if r.status().is_success() => r.bytes().await.is_ok(),
                    _ => false,
                };
                if measuring.load(Ordering::Relaxed) {
                    if ok {
                        done.fetch_add(1, Ordering::Relaxed);
                        lat.lock().push(t0.elapsed().as_secs_f64());
                    } else {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    // Warm-up: connections, tokenizer caches, engine steady state.
    tokio::time::sleep(Duration::from_secs(2)).await;
    measuring.store(true, Ordering::Relaxed);
    let pb = ProgressBar::new(seconds);
    pb.set_style(
        ProgressStyle::with_template("{prefix:>28} [{bar:30}] {pos}/{len}s {msg}")
            .expect("template"),
    );
    pb.set_prefix(label.to_string());
    let cpu0 = cpu_seconds(pid)?;
    let t0 = Instant::now();
    for s in 1..=seconds {
        tokio::time::sleep_until((t0 + Duration::from_secs(s)).into()).await;
        pb.set_position(s);
        pb.set_message(format!(
            "{:.0} req/s",
            done.load(Ordering::Relaxed) as f64 / t0.elapsed().as_secs_f64()
        ));
    }
    let elapsed = t0.elapsed().as_secs_f64();
    measuring.store(false, Ordering::Relaxed);
    let n = done.load(Ordering::Relaxed);
    let cpu = cpu_seconds(pid)? - cpu0;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
    }
    pb.finish();
    let mut l = lat.lock().clone();
    l.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| {
        if l.is_empty() {
            0.0
        } else {
            l[((l.len() - 1) as f64 * p) as usize] * 1e3
        }
    };
    Ok(json!({
        "requests": n,
        "errors": errors.load(Ordering::Relaxed),
        "seconds": elapsed,
        "requests_per_s": n as f64 / elapsed,
        "sim_cpu_cores_used": cpu / elapsed,
        "sim_cpu_us_per_request": cpu * 1e6 / (n.max(1) as f64),
        "latency_ms": {"p50": q(0.5), "p99": q(0.99)},
    }))
}

async fn memory(bin: &PathBuf) -> Result<Value> {
    let sim = start_sim(
        bin,
        &[
            "--profile",
            "zero",
            "--time-scale",
            "0",
            "--num-gpu-blocks",
            "25000",
        ],
    )
    .await?;
    let pid = sim.child.id();
    let client = reqwest::Client::new();
    // Touch every code path once before the baseline.
    client
        .post(format!("http://127.0.0.1:{}/v1/completions", sim.port))
        .json(&json!({"prompt": [1, 2, 3], "max_tokens": 1}))
        .send()
        .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = rss_kib(pid)?;
    // 200 distinct 2,000-token prompts fill 25,000 blocks of 16.
    let mut rng = StdRng::seed_from_u64(7);
    for _ in 0..200 {
        let prompt: Vec<u32> = (0..2000).map(|_| rng.random_range(1000..100_000)).collect();
        let r = client
            .post(format!("http://127.0.0.1:{}/v1/completions", sim.port))
            .json(&json!({"prompt": prompt, "max_tokens": 1}))
            .send()
            .await?;
        if !r.status().is_success() {
            bail!("fill request failed: {}", r.status());
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = rss_kib(pid)?;
    let metrics = client
        .get(format!("http://127.0.0.1:{}/metrics", sim.port))
        .send()
        .await?
        .text()
        .await?;
    let cached: f64 = metrics
        .lines()
        .find(|l| l.starts_with("vllm_sim:cached_blocks{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .context("cached_blocks metric")?;
    Ok(json!({
        "cached_blocks": cached,
        "rss_idle_mib": before as f64 / 1024.0,
        "rss_full_cache_mib": after as f64 / 1024.0,
        "bytes_per_cached_block": (after.saturating_sub(before) * 1024) as f64 / cached.max(1.0),
    }))
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let bin = match &args.sim {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("vllm-sim"),
    };
    let sim = start_sim(
        &bin,
        &[
            "--profile",
            "h100-8b",
            "--time-scale",
            "0",
            "--enable-prompt-tokens-details",
        ],
    )
    .await?;
    let shared = Arc::new(Workload::new(16, 1500, 450, args.max_tokens, false));
    let shared_stream = Arc::new(Workload::new(16, 1500, 450, args.max_tokens, true));
    let unique = Arc::new(Workload::new(0, 1500, 450, args.max_tokens, false));
    let mut rng = StdRng::seed_from_u64(1);
    let tokens_shared = prompt_tokens(sim.port, &shared.body(&mut rng, 0)).await?;
    let tokens_unique = prompt_tokens(sim.port, &unique.body(&mut rng, 0)).await?;
    let mut scenarios = serde_json::Map::new();
    let s1 = run_load(
        sim.port,
        sim.child.id(),
        shared,
        args.concurrency,
        args.seconds,
        "16 system prompts",
    )
    .await?;
    scenarios.insert(
        "chat_16_system_prompts".into(),
        json!({"prompt_tokens": tokens_shared, "stream": false, "result": s1}),
    );
    let s2 = run_load(
        sim.port,
        sim.child.id(),
        shared_stream,
        args.concurrency,
        args.seconds,
        "16 system prompts, SSE",
    )
    .await?;
    scenarios.insert(
        "chat_16_system_prompts_stream".into(),
        json!({"prompt_tokens": tokens_shared, "stream": true, "result": s2}),
    );
    let s3 = run_load(
        sim.port,
        sim.child.id(),
        unique,
        args.concurrency,
        args.seconds,
        "every prompt unique",
    )
    .await?;
    scenarios.insert(
        "chat_all_unique".into(),
        json!({"prompt_tokens": tokens_unique, "stream": false, "result": s3}),
    );
    drop(sim);
    let mem = memory(&bin).await?;
    let out = json!({
        "benchmark": "vllm-sim",
        "machine": format!("{} cores (load generator on the same machine)", std::thread::available_parallelism().map_or(0, |n| n.get())),
        "time_scale": 0,
        "profile": "h100-8b",
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "scenarios": scenarios,
        "memory_25k_blocks": mem,
    });
    if let Some(d) = args.out.parent() {
        std::fs::create_dir_all(d)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&out)? + "\n")?;
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
