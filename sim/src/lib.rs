//! `vllm-sim`: a simulated vLLM instance that a router cannot tell from
//! vLLM on the wire: the OpenAI API, KV-cache events over ZMQ with vLLM's
//! framing and fields, and vLLM's Prometheus metric names. Behind them sit a
//! paged prefix cache with vLLM's semantics and a continuous-batching
//! scheduler priced by a calibrated latency model.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod anthropic;
pub mod apis;
pub mod block_pool;
pub mod config;
pub mod engine;
pub mod exposition;
pub mod faults;
pub mod hashing;
pub mod instrumentator;
pub mod kv_events;
pub mod latency;
pub mod metrics;
pub mod openai;
pub mod priority;
pub mod publisher;
pub mod response_store;
pub mod responses;
pub mod responses_input;
pub mod runner;
pub mod server;
pub mod state;
pub mod validation;
pub mod waiting;

use anyhow::Context;
use config::Args;
use kvasir_tokenizer::ChatTokenizer;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Words whose single-token forms make up the synthetic completions.
const OUTPUT_WORDS: &[&str] = &[
    " the", " of", " and", " to", " in", " a", " is", " that", " for", " it", " as", " with",
    " was", " on", " be", " by", " this", " are", " from", " at", " or", " an", " which", " can",
    " model", " cache", " token", " request", " system", " data", " time", " first", " new",
    " more", " will", " each", " one", " all", " when", " we",
];

/// The synthetic output vocabulary: (token id, text) pairs of words that
/// are one token each, so generated ids and text agree.
pub fn output_vocab(tok: &ChatTokenizer) -> Vec<(u32, String)> {
    let mut v: Vec<(u32, String)> = OUTPUT_WORDS
        .iter()
        .filter_map(|w| match tok.encode(w).as_slice() {
            [id] => Some((*id, (*w).to_string())),
            _ => None,
        })
        .collect();
    if v.is_empty() {
        // Any tokenizer has some single-token word; fall back to id 0's text.
        v.push((0, tok.decode(&[0])));
    }
    v
}

/// Finds the tokenizer folder: the flag or env var, else
/// `.tools/tokenizers/qwen3` above the working directory or the binary.
pub fn find_tokenizer_dir(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    let rel = Path::new(".tools/tokenizers/qwen3");
    let mut starts = vec![std::env::current_dir().ok()];
    starts.push(
        std::env::current_exe()
            .ok()
            .and_then(|e| e.parent().map(Path::to_path_buf)),
    );
    for start in starts.into_iter().flatten() {
        for dir in start.ancestors() {
            let c = dir.join(rel);
            if c.join("tokenizer.json").is_file() {
                return Ok(c);
            }
        }
    }
    anyhow::bail!("no tokenizer found: pass --tokenizer DIR or set KVASIR_TOKENIZER_DIR (run `make setup` to fetch the Qwen3 tokenizer into .tools/)")
}

/// Starts everything and serves until the process is stopped.
pub async fn serve(args: Args) -> anyhow::Result<()> {
    run(args, None).await
}

/// [`serve`] on a listener already bound (`--host` and `--port` unused),
/// for tests that let the kernel choose the port.
pub async fn serve_on(args: Args, listener: tokio::net::TcpListener) -> anyhow::Result<()> {
    run(args, Some(listener)).await
}

