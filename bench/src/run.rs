//! Running a workload open-loop against a target, and reading the engines'
//! counters around it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;
use tokio::time::{sleep_until, timeout_at};

use crate::chat::{tenant_name, ChatPlan};
use crate::client::{host_of, send, send_as, Prompt, Routes, Target};
use crate::record::{Outcome, Record};
use crate::tenants::TenantsPlan;
use crate::trace::{prompt_tokens, TraceRequest};

/// Counters summed over the engines (simulated seconds and tokens).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineCounters {
    /// `vllm_sim:prefill_seconds_total`.
    pub prefill_s: f64,
    /// `vllm_sim:virtual_seconds_total` (busy time).
    pub busy_s: f64,
    /// `vllm:prefix_cache_queries_total`.
    pub cache_queries: f64,
    /// `vllm:prefix_cache_hits_total`.
    pub cache_hits: f64,
    /// `vllm:num_preemptions_total`.
    pub preemptions: f64,
}

/// Tries of one engine's `/metrics` before a scrape fails, and the pause
/// between them: an engine restarted mid-run (the deployed benchmark does
/// that) is down for a moment, which must not end the run.
const SCRAPE_TRIES: u32 = 25;
const SCRAPE_RETRY: Duration = Duration::from_millis(200);

async fn metrics_text(client: &reqwest::Client, url: &str) -> anyhow::Result<String> {
    let mut tries = 0;
    loop {
        let got = async {
            client
                .get(url)
                .timeout(Duration::from_secs(5))
                .send()
                .await?
                .error_for_status()?
                .text()
                .await
        }
        .await;
        match got {
            Ok(t) => return Ok(t),
            Err(e) if tries + 1 >= SCRAPE_TRIES => {
                return Err(e).with_context(|| format!("scraping {url}"))
            }
            Err(_) => tries += 1,
        }
        tokio::time::sleep(SCRAPE_RETRY).await;
    }
}

/// Reads and sums the counters of every engine's `/metrics`.
pub async fn scrape(client: &reqwest::Client, urls: &[String]) -> anyhow::Result<EngineCounters> {
    let mut c = EngineCounters::default();
    for u in urls {
        let text = metrics_text(client, u).await?;
        let sum =
            |name| kvasir_promtext::sum(&text, name).with_context(|| format!("{name} in {u}"));
        c.prefill_s += sum("vllm_sim:prefill_seconds_total")?;
        c.busy_s += sum("vllm_sim:virtual_seconds_total")?;
        c.cache_queries += sum("vllm:prefix_cache_queries_total")?;
        c.cache_hits += sum("vllm:prefix_cache_hits_total")?;
        c.preemptions += sum("vllm:num_preemptions_total")?;
    }
    Ok(c)
}

/// Engine-side facts of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineUse {
    /// Engines scraped.
    pub engines: usize,
    /// Mean prefill utilisation per engine over the second half of the
    /// arrival window.
    #[serde(with = "crate::stats::nonfinite")]
    pub prefill_utilisation: f64,
    /// Mean busy share per engine over the same window.
    #[serde(with = "crate::stats::nonfinite")]
    pub busy_utilisation: f64,
    /// Recompute preemptions during the whole run.
    pub preemptions: f64,
}

fn engine_use(a: EngineCounters, b: EngineCounters, engines: usize, sim_s: f64) -> EngineUse {
    let n = engines.max(1) as f64;
    EngineUse {
        engines,
        prefill_utilisation: (b.prefill_s - a.prefill_s) / n / sim_s,
        busy_utilisation: (b.busy_s - a.busy_s) / n / sim_s,
        preemptions: 0.0,
    }
}

/// Scrapes the engines at `at` (in the background): the start of the
/// measured half of the arrival window.
fn scrape_at(
    http: &reqwest::Client,
    urls: &[String],
    at: Instant,
) -> tokio::task::JoinHandle<anyhow::Result<(EngineCounters, Instant)>> {
    let (http, urls) = (http.clone(), urls.to_vec());
    tokio::spawn(async move {
        sleep_until(at.into()).await;
        let c = scrape(&http, &urls).await?;
        Ok((c, Instant::now()))
    })
}

/// Utilisation over `[from, to]` (the second half of the arrival window:
/// the first half includes the ramp-up while queues and conversations
/// build).
fn window_use(
    from: (EngineCounters, Instant),
    to: (EngineCounters, Instant),
    engines: usize,
    scale: f64,
) -> EngineUse {
    let sim_s = (to.1.saturating_duration_since(from.1)).as_secs_f64() / scale;
    engine_use(from.0, to.0, engines, sim_s.max(1e-9))
}

