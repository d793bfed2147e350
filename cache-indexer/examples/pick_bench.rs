//! Pick latency benchmark (not a test): prints one JSON document.
//!
//! ```text
//! cargo run --release -p kvasir-cache-indexer --example pick_bench [-- --quick]
//! ```
//!
//! For 8 and 64 endpoints, each holding 25,000 indexed blocks (filled
//! directly through `PoolIndex::apply` with synthetic `BlockStored` events:
//! chains of 4,096 random tokens, plus the benchmark chats' shared system
//! prompt on every endpoint and each chat's history on its home endpoint),
//! it measures
//! `Pick` for
//!
//! * a ~4k-token chat (system prompt + a few turns), and
//! * a ~32k-token chat whose earlier turns were seen (the tokenizer's
//!   segment cache holds the history; each pick adds a new final message),
//!
//! both in process (`IndexerService::pick`, the function the gRPC handler
//! calls) and through gRPC on loopback (tonic client -> tonic server, one
//! connection), reporting p50/p99/mean in microseconds. Cold tokenization
//! (a fresh tokenizer with no segment cache) and warm template+encode
//! times are reported separately. The worst case: picks of 1 MB chat
//! messages built to be expensive to tokenize (one repeated character,
//! whitespace, punctuation, base64, decomposed accents that NFC must
//! compose, and plain words for scale), each new
//! to the segment cache, with the pool's default `tokenizeBudget` and with
//! none. Needs the Qwen3 tokenizer (`$KVASIR_TOKENIZER_DIR` or
//! `.tools/tokenizers/qwen3`).

#[path = "../tests/it/testkit/mod.rs"]
mod testkit;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvasir_cache_indexer::events::EngineHash;
use kvasir_cache_indexer::load::{EngineLoad, LoadConfig, LoadTracker};
use kvasir_cache_indexer::scoring::Weights;
use kvasir_cache_indexer::tokenize::{RequestTokenizer, TokenizeBudget};
use kvasir_cache_indexer::types::{EndpointSpec, IndexSource};
use kvasir_cache_indexer::{stored_batch, IndexerService, Pool, Pools};
use kvasir_proto::v1 as pb;
use kvasir_tokenizer::{ChatMessage, ChatTokenizer};
use serde_json::json;
use testkit::Rng;

const BLOCK: u32 = 16;
const BLOCKS_PER_ENDPOINT: usize = 25_000;

fn tokenizer_dir() -> PathBuf {
    std::env::var_os("KVASIR_TOKENIZER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/tokenizers/qwen3")
        })
}

/// Text with a large, varied vocabulary (common words mixed with made-up
/// ones from syllables, numbers, punctuation), so the BPE is not flattered
/// by a handful of repeated words.
fn prose(rng: &mut Rng, words: usize) -> String {
    const W: [&str; 32] = [
        "the", "router", "sends", "each", "request", "to", "an", "engine", "that", "already",
        "holds", "its", "prefix", "in", "cache", "while", "load", "stays", "balanced", "across",
        "replicas", "and", "tokens", "flow", "through", "blocks", "of", "sixteen", "with", "low",
        "latency", "today",
    ];
    const SYL: [&str; 40] = [
        "ka", "lo", "mi", "zen", "tra", "vok", "el", "ur", "quin", "dra", "sol", "fe", "rix", "no",
        "pa", "gul", "ther", "an", "ibs", "cor", "ly", "mun", "esh", "tav", "ro", "zi", "pol",
        "wen", "ask", "ut", "bri", "hal", "ot", "sen", "ve", "gram", "ic", "dor", "fy", "ex",
    ];
    let mut s = String::with_capacity(words * 8);
    for i in 0..words {
        if i > 0 {
            s.push_str(match rng.next() % 23 {
                0 => ". ",
                1 => ", ",
                2 => "\n",
                _ => " ",
            });
        }
        match rng.next() % 4 {
            0 | 1 => s.push_str(W[(rng.next() % W.len() as u64) as usize]),
            2 => {
                for _ in 0..1 + rng.next() % 3 {
                    s.push_str(SYL[(rng.next() % SYL.len() as u64) as usize]);
                }
            }
            _ => {
                let w = W[(rng.next() % W.len() as u64) as usize];
                s.push_str(&w[..1].to_uppercase());
                s.push_str(&w[1..]);
                if rng.next().is_multiple_of(5) {
                    s.push_str(&format!("-{}", rng.next() % 10_000));
                }
            }
        }
    }
    s
}

