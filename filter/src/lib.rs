//! # kvasir-filter
//!
//! Kvasir's Envoy filter: a proxy-wasm HTTP filter (`wasm32-wasip1`) that,
//! for every LLM request, finds the tenant, applies the compiled policies
//! ([`kvasir_policy`]), asks the cache-indexer over gRPC which endpoint
//! holds the prompt's prefix (`kvasir.v1.Indexer/Pick`), and sends the
//! request exactly there through Envoy's override-host load balancer
//! (`x-gateway-destination-endpoint`), failing open to Envoy's own load
//! balancing when the indexer is slow or down. On the way back it measures
//! TTFT, inter-token gaps and end-to-end time, reads `usage`, reports to
//! the indexer and writes per-tenant, per-model Envoy stats.
//!
//! The crate is a thin adapter. Every decision is in `kvasir-policy` or in
//! the pure modules here, which build and are tested natively:
//!
//! - [`settings`]: the plugin configuration (policy document + settings);
//! - [`request`]: API kind by path, borrowed parsing of the needed fields;
//! - [`rewrite`]: model rewrite and `include_usage` injection by splicing;
//! - [`scan`]: every string of a body, for the PII scan;
//! - [`reply`]: local replies in OpenAI's or Anthropic's error shape;
//! - [`pick`]: `Pick` / `Report` messages and the fail-open rules;
//! - [`governance`]: the 429s of a rate-limited or shed pick, the
//!   `x-ratelimit-*` headers, when a stream reports its usage so far;
//! - [`session`]: the per-VM `Session` streams' decisions (send on a
//!   stream or fall back to unary, open, time out, deliver) and the root's
//!   timer period;
//! - [`shared`]: the state one VM's requests share (config, pool states);
//! - [`response`]: TTFT / ITL / e2e and `usage` from JSON or SSE;
//! - [`stats`]: stat names (Prometheus labels via stats tags);
//! - [`host`]: what the filter asks of Envoy, the [`host::Host`] trait;
//! - [`engine`]: the per-request state machine over a [`host::Host`].
//!
//! Only the `wasm` module (built for `wasm32` alone) touches the
//! proxy-wasm SDK. See `filter/README.md` for deployment and the stats.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod engine;
pub mod governance;
pub mod host;
pub mod local_budget;
pub mod pick;
pub mod reply;
pub mod request;
pub mod response;
pub mod rewrite;
pub mod scan;
pub mod session;
pub mod settings;
pub mod shared;
pub mod stats;

#[cfg(target_arch = "wasm32")]
mod wasm;