async fn run(args: Args, listener: Option<tokio::net::TcpListener>) -> anyhow::Result<()> {
    args.validate().map_err(anyhow::Error::msg)?;
    let dir = find_tokenizer_dir(args.tokenizer.as_deref())?;
    let tokenizer = Arc::new(
        ChatTokenizer::from_dir(&dir)
            .with_context(|| format!("loading tokenizer from {}", dir.display()))?,
    );
    let vocab = output_vocab(&tokenizer);
    let profile = args.latency_profile().map_err(anyhow::Error::msg)?;
    let faults = Arc::new(faults::Faults::default());
    faults
        .apply(&faults::FaultSettings {
            fail_rate: Some(args.fault_fail_rate),
            drop_event_rate: Some(args.fault_drop_event_rate),
            unhealthy: Some(args.fault_unhealthy),
            ..Default::default()
        })
        .map_err(anyhow::Error::msg)?;

    let ev = args.kv_events().map_err(anyhow::Error::msg)?;
    let (publisher, endpoints) = if ev.enabled {
        publisher::start(
            publisher::PublisherConfig {
                endpoint: ev.endpoint.clone(),
                replay_endpoint: ev.replay_endpoint.clone(),
                topic: ev.topic.clone(),
                buffer_steps: ev.buffer_steps,
                encoding: args.kv_events_encoding,
                hash_format: args.kv_events_hash_format,
                dp_rank: Some(args.data_parallel_rank),
            },
            faults.clone(),
        )
        .await
        .with_context(|| {
            format!(
                "binding KV-event sockets {} / {:?}",
                ev.endpoint, ev.replay_endpoint
            )
        })?
    } else {
        // Events off: a sink that drops batches.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        (
            tx,
            publisher::BoundEndpoints {
                publish: "disabled".into(),
                replay: None,
            },
        )
    };

    let cfg = engine::EngineConfig {
        block_size: args.block_size,
        num_gpu_blocks: args.num_gpu_blocks,
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_model_len: args.max_model_len,
        enable_prefix_caching: !args.no_enable_prefix_caching,
        profile: profile.clone(),
        hash_seed: args.hash_seed(),
        policy: args.scheduling_policy,
    };
    let hash_seed = cfg.hash_seed.0;
    let ids: Arc<[u32]> = vocab.iter().map(|(i, _)| *i).collect::<Vec<_>>().into();
    let engine = engine::Engine::new(cfg, ids);
    let handle = runner::spawn(engine, args.time_scale, faults.clone(), publisher.clone());

    let info = metrics::StaticInfo {
        model: args.model.clone(),
        block_size: args.block_size,
        num_gpu_blocks: args.num_gpu_blocks,
        enable_prefix_caching: !args.no_enable_prefix_caching,
        profile: profile.name.clone(),
        time_scale: args.time_scale,
        scheduling_policy: args.scheduling_policy.as_str(),
    };
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let merge_inline_system = anthropic::template_needs_system_first(&tokenizer);
    let state = Arc::new(server::AppState {
        model: args.model.clone(),
        max_model_len: args.max_model_len,
        tokenizer,
        engine: handle,
        faults,
        info,
        endpoints: endpoints.clone(),
        publisher,
        piece_text: vocab.into_iter().collect::<HashMap<_, _>>(),
        default_output_tokens: args.default_output_tokens,
        prompt_tokens_details: args.enable_prompt_tokens_details,
        next_id: std::sync::atomic::AtomicU64::new(0),
        failed: std::sync::atomic::AtomicU64::new(0),
        started,
        apis: state::ApiState {
            merge_inline_system,
            store: response_store::ResponseStore::new(args.enable_responses_api_store),
            load_tracking: args.enable_server_load_tracking,
            server_load: std::sync::atomic::AtomicI64::new(0),
            kv_event_sources: instrumentator::kv_event_sources(
                &ev,
                &endpoints,
                args.data_parallel_rank,
            ),
        },
    });
    if args.enable_responses_api_store {
        // vLLM warns the same: nothing is ever removed from the store.
        tracing::warn!("the Responses API store is on: stored responses are never removed");
    }
    let listener = match listener {
        Some(l) => l,
        None => tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("binding HTTP on {}:{}", args.host, args.port))?,
    };
    if args.enable_sim_admin {
        tracing::warn!("the /sim/ admin endpoints are on: whoever reaches this port can inject faults (tests only)");
    }
    let addr = listener.local_addr()?;
    tracing::info!(
        http = %addr,
        model = %args.model,
        kv_events = %endpoints.publish,
        kv_events_replay = ?endpoints.replay,
        topic = %ev.topic,
        profile = %profile.name,
        time_scale = args.time_scale,
        block_size = args.block_size,
        num_gpu_blocks = args.num_gpu_blocks,
        tokenizer = %dir.display(),
        block_hash_seed = hash_seed,
        "vllm-sim ready"
    );
    // Streamed tokens are small writes: without TCP_NODELAY, Nagle's
    // algorithm and the peer's delayed ACK hold each one back ~40 ms
    // (uvicorn, which serves vLLM, sets it too).
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(error = %e, "could not set TCP_NODELAY");
        }
    });
    axum::serve(listener, server::router(state, args.enable_sim_admin))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