/// A chat of about `target` tokens: system prompt, then user/assistant turns.
fn chat(tok: &ChatTokenizer, rng: &mut Rng, system: &str, target: usize) -> Vec<ChatMessage> {
    let mut m = vec![ChatMessage::new("system", system)];
    loop {
        m.push(ChatMessage::new("user", prose(rng, 250)));
        let n = tok.encode_chat(&m, true).map(|v| v.len()).unwrap_or(0);
        if n >= target {
            return m;
        }
        m.push(ChatMessage::new("assistant", prose(rng, 400)));
    }
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn stats(mut us: Vec<f64>) -> serde_json::Value {
    us.sort_by(f64::total_cmp);
    let mean = us.iter().sum::<f64>() / us.len().max(1) as f64;
    json!({
        "n": us.len(),
        "p50_us": (pct(&us, 0.5) * 10.0).round() / 10.0,
        "p99_us": (pct(&us, 0.99) * 10.0).round() / 10.0,
        "mean_us": (mean * 10.0).round() / 10.0,
    })
}

fn pick_request(id: String, messages: &[ChatMessage]) -> pb::PickRequest {
    pb::PickRequest {
        pool: "bench".into(),
        request_id: id,
        prompt: Some(pb::pick_request::Prompt::Chat(pb::Chat {
            messages: messages
                .iter()
                .map(|m| pb::ChatMessage {
                    role: m.role.clone(),
                    content: m.content.clone(),
                })
                .collect(),
        })),
        max_endpoints: 3,
        ..Default::default()
    }
}

/// 1 MB messages that are expensive to tokenize (the first four are single
/// pre-tokenizer pieces, or pieces without whole-token shortcuts).
fn worst_texts(rng: &mut Rng) -> Vec<(&'static str, String)> {
    const MB: usize = 1 << 20;
    const B64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let base64: String = (0..MB)
        .map(|_| B64[(rng.next() % 64) as usize] as char)
        .collect();
    let mut words = prose(rng, MB / 6);
    words.truncate(MB);
    vec![
        ("one_character", "a".repeat(MB)),
        ("spaces", " ".repeat(MB)),
        ("json_punctuation", "{[\"".repeat(MB / 3)),
        ("base64", base64),
        (
            "decomposed_accents",
            "cafe\u{301} na\u{308}ive ".repeat(MB / 16),
        ),
        ("words", words),
    ]
}

/// Pick latency (ms) of each worst-case text with `budget`: 8 idle
/// endpoints, an empty index, each pick's text new (a unique first line).
/// With index `events` tokenization also stops where no engine holds the
/// prompt (at once here); with `picks` only the budget stops it.
async fn worst_case(
    tok: &Arc<ChatTokenizer>,
    texts: &[(&'static str, String)],
    (source, budget): (IndexSource, TokenizeBudget),
    iters: usize,
) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let load = LoadTracker::new(LoadConfig::default());
    let pool = Arc::new(
        Pool::new(
            "bench",
            "Qwen/Qwen3-8B",
            BLOCK,
            RequestTokenizer::Local(Arc::clone(tok)),
            load,
            Weights::default(),
        )
        .with_index(source, 25_000)
        .with_tokenize_budget(budget),
    );
    let specs: Vec<EndpointSpec> = (0..8)
        .map(|i| EndpointSpec {
            address: format!("10.1.0.{}:8000", i + 1),
            kv_events: format!("tcp://10.1.0.{}:5557", i + 1),
            replay: None,
            metrics_url: None,
            topic: String::new(),
        })
        .collect();
    pool.set_endpoints(specs, |_| None);
    for e in pool.endpoints().iter() {
        let idle = EngineLoad {
            running: 0,
            waiting: 0,
            kv_usage: 0.1,
        };
        pool.load.record_scrape(e.id, Some(idle), Instant::now());
    }
    let mut out = serde_json::Map::new();
    for (name, text) in texts {
        let mut ms = Vec::new();
        let mut prompt_tokens = 0;
        for i in 0..iters {
            let m = [ChatMessage::new("user", format!("{name} {i}\n{text}"))];
            let id = format!("worst-{name}-{i}");
            let t = Instant::now();
            let resp = pool.pick(pick_request(id.clone(), &m)).await?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            prompt_tokens = resp.prompt_tokens;
            pool.report(&pb::ReportRequest {
                pool: "bench".into(),
                request_id: id,
                ..Default::default()
            })?;
            // Let a stopped pick's background chain completion finish, so
            // it is not timed in the next pick.
            while pool.chain_completions_running() > 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        ms.sort_by(f64::total_cmp);
        out.insert(
            (*name).into(),
            json!({
                "bytes": text.len(),
                "prompt_tokens": prompt_tokens,
                "p50_ms": (pct(&ms, 0.5) * 100.0).round() / 100.0,
                "max_ms": (ms.last().copied().unwrap_or(0.0) * 100.0).round() / 100.0,
            }),
        );
    }
    Ok(serde_json::Value::Object(out))
}

struct Case {
    name: &'static str,
    /// The seen part: stored on the home endpoint.
    history: Vec<ChatMessage>,
    /// Token ids of what the engine cached for the history.
    history_ids: Vec<u32>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::args().any(|a| a == "--quick");
    let dir = tokenizer_dir();
    let tok = Arc::new(ChatTokenizer::from_dir(&dir)?);
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let system = prose(&mut rng, 700);

    // The two chats. The 32k one: its history (every message but the last)
    // was the previous turn's prompt, which the home engine cached.
    let c4 = chat(&tok, &mut rng, &system, 4_000);
    let c32 = chat(&tok, &mut rng, &system, 32_000);
    let cases: Vec<Case> = [("chat_4k", c4), ("chat_32k_seen_history", c32)]
        .into_iter()
        .map(|(name, full)| {
            let history = full[..full.len() - 1].to_vec();
            let history_ids = tok.encode_chat(&history, true).unwrap_or_default();
            Case {
                name,
                history,
                history_ids,
            }
        })
        .collect();
    let system_ids = tok.encode_chat(&[ChatMessage::new("system", system.as_str())], false)?;

    // Cold and warm tokenization, on their own.
    let mut tokenization = serde_json::Map::new();
    for case in &cases {
        let mut full = case.history.clone();
        full.push(ChatMessage::new("user", prose(&mut rng, 60)));
        let n_tokens = tok.encode_chat(&full, true)?.len();
        let mut cold = Vec::new();
        for _ in 0..if quick { 3 } else { 10 } {
            let fresh = ChatTokenizer::from_dir(&dir)?.with_cache_bytes(0);
            let t = Instant::now();
            let ids = fresh.encode_chat(&full, true)?;
            cold.push(t.elapsed().as_secs_f64() * 1e6);
            assert_eq!(ids.len(), n_tokens);
        }
        let mut render = Vec::new();
        let mut warm = Vec::new();
        for i in 0..if quick { 50 } else { 300 } {
            let mut m = case.history.clone();
            m.push(ChatMessage::new(
                "user",
                format!("question {i}: {}", prose(&mut rng, 40)),
            ));
            let t = Instant::now();
            let text = tok.render_chat(&m, true)?;
            render.push(t.elapsed().as_secs_f64() * 1e6);
            let t = Instant::now();
            let _ = tok.encode_chat(&m, true)?;
            warm.push(t.elapsed().as_secs_f64() * 1e6);
            std::hint::black_box(text);
        }
        tokenization.insert(
            case.name.into(),
            json!({
                "prompt_tokens": n_tokens,
                "cold_encode_chat": stats(cold),
                "warm_template_render_only": stats(render),
                "warm_encode_chat_history_cached": stats(warm),
            }),
        );
    }

    let mut results = Vec::new();
    for &n_endpoints in &[8usize, 64] {
        let load = LoadTracker::new(LoadConfig::default());
        let pool = Arc::new(Pool::new(
            "bench",
            "Qwen/Qwen3-8B",
            BLOCK,
            RequestTokenizer::Local(Arc::clone(&tok)),
            load,
            Weights::default(),
        ));
        let specs: Vec<EndpointSpec> = (0..n_endpoints)
            .map(|i| EndpointSpec {
                address: format!("10.0.{}.{}:8000", i / 200, i % 200 + 1),
                kv_events: format!("tcp://10.0.{}.{}:5557", i / 200, i % 200 + 1),
                replay: None,
                metrics_url: None,
                topic: String::new(),
            })
            .collect();
        pool.set_endpoints(specs, |_| None);
        let eps = pool.endpoints();
        let now = Instant::now();
        for e in eps.iter() {
            pool.load.record_scrape(
                e.id,
                Some(EngineLoad {
                    running: 4,
                    waiting: 0,
                    kv_usage: 0.3,
                }),
                now,
            );
        }

        // Fill: every endpoint holds the system prompt; endpoint 1 the 4k
        // history, endpoint 2 the 32k history; the rest random chains.
        let fill_start = Instant::now();
        let mut hash = 1u64;
        let mut store = |pool: &Pool, e: usize, ids: &[u32]| -> usize {
            let full = ids.len() / BLOCK as usize;
            let hashes = (0..full)
                .map(|_| {
                    hash += 1;
                    EngineHash::U64(hash)
                })
                .collect();
            pool.index.apply(
                eps[e].id,
                &stored_batch(hashes, ids[..full * BLOCK as usize].to_vec(), BLOCK),
            );
            full
        };
        let mut total = 0usize;
        // The histories start with the system prompt; an engine stores
        // shared content once, so each home endpoint gets its history as
        // one chain. Homes are filled first, so that each home holds its
        // whole history as one chain and the long matches are measured.
        let mut held = vec![0usize; n_endpoints];
        held[1] = store(&pool, 1, &cases[0].history_ids);
        held[2] = store(&pool, 2, &cases[1].history_ids);
        for (e, h) in held.iter_mut().enumerate() {
            if e > 2 || e == 0 {
                *h = store(&pool, e, &system_ids);
            }
            while *h < BLOCKS_PER_ENDPOINT {
                let n = (BLOCKS_PER_ENDPOINT - *h).min(256) * BLOCK as usize;
                let ids: Vec<u32> = (0..n).map(|_| (rng.next() % 150_000) as u32).collect();
                *h += store(&pool, e, &ids);
            }
            total += *h;
        }
        pool.index.flush().await;
        let fill_s = fill_start.elapsed().as_secs_f64();
        if std::env::var_os("PICK_BENCH_DEBUG").is_some() {
            for (ci, case) in cases.iter().enumerate() {
                let o = pool.index.overlap(&case.history_ids);
                let mut full = case.history.clone();
                full.push(ChatMessage::new("user", "x"));
                let ids = tok.encode_chat(&full, true)?;
                let common = ids
                    .iter()
                    .zip(&case.history_ids)
                    .take_while(|(a, b)| a == b)
                    .count();
                eprintln!(
                    "{}: history {} tokens, home matched {} of {} blocks; request shares {common} tokens; blocks(home)={}",
                    case.name,
                    case.history_ids.len(),
                    o.blocks_for(eps[1 + ci].id),
                    o.request_blocks,
                    pool.index.blocks(eps[1 + ci].id)
                );
            }
        }
        let indexed: usize = eps.iter().map(|e| pool.index.blocks(e.id)).sum();

        let pools = Arc::new(Pools::new(vec![Arc::clone(&pool)]));
        let svc = IndexerService::new(Arc::clone(&pools));

        // gRPC server on loopback.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        let server_svc = svc.clone();
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(
                    pb::indexer_server::IndexerServer::new(server_svc)
                        .max_decoding_message_size(64 << 20),
                )
                .serve_with_incoming(incoming)
                .await;
        });
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
            .tcp_nodelay(true)
            .connect()
            .await?;
        let mut client =
            pb::indexer_client::IndexerClient::new(channel).max_encoding_message_size(64 << 20);

        for (ci, case) in cases.iter().enumerate() {
            let iters = match (quick, ci) {
                (true, _) => 100,
                (false, 0) => 2000,
                (false, _) => 500,
            };
            let home = eps[1 + ci].spec.address.clone();
            // Distinct final messages, prepared outside the timed part.
            let reqs: Vec<Vec<ChatMessage>> = (0..iters * 2 + 20)
                .map(|i| {
                    let mut m = case.history.clone();
                    m.push(ChatMessage::new(
                        "user",
                        format!("question {i}: {}", prose(&mut rng, 40)),
                    ));
                    m
                })
                .collect();
            let mut in_process = Vec::with_capacity(iters);
            let mut grpc = Vec::with_capacity(iters);
            let mut correct = 0usize;
            let mut prompt_tokens = 0;
            for (i, m) in reqs.iter().enumerate() {
                let id = format!("{}-{n_endpoints}-{i}", case.name);
                let warmup = i < 20;
                let req = pick_request(id.clone(), m);
                let use_grpc = i % 2 == 1;
                let t = Instant::now();
                let resp = if use_grpc {
                    client.pick(req).await?.into_inner()
                } else {
                    svc.pick(req).await?
                };
                let us = t.elapsed().as_secs_f64() * 1e6;
                if !warmup {
                    if use_grpc {
                        grpc.push(us);
                    } else {
                        in_process.push(us);
                    }
                }
                correct += usize::from(resp.endpoints.first().is_some_and(|e| e.address == home));
                if std::env::var_os("PICK_BENCH_DEBUG").is_some() && i == 25 {
                    eprintln!("{} home {home}: {resp:#?}", case.name);
                }
                prompt_tokens = resp.prompt_tokens;
                // Complete it so in-flight state stays bounded, as in service.
                pool.report(&pb::ReportRequest {
                    pool: "bench".into(),
                    request_id: id,
                    ..Default::default()
                })?;
            }
            results.push(json!({
                "endpoints": n_endpoints,
                "blocks_per_endpoint": BLOCKS_PER_ENDPOINT,
                "case": case.name,
                "prompt_tokens": prompt_tokens,
                "picked_home_fraction": correct as f64 / reqs.len() as f64,
                "in_process": stats(in_process),
                "grpc_loopback": stats(grpc),
            }));
        }
        results.push(json!({
            "endpoints": n_endpoints,
            "fill": {"blocks": total, "indexed_blocks": indexed, "seconds": (fill_s * 1000.0).round() / 1000.0},
        }));
        server.abort();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let texts = worst_texts(&mut rng);
    let iters = if quick { 2 } else { 5 };
    let unbounded = TokenizeBudget {
        max_bytes: usize::MAX,
        max_piece_bytes: usize::MAX,
    };
    let mut worst = serde_json::Map::new();
    worst.insert("default_budget".into(), json!(TokenizeBudget::default()));
    for (key, source, budget) in [
        (
            "events_default_budget",
            IndexSource::Events,
            TokenizeBudget::default(),
        ),
        ("events_no_budget", IndexSource::Events, unbounded.clone()),
        (
            "picks_default_budget",
            IndexSource::Picks,
            TokenizeBudget::default(),
        ),
        ("picks_no_budget", IndexSource::Picks, unbounded.clone()),
    ] {
        let r = worst_case(&tok, &texts, (source, budget), iters).await?;
        worst.insert(key.into(), r);
    }

    let out = json!({
        "benchmark": "pick_latency",
        "notes": "in_process = IndexerService::pick (what the gRPC handler runs: tokenize, match, score, account); grpc_loopback = tonic client->server on 127.0.0.1, one connection, same process. Each pick has a new final user message; the rest of the chat was seen before (segment cache warm). Index filled via PoolIndex::apply.",
        "machine": {"cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)},
        "tokenization": tokenization,
        "pick": results,
        "worst_case_1mb": worst,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
