//! Configuration: a YAML (or JSON) file plus command-line flags.
//!
//! The file describes pools; flags set the listen addresses and can add
//! static endpoints for quick starts (`--endpoint pool=NAME,address=...`).
//! Keys are camelCase (Kubernetes style: the file usually lives in a
//! ConfigMap); the snake_case spelling of each key is accepted too.
//! [`Config::validate`] checks everything the types cannot and names the
//! exact place of each problem, e.g.
//! `pools[1].endpoints[0].address: not ip:port`.
//!
//! ```yaml
//! grpcAddr: 0.0.0.0:50051
//! httpAddr: 0.0.0.0:9090
//! pools:
//!   - name: qwen
//!     model: Qwen/Qwen3-8B
//!     blockSize: 16
//!     tokenizer: /models/qwen3        # a tokenizer dir | render | approx
//!     index: events                   # events (KV events) | picks (own pick history)
//!     endpoints:
//!       - address: 10.0.0.5:8000
//!         events: tcp://10.0.0.5:5557
//!         replay: tcp://10.0.0.5:5558
//!   - name: llama
//!     tokenizer: render
//!     discovery: { namespace: serving, inferencePool: llama, eventsPort: 5557, replayPort: 5558 }
//! ```

use std::collections::BTreeSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use serde::{Deserialize, Deserializer, Serialize};

use crate::discovery::DiscoveryDefaults;
use crate::health::FailureConfig;
use crate::history::DEFAULT_PICK_HISTORY_BLOCKS;
use crate::load::SaturationThresholds;
use crate::scoring::Weights;
use crate::tokenize::TokenizeBudget;
use crate::types::{EndpointSpec, IndexSource};

/// Default tokens per KV block (vLLM's default).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// Default scrape interval of the engines' `/metrics`.
pub const DEFAULT_SCRAPE_INTERVAL_MS: u64 = 250;
/// Fastest allowed scrape interval: below this the scrapes themselves load
/// the engines' HTTP servers for little gain.
pub const MIN_SCRAPE_INTERVAL_MS: u64 = 100;
/// Slowest allowed scrape interval: slower and the load picture is too old
/// to steer by (in-flight accounting covers the gap only partly).
pub const MAX_SCRAPE_INTERVAL_MS: u64 = 1000;

/// A configuration problem, with where it is.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid YAML/JSON of the expected shape.
    #[error("parsing config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (it names line and column).
        message: String,
    },
    /// A flag's value is malformed.
    #[error("{flag}: {message}")]
    Flag {
        /// The flag, e.g. `--endpoint[0]`.
        flag: String,
        /// What is wrong.
        message: String,
    },
    /// A value is out of range or inconsistent; `path` names it.
    #[error("{path}: {message}")]
    Invalid {
        /// Where, e.g. `pools[1].endpoints[0].address`.
        path: String,
        /// What is wrong.
        message: String,
    },
}

fn invalid(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        path: path.into(),
        message: message.into(),
    }
}

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
    /// (`events` is required unless the pool's index is `picks`).
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

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// gRPC listen address.
    #[serde(default = "default_grpc_addr", alias = "grpc_addr")]
    pub grpc_addr: SocketAddr,
    /// HTTP listen address.
    #[serde(default = "default_http_addr", alias = "http_addr")]
    pub http_addr: SocketAddr,
    /// The pools; names are unique.
    #[serde(default)]
    pub pools: Vec<PoolConfig>,
    /// Token file of the gRPC port (see [`Args::grpc_token_file`]); none:
    /// unauthenticated.
    #[serde(default, alias = "grpc_token_file")]
    pub grpc_token_file: Option<PathBuf>,
    /// Longest a graceful shutdown waits for in-flight calls, ms.
    #[serde(default = "default_shutdown_grace_ms", alias = "shutdown_grace_ms")]
    pub shutdown_grace_ms: u64,
    /// A file of more pools, added to `pools` at load (see [`crate::pools_file`]);
    /// relative to this file's directory.
    #[serde(default, alias = "pools_file")]
    pub pools_file: Option<PathBuf>,
}

fn default_grpc_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 50051))
}
fn default_http_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9090))
}
/// Default of [`Config::shutdown_grace_ms`]: long enough for a pick (a
/// render call is at most its timeout), well inside Kubernetes' default
/// 30 s termination grace.
pub const DEFAULT_SHUTDOWN_GRACE_MS: u64 = 5_000;
fn default_shutdown_grace_ms() -> u64 {
    DEFAULT_SHUTDOWN_GRACE_MS
}

