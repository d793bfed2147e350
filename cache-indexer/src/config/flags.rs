//! The command line: flags, and how they apply on top of the file.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

use super::error::ConfigError;
use super::file::load_file;
use super::schema::{Config, EndpointConfig, PoolConfig, TokenizerSource};
use crate::types::IndexSource;

/// Command-line flags of the `cache-indexer` binary.
#[derive(Debug, Clone, Parser, Default)]
#[command(
    name = "cache-indexer",
    version,
    about = "Kvasir's cache-indexer: KV-prefix index fed by vLLM's KV events, load tracking, and the endpoint picker (gRPC kvasir.v1)"
)]
pub struct Args {
    /// Config file (YAML or JSON). Flags below override its addresses and
    /// add endpoints.
    #[arg(long, env = "KVASIR_INDEXER_CONFIG")]
    pub config: Option<PathBuf>,
    /// gRPC listen address (kvasir.v1.Indexer and grpc.health.v1); default: the file's, else 127.0.0.1:50051.
    #[arg(long)]
    pub grpc_addr: Option<SocketAddr>,
    /// HTTP listen address (/metrics, /healthz, /readyz); default: the file's, else 127.0.0.1:9090.
    #[arg(long)]
    pub http_addr: Option<SocketAddr>,
    /// A static endpoint, repeatable:
    /// `pool=NAME,address=IP:PORT[,events=tcp://IP:PORT][,replay=tcp://IP:PORT][,metrics=URL][,topic=T]`
    /// (without `events`, the engine's own `/kv_event_sources` says where
    /// it publishes).
    /// A pool not in the file is created with `--model`, `--block-size`,
    /// `--tokenizer`, `--index` and `--pick-history-blocks`.
    #[arg(long = "endpoint", value_name = "SPEC")]
    pub endpoints: Vec<String>,
    /// Tokenizer of pools created by `--endpoint`: a Hugging Face tokenizer
    /// directory, `render` or `approx` (default: render).
    #[arg(long, env = "KVASIR_TOKENIZER_DIR")]
    pub tokenizer: Option<String>,
    /// Model of pools created by `--endpoint`.
    #[arg(long)]
    pub model: Option<String>,
    /// Block size of pools created by `--endpoint` (default: 16).
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Scrape interval (ms) of pools created by `--endpoint` (default: 250).
    #[arg(long)]
    pub scrape_interval_ms: Option<u64>,
    /// Where the prefix index of pools created by `--endpoint` comes from:
    /// `events` (the engines' KV events, default) or `picks` (this
    /// replica's own pick history; no KV events needed).
    #[arg(long, value_name = "events|picks")]
    pub index: Option<String>,
    /// Pick-history capacity per endpoint, in blocks, of pools created by
    /// `--endpoint` (index `picks`, or tokenizer `approx`; default: 25000).
    #[arg(long, value_name = "N")]
    pub pick_history_blocks: Option<usize>,
    /// File holding the token every `kvasir.v1.Indexer` call must carry as
    /// `authorization: Bearer <token>` (re-read when it changes, e.g. a
    /// rotated Kubernetes Secret). Without it the gRPC port is open to
    /// anyone who reaches it (logged as a warning at start).
    #[arg(long, env = "KVASIR_GRPC_TOKEN_FILE", value_name = "PATH")]
    pub grpc_token_file: Option<PathBuf>,
    /// On SIGTERM/SIGINT, how long in-flight calls may take to finish
    /// before the indexer exits anyway, ms (default: the file's, else 5000).
    #[arg(long, value_name = "MS")]
    pub shutdown_grace_ms: Option<u64>,
}

/// Parses one `--endpoint` value into (pool name, endpoint); without
/// `events` the engine is asked for its KV-event sockets.
pub fn parse_endpoint_flag(spec: &str) -> Result<(String, EndpointConfig), String> {
    let mut pool = None;
    let mut address = None;
    let mut events = None;
    let mut replay = None;
    let mut metrics = None;
    let mut topic = String::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| format!("`{part}` is not key=value"))?;
        let v = v.trim().to_string();
        match k.trim() {
            "pool" => pool = Some(v),
            "address" => address = Some(v),
            "events" | "kv_events" | "kvEvents" => events = Some(v),
            "replay" => replay = Some(v),
            "metrics" => metrics = Some(v),
            "topic" => topic = v,
            other => {
                return Err(format!(
                    "unknown key `{other}` (expected pool, address, events, replay, metrics, topic)"
                ))
            }
        }
    }
    let address = address.ok_or("address=IP:PORT is required")?;
    Ok((
        pool.unwrap_or_else(|| "default".to_string()),
        EndpointConfig {
            address,
            events,
            replay,
            metrics,
            topic,
        },
    ))
}

impl Config {
    /// The file (if any) with the flags applied, validated.
    pub fn from_args(args: &Args) -> Result<Config, ConfigError> {
        let mut cfg = match &args.config {
            Some(path) => load_file(path)?,
            None => Config::default(),
        };
        cfg.apply_args(args)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Applies flags on top of the file: addresses override, endpoints add
    /// (creating pools the file does not have).
    pub fn apply_args(&mut self, args: &Args) -> Result<(), ConfigError> {
        if let Some(a) = args.grpc_addr {
            self.grpc_addr = a;
        }
        if let Some(a) = args.http_addr {
            self.http_addr = a;
        }
        if let Some(f) = &args.grpc_token_file {
            self.grpc_token_file = Some(f.clone());
        }
        if let Some(g) = args.shutdown_grace_ms {
            self.shutdown_grace_ms = g;
        }
        let index = match &args.index {
            Some(s) => Some(
                s.parse::<IndexSource>()
                    .map_err(|message| ConfigError::Flag {
                        flag: "--index".into(),
                        message,
                    })?,
            ),
            None => None,
        };
        if args.pick_history_blocks == Some(0) {
            return Err(ConfigError::Flag {
                flag: "--pick-history-blocks".into(),
                message: "must be at least 1".into(),
            });
        }
        for (i, spec) in args.endpoints.iter().enumerate() {
            let flag = || format!("--endpoint[{i}] `{spec}`");
            let (pool, ep) = parse_endpoint_flag(spec).map_err(|message| ConfigError::Flag {
                flag: flag(),
                message,
            })?;
            let idx = match self.pools.iter().position(|p| p.name == pool) {
                Some(idx) => idx,
                None => {
                    let mut p = PoolConfig::new(pool);
                    if let Some(t) = &args.tokenizer {
                        p.tokenizer = TokenizerSource::from(t.as_str());
                    }
                    if let Some(m) = &args.model {
                        p.model = m.clone();
                    }
                    if let Some(b) = args.block_size {
                        p.block_size = b;
                    }
                    if let Some(s) = args.scrape_interval_ms {
                        p.scrape.interval_ms = s;
                        p.scrape.timeout_ms = p.scrape.timeout_ms.min(s);
                    }
                    if let Some(ix) = index {
                        p.index = ix;
                    }
                    if let Some(n) = args.pick_history_blocks {
                        p.pick_history_blocks = n;
                    }
                    self.pools.push(p);
                    self.pools.len() - 1
                }
            };
            self.pools[idx].endpoints.push(ep);
        }
        Ok(())
    }
}
