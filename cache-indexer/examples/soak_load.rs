//! Soak load for a running cache-indexer (not a test): fake engines
//! publishing vLLM KV events over ZMQ at a fixed total rate, and picks over
//! gRPC at a fixed rate, each answered pick followed by its `DONE` report
//! as the filter sends one when the response ends.
//!
//! ```text
//! cargo build --release -p kvasir-cache-indexer --example soak_load
//! target/release/examples/soak_load --grpc 127.0.0.1:50051 --token-file T \
//!     --events-per-s 10000 --picks-per-s 2000 --duration-s 600
//! ```
//!
//! It binds `--publishers` PUB sockets first and prints their addresses as
//! one JSON line (`{"publishers": [...]}`), so the caller can start the
//! indexer with `--endpoint pool=main,address=...,events=<socket>`; it then
//! waits until a pick is answered, gives the subscriptions a moment to
//! arrive (PUB drops what nobody subscribed to), and runs. Every
//! `--window-s` it prints one JSON line (`{"window": ...}`: events and picks
//! sent in that window, their rates, pick latency percentiles, errors); at
//! the end one `{"summary": ...}` line with the totals.
//!
//! The events follow vLLM's (map layout, uint64 hashes, block size 16):
//! each engine stores chains of `--chain-events` `BlockStored` events of
//! `--blocks-per-event` blocks, each event's parent the previous one's last
//! block, and once it holds `--capacity-blocks` it removes its oldest chain
//! in one `BlockRemoved` per chain stored: a full cache evicting as it
//! stores, so the index's size is steady and its memory should be too.
//! Rates are open loop: events are sent on a 10 ms clock at whatever the
//! schedule says is due; a pick is started when due unless
//! `--max-in-flight` picks are already waiting, in which case it is
//! counted as `dropped` (the achieved rate then shows the shortfall).

#[path = "../tests/it/testkit/mod.rs"]
mod testkit;

use std::collections::VecDeque;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use kvasir_proto::v1 as pb;
use parking_lot::Mutex;
use rmpv::Value as V;
use serde_json::json;
use testkit::{Rng, BLOCK_SIZE};
use tonic::metadata::MetadataValue;
use zeromq::{Socket, SocketSend, ZmqMessage};

#[derive(Parser)]
struct Args {
    /// The indexer's gRPC address (ip:port).
    #[arg(long)]
    grpc: String,
    /// File holding the indexer's gRPC token (its `--grpc-token-file`).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Pool to pick in.
    #[arg(long, default_value = "main")]
    pool: String,
    /// Model named in the picks.
    #[arg(long, default_value = "Qwen/Qwen3-8B")]
    model: String,
    /// Fake engines, each one PUB socket.
    #[arg(long, default_value_t = 8)]
    publishers: usize,
    /// KV events per second, all engines together (BlockStored and
    /// BlockRemoved each count one).
    #[arg(long, default_value_t = 10_000.0)]
    events_per_s: f64,
    /// Blocks in each BlockStored event.
    #[arg(long, default_value_t = 4)]
    blocks_per_event: usize,
    /// BlockStored events per chain (one prompt's prefix).
    #[arg(long, default_value_t = 8)]
    chain_events: usize,
    /// Blocks an engine holds before it evicts its oldest chain.
    #[arg(long, default_value_t = 25_000)]
    capacity_blocks: usize,
    /// Picks per second.
    #[arg(long, default_value_t = 2_000.0)]
    picks_per_s: f64,
    /// Most picks waiting for an answer at once.
    #[arg(long, default_value_t = 2_000)]
    max_in_flight: u64,
    /// A pick not answered within this many ms counts as an error.
    #[arg(long, default_value_t = 2_000)]
    pick_timeout_ms: u64,
    /// Seconds to run.
    #[arg(long, default_value_t = 600.0)]
    duration_s: f64,
    /// Seconds per reported window.
    #[arg(long, default_value_t = 5.0)]
    window_s: f64,
    /// Longest wait for the indexer's first answered pick, seconds.
    #[arg(long, default_value_t = 60.0)]
    ready_timeout_s: f64,
}