impl Default for Config {
    fn default() -> Self {
        Config {
            grpc_addr: default_grpc_addr(),
            http_addr: default_http_addr(),
            pools: Vec::new(),
            grpc_token_file: None,
            shutdown_grace_ms: DEFAULT_SHUTDOWN_GRACE_MS,
            pools_file: None,
        }
    }
}

/// How a pool turns requests into token ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(into = "String")]
pub enum TokenizerSource {
    /// A Hugging Face model directory (`tokenizer.json`,
    /// `tokenizer_config.json`): exact ids, computed in process.
    Dir(PathBuf),
    /// Ask one healthy engine's `/v1/chat/completions/render` (chats) or
    /// `/tokenize` (text): exact ids, one HTTP round trip per pick.
    Render,
    /// Hash the prompt's bytes into pseudo-tokens: no exact prefix matching
    /// against the engines' events; affinity comes from the indexer's own
    /// pick history (see `tokenize.rs`).
    Approx,
}

impl TokenizerSource {
    /// The mode's name as it appears in metrics and answers.
    pub fn mode_name(&self) -> &'static str {
        match self {
            TokenizerSource::Dir(_) => "tokenizer",
            TokenizerSource::Render => "render",
            TokenizerSource::Approx => "approx",
        }
    }
}

impl From<&str> for TokenizerSource {
    fn from(s: &str) -> Self {
        match s {
            "render" => TokenizerSource::Render,
            "approx" => TokenizerSource::Approx,
            dir => TokenizerSource::Dir(PathBuf::from(dir)),
        }
    }
}

impl From<TokenizerSource> for String {
    fn from(t: TokenizerSource) -> String {
        match t {
            TokenizerSource::Dir(p) => p.display().to_string(),
            other => other.mode_name().to_string(),
        }
    }
}

impl<'de> Deserialize<'de> for TokenizerSource {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(TokenizerSource::from(s.as_str()))
    }
}

impl fmt::Display for TokenizerSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&String::from(self.clone()))
    }
}

/// One pool of engines serving one model with one block size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolConfig {
    /// Pool name, as `PickRequest.pool` names it.
    pub name: String,
    /// Model the engines serve (sent to `render`; informational otherwise).
    #[serde(default)]
    pub model: String,
    /// Tokens per KV block; must equal the engines' `--block-size`.
    #[serde(default = "default_block_size", alias = "block_size")]
    pub block_size: u32,
    /// Tokenizer mode.
    #[serde(default = "default_tokenizer")]
    pub tokenizer: TokenizerSource,
    /// Where the prefix index comes from: the engines' KV events, or this
    /// replica's own picks.
    #[serde(default)]
    pub index: IndexSource,
    /// Capacity of each endpoint's pick history, in blocks (index `picks`,
    /// and the `approx` tokenizer's history).
    #[serde(default = "default_pick_history_blocks", alias = "pick_history_blocks")]
    pub pick_history_blocks: usize,
    /// Static endpoints.
    #[serde(default)]
    pub endpoints: Vec<EndpointConfig>,
    /// Endpoints from an InferencePool instead.
    #[serde(default)]
    pub discovery: Option<DiscoveryConfig>,
    /// Scoring weights.
    #[serde(default)]
    pub scoring: Weights,
    /// Saturation thresholds.
    #[serde(default)]
    pub saturation: SaturationThresholds,
    /// Scrape settings.
    #[serde(default)]
    pub scrape: ScrapeConfig,
    /// In-flight accounting settings.
    #[serde(default, alias = "in_flight")]
    pub in_flight: InFlightConfig,
    /// Timeout of one `render` call, ms.
    #[serde(default = "default_render_timeout_ms", alias = "render_timeout_ms")]
    pub render_timeout_ms: u64,
    /// Bounds on one pick's in-process tokenization.
    #[serde(default, alias = "tokenize_budget")]
    pub tokenize_budget: TokenizeBudget,
    /// When an endpoint whose requests fail is ranked last.
    #[serde(default)]
    pub failures: FailureConfig,
}

fn default_block_size() -> u32 {
    DEFAULT_BLOCK_SIZE
}
fn default_tokenizer() -> TokenizerSource {
    TokenizerSource::Render
}
fn default_render_timeout_ms() -> u64 {
    200
}
fn default_pick_history_blocks() -> usize {
    DEFAULT_PICK_HISTORY_BLOCKS
}

