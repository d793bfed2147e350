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
//!       - address: 10.0.0.6:8000      # no events: read from its GET /kv_event_sources
//!   - name: llama
//!     tokenizer: render
//!     discovery: { namespace: serving, inferencePool: llama }   # kvEventSources: true by default
//!   - name: legacy
//!     discovery: { namespace: serving, inferencePool: old, eventsPort: 5557, replayPort: 5558 }
//! responses: { store: redis, redisUrl: "redis://redis:6379" }  # see [`crate::responses::config`]
//! sharedLoad: { redisUrl: "redis://redis:6379" }  # replicas see each other's picks, see [`crate::shared_load::config`]
//! ```
//!
//! The parts: [`schema`] (the file's types and defaults), [`error`],
//! [`file`] (reading a file, with its [`pools_file`]), [`flags`] (the
//! command line on top of the file) and [`validate`].

pub mod error;
pub mod file;
pub mod flags;
pub mod pools_file;
pub mod schema;
pub mod validate;

pub use error::ConfigError;
pub use file::{load_file, parse};
pub use flags::{parse_endpoint_flag, Args};
pub use schema::{
    Config, DiscoveryConfig, EndpointConfig, InFlightConfig, PoolConfig, ScrapeConfig,
    TokenizerSource, DEFAULT_BLOCK_SIZE, DEFAULT_SCRAPE_INTERVAL_MS, DEFAULT_SHUTDOWN_GRACE_MS,
    MAX_SCRAPE_INTERVAL_MS, MIN_SCRAPE_INTERVAL_MS,
};

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
