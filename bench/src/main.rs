//! `kvasir-bench`: the routing benchmark's load generator and report.
//!
//! ```text
//! kvasir-bench trace  --url http://127.0.0.1:10000 --trace T.jsonl --speed 4 --time-scale 0.25 --mode kvasir --load 1 --out-dir D
//! kvasir-bench chat   --url http://127.0.0.1:10000 --conversations-per-s 0.5 --time-scale 0.25 --mode kvasir --load 1 --out-dir D
//! kvasir-bench workload --shape agents --rate 0.5 --duration-s 90 --url http://127.0.0.1:10000 --mode kvasir --load 1 --out-dir D
//! kvasir-bench workload-stats --shape bursty --rate 20 --duration-s 90
//! kvasir-bench bound  --trace T.jsonl --capacity-tokens 3200000 --out D/bound.json
//! kvasir-bench report --dir D
//! kvasir-bench tenants --url http://127.0.0.1:10000 --tenants 4 --rate 2 --burst 0:3:20..40 --mode kvasir --load 1 --out-dir D
//! kvasir-bench governance-report --dir D
//! ```
//! `bench/routing.py` starts the simulated cluster and each routing mode and
//! calls these; see the README's routing benchmark section
//! (`bench/governance.py` the governance benchmarks').
#![forbid(unsafe_code)]

mod governance_cli;
mod replay_cli;
mod streams_cli;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use kvasir_bench::chat::{self, ChatConfig};
use kvasir_bench::client::{host_of, Routes, Target};
use kvasir_bench::compare;
use kvasir_bench::run::{self, RunOptions, RunResult};
use kvasir_bench::workloads::{self, Shape, WorkloadConfig};
use kvasir_bench::{bound, results, stats, trace, ttft_growth, RunMeta};
use kvasir_scoring::Weights;
use vllm_latency::LatencyProfile;

#[derive(Parser)]
#[command(
    version,
    about = "Kvasir's routing benchmark: load generator and report"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Replay a Mooncake-format trace (token-id prompts on /v1/completions).
    Trace(TraceArgs),
    /// Run the synthetic multi-tenant chat workload (/v1/chat/completions).
    Chat(ChatArgs),
    /// Run one of the workload shapes beyond the trace and the chat:
    /// `longchat` (long-context conversations under large shared system
    /// prompts), `agents` (agentic tool loops), `bursty` (short prompts and
    /// long documents in bursts), each from its documented parameters.
    Workload(WorkloadArgs),
    /// Print what a workload shape plans at a rate, as JSON (sessions,
    /// requests, prompt lengths, shared-prefix fraction, burstiness, reused
    /// content); sends nothing.
    WorkloadStats(ShapeArgs),
    /// Compute the hit rate one pooled LRU cache would get on a trace.
    Bound(BoundArgs),
    /// Write the markdown report and the plots from a results directory.
    Report(ReportArgs),
    /// The latency one proxy path adds over another: both driven
    /// open-loop at the same rates in alternating blocks.
    Overhead(OverheadArgs),
    /// Several tenants sending open-loop at their own rates, one of them
    /// optionally bursting (the governance benchmarks' workload).
    Tenants(governance_cli::TenantsArgs),
    /// Write the governance benchmarks' report from a results directory
    /// holding `scenarios.json` and the runs it names.
    GovernanceReport(governance_cli::GovernanceReportArgs),
    /// Replay a chat run's conversations through the simulator's engines
    /// in virtual time, placed as the run placed them and by oracle
    /// routers (batching and eviction as the engines do them).
    Replay(replay_cli::ReplayArgs),
    /// Clients each holding a streamed chat request, one after another, for
    /// a while (closed loop): the load overload and fault behaviour are
    /// judged under.
    Streams(streams_cli::StreamsArgs),
}

#[derive(Args, Clone)]
struct Common {
    /// Base URL of the proxy; repeatable: trace requests, and chat
    /// conversations as a whole, alternate over the proxies.
    #[arg(long = "url", default_value = "http://127.0.0.1:10000")]
    urls: Vec<String>,
    /// Base URL of an engine that takes traffic directly, not through a
    /// proxy (repeatable; used with `--direct-share`).
    #[arg(long = "direct-url")]
    direct_urls: Vec<String>,
    /// Share of trace requests / conversations sent to the `--direct-url`
    /// engines instead of the proxies (the same ones in every mode).
    #[arg(long, default_value_t = 0.0)]
    direct_share: f64,
    /// Model to ask for.
    #[arg(long, default_value = "Qwen/Qwen3-8B")]
    model: String,
    /// The simulators' time scale (wall seconds per simulated second);
    /// arrivals are scheduled and latencies reported in simulated time.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Engines' /metrics URLs, for prefill utilisation (repeatable).
    #[arg(long = "engine-metrics")]
    engine_metrics: Vec<String>,
    /// Give up on requests still running this many simulated seconds after
    /// the last arrival.
    #[arg(long, default_value_t = 600.0)]
    drain_s: f64,
    /// Routing mode label for the results.
    #[arg(long)]
    mode: String,
    /// Load factor label (1.0 = the reference load).
    #[arg(long)]
    load: f64,
    /// Directory for `<workload>-<load>-<mode>.csv` and `.json`.
    #[arg(long)]
    out_dir: PathBuf,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
}