impl PoolConfig {
    /// A pool with defaults and no endpoints.
    pub fn new(name: impl Into<String>) -> Self {
        PoolConfig {
            name: name.into(),
            model: String::new(),
            block_size: DEFAULT_BLOCK_SIZE,
            tokenizer: default_tokenizer(),
            index: IndexSource::default(),
            pick_history_blocks: DEFAULT_PICK_HISTORY_BLOCKS,
            endpoints: Vec::new(),
            discovery: None,
            scoring: Weights::default(),
            saturation: SaturationThresholds::default(),
            scrape: ScrapeConfig::default(),
            in_flight: InFlightConfig::default(),
            render_timeout_ms: default_render_timeout_ms(),
            tokenize_budget: TokenizeBudget::default(),
            failures: FailureConfig::default(),
        }
    }
}

/// One static engine endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EndpointConfig {
    /// HTTP address `ip:port`.
    pub address: String,
    /// KV-events PUB endpoint, `tcp://ip:port`; required when the pool's
    /// index is `events`, unused with `picks`.
    #[serde(default, alias = "kvEvents", alias = "kv_events")]
    pub events: Option<String>,
    /// Replay ROUTER endpoint, `tcp://ip:port` (unused with index `picks`).
    #[serde(default)]
    pub replay: Option<String>,
    /// Prometheus URL; default `http://<address>/metrics`.
    #[serde(default, alias = "metricsUrl", alias = "metrics_url")]
    pub metrics: Option<String>,
    /// Event topic (vLLM's default is empty).
    #[serde(default)]
    pub topic: String,
}

impl EndpointConfig {
    /// The endpoint as the rest of the indexer sees it.
    pub fn to_spec(&self) -> EndpointSpec {
        EndpointSpec {
            address: self.address.clone(),
            kv_events: self.events.clone().unwrap_or_default(),
            replay: self.replay.clone(),
            metrics_url: self.metrics.clone(),
            topic: self.topic.clone(),
        }
    }
}

/// Endpoints from a Gateway API InferencePool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// Namespace of the pool and its pods.
    pub namespace: String,
    /// `InferencePool` name.
    #[serde(alias = "inference_pool")]
    pub inference_pool: String,
    /// KV-events port when a pod has no `kvasir.io/kv-events-port` annotation.
    #[serde(default = "default_events_port", alias = "events_port")]
    pub events_port: u16,
    /// Replay port when a pod has no annotation (none by default, as vLLM).
    #[serde(default, alias = "replay_port")]
    pub replay_port: Option<u16>,
    /// Event topic when a pod has no annotation.
    #[serde(default)]
    pub topic: String,
}

fn default_events_port() -> u16 {
    5557
}

impl DiscoveryConfig {
    /// The per-pod defaults discovery applies.
    pub fn defaults(&self) -> DiscoveryDefaults {
        DiscoveryDefaults {
            events_port: self.events_port,
            replay_port: self.replay_port,
            topic: self.topic.clone(),
        }
    }
}

/// How the engines' `/metrics` are scraped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ScrapeConfig {
    /// Interval, ms (100..=1000).
    #[serde(alias = "interval_ms")]
    pub interval_ms: u64,
    /// Timeout of one scrape, ms (at most the interval).
    #[serde(alias = "timeout_ms")]
    pub timeout_ms: u64,
    /// Consecutive failed scrapes after which an endpoint is unhealthy (it
    /// is healthy again after one success).
    #[serde(alias = "unhealthy_after")]
    pub unhealthy_after: u32,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        ScrapeConfig {
            interval_ms: DEFAULT_SCRAPE_INTERVAL_MS,
            timeout_ms: 200,
            unhealthy_after: 3,
        }
    }
}

impl ScrapeConfig {
    /// The interval as a duration.
    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.interval_ms)
    }
    /// The timeout as a duration.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }
}

