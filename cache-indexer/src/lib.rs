//! Kvasir's cache-indexer: knows what every vLLM instance holds in its KV
//! cache (from the engines' own KV events) and how loaded each one is, and
//! answers "which endpoint should serve this request" over gRPC.
//!
//! What it offers:
//! * the indexer as the binary runs it: a [`Config`](config::Config), then
//!   [`start`] gives a running [`Indexer`] (gRPC `kvasir.v1.Indexer`,
//!   `/metrics`, `/healthz`, `/readyz`);
//! * the picker in process, for benchmarks and tests: a [`Pool`] per pool
//!   (its [`Pool::pick`] is the whole pick path), [`Pools`] by name, and
//!   [`IndexerService`], the gRPC service over them;
//! * the building blocks tests and benchmarks drive directly: the
//!   configuration, the KV-event ingest, the prefix index, load tracking,
//!   scoring, tokenization, discovery and the shared types.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use app::{start, AppError, Indexer};
pub use auth::RELOAD_INTERVAL as TOKEN_RELOAD_INTERVAL;
pub use pool::{stored_batch, Endpoint, EndpointChanges, Pool, ServiceError};
pub use pools::Pools;
pub use service::IndexerService;

pub mod budgets;
pub mod config;
pub mod discovery;
pub mod events;
pub mod flow;
pub mod grpc_limit;
pub mod index;
pub mod load;
pub mod picker;
pub mod responses;
pub mod scoring;
mod service;
pub mod shared_load;
pub mod tokenize;
pub mod types;

mod abandoned;
mod app;
mod auth;
mod endpoint;
mod exposition;
mod health;
mod history;
mod http;
mod lifecycle;
mod metrics;
mod pick;
mod pool;
mod pools;
mod redis_link;
mod report;
mod session;
