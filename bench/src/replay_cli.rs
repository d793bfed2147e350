//! `kvasir-bench replay`: a chat or trace run's requests through the
//! simulator's engines in virtual time, placed as the run placed them and
//! by oracle routers ([`kvasir_bench::replay`]), as a markdown table.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use kvasir_bench::bound::EngineModel;
use kvasir_bench::record::{Outcome, Record};
use kvasir_bench::replay::{self, Placement, Setup};
use kvasir_bench::stats::Dist;
use kvasir_bench::{compare, floor, results, stats, trace};
use vllm_sim::engine::{EngineConfig, SchedulingPolicy};
use vllm_sim::hashing::HashSeed;

use super::EngineArgs;

#[derive(Args)]
pub(crate) struct ReplayArgs {
    /// A results folder holding a chat run.
    #[arg(long)]
    dir: PathBuf,
    /// The run's workload: `chat`, or `trace` (with `--trace`).
    #[arg(long, default_value = "chat")]
    workload: String,
    /// The trace file the run replayed (a trace run's records name their
    /// requests by their place in it).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Start of the trace window the run replayed, seconds of trace time
    /// (default: the folder's deployment record, else 0).
    #[arg(long)]
    from_s: Option<f64>,
    /// Length of that window, seconds (default: the deployment record's,
    /// else to the end).
    #[arg(long)]
    window_s: Option<f64>,
    /// Tokens per trace hash id.
    #[arg(long, default_value_t = kvasir_bench::trace::MOONCAKE_BLOCK_TOKENS)]
    trace_block_tokens: usize,
    /// The run's mode (its files are `<workload>-<load>-<mode>.*`).
    #[arg(long, default_value = "kvasir")]
    mode: String,
    /// The run's load.
    #[arg(long, default_value_t = 1.0)]
    load: f64,
    #[command(flatten)]
    engine: EngineArgs,
    /// KV blocks per engine; default: the folder's deployment record
    /// (`summary.json`).
    #[arg(long)]
    num_gpu_blocks: Option<usize>,
    /// Most sequences in one engine's batch.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Longest prompt plus completion.
    #[arg(long, default_value_t = 196_608)]
    max_model_len: usize,
    /// Placements, `;`-separated: `own` (the run's), `dealt`
    /// (conversations dealt over the engines in turn), `kvasir` (the
    /// ranking with the indexer's default weights) or
    /// `kvasir:key=value[,key=value]` (other weights, the pool's `scoring`
    /// keys), `at-arrival:PENALTY`,
    /// `central:oldest|quickest:PENALTY[:FREE_TOKENS]` (see the module
    /// docs of `replay`).
    #[arg(
        long,
        default_value = "own;kvasir:queuedPrefill=0.15;kvasir;at-arrival:0.5;central:quickest:0.5:2048",
        value_delimiter = ';'
    )]
    placements: Vec<String>,
    /// Engines at vLLM's `--scheduling-policy priority`, each request's
    /// `priority` as the pool's `enginePriorityBy: prefill` sets it (its
    /// uncached prompt tokens in 256-token steps): shortest prefill first
    /// in the engines' waiting queues.
    #[arg(long)]
    shortest_first: bool,
    /// Print the rows as JSON (`placement`, `mean`, `p50`, `p90`, `p99`
    /// in ms, `hit_rate`; the run's own as `measured`) instead of a table.
    #[arg(long)]
    json: bool,
}