/// Run-wide settings.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// What to send (model, time scale).
    pub target: Target,
    /// Where each trace request or conversation goes.
    pub routes: Routes,
    /// Engines' `/metrics` URLs (for utilisation).
    pub engine_metrics: Vec<String>,
    /// Give up on requests this long (simulated seconds) after the last
    /// arrival.
    pub drain_s: f64,
    /// Show a progress bar.
    pub progress: bool,
}

/// What a run produced.
#[derive(Debug)]
pub struct RunResult {
    /// One record per request sent.
    pub records: Vec<Record>,
    /// Engine utilisation.
    pub engines: EngineUse,
    /// Wall seconds the run took.
    pub wall_s: f64,
    /// When the run's clock started (simulated second 0), Unix ms: lets
    /// the orchestrator place what it did meanwhile (an engine restart) on
    /// the records' `sent_s` axis.
    pub start_unix_ms: u64,
    /// Requests sent per base URL (units go to proxies or engines).
    pub sent: BTreeMap<String, usize>,
}

/// The target for `unit` under `routes`, whether it bypasses the proxies,
/// and the count of requests sent there bumped by `requests`.
fn route(
    opts: &RunOptions,
    unit: usize,
    requests: usize,
    sent: &mut BTreeMap<String, usize>,
) -> (Target, bool) {
    let (url, direct) = opts.routes.pick(unit);
    *sent.entry(url.to_string()).or_default() += requests;
    let mut t = opts.target.clone();
    t.url = url.to_string();
    (t, direct)
}

/// A direct request's record names the engine it was sent to (no proxy
/// added the served-endpoint header).
fn served_directly(mut rec: Record, target: &Target) -> Record {
    if rec.endpoint.is_empty() {
        rec.endpoint = host_of(&target.url).to_string();
    }
    rec
}

fn unix_ms(at: Instant) -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let ahead = at.saturating_duration_since(Instant::now());
    (now + ahead).as_millis() as u64
}

fn bar(total: usize, show: bool) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(total as u64);
    b.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}")
            .expect("static template")
            .progress_chars("=> "),
    );
    b
}

fn client() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(1024)
        .build()?)
}

struct Clock {
    t0: Instant,
    scale: f64,
}

impl Clock {
    fn wall(&self, sim_s: f64) -> Instant {
        self.t0 + Duration::from_secs_f64((sim_s * self.scale).max(0.0))
    }
    fn sim_now(&self) -> f64 {
        self.t0.elapsed().as_secs_f64() / self.scale
    }
}

/// What an open-loop run began with, for [`finish`].
struct Began {
    /// The engines' counters before the first request.
    before: EngineCounters,
    /// The scrape at the middle of the arrival window.
    half: tokio::task::JoinHandle<anyhow::Result<(EngineCounters, Instant)>>,
    wall0: Instant,
    start_unix_ms: u64,
    scale: f64,
}

/// The end of an open-loop run (one task per request): the engines
/// scraped once every request was sent and once every one ended, the
/// records in request order, and the engines' use over the measured half.
async fn finish(
    http: &reqwest::Client,
    opts: &RunOptions,
    began: Began,
    tasks: Vec<tokio::task::JoinHandle<Record>>,
    pb: ProgressBar,
    via: BTreeMap<String, usize>,
) -> anyhow::Result<RunResult> {
    let mid = (scrape(http, &opts.engine_metrics).await?, Instant::now());
    let half = began.half.await??;
    let mut records = Vec::with_capacity(tasks.len());
    for t in tasks {
        records.push(t.await?);
    }
    let after = scrape(http, &opts.engine_metrics).await?;
    pb.finish_and_clear();
    let mut engines = window_use(half, mid, opts.engine_metrics.len(), began.scale);
    engines.preemptions = after.preemptions - began.before.preemptions;
    Ok(RunResult {
        records,
        engines,
        wall_s: began.wall0.elapsed().as_secs_f64(),
        start_unix_ms: began.start_unix_ms,
        sent: via,
    })
}

