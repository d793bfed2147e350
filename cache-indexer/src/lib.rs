//! Kvasir's cache-indexer: knows what every vLLM instance holds in its KV
//! cache (from the engines' own KV events) and how loaded each one is, and
//! answers "which endpoint should serve this request" over gRPC.
#![forbid(unsafe_code)]

pub mod app;
pub mod auth;
pub mod config;
pub mod discovery;
pub mod events;
pub mod health;
pub mod history;
pub mod http;
pub mod index;
pub mod lifecycle;
pub mod load;
pub mod metrics;
mod pick_tokens;
pub mod pools_file;
pub mod scoring;
pub mod service;
pub mod session;
pub mod tokenize;
pub mod types;