/// In-flight accounting of picks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct InFlightConfig {
    /// A pick with no DONE report after this long is dropped from the
    /// accounting (lost reports must not leak load forever), seconds.
    #[serde(alias = "timeout_s")]
    pub timeout_s: u64,
    /// A pick's prefill counts as queued on its endpoint until a
    /// FIRST_TOKEN or DONE report, or at most this long, ms. Bounds the
    /// error when the filter sends only DONE reports of long streams; long
    /// enough for a 100k-token prompt's prefill (~10 s on an H100), which
    /// a 2 s horizon forgot while short requests queued behind it.
    #[serde(alias = "prefill_horizon_ms")]
    pub prefill_horizon_ms: u64,
    /// A pick with no report at all (neither FIRST_TOKEN nor DONE) after
    /// this long is dropped, ms: a pick no request followed never gets one.
    /// See `load::LoadConfig::unconfirmed_timeout` for the default.
    #[serde(alias = "unconfirmed_timeout_ms")]
    pub unconfirmed_timeout_ms: u64,
    /// Unconfirmed picks (no report yet) accounted per endpoint; picks past
    /// it are answered but add no load.
    #[serde(alias = "max_unconfirmed_per_endpoint")]
    pub max_unconfirmed_per_endpoint: u32,
    /// In-flight picks tracked per pool (a memory bound); picks past it
    /// are answered but not accounted.
    #[serde(alias = "max_tracked")]
    pub max_tracked: usize,
}

impl Default for InFlightConfig {
    fn default() -> Self {
        let d = crate::load::LoadConfig::default();
        InFlightConfig {
            timeout_s: 300,
            prefill_horizon_ms: 30_000,
            unconfirmed_timeout_ms: u64::try_from(d.unconfirmed_timeout.as_millis())
                .unwrap_or(u64::MAX),
            max_unconfirmed_per_endpoint: d.max_unconfirmed_per_endpoint,
            max_tracked: d.max_tracked,
        }
    }
}

/// Parses a config file's text (YAML; JSON is YAML too).
pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
    serde_yaml::from_str(text).map_err(|e| ConfigError::Parse {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Reads and parses a config file, with its `poolsFile`'s pools added
/// (those are validated; the rest is not yet).
pub fn load_file(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut cfg = parse(&text, path)?;
    crate::pools_file::add_pools(&mut cfg, path)?;
    Ok(cfg)
}

/// Parses one `--endpoint` value into (pool name, endpoint). Whether
/// `events` may be missing depends on the pool (see [`Config::apply_args`]).
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
            if ep.events.is_none() && self.pools[idx].index == IndexSource::Events {
                return Err(ConfigError::Flag {
                    flag: flag(),
                    message: "events=tcp://IP:PORT is required (the pool's index is events; with --index picks it is not)".into(),
                });
            }
            self.pools[idx].endpoints.push(ep);
        }
        Ok(())
    }

    /// Checks ranges and consistency; the first problem is returned with
    /// its path.
    pub fn validate(&self) -> Result<(), ConfigError> {
        // The controller's pools file may list none yet; it rolls the
        // indexer when it does.
        if self.pools.is_empty() && self.pools_file.is_none() {
            return Err(invalid(
                "pools",
                "no pools configured (give --config FILE or --endpoint pool=...,address=...,events=...)",
            ));
        }
        let mut names = BTreeSet::new();
        for (i, pool) in self.pools.iter().enumerate() {
            let at = format!("pools[{i}]");
            validate_pool(pool, &at)?;
            if !names.insert(pool.name.as_str()) {
                return Err(invalid(
                    format!("{at}.name"),
                    format!("duplicate pool name `{}`", pool.name),
                ));
            }
        }
        Ok(())
    }
}