#[derive(Args, Clone)]
struct Slice {
    /// Trace file (JSON lines).
    #[arg(long)]
    trace: PathBuf,
    /// Start of the replayed window, seconds of trace time.
    #[arg(long, default_value_t = 0.0)]
    from_s: f64,
    /// Length of the window, seconds of trace time (default: to the end).
    #[arg(long)]
    duration_s: Option<f64>,
    /// Tokens per hash id.
    #[arg(long, default_value_t = trace::MOONCAKE_BLOCK_TOKENS)]
    block_tokens: usize,
}

#[derive(Args)]
struct TraceArgs {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    slice: Slice,
    /// Speed-up of the trace's arrival times (2 = twice as many requests
    /// per second).
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
}

#[derive(Args)]
struct ChatArgs {
    #[command(flatten)]
    common: Common,
    /// Tenants.
    #[arg(long, default_value_t = 8)]
    tenants: usize,
    /// Tenant popularity skew (weight 1/(i+1)^skew).
    #[arg(long, default_value_t = 0.5)]
    tenant_skew: f64,
    /// New conversations per simulated second.
    #[arg(long)]
    conversations_per_s: f64,
    /// Simulated seconds of conversation arrivals; no turn starts after
    /// the last arrival (the run ends with its arrival window).
    #[arg(long, default_value_t = 120.0)]
    duration_s: f64,
    /// System prompt words (about tokens), MIN..MAX.
    #[arg(long, default_value = "1500..3000", value_parser = range_usize)]
    system_words: (usize, usize),
    /// Turns per conversation, MIN..MAX.
    #[arg(long, default_value = "3..8", value_parser = range_usize)]
    turns: (usize, usize),
    /// User message words, MIN..MAX.
    #[arg(long, default_value = "100..400", value_parser = range_usize)]
    user_words: (usize, usize),
    /// Completion tokens, MIN..MAX.
    #[arg(long, default_value = "100..300", value_parser = range_usize)]
    output_tokens: (usize, usize),
    /// Mean think time between turns, simulated seconds.
    #[arg(long, default_value_t = 8.0)]
    think_s: f64,
    /// Seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// A workload shape at a rate.
#[derive(Args, Clone)]
struct ShapeArgs {
    /// `longchat`, `agents` or `bursty`.
    #[arg(long, value_parser = shape_name)]
    shape: Shape,
    /// Sessions started per simulated second, on average (a `bursty`
    /// session is one request): what the load factor scales.
    #[arg(long)]
    rate: f64,
    /// Simulated seconds in which sessions start; no turn starts after the
    /// last start (the run ends with its arrival window).
    #[arg(long, default_value_t = 120.0)]
    duration_s: f64,
    /// Seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

impl ShapeArgs {
    fn config(&self) -> WorkloadConfig {
        WorkloadConfig::new(self.shape, self.rate, self.duration_s, self.seed)
    }
}

fn shape_name(s: &str) -> Result<Shape, String> {
    Shape::parse(s).ok_or_else(|| {
        let names: Vec<&str> = Shape::ALL.iter().map(|x| x.name()).collect();
        format!("unknown shape `{s}` (one of {})", names.join(", "))
    })
}

#[derive(Args)]
struct WorkloadArgs {
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    shape: ShapeArgs,
}

/// The engines the runs were made on, for pricing requests with no
/// queueing (the unqueued TTFT floors).
#[derive(Args, Clone)]
struct EngineArgs {
    /// Tokens per engine KV block.
    #[arg(long, default_value_t = 16)]
    engine_block: usize,
    /// The engines' latency profile (vllm-sim's `--profile`), for the
    /// unqueued TTFT; `none` skips it.
    #[arg(long, default_value = vllm_latency::DEFAULT_PROFILE)]
    profile: String,
    /// The engines' prefill token budget per step (vllm-sim's flag).
    #[arg(long, default_value_t = vllm_latency::DEFAULT_MAX_NUM_BATCHED_TOKENS)]
    max_num_batched_tokens: usize,
}

impl EngineArgs {
    /// The latency model, or `None` for `--profile none`.
    fn model(&self) -> anyhow::Result<Option<bound::EngineModel>> {
        anyhow::ensure!(self.engine_block >= 1, "--engine-block must be at least 1");
        match self.profile.as_str() {
            "none" => Ok(None),
            _ if self.max_num_batched_tokens == 0 => {
                anyhow::bail!("--max-num-batched-tokens must be at least 1")
            }
            name => Ok(Some(bound::EngineModel {
                profile: LatencyProfile::by_name(name).with_context(|| {
                    format!(
                        "--profile {name}: unknown (one of {}, or none)",
                        LatencyProfile::NAMES.join(", ")
                    )
                })?,
                max_num_batched_tokens: self.max_num_batched_tokens,
            })),
        }
    }
}

#[derive(Args)]
struct BoundArgs {
    #[command(flatten)]
    slice: Slice,
    /// Capacity of the pooled cache, tokens (all engines together).
    #[arg(long)]
    capacity_tokens: u64,
    #[command(flatten)]
    engine: EngineArgs,
    /// Output JSON file.
    #[arg(long)]
    out: PathBuf,
}

/// `name:key=value,...`: the default scoring weights with those keys (the
/// pool's `scoring` keys) set, validated as the indexer validates them.
pub(crate) fn parse_weights(spec: &str) -> anyhow::Result<Weights> {
    let (_, kvs) = spec
        .split_once(':')
        .filter(|(n, k)| !n.is_empty() && !k.is_empty())
        .with_context(|| format!("{spec:?}: expected name:key=value[,key=value]"))?;
    let mut w = serde_json::to_value(Weights::default())?;
    for kv in kvs.split(',') {
        let (k, v) = kv
            .split_once('=')
            .with_context(|| format!("{spec:?}: {kv:?} is not key=value"))?;
        let v: serde_json::Value = serde_json::from_str(v.trim())
            .with_context(|| format!("{spec:?}: {v:?} is not a number, true, false or null"))?;
        w[k.trim()] = v;
    }
    let w: Weights = serde_json::from_value(w).with_context(|| format!("{spec:?}"))?;
    w.validate()
        .map_err(|(field, why)| anyhow::anyhow!("{spec:?}: {field}: {why}"))?;
    Ok(w)
}

#[derive(Args)]
struct ReportArgs {
    /// Results directory (runs' CSV and JSON, optional bound.json and
    /// setup.txt).
    #[arg(long)]
    dir: PathBuf,
    /// The command line to quote in the report.
    #[arg(long, default_value = "make bench-full")]
    command: String,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Args)]
struct OverheadArgs {
    /// Full URL of a path, repeatable (the first is the one measured, the
    /// others its baselines), e.g. `http://127.0.0.1:10000/v1/chat/completions`.
    #[arg(long = "url", required = true)]
    urls: Vec<String>,
    /// A label per URL, same order.
    #[arg(long = "name", required = true)]
    names: Vec<String>,
    /// JSON-lines file of request bodies, cycled in order.
    #[arg(long)]
    bodies: PathBuf,
    /// Extra header `name: value`, repeatable.
    #[arg(long = "header")]
    headers: Vec<String>,
    /// Requests per second on each path, comma-separated for several runs.
    #[arg(long, default_value = "100,500", value_delimiter = ',')]
    rates: Vec<f64>,
    /// Seconds of requests per path and rate.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Length of one block, seconds.
    #[arg(long, default_value_t = 0.5)]
    block_s: f64,
    /// Seconds of warm-up per path at 50 req/s (caches, connections), not
    /// measured.
    #[arg(long, default_value_t = 2.0)]
    warmup_s: f64,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 10.0)]
    timeout_s: f64,
    /// Output JSON file.
    #[arg(long)]
    out: PathBuf,
}