/// Replays a trace: request i is sent at its timestamp / `speed`
/// (simulated), whatever happened to earlier ones.
pub async fn run_trace(
    trace: Arc<Vec<TraceRequest>>,
    speed: f64,
    block_tokens: usize,
    opts: &RunOptions,
) -> anyhow::Result<RunResult> {
    anyhow::ensure!(speed > 0.0 && speed.is_finite(), "speed must be > 0");
    let http = client()?;
    let scale = opts.target.time_scale.max(1e-9);
    let before = scrape(&http, &opts.engine_metrics).await?;
    let start_ms = trace.first().map_or(0.0, |r| r.timestamp);
    let last_s = trace
        .last()
        .map_or(0.0, |r| (r.timestamp - start_ms) / 1e3 / speed);
    let wall0 = Instant::now();
    let clock = Arc::new(Clock {
        t0: wall0 + Duration::from_millis(50),
        scale,
    });
    let deadline = clock.wall(last_s + opts.drain_s);
    let half = scrape_at(&http, &opts.engine_metrics, clock.wall(last_s / 2.0));
    let start_unix_ms = unix_ms(clock.t0);
    let pb = bar(trace.len(), opts.progress);
    let mut tasks = Vec::with_capacity(trace.len());
    let mut via = BTreeMap::new();
    for i in 0..trace.len() {
        let at = (trace[i].timestamp - start_ms) / 1e3 / speed;
        sleep_until(clock.wall(at).into()).await;
        let (target, direct) = route(opts, i, 1, &mut via);
        let (http, trace, pb, clock) = (http.clone(), trace.clone(), pb.clone(), clock.clone());
        tasks.push(tokio::spawn(async move {
            let r = &trace[i];
            let sent_s = clock.sim_now();
            let prompt = Prompt::Tokens(prompt_tokens(r, block_tokens, i as u64));
            let out = r.output_length.min(u32::MAX as usize) as u32;
            let rec = Record::unanswered(i, "trace".into(), None, 0, sent_s);
            let sent = send(&http, &target, rec.clone(), &prompt, out);
            let rec = match timeout_at(deadline.into(), sent).await {
                Ok((rec, _)) if direct => served_directly(rec, &target),
                Ok((rec, _)) => rec,
                Err(_) => rec.timed_out(),
            };
            pb.inc(1);
            rec
        }));
    }
    let began = Began {
        before,
        half,
        wall0,
        start_unix_ms,
        scale,
    };
    finish(&http, opts, began, tasks, pb, via).await
}

/// Runs a multi-tenant plan ([`crate::tenants`]): request i is sent at its
/// arrival whatever happened to earlier ones, requests alternating over the
/// proxies. A record's `turn` is 1 for a burst's extra request, else 0.
pub async fn run_tenants(plan: Arc<TenantsPlan>, opts: &RunOptions) -> anyhow::Result<RunResult> {
    let http = client()?;
    let scale = opts.target.time_scale.max(1e-9);
    let before = scrape(&http, &opts.engine_metrics).await?;
    let last_s = plan.requests.last().map_or(0.0, |r| r.arrival_s);
    let wall0 = Instant::now();
    let clock = Arc::new(Clock {
        t0: wall0 + Duration::from_millis(50),
        scale,
    });
    let deadline = clock.wall(last_s + opts.drain_s);
    let half = scrape_at(&http, &opts.engine_metrics, clock.wall(last_s / 2.0));
    let start_unix_ms = unix_ms(clock.t0);
    let pb = bar(plan.requests.len(), opts.progress);
    let mut tasks = Vec::with_capacity(plan.requests.len());
    let mut via = BTreeMap::new();
    for i in 0..plan.requests.len() {
        sleep_until(clock.wall(plan.requests[i].arrival_s).into()).await;
        let (target, direct) = route(opts, i, 1, &mut via);
        let (http, plan, pb, clock) = (http.clone(), plan.clone(), pb.clone(), clock.clone());
        tasks.push(tokio::spawn(async move {
            let r = &plan.requests[i];
            let sent_s = clock.sim_now();
            let with_max = plan.max_tokens.get(r.tenant).copied().unwrap_or(true);
            // Without max_tokens, /v1/completions answers 16 tokens: such
            // a tenant asks the chat API.
            let prompt = if with_max {
                Prompt::Tokens(plan.prompt(r))
            } else {
                Prompt::Chat(plan.chat(r))
            };
            let rec = Record::unanswered(i, plan.tenant(r), None, usize::from(r.burst), sent_s);
            let sent = send_as(
                &http,
                &target,
                rec.clone(),
                &prompt,
                r.output_tokens,
                with_max,
            );
            let rec = match timeout_at(deadline.into(), sent).await {
                Ok((rec, _)) if direct => served_directly(rec, &target),
                Ok((rec, _)) => rec,
                Err(_) => rec.timed_out(),
            };
            pb.inc(1);
            rec
        }));
    }
    let began = Began {
        before,
        half,
        wall0,
        start_unix_ms,
        scale,
    };
    finish(&http, opts, began, tasks, pb, via).await
}