/// What the load has done so far (totals; windows are differences).
#[derive(Default)]
struct Counters {
    events: AtomicU64,
    batches: AtomicU64,
    blocks_stored: AtomicU64,
    picks_sent: AtomicU64,
    picks_ok: AtomicU64,
    picks_err: AtomicU64,
    picks_dropped: AtomicU64,
    reports_err: AtomicU64,
    send_err: AtomicU64,
    in_flight: AtomicU64,
}

struct Shared {
    counters: Counters,
    /// Answered picks' latencies (µs) in the current window.
    window_us: Mutex<Vec<u32>>,
    /// Every answered pick's latency (µs), for the run's percentiles.
    all_us: Mutex<Vec<u32>>,
    errors: Mutex<std::collections::BTreeMap<String, u64>>,
}

/// Adds the indexer's token to every call.
#[derive(Clone)]
struct Auth(Option<MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for Auth {
    fn call(&mut self, mut r: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            r.metadata_mut().insert("authorization", v.clone());
        }
        Ok(r)
    }
}

type Client = pb::indexer_client::IndexerClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Auth>,
>;

/// One fake engine's cache: the chains it holds, oldest first.
struct Engine {
    rng: Rng,
    chains: VecDeque<Vec<u64>>,
    current: Vec<u64>,
    held: usize,
    seq: u64,
}

impl Engine {
    /// The next `n` events of this engine's life as one batch payload.
    fn batch(&mut self, n: usize, a: &Args) -> (Vec<u8>, u64) {
        let mut events = Vec::with_capacity(n);
        let mut stored = 0u64;
        while events.len() < n {
            if self.current.len() >= a.chain_events * a.blocks_per_event {
                let done = std::mem::take(&mut self.current);
                self.held += done.len();
                self.chains.push_back(done);
                if self.held > a.capacity_blocks {
                    if let Some(old) = self.chains.pop_front() {
                        self.held -= old.len();
                        events.push(removed(&old));
                        continue;
                    }
                }
            }
            let parent = self.current.last().copied();
            let hashes: Vec<u64> = (0..a.blocks_per_event).map(|_| self.rng.next()).collect();
            let tokens: Vec<u32> = (0..a.blocks_per_event * BLOCK_SIZE as usize)
                .map(|_| (self.rng.next() % 151_936) as u32)
                .collect();
            events.push(stored_event(&hashes, parent, &tokens));
            stored += hashes.len() as u64;
            self.current.extend(hashes);
        }
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let b = V::Array(vec![V::F64(ts), V::Array(events), V::from(0)]);
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &b).expect("encode to Vec");
        (out, stored)
    }
}