/// The overhead warm-up's rate per path (the `--warmup-s` help says 50).
const WARMUP_RPS: f64 = 50.0;

fn overhead_cmd(a: &OverheadArgs) -> anyhow::Result<()> {
    use kvasir_bench::overhead::{self, Setup};
    anyhow::ensure!(
        a.urls.len() == a.names.len(),
        "--url and --name must be given the same number of times ({} vs {})",
        a.urls.len(),
        a.names.len()
    );
    anyhow::ensure!(
        a.rates.iter().all(|r| *r > 0.0 && r.is_finite()),
        "--rates must be positive"
    );
    let text = std::fs::read_to_string(&a.bodies)
        .with_context(|| format!("reading {}", a.bodies.display()))?;
    let bodies: Vec<bytes::Bytes> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| bytes::Bytes::from(l.to_string()))
        .collect();
    anyhow::ensure!(!bodies.is_empty(), "{} has no bodies", a.bodies.display());
    let headers = a
        .headers
        .iter()
        .map(|h| {
            h.split_once(':')
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .with_context(|| format!("--header `{h}`: expected `name: value`"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let setup = Arc::new(Setup {
        urls: a.urls.clone(),
        names: a.names.clone(),
        bodies,
        headers,
        timeout: std::time::Duration::from_secs_f64(a.timeout_s),
    });
    // One thread: the client must take as little as possible of the CPU
    // the paths under test share.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let results = rt.block_on(async {
        let client = reqwest::Client::builder()
            .no_proxy()
            .tcp_nodelay(true)
            .pool_max_idle_per_host(256)
            .build()?;
        let n = setup.bodies.len();
        let warm = overhead::schedule(WARMUP_RPS, a.warmup_s, a.block_s, setup.urls.len(), n);
        overhead::run(&client, &setup, WARMUP_RPS, &warm).await;
        let mut out = Vec::new();
        for &rate in &a.rates {
            let slots = overhead::schedule(rate, a.seconds, a.block_s, setup.urls.len(), n);
            let r = overhead::run(&client, &setup, rate, &slots).await;
            for p in &r.paths {
                eprintln!(
                    "{rate:5.0} rps {:15} n={:5} errors={} p50 {:.3} ms p99 {:.3} ms",
                    p.name, p.n, p.errors, p.p50_ms, p.p99_ms
                );
            }
            out.push(r);
        }
        anyhow::Ok(out)
    })?;
    std::fs::write(&a.out, serde_json::to_string_pretty(&results)?)?;
    Ok(())
}

fn range_usize(s: &str) -> Result<(usize, usize), String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("expected MIN..MAX, got `{s}`"))?;
    let p = |x: &str| x.trim().parse::<usize>().map_err(|e| format!("`{x}`: {e}"));
    Ok((p(a)?, p(b)?))
}