/// Runs a chat plan: each conversation starts at its arrival and sends its
/// turns one after another, each after the previous answer plus the think
/// time, with the whole history so far (the engine's own answers included).
/// No turn starts after the last conversation's arrival: the run ends with
/// its arrival window (users still mid-conversation leave), so the load
/// stays what the arrival rate says instead of trailing off for minutes.
pub async fn run_chat(plan: Arc<ChatPlan>, opts: &RunOptions) -> anyhow::Result<RunResult> {
    let http = client()?;
    let scale = opts.target.time_scale.max(1e-9);
    let before = scrape(&http, &opts.engine_metrics).await?;
    let wall0 = Instant::now();
    let clock = Arc::new(Clock {
        t0: wall0 + Duration::from_millis(50),
        scale,
    });
    let last_arrival = plan.conversations.last().map_or(0.0, |c| c.arrival_s);
    let deadline = clock.wall(last_arrival + opts.drain_s);
    let arrivals_end = clock.wall(last_arrival);
    let half = scrape_at(&http, &opts.engine_metrics, clock.wall(last_arrival / 2.0));
    let start_unix_ms = unix_ms(clock.t0);
    let pb = bar(plan.requests(), opts.progress);
    let records = Arc::new(Mutex::new(Vec::with_capacity(plan.requests())));
    // Counted as planned (turns a conversation never reached included).
    let mut via = BTreeMap::new();
    // Request ids: conversation-major, in plan order.
    let mut first_id = Vec::with_capacity(plan.conversations.len());
    let mut n = 0;
    for c in &plan.conversations {
        first_id.push(n);
        n += c.turns.len();
    }
    let mut tasks = Vec::new();
    for (ci, c) in plan.conversations.iter().enumerate() {
        // A conversation stays with one proxy (a client's connection).
        let (target, direct) = route(opts, ci, c.turns.len(), &mut via);
        let (http, plan, pb, clock, records) = (
            http.clone(),
            plan.clone(),
            pb.clone(),
            clock.clone(),
            records.clone(),
        );
        let start = clock.wall(c.arrival_s);
        let id0 = first_id[ci];
        tasks.push(tokio::spawn(async move {
            sleep_until(start.into()).await;
            let conv = &plan.conversations[ci];
            let tenant = tenant_name(conv.tenant);
            let mut history: Vec<(&'static str, String)> =
                vec![("system", plan.system_prompts[conv.tenant].clone())];
            for (k, turn) in conv.turns.iter().enumerate() {
                history.push(("user", turn.user.clone()));
                let sent_s = clock.sim_now();
                let prompt = Prompt::Chat(history.clone());
                let rec = Record::unanswered(id0 + k, tenant.clone(), Some(ci), k, sent_s);
                let sent = send(&http, &target, rec.clone(), &prompt, turn.output_tokens);
                let (rec, text) = match timeout_at(deadline.into(), sent).await {
                    Ok((rec, text)) if direct => (served_directly(rec, &target), text),
                    Ok(answered) => answered,
                    Err(_) => (rec.timed_out(), String::new()),
                };
                let ok = rec.outcome == Outcome::Ok;
                records.lock().await.push(rec);
                pb.inc(1);
                if !ok {
                    // The user gives up: the rest of the conversation is not sent.
                    pb.inc((conv.turns.len() - k - 1) as u64);
                    break;
                }
                history.push(("assistant", text));
                let next = Instant::now() + Duration::from_secs_f64(turn.think_s * clock.scale);
                if next > arrivals_end {
                    pb.inc((conv.turns.len() - k - 1) as u64);
                    break;
                }
                sleep_until(next.into()).await;
            }
        }));
    }
    sleep_until(arrivals_end.into()).await;
    let mid = (scrape(&http, &opts.engine_metrics).await?, Instant::now());
    let half = half.await??;
    for t in tasks {
        t.await?;
    }
    let after = scrape(&http, &opts.engine_metrics).await?;
    pb.finish_and_clear();
    let mut engines = window_use(half, mid, opts.engine_metrics.len(), scale);
    engines.preemptions = after.preemptions - before.preemptions;
    let mut records = Arc::try_unwrap(records)
        .map_err(|_| anyhow::anyhow!("records still shared"))?
        .into_inner();
    records.sort_by_key(|r| r.id);
    Ok(RunResult {
        records,
        engines,
        wall_s: wall0.elapsed().as_secs_f64(),
        start_unix_ms,
        sent: via,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utilisation_is_per_engine_and_per_simulated_second() {
        let a = EngineCounters::default();
        let b = EngineCounters {
            prefill_s: 8.0,
            busy_s: 16.0,
            ..a
        };
        let u = engine_use(a, b, 8, 2.0);
        assert_eq!(u.prefill_utilisation, 0.5);
        assert_eq!(u.busy_utilisation, 1.0);
    }
}