pub(crate) fn validate_pool(pool: &PoolConfig, at: &str) -> Result<(), ConfigError> {
    if pool.name.trim().is_empty() {
        return Err(invalid(format!("{at}.name"), "must not be empty"));
    }
    if pool.block_size == 0 || pool.block_size > 1024 {
        return Err(invalid(format!("{at}.blockSize"), "must be 1..=1024"));
    }
    if let TokenizerSource::Dir(dir) = &pool.tokenizer {
        if !dir.join("tokenizer.json").is_file() {
            return Err(invalid(
                format!("{at}.tokenizer"),
                format!(
                    "`{}` is not a tokenizer directory (no tokenizer.json); use a directory, `render` or `approx`",
                    dir.display()
                ),
            ));
        }
    }
    match (&pool.discovery, pool.endpoints.is_empty()) {
        (Some(_), false) => {
            return Err(invalid(
                at.to_string(),
                "give either endpoints or discovery, not both",
            ))
        }
        (None, true) => {
            return Err(invalid(
                format!("{at}.endpoints"),
                "no endpoints and no discovery",
            ))
        }
        _ => {}
    }
    let mut seen = BTreeSet::new();
    for (j, ep) in pool.endpoints.iter().enumerate() {
        let eat = format!("{at}.endpoints[{j}]");
        if ep.address.parse::<SocketAddr>().is_err() {
            return Err(invalid(
                format!("{eat}.address"),
                format!("not ip:port: `{}`", ep.address),
            ));
        }
        if !seen.insert(ep.address.as_str()) {
            return Err(invalid(
                format!("{eat}.address"),
                format!("duplicate address `{}`", ep.address),
            ));
        }
        // With index `picks` nothing subscribes: events and replay may be
        // left out (and are only checked for form when given).
        match &ep.events {
            Some(e) => check_zmq(e, &format!("{eat}.events"))?,
            None if pool.index == IndexSource::Events => {
                return Err(invalid(
                    format!("{eat}.events"),
                    "required when the pool's index is events (the engine's KV-events endpoint, tcp://ip:port); index: picks needs none",
                ))
            }
            None => {}
        }
        if let Some(r) = &ep.replay {
            check_zmq(r, &format!("{eat}.replay"))?;
        }
        if let Some(m) = &ep.metrics {
            if !m.starts_with("http://") {
                return Err(invalid(
                    format!("{eat}.metrics"),
                    format!("not an http:// URL: `{m}`"),
                ));
            }
        }
    }
    if let Some(d) = &pool.discovery {
        let dat = format!("{at}.discovery");
        if d.namespace.is_empty() {
            return Err(invalid(format!("{dat}.namespace"), "must not be empty"));
        }
        if d.inference_pool.is_empty() {
            return Err(invalid(format!("{dat}.inferencePool"), "must not be empty"));
        }
        if d.events_port == 0 {
            return Err(invalid(format!("{dat}.eventsPort"), "must be 1..=65535"));
        }
        if d.replay_port == Some(0) {
            return Err(invalid(format!("{dat}.replayPort"), "must be 1..=65535"));
        }
    }
    let s = &pool.scrape;
    if !(MIN_SCRAPE_INTERVAL_MS..=MAX_SCRAPE_INTERVAL_MS).contains(&s.interval_ms) {
        return Err(invalid(
            format!("{at}.scrape.intervalMs"),
            format!(
                "must be {MIN_SCRAPE_INTERVAL_MS}..={MAX_SCRAPE_INTERVAL_MS}, got {}",
                s.interval_ms
            ),
        ));
    }
    if s.timeout_ms == 0 || s.timeout_ms > s.interval_ms {
        return Err(invalid(
            format!("{at}.scrape.timeoutMs"),
            format!(
                "must be 1..=intervalMs ({}), got {}",
                s.interval_ms, s.timeout_ms
            ),
        ));
    }
    if s.unhealthy_after == 0 {
        return Err(invalid(
            format!("{at}.scrape.unhealthyAfter"),
            "must be at least 1",
        ));
    }
    if pool.in_flight.timeout_s == 0 {
        return Err(invalid(
            format!("{at}.inFlight.timeoutS"),
            "must be at least 1",
        ));
    }
    validate_in_flight_bounds(&pool.in_flight, at)?;
    if pool.render_timeout_ms == 0 {
        return Err(invalid(
            format!("{at}.renderTimeoutMs"),
            "must be at least 1",
        ));
    }
    if pool.pick_history_blocks == 0 {
        return Err(invalid(
            format!("{at}.pickHistoryBlocks"),
            "must be at least 1",
        ));
    }
    pool.scoring
        .validate()
        .map_err(|(field, msg)| invalid(format!("{at}.scoring.{field}"), msg))?;
    pool.saturation
        .validate()
        .map_err(|(field, msg)| invalid(format!("{at}.saturation.{field}"), msg))?;
    pool.tokenize_budget
        .validate()
        .map_err(|(field, msg)| invalid(format!("{at}.tokenizeBudget.{field}"), msg))?;
    pool.failures
        .validate()
        .map_err(|(field, msg)| invalid(format!("{at}.failures.{field}"), msg))?;
    Ok(())
}