pub(crate) fn replay_cmd(a: &ReplayArgs) -> anyhow::Result<()> {
    let placements = a
        .placements
        .iter()
        .map(|p| placement(p))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let model = a
        .engine
        .model()?
        .context("--profile none: the replay needs a latency profile")?;
    anyhow::ensure!(
        a.workload == "chat" || a.workload == "trace",
        "--workload {:?}: chat or trace",
        a.workload
    );
    let runs = results::read_runs(&a.dir)?;
    let (meta, records) = runs
        .iter()
        .find(|(m, _)| {
            m.workload == a.workload && m.mode == a.mode && (m.load - a.load).abs() < 1e-9
        })
        .with_context(|| {
            format!(
                "{}: no {} run of mode {} at load {}",
                a.dir.display(),
                a.workload,
                a.mode,
                a.load
            )
        })?;
    let (convs, endpoints) = conversations_of(a, &runs, records)?;
    let engines = meta.engines.engines.max(endpoints.len()).max(1);
    let setup = setup_of(a, engines, model)?;
    let mut rows = vec![measured(records)];
    for (name, pl) in a.placements.iter().zip(placements) {
        let out = replay::replay(&convs, &setup, &pl);
        rows.push(Row {
            placement: name.clone(),
            hit_rate: out.hit_rate(),
            ttft: Dist::of(out.ttft_ms),
            per_engine: out.per_engine,
            preemptions: out.preemptions,
        });
    }
    if a.json {
        let v: Vec<serde_json::Value> = rows.iter().map(Row::json).collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!(
        "{} {} at load {}: {} conversations on {engines} engines of {} blocks",
        a.workload,
        a.mode,
        a.load,
        convs.len(),
        setup.engine.num_gpu_blocks
    );
    println!(
        "| placement | TTFT mean | p50 | p90 | p99 | hit rate | turns per engine | preempted |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |");
    for r in &rows {
        r.print();
    }
    Ok(())
}

/// The replayed cluster: `engines` engines as the flags and the folder's
/// deployment record describe them.
fn setup_of(a: &ReplayArgs, engines: usize, model: EngineModel) -> anyhow::Result<Setup> {
    let num_gpu_blocks = match a.num_gpu_blocks {
        Some(n) => n,
        None => deployed_blocks(&a.dir, &a.workload).with_context(|| {
            format!(
                "{}: no deployment record with the {}'s KV blocks; give --num-gpu-blocks",
                a.dir.display(),
                a.workload
            )
        })?,
    };
    anyhow::ensure!(num_gpu_blocks > 0, "--num-gpu-blocks must be at least 1");
    Ok(Setup {
        engines,
        engine: EngineConfig {
            block_size: a.engine.engine_block,
            num_gpu_blocks,
            max_num_seqs: a.max_num_seqs,
            max_num_batched_tokens: model.max_num_batched_tokens,
            max_model_len: a.max_model_len,
            enable_prefix_caching: true,
            profile: model.profile.clone(),
            hash_seed: HashSeed(0),
            policy: if a.shortest_first {
                SchedulingPolicy::Priority
            } else {
                SchedulingPolicy::Fcfs
            },
        },
        model,
        shortest_first: a.shortest_first,
    })
}

/// The run as measured: its answered requests' TTFT and its hit rate.
fn measured(records: &[Record]) -> Row {
    let answered = records
        .iter()
        .filter(|r| r.outcome == Outcome::Ok)
        .map(|r| r.ttft_ms)
        .collect();
    Row {
        placement: "measured".into(),
        ttft: Dist::of(answered),
        hit_rate: stats::summarize(records).cache_hit_rate,
        per_engine: Vec::new(),
        preemptions: 0,
    }
}

/// A `--placements` entry.
fn placement(spec: &str) -> anyhow::Result<Placement> {
    match spec {
        "kvasir" => Ok(Placement::Scored(Box::default())),
        s if s.starts_with("kvasir:") => Ok(Placement::Scored(Box::new(
            super::parse_weights(s).context("--placements")?,
        ))),
        s => Placement::parse(s).map_err(|e| anyhow::anyhow!("--placements: {e}")),
    }
}

/// One placement's figures.
struct Row {
    placement: String,
    ttft: Dist,
    hit_rate: f64,
    per_engine: Vec<usize>,
    preemptions: u64,
}

impl Row {
    fn print(&self) {
        let d = &self.ttft;
        let measured = self.placement == "measured";
        let per: Vec<String> = self.per_engine.iter().map(|n| n.to_string()).collect();
        println!(
            "| {} | {} | {} | {} | {} | {:.1}% | {} | {} |",
            if measured {
                "measured (the run)"
            } else {
                &self.placement
            },
            compare::ms(d.mean),
            compare::ms(d.p50),
            compare::ms(d.p90),
            compare::ms(d.p99),
            self.hit_rate * 100.0,
            per.join(" "),
            if measured {
                String::new()
            } else {
                self.preemptions.to_string()
            },
        );
    }

    /// Non-finite figures (no turn answered) are null.
    fn json(&self) -> serde_json::Value {
        let f = |v: f64| v.is_finite().then_some(v);
        serde_json::json!({
            "placement": self.placement,
            "mean": f(self.ttft.mean),
            "p50": f(self.ttft.p50),
            "p90": f(self.ttft.p90),
            "p99": f(self.ttft.p99),
            "hit_rate": f(self.hit_rate),
        })
    }
}

/// The run's requests as conversations to replay, with its endpoints: a
/// chat's conversations, or a trace run's requests with their prompts
/// from `--trace`.
fn conversations_of(
    a: &ReplayArgs,
    runs: &[(kvasir_bench::RunMeta, Vec<Record>)],
    records: &[Record],
) -> anyhow::Result<(Vec<replay::Conversation>, Vec<String>)> {
    if a.workload == "trace" {
        let path = a
            .trace
            .as_ref()
            .context("--workload trace needs --trace (the trace file the run replayed)")?;
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let all = trace::parse(&text).with_context(|| format!("parsing {}", path.display()))?;
        // A record's id is its request's place in the window the run replayed.
        let record = deployment(&a.dir);
        let field = |k: &str| {
            record
                .as_ref()?
                .pointer(&format!("/workloads/trace/{k}"))?
                .as_f64()
        };
        let from = a.from_s.or_else(|| field("from_s")).unwrap_or(0.0) * 1e3;
        let to = a
            .window_s
            .or_else(|| field("window_s"))
            .map_or(f64::INFINITY, |w| from + w * 1e3);
        let t: Vec<_> = all
            .into_iter()
            .filter(|r| r.timestamp >= from && r.timestamp < to)
            .collect();
        anyhow::ensure!(
            a.trace_block_tokens > 0,
            "--trace-block-tokens must be at least 1"
        );
        return replay::trace_requests(records, &t, a.trace_block_tokens)
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()));
    }
    let same: Vec<&[Record]> = runs
        .iter()
        .filter(|(m, _)| m.workload == "chat" && (m.load - a.load).abs() < 1e-9)
        .map(|(_, r)| r.as_slice())
        .collect();
    let system = floor::system_prompts(records, &same);
    Ok(replay::conversations(records, &system))
}

/// The folder's deployment record (`summary.json`'s `deployment`).
fn deployment(dir: &std::path::Path) -> Option<serde_json::Value> {
    let mut s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).ok()?).ok()?;
    Some(s.get_mut("deployment")?.take())
}

/// A workload's KV blocks per engine from the folder's deployment record.
fn deployed_blocks(dir: &std::path::Path, workload: &str) -> Option<usize> {
    let n = deployment(dir)?
        .pointer(&format!("/workloads/{workload}/num_gpu_blocks"))?
        .as_u64()?;
    usize::try_from(n).ok()
}