fn load_trace(s: &Slice) -> anyhow::Result<Vec<trace::TraceRequest>> {
    let text = std::fs::read_to_string(&s.trace)
        .with_context(|| format!("reading {}", s.trace.display()))?;
    let all = trace::parse(&text).with_context(|| format!("parsing {}", s.trace.display()))?;
    let from = s.from_s * 1e3;
    let to = s.duration_s.map_or(f64::INFINITY, |d| from + d * 1e3);
    let v: Vec<_> = all
        .into_iter()
        .filter(|r| r.timestamp >= from && r.timestamp < to)
        .collect();
    anyhow::ensure!(
        !v.is_empty(),
        "no trace requests in the window {}s + {:?}s",
        s.from_s,
        s.duration_s
    );
    Ok(v)
}

fn options(c: &Common) -> anyhow::Result<RunOptions> {
    anyhow::ensure!(
        c.time_scale > 0.0 && c.time_scale.is_finite(),
        "--time-scale must be > 0"
    );
    anyhow::ensure!(
        (0.0..=1.0).contains(&c.direct_share),
        "--direct-share must be within 0..=1"
    );
    anyhow::ensure!(
        c.direct_share == 0.0 || !c.direct_urls.is_empty(),
        "--direct-share needs --direct-url"
    );
    let base = |u: &String| u.trim_end_matches('/').to_string();
    let proxies: Vec<String> = c.urls.iter().map(base).collect();
    Ok(RunOptions {
        target: Target {
            url: proxies[0].clone(),
            model: c.model.clone(),
            time_scale: c.time_scale,
        },
        routes: Routes {
            proxies,
            direct: c.direct_urls.iter().map(base).collect(),
            direct_share: c.direct_share,
        },
        engine_metrics: c.engine_metrics.clone(),
        drain_s: c.drain_s,
        progress: !c.no_progress,
    })
}