fn validate_in_flight_bounds(f: &InFlightConfig, at: &str) -> Result<(), ConfigError> {
    let max_ms = f.timeout_s.saturating_mul(1000);
    if f.unconfirmed_timeout_ms == 0 || f.unconfirmed_timeout_ms > max_ms {
        return Err(invalid(
            format!("{at}.inFlight.unconfirmedTimeoutMs"),
            format!(
                "must be 1..=timeoutS in ms ({max_ms}), got {}",
                f.unconfirmed_timeout_ms
            ),
        ));
    }
    if f.max_unconfirmed_per_endpoint == 0 {
        return Err(invalid(
            format!("{at}.inFlight.maxUnconfirmedPerEndpoint"),
            "must be at least 1",
        ));
    }
    if f.max_tracked == 0 {
        return Err(invalid(
            format!("{at}.inFlight.maxTracked"),
            "must be at least 1",
        ));
    }
    Ok(())
}

fn check_zmq(endpoint: &str, path: &str) -> Result<(), ConfigError> {
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| {
        invalid(
            path,
            format!("not a tcp://host:port endpoint: `{endpoint}`"),
        )
    })?;
    let ok = rest
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
    if !ok {
        return Err(invalid(
            path,
            format!("not a tcp://host:port endpoint: `{endpoint}`"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_ok(text: &str) -> Config {
        parse(text, Path::new("test.yaml")).unwrap()
    }

    fn err(cfg: &Config) -> String {
        cfg.validate().unwrap_err().to_string()
    }

    const BASIC: &str = r#"
pools:
  - name: a
    tokenizer: approx
    endpoints:
      - { address: "127.0.0.1:8001", events: "tcp://127.0.0.1:5557", replay: "tcp://127.0.0.1:5558" }
  - name: b
    tokenizer: render
    block_size: 32
    discovery: { namespace: ns, inferencePool: p, eventsPort: 6000 }
    scrape: { intervalMs: 500, timeoutMs: 100 }
    scoring: { prefill: 2.0, maxQueueSkew: 262144 }
"#;

    #[test]
    fn parses_yaml_with_defaults_and_aliases() {
        let cfg = parse_ok(BASIC);
        cfg.validate().unwrap();
        assert_eq!(cfg.grpc_addr, default_grpc_addr());
        assert_eq!(cfg.pools[0].block_size, 16);
        assert_eq!(cfg.pools[0].tokenizer, TokenizerSource::Approx);
        assert_eq!(cfg.pools[0].scrape.interval_ms, 250);
        assert_eq!(cfg.pools[1].block_size, 32);
        assert_eq!(cfg.pools[1].scoring.prefill, 2.0);
        assert_eq!(cfg.pools[1].scoring.decode, Weights::default().decode);
        assert_eq!(cfg.pools[0].scoring.max_queue_skew, None);
        assert_eq!(cfg.pools[1].scoring.max_queue_skew, Some(262_144.0));
        let d = cfg.pools[1].discovery.as_ref().unwrap();
        assert_eq!(d.defaults().events_port, 6000);
        assert_eq!(d.defaults().replay_port, None);
        let spec = cfg.pools[0].endpoints[0].to_spec();
        assert_eq!(spec.metrics_url(), "http://127.0.0.1:8001/metrics");
    }

    #[test]
    fn parses_json_too() {
        let cfg = parse_ok(
            r#"{"grpcAddr":"0.0.0.0:1","pools":[{"name":"x","tokenizer":"approx",
               "endpoints":[{"address":"10.0.0.1:8000","kvEvents":"tcp://10.0.0.1:5557"}]}]}"#,
        );
        cfg.validate().unwrap();
        assert_eq!(cfg.grpc_addr.port(), 1);
    }

    #[test]
    fn unknown_keys_are_rejected_with_location() {
        let e = parse(
            "pools:\n  - name: a\n    blokSize: 3\n",
            Path::new("f.yaml"),
        )
        .unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("blokSize") && msg.contains("line"), "{msg}");
    }

    #[test]
    fn validation_errors_name_the_place() {
        let mut cfg = parse_ok(BASIC);
        cfg.pools[1].discovery = None;
        cfg.pools[1].endpoints.push(EndpointConfig {
            address: "localhost".into(),
            events: Some("tcp://127.0.0.1:1".into()),
            replay: None,
            metrics: None,
            topic: String::new(),
        });
        assert_eq!(
            err(&cfg),
            "pools[1].endpoints[0].address: not ip:port: `localhost`"
        );
        cfg.pools[1].endpoints[0].address = "127.0.0.1:9".into();
        cfg.pools[1].endpoints[0].events = Some("127.0.0.1:1".into());
        assert!(err(&cfg).starts_with("pools[1].endpoints[0].events: not a tcp://"));
        cfg.pools[1].endpoints[0].events = Some("tcp://127.0.0.1:1".into());
        cfg.pools[1].scrape.interval_ms = 50;
        assert!(err(&cfg).starts_with("pools[1].scrape.intervalMs: must be 100..=1000"));
        cfg.pools[1].scrape.interval_ms = 500;
        cfg.pools[1].name = "a".into();
        assert_eq!(err(&cfg), "pools[1].name: duplicate pool name `a`");
        cfg.pools[1].name = "b".into();
        cfg.pools[1].scoring.decode = -1.0;
        assert!(
            err(&cfg).starts_with("pools[1].scoring.decode:"),
            "{}",
            err(&cfg)
        );
        cfg.pools[1].scoring = Weights::default();
        cfg.pools[1].scoring.max_queue_skew = Some(-1.0);
        assert!(
            err(&cfg).starts_with("pools[1].scoring.maxQueueSkew:"),
            "{}",
            err(&cfg)
        );
        cfg.pools[1].scoring = Weights::default();
        cfg.pools[1].tokenizer = TokenizerSource::Dir("/nonexistent".into());
        assert!(err(&cfg)
            .starts_with("pools[1].tokenizer: `/nonexistent` is not a tokenizer directory"));
        cfg.pools[1].tokenizer = TokenizerSource::Render;
        cfg.validate().unwrap();
        cfg.pools[0].discovery = cfg.pools[0].discovery.clone().or(Some(DiscoveryConfig {
            namespace: "n".into(),
            inference_pool: "p".into(),
            events_port: 1,
            replay_port: None,
            topic: String::new(),
        }));
        assert_eq!(
            err(&cfg),
            "pools[0]: give either endpoints or discovery, not both"
        );
    }

    const PICKS: &str = r#"