fn stored_event(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> V {
    V::Map(vec![
        (V::from("type"), V::from("BlockStored")),
        (
            V::from("block_hashes"),
            V::Array(hashes.iter().map(|h| V::from(*h)).collect()),
        ),
        (V::from("parent_block_hash"), parent.map_or(V::Nil, V::from)),
        (
            V::from("token_ids"),
            V::Array(tokens.iter().map(|t| V::from(*t)).collect()),
        ),
        (V::from("block_size"), V::from(BLOCK_SIZE)),
        (V::from("lora_id"), V::Nil),
        (V::from("medium"), V::from("GPU")),
        (V::from("lora_name"), V::Nil),
    ])
}

fn removed(hashes: &[u64]) -> V {
    V::Map(vec![
        (V::from("type"), V::from("BlockRemoved")),
        (
            V::from("block_hashes"),
            V::Array(hashes.iter().map(|h| V::from(*h)).collect()),
        ),
        (V::from("medium"), V::from("GPU")),
    ])
}

/// Publishes one engine's events at `rate` per second until `until`.
async fn publish(
    mut sock: zeromq::PubSocket,
    mut engine: Engine,
    rate: f64,
    a: Arc<Args>,
    shared: Arc<Shared>,
    until: Instant,
) {
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut sent = 0u64;
    while Instant::now() < until {
        tick.tick().await;
        let due = (rate * start.elapsed().as_secs_f64()) as u64;
        // At most a second's worth at once: a stalled sender catches up
        // over time instead of in one giant batch.
        let n = due.saturating_sub(sent).min(rate.ceil() as u64) as usize;
        if n == 0 {
            continue;
        }
        let (payload, stored) = engine.batch(n, &a);
        let frames = vec![
            Bytes::new(),
            Bytes::copy_from_slice(&engine.seq.to_be_bytes()),
            Bytes::from(payload),
        ];
        engine.seq += 1;
        let msg = ZmqMessage::try_from(frames).expect("non-empty frame list");
        if sock.send(msg).await.is_err() {
            shared.counters.send_err.fetch_add(1, Relaxed);
        }
        sent += n as u64;
        let c = &shared.counters;
        c.events.fetch_add(n as u64, Relaxed);
        c.batches.fetch_add(1, Relaxed);
        c.blocks_stored.fetch_add(stored, Relaxed);
    }
}

const SYSTEM: &str = "You are a careful assistant for a logistics company. Answer \
in short paragraphs, cite the order number when one is given, and never invent \
tracking codes. When a question is ambiguous, ask one clarifying question first.";

const WORDS: &str = "order parcel delivery late address refund invoice customs pallet \
warehouse route driver signature damaged return label weight express tuesday morning city \
north harbour fragile glass books priority";

fn pick_request(a: &Args, i: u64, rng: &mut Rng) -> pb::PickRequest {
    let vocab: Vec<&str> = WORDS.split_whitespace().collect();
    let words: Vec<&str> = (0..40).map(|_| vocab[rng.below(vocab.len())]).collect();
    pb::PickRequest {
        pool: a.pool.clone(),
        model: a.model.clone(),
        request_id: format!("soak-{i}"),
        prompt: Some(pb::pick_request::Prompt::Chat(pb::Chat {
            messages: vec![
                pb::ChatMessage {
                    role: "system".into(),
                    content: SYSTEM.into(),
                },
                pb::ChatMessage {
                    role: "user".into(),
                    content: format!("question {i} about order {}: {}", i % 997, words.join(" ")),
                },
            ],
        })),
        max_endpoints: 3,
        ..Default::default()
    }
}

fn status_kind(s: &tonic::Status) -> String {
    format!("{:?}", s.code()).to_lowercase()
}

/// One pick and, if answered, its DONE report.
async fn pick_once(
    mut client: Client,
    req: pb::PickRequest,
    timeout: Duration,
    shared: Arc<Shared>,
) {
    let c = &shared.counters;
    let id = req.request_id.clone();
    let pool = req.pool.clone();
    let t = Instant::now();
    let r = tokio::time::timeout(timeout, client.pick(req)).await;
    let us = t.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
    c.in_flight.fetch_sub(1, Relaxed);
    let resp = match r {
        Ok(Ok(resp)) => resp.into_inner(),
        Ok(Err(s)) => {
            c.picks_err.fetch_add(1, Relaxed);
            *shared.errors.lock().entry(status_kind(&s)).or_default() += 1;
            return;
        }
        Err(_) => {
            c.picks_err.fetch_add(1, Relaxed);
            *shared.errors.lock().entry("timeout".into()).or_default() += 1;
            return;
        }
    };
    c.picks_ok.fetch_add(1, Relaxed);
    shared.window_us.lock().push(us);
    shared.all_us.lock().push(us);
    let report = pb::ReportRequest {
        pool,
        request_id: id,
        endpoint: resp
            .endpoints
            .first()
            .map(|e| e.address.clone())
            .unwrap_or_default(),
        prompt_tokens: resp.prompt_tokens,
        completion_tokens: 64,
        outcome: pb::Outcome::Success as i32,
        phase: pb::ReportPhase::Done as i32,
        ..Default::default()
    };
    if tokio::time::timeout(timeout, client.report(report))
        .await
        .map_or(true, |r| r.is_err())
    {
        c.reports_err.fetch_add(1, Relaxed);
    }
}

fn pct(sorted: &[u32], p: f64) -> u32 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn latency(mut us: Vec<u32>) -> serde_json::Value {
    us.sort_unstable();
    json!({
        "p50_us": pct(&us, 0.5), "p90_us": pct(&us, 0.9), "p99_us": pct(&us, 0.99),
        "max_us": us.last().copied().unwrap_or(0), "n": us.len(),
    })
}

fn line(v: serde_json::Value) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

async fn connect(a: &Args) -> anyhow::Result<Client> {
    let token = match &a.token_file {
        Some(p) => Some(std::fs::read_to_string(p)?.trim().to_string()),
        None => None,
    };
    let auth: Option<MetadataValue<tonic::metadata::Ascii>> = match token {
        Some(t) => Some(format!("Bearer {t}").parse()?),
        None => None,
    };
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", a.grpc))?
        .tcp_nodelay(true)
        .connect_lazy();
    Ok(pb::indexer_client::IndexerClient::with_interceptor(
        channel,
        Auth(auth),
    ))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Arc::new(Args::parse());
    anyhow::ensure!(a.publishers > 0, "--publishers must be at least 1");
    anyhow::ensure!(
        a.blocks_per_event > 0 && a.chain_events > 0,
        "--blocks-per-event and --chain-events must be at least 1"
    );
    let mut socks = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..a.publishers {
        let mut s = zeromq::PubSocket::new();
        addrs.push(s.bind("tcp://127.0.0.1:0").await?.to_string());
        socks.push(s);
    }
    line(json!({ "publishers": addrs }));

    let client = connect(&a).await?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let ready_by = Instant::now() + Duration::from_secs_f64(a.ready_timeout_s);
    loop {
        let mut c = client.clone();
        match c.pick(pick_request(&a, 0, &mut rng)).await {
            Ok(r) if !r.get_ref().endpoints.is_empty() => {
                // Ended like every other pick, so nothing stays in flight.
                let done = pb::ReportRequest {
                    pool: a.pool.clone(),
                    request_id: "soak-0".into(),
                    endpoint: r.get_ref().endpoints[0].address.clone(),
                    outcome: pb::Outcome::Success as i32,
                    phase: pb::ReportPhase::Done as i32,
                    ..Default::default()
                };
                c.report(done).await?;
                break;
            }
            _ if Instant::now() > ready_by => anyhow::bail!("the indexer never answered a pick"),
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    // The indexer subscribes once it is up; PUB drops what is sent before.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let shared = Arc::new(Shared {
        counters: Counters::default(),
        window_us: Mutex::new(Vec::new()),
        all_us: Mutex::new(Vec::new()),
        errors: Mutex::new(Default::default()),
    });
    line(json!({ "started": true }));
    let start = Instant::now();
    let until = start + Duration::from_secs_f64(a.duration_s);
    let per_pub = a.events_per_s / a.publishers as f64;
    let mut tasks = Vec::new();
    for (i, s) in socks.into_iter().enumerate() {
        let engine = Engine {
            rng: Rng(0x1234_5678_9abc_def1 ^ ((i as u64 + 1) << 32)),
            chains: VecDeque::new(),
            current: Vec::new(),
            held: 0,
            seq: 0,
        };
        tasks.push(tokio::spawn(publish(
            s,
            engine,
            per_pub,
            Arc::clone(&a),
            Arc::clone(&shared),
            until,
        )));
    }
    let picker = {
        let (a, shared) = (Arc::clone(&a), Arc::clone(&shared));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(5));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            let mut started = 0u64;
            let mut rng = Rng(0x5eed_0000_1111_2222);
            let timeout = Duration::from_millis(a.pick_timeout_ms);
            while Instant::now() < until {
                tick.tick().await;
                let due = (a.picks_per_s * start.elapsed().as_secs_f64()) as u64;
                while started < due {
                    started += 1;
                    let c = &shared.counters;
                    c.picks_sent.fetch_add(1, Relaxed);
                    if c.in_flight.load(Relaxed) >= a.max_in_flight {
                        c.picks_dropped.fetch_add(1, Relaxed);
                        continue;
                    }
                    c.in_flight.fetch_add(1, Relaxed);
                    let req = pick_request(&a, started, &mut rng);
                    tokio::spawn(pick_once(client.clone(), req, timeout, Arc::clone(&shared)));
                }
            }
        })
    };

    let snap = |c: &Counters| {
        [
            c.events.load(Relaxed),
            c.picks_ok.load(Relaxed),
            c.picks_err.load(Relaxed),
            c.picks_dropped.load(Relaxed),
            c.reports_err.load(Relaxed),
            c.blocks_stored.load(Relaxed),
        ]
    };
    let mut last = snap(&shared.counters);
    let mut last_t = start;
    let window = Duration::from_secs_f64(a.window_s.max(0.5));
    let mut next = start + window;
    loop {
        let end = Instant::now() >= until;
        tokio::time::sleep_until(next.min(until).into()).await;
        let now = Instant::now();
        let cur = snap(&shared.counters);
        let dt = (now - last_t).as_secs_f64().max(1e-9);
        let d: Vec<u64> = cur.iter().zip(&last).map(|(x, y)| x - y).collect();
        let us = std::mem::take(&mut *shared.window_us.lock());
        line(json!({"window": {
            "t_s": ((now - start).as_secs_f64() * 10.0).round() / 10.0,
            "events": d[0], "events_per_s": (d[0] as f64 / dt).round(),
            "blocks_stored": d[5],
            "picks_ok": d[1], "picks_per_s": (d[1] as f64 / dt).round(),
            "picks_err": d[2], "picks_dropped": d[3], "reports_err": d[4],
            "in_flight": shared.counters.in_flight.load(Relaxed),
            "pick": latency(us),
        }}));
        last = cur;
        last_t = now;
        next += window;
        if end || now >= until {
            break;
        }
    }
    for t in tasks {
        t.await?;
    }
    picker.await?;
    // Let the last picks come back (bounded by their timeout).
    let drain = Instant::now() + Duration::from_millis(a.pick_timeout_ms + 500);
    while shared.counters.in_flight.load(Relaxed) > 0 && Instant::now() < drain {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let c = &shared.counters;
    let all = std::mem::take(&mut *shared.all_us.lock());
    line(json!({"summary": {
        "duration_s": (elapsed * 10.0).round() / 10.0,
        "publishers": a.publishers,
        "target_events_per_s": a.events_per_s,
        "target_picks_per_s": a.picks_per_s,
        "blocks_per_event": a.blocks_per_event,
        "capacity_blocks": a.capacity_blocks,
        "events": c.events.load(Relaxed),
        "batches": c.batches.load(Relaxed),
        "blocks_stored": c.blocks_stored.load(Relaxed),
        "events_per_s": (c.events.load(Relaxed) as f64 / a.duration_s).round(),
        "picks_sent": c.picks_sent.load(Relaxed),
        "picks_ok": c.picks_ok.load(Relaxed),
        "picks_err": c.picks_err.load(Relaxed),
        "picks_dropped": c.picks_dropped.load(Relaxed),
        "reports_err": c.reports_err.load(Relaxed),
        "send_err": c.send_err.load(Relaxed),
        "picks_per_s": (c.picks_ok.load(Relaxed) as f64 / a.duration_s).round(),
        "errors": *shared.errors.lock(),
        "pick": latency(all),
    }}));
    Ok(())
}