fn write_run(
    c: &Common,
    opts: &RunOptions,
    workload: &str,
    rate: f64,
    res: RunResult,
) -> anyhow::Result<()> {
    let mut notes = serde_json::Map::new();
    if opts.routes.spread() {
        // Where the units went (a conversation counts all its planned turns).
        for (url, n) in &res.sent {
            notes.insert(format!("planned via {}", host_of(url)), (*n).into());
        }
        notes.insert("start_unix_ms".into(), res.start_unix_ms.into());
    }
    let meta = RunMeta {
        workload: workload.into(),
        mode: c.mode.clone(),
        load: c.load,
        rate,
        time_scale: c.time_scale,
        wall_s: res.wall_s,
        engines: res.engines,
        ttft_growth: ttft_growth(&res.records),
        summary: stats::summarize(&res.records),
        notes,
    };
    results::write_run(&c.out_dir, &meta, &res.records)?;
    let s = &meta.summary;
    eprintln!(
        "{}: {} requests ({} failed, {} timed out), TTFT p50 {} p99 {}, hit rate {:.1}%, prefill use {:.1}%, {:.0} s wall",
        results::run_name(workload, c.load, &c.mode),
        s.requests,
        s.failed,
        s.timeouts,
        compare::ms(s.ttft.p50),
        compare::ms(s.ttft.p99),
        s.cache_hit_rate * 100.0,
        meta.engines.prefill_utilisation * 100.0,
        meta.wall_s
    );
    Ok(())
}

fn report_cmd(a: &ReportArgs) -> anyhow::Result<()> {
    let model = a.engine.model()?;
    results::write_report(
        &a.dir,
        &a.command,
        model.as_ref(),
        a.engine.engine_block as u64,
    )?;
    eprintln!("wrote {}", a.dir.join("report.md").display());
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().cmd {
        Cmd::Overhead(a) => overhead_cmd(&a),
        Cmd::Replay(a) => replay_cli::replay_cmd(&a),
        cmd => tokio::runtime::Runtime::new()?.block_on(run_cmd(cmd)),
    }
}

async fn run_cmd(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Trace(a) => {
            let t = Arc::new(load_trace(&a.slice)?);
            let opts = options(&a.common)?;
            let res = run::run_trace(t, a.speed, a.slice.block_tokens, &opts).await?;
            write_run(&a.common, &opts, "trace", a.speed, res)
        }
        Cmd::Chat(a) => {
            let (o0, o1) = a.output_tokens;
            let cfg = ChatConfig {
                tenants: a.tenants,
                tenant_skew: a.tenant_skew,
                system_words: a.system_words,
                turns: a.turns,
                user_words: a.user_words,
                output_tokens: (
                    u32::try_from(o0).context("--output-tokens")?,
                    u32::try_from(o1).context("--output-tokens")?,
                ),
                think_s: a.think_s,
                conversations_per_s: a.conversations_per_s,
                duration_s: a.duration_s,
                seed: a.seed,
            };
            let plan = Arc::new(chat::plan(&cfg)?);
            let opts = options(&a.common)?;
            let res = run::run_chat(plan, &opts).await?;
            write_run(&a.common, &opts, "chat", a.conversations_per_s, res)
        }
        Cmd::Workload(a) => {
            let cfg = a.shape.config();
            let plan = Arc::new(workloads::plan(&cfg)?);
            let opts = options(&a.common)?;
            let res = run::run_chat(plan, &opts).await?;
            write_run(&a.common, &opts, a.shape.shape.name(), cfg.rate, res)
        }
        Cmd::WorkloadStats(a) => {
            let cfg = a.config();
            let plan = workloads::plan(&cfg)?;
            println!(
                "{}",
                serde_json::to_string_pretty(&workloads::stats(&cfg, &plan))?
            );
            Ok(())
        }
        Cmd::Bound(a) => {
            let t = load_trace(&a.slice)?;
            let model = a.engine.model()?;
            let b = bound::pooled_hit_rate(
                &t,
                a.slice.block_tokens,
                a.engine.engine_block,
                a.capacity_tokens,
                model.as_ref(),
            );
            eprintln!(
                "pooled cache of {} tokens: hit rate {:.1}%{}",
                b.capacity_tokens,
                b.hit_rate * 100.0,
                b.unqueued_mean_ttft_ms
                    .map(|v| format!(", unqueued mean TTFT {v:.0} ms"))
                    .unwrap_or_default()
            );
            std::fs::write(&a.out, serde_json::to_string_pretty(&b)?)?;
            Ok(())
        }
        Cmd::Report(a) => report_cmd(&a),
        Cmd::Tenants(a) => governance_cli::tenants_cmd(a).await,
        Cmd::Streams(a) => streams_cli::streams_cmd(a).await,
        Cmd::GovernanceReport(a) => governance_cli::governance_report_cmd(&a),
        Cmd::Overhead(_) | Cmd::Replay(_) => {
            anyhow::bail!("overhead and replay run without an async runtime")
        }
    }
}