pools:
  - name: a
    index: picks
    pickHistoryBlocks: 1000
    tokenizer: render
    endpoints:
      - { address: "127.0.0.1:8001" }
      - { address: "127.0.0.1:8002", events: "tcp://127.0.0.1:5557" }
  - name: b
    index: events
    pick_history_blocks: 7
    endpoints:
      - { address: "127.0.0.1:8003", events: "tcp://127.0.0.1:5559" }
  - name: c
    index: picks
    discovery: { namespace: ns, inferencePool: p }
"#;

    #[test]
    fn index_source_and_pick_history_blocks() {
        let basic = parse_ok(BASIC);
        assert_eq!(basic.pools[0].index, IndexSource::Events, "default");
        assert_eq!(basic.pools[0].pick_history_blocks, 25_000);
        let cfg = parse_ok(PICKS);
        cfg.validate().unwrap();
        assert_eq!(cfg.pools[0].index, IndexSource::Picks);
        assert_eq!(cfg.pools[0].pick_history_blocks, 1000);
        assert_eq!(cfg.pools[1].index, IndexSource::Events);
        assert_eq!(cfg.pools[1].pick_history_blocks, 7, "snake_case accepted");
        assert_eq!(cfg.pools[2].index, IndexSource::Picks);
        assert_eq!(cfg.pools[0].endpoints[0].events, None);
        let spec = cfg.pools[0].endpoints[0].to_spec();
        assert_eq!(spec.kv_events, "");
        assert_eq!(spec.metrics_url(), "http://127.0.0.1:8001/metrics");

        // Events are required with index events, and checked for form
        // when given with picks.
        let mut bad = cfg.clone();
        bad.pools[1].endpoints[0].events = None;
        assert_eq!(
            err(&bad),
            "pools[1].endpoints[0].events: required when the pool's index is events (the engine's KV-events endpoint, tcp://ip:port); index: picks needs none"
        );
        let mut bad = cfg.clone();
        bad.pools[0].endpoints[0].events = Some("127.0.0.1:1".into());
        assert!(err(&bad).starts_with("pools[0].endpoints[0].events: not a tcp://"));
        let mut bad = cfg.clone();
        bad.pools[0].endpoints[0].replay = Some("nope".into());
        assert!(err(&bad).starts_with("pools[0].endpoints[0].replay: not a tcp://"));
        let mut bad = cfg.clone();
        bad.pools[1].pick_history_blocks = 0;
        assert_eq!(err(&bad), "pools[1].pickHistoryBlocks: must be at least 1");

        // An unknown source is a parse error naming the key and the line.
        let e = parse("pools:\n  - name: a\n    index: kv\n", Path::new("f.yaml"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("pools[0].index")
                && e.contains("`events` or `picks`")
                && e.contains("line 3"),
            "{e}"
        );
        // Round trip.
        let text = serde_yaml::to_string(&cfg).unwrap();
        assert!(text.contains("index: picks"), "{text}");
        assert_eq!(parse_ok(&text), cfg);
    }

    #[test]
    fn index_flags_apply_to_flag_pools() {
        let args = Args {
            endpoints: vec![
                "pool=p,address=127.0.0.1:8001".into(),
                "pool=p,address=127.0.0.1:8002,events=tcp://127.0.0.1:5559".into(),
            ],
            tokenizer: Some("approx".into()),
            index: Some("picks".into()),
            pick_history_blocks: Some(500),
            ..Default::default()
        };
        let cfg = Config::from_args(&args).unwrap();
        assert_eq!(cfg.pools[0].index, IndexSource::Picks);
        assert_eq!(cfg.pools[0].pick_history_blocks, 500);
        assert_eq!(cfg.pools[0].endpoints[0].events, None);
        assert_eq!(
            cfg.pools[0].endpoints[1].events.as_deref(),
            Some("tcp://127.0.0.1:5559")
        );

        let no_events = Args {
            index: None,
            ..args.clone()
        };
        let e = Config::from_args(&no_events).unwrap_err().to_string();
        assert_eq!(
            e,
            "--endpoint[0] `pool=p,address=127.0.0.1:8001`: events=tcp://IP:PORT is required (the pool's index is events; with --index picks it is not)"
        );
        let bad = Args {
            index: Some("kv".into()),
            ..args.clone()
        };
        assert_eq!(
            Config::from_args(&bad).unwrap_err().to_string(),
            "--index: `kv` is not an index source (expected events or picks)"
        );
        let zero = Args {
            pick_history_blocks: Some(0),
            ..args.clone()
        };
        assert_eq!(
            Config::from_args(&zero).unwrap_err().to_string(),
            "--pick-history-blocks: must be at least 1"
        );

        // The flags shape only pools the flags create; an endpoint added to
        // a file's pool follows that pool's index.
        let mut file = parse_ok(PICKS);
        let add = Args {
            endpoints: vec![
                "pool=a,address=127.0.0.1:8009".into(),
                "pool=b,address=127.0.0.1:8010".into(),
            ],
            index: Some("events".into()),
            ..Default::default()
        };
        let e = file.apply_args(&add).unwrap_err().to_string();
        assert!(
            e.starts_with(
                "--endpoint[1] `pool=b,address=127.0.0.1:8010`: events=tcp://IP:PORT is required"
            ),
            "{e}"
        );
        assert_eq!(file.pools[0].index, IndexSource::Picks);
        assert_eq!(file.pools[0].endpoints.len(), 3);
    }

    #[test]
    fn endpoint_flags_make_pools() {
        let args = Args {
            endpoints: vec![
                "pool=p,address=127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558".into(),
                "pool=p,address=127.0.0.1:8002,events=tcp://127.0.0.1:5559".into(),
            ],
            tokenizer: Some("approx".into()),
            grpc_addr: Some("127.0.0.1:1234".parse().unwrap()),
            ..Default::default()
        };
        let cfg = Config::from_args(&args).unwrap();
        assert_eq!(cfg.grpc_addr.port(), 1234);
        assert_eq!(cfg.pools.len(), 1);
        assert_eq!(cfg.pools[0].endpoints.len(), 2);
        assert_eq!(
            cfg.pools[0].endpoints[0].replay.as_deref(),
            Some("tcp://127.0.0.1:5558")
        );
        assert_eq!(cfg.pools[0].tokenizer, TokenizerSource::Approx);

        let bad = Args {
            endpoints: vec!["pool=p,adress=1".into()],
            ..Default::default()
        };
        let e = Config::from_args(&bad).unwrap_err().to_string();
        assert!(
            e.starts_with("--endpoint[0] `pool=p,adress=1`: unknown key `adress`"),
            "{e}"
        );
        let none = Config::from_args(&Args::default()).unwrap_err().to_string();
        assert!(none.starts_with("pools: no pools configured"), "{none}");
    }
}
