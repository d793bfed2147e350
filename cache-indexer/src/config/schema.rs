//! The configuration file's shape: every key, its default and its
//! spellings.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use crate::budgets::config::BudgetsConfig;
use crate::discovery::DiscoveryDefaults;
use crate::health::FailureConfig;
use crate::history::DEFAULT_PICK_HISTORY_BLOCKS;
use crate::load::SaturationThresholds;
use crate::responses::config::ResponsesConfig;
use crate::scoring::Weights;
use crate::shared_load::config::SharedLoadConfig;
use crate::tokenize::TokenizeBudget;
use crate::types::{EndpointSpec, IndexSource};
use kvasir_flowcontrol::FlowControlConfig;

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
    /// Largest gRPC message the gRPC port accepts, bytes (a Pick carries
    /// the prompt, so at least the filter's `bodyLimitBytes`); a larger one
    /// is refused with RESOURCE_EXHAUSTED before it is buffered.
    #[serde(
        default = "default_grpc_max_message_bytes",
        alias = "grpc_max_message_bytes"
    )]
    pub grpc_max_message_bytes: usize,
    /// A file of more pools, added to `pools` at load (see [`super::pools_file`]);
    /// relative to this file's directory.
    #[serde(default, alias = "pools_file")]
    pub pools_file: Option<PathBuf>,
    /// Which engine holds each stored Responses API response (see
    /// [`crate::responses::config`]).
    #[serde(default)]
    pub responses: ResponsesConfig,
    /// Other replicas' in-flight picks and queued prefill, through Redis
    /// (see [`crate::shared_load::config`]); off by default.
    #[serde(default, alias = "shared_load")]
    pub shared_load: SharedLoadConfig,
    /// Where tenants' token budgets are kept (see [`crate::budgets::config`]): in
    /// this process by default, or in Redis shared by replicas.
    #[serde(default)]
    pub budgets: BudgetsConfig,
    /// Endpoint pickers (the Inference Extension's ext_proc protocol), one
    /// per pool that gateways handling InferencePool themselves reach
    /// (see [`crate::picker`]); none by default.
    #[serde(default)]
    pub pickers: Vec<crate::picker::PickerConfig>,
}

pub(super) fn default_grpc_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 50051))
}
fn default_http_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 9090))
}
/// Default of [`Config::grpc_max_message_bytes`]: 4 MiB, gRPC's usual
/// limit, four times the filter's default `bodyLimitBytes` (a Pick is the
/// prompt plus a few hundred bytes).
pub const DEFAULT_GRPC_MAX_MESSAGE_BYTES: usize = 4 << 20;
/// Smallest [`Config::grpc_max_message_bytes`]: room for a Report and a
/// short prompt's Pick.
pub const MIN_GRPC_MAX_MESSAGE_BYTES: usize = 64 << 10;
fn default_grpc_max_message_bytes() -> usize {
    DEFAULT_GRPC_MAX_MESSAGE_BYTES
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
            grpc_max_message_bytes: DEFAULT_GRPC_MAX_MESSAGE_BYTES,
            pools_file: None,
            responses: ResponsesConfig::default(),
            shared_load: SharedLoadConfig::default(),
            budgets: BudgetsConfig::default(),
            pickers: Vec::new(),
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
    /// When picks wait in the pool's queue instead of going to a saturated
    /// engine's (off by default).
    #[serde(default, alias = "flow_control")]
    pub flow_control: FlowControlConfig,
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
            flow_control: FlowControlConfig::default(),
        }
    }
}

/// One static engine endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EndpointConfig {
    /// HTTP address `ip:port`.
    pub address: String,
    /// KV-events PUB endpoint, `tcp://ip:port`; unused with index `picks`.
    /// Without it (index `events`) the subscriber reads the engine's own
    /// `GET /kv_event_sources` (vLLM 0.34) for it, its replay and topic;
    /// given, it wins and `replay`/`topic` are taken as written.
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
    /// Read each engine's KV-event sockets from the engine (vLLM 0.34's
    /// `GET /kv_event_sources`) for pods without a
    /// `kvasir.io/kv-events-port` annotation. Unset: on unless `eventsPort`
    /// or `replayPort` is given (see [`DiscoveryConfig::reads_engine_sources`]).
    #[serde(default, alias = "kv_event_sources")]
    pub kv_event_sources: Option<bool>,
    /// KV-events port when a pod has no `kvasir.io/kv-events-port`
    /// annotation and the engines are not asked (default 5557, vLLM's).
    #[serde(default, alias = "events_port")]
    pub events_port: Option<u16>,
    /// Replay port when a pod has no annotation (none by default, as vLLM).
    #[serde(default, alias = "replay_port")]
    pub replay_port: Option<u16>,
    /// Event topic when a pod has no annotation.
    #[serde(default)]
    pub topic: String,
}

/// vLLM's default KV-events port (`tcp://*:5557`).
pub const DEFAULT_EVENTS_PORT: u16 = 5557;

impl DiscoveryConfig {
    /// Whether pods without an events-port annotation have their KV-event
    /// sockets read from the engine. Unless set, yes when no port is
    /// configured: an engine of vLLM 0.34 or later says where it publishes
    /// (ports offset per data-parallel rank, a replay socket only if it runs
    /// one), which a guessed pool-wide port can get wrong, while a port
    /// someone wrote down is a statement about their engines to honour.
    pub fn reads_engine_sources(&self) -> bool {
        self.kv_event_sources
            .unwrap_or(self.events_port.is_none() && self.replay_port.is_none())
    }

    /// The per-pod defaults discovery applies.
    pub fn defaults(&self) -> DiscoveryDefaults {
        DiscoveryDefaults {
            kv_event_sources: self.reads_engine_sources(),
            events_port: self.events_port.unwrap_or(DEFAULT_EVENTS_PORT),
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
