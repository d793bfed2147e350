//! Load tracking: what each engine says about itself (scraped from vLLM's
//! `/metrics`) and what this indexer has sent it (in-flight picks).
//!
//! * **Scrapes.** Every interval each endpoint's `/metrics` is fetched with a
//!   timeout and `vllm:num_requests_running`, `vllm:num_requests_waiting` and
//!   `vllm:kv_cache_usage_perc` are read (summed over series for the two
//!   counts, averaged for KV usage: a data-parallel engine exposes one series
//!   per rank, and its HTTP server balances across them). An endpoint is
//!   healthy from its first successful scrape and unhealthy after
//!   `unhealthyAfter` failures in a row, or at once when the connection is
//!   refused (nobody listens); it has to be scraped once before it is
//!   picked at all, so a freshly added endpoint joins within one interval.
//!   An endpoint whose KV-event socket disconnects is probed at once
//!   ([`liveness`]), not at the next interval.
//! * **In flight.** A pick with a request id adds the request to its
//!   endpoint, with the prefill tokens it is expected to compute; a
//!   FIRST_TOKEN report ends its prefill part, a DONE report (or the
//!   in-flight timeout, for lost reports) removes it. The prefill part also
//!   lapses after the prefill horizon, so filters that only report DONE do not
//!   make long streams look like queued prefill forever. A prompt whose
//!   prefill ended keeps counting as held by its engine for
//!   [`PENDING_GRACE`], until its KV events have reached the index.
//! * **Saturation.** Per endpoint, `max(kv_usage / kvUsage, waiting /
//!   waiting)` capped at 1; saturated at 1, i.e. when KV usage or the waiting
//!   queue reaches its threshold. Only *KV-full* endpoints (usage at
//!   `kvUsage`) are left out of picks; a long waiting queue is priced by the
//!   scorer's queue terms instead (see `scoring`), unless `leaveOutQueued`
//!   asks for the old rule (every saturated endpoint left out). Pool saturation is the
//!   **mean** over healthy endpoints (1 when none is healthy): the fraction of
//!   the pool's headroom in use, which is what an admission policy wants; the
//!   minimum would report a pool with one idle endpoint as empty.
//! * **Other replicas.** With shared load ([`crate::shared_load`]) the
//!   views' in-flight and queued-prefill terms also count the picks other
//!   indexer replicas placed, as last read from the shared store
//!   ([`peers`]), for at most the store's TTL after the read.
//!
//! The parts, lowest first: [`engine_metrics`] reads an engine's `/metrics`
//! page, [`saturation`] says when an engine is too loaded, [`prefix`] hashes
//! prompts into block chains (shared with the pick path), [`tracker`] keeps
//! the per-pool state and [`scrape`] fetches the pages into it.

mod drain;
pub mod engine_metrics;
pub mod liveness;
pub mod peer_chains;
pub mod peers;
mod placed;
pub mod prefix;
pub mod saturation;
pub mod scrape;
pub mod tracker;
mod tracker_state;

pub use engine_metrics::{parse_sample, parse_vllm_metrics, EngineLoad, MetricsParseError, Sample};
pub use liveness::Liveness;
pub use peer_chains::SampledChain;
pub use peers::{PeerLoad, PeerPending, PeerStats};
pub(crate) use placed::Placed;
pub use placed::{SharedPlacements, MAX_SHARED_ENDS, MAX_SHARED_STARTS};
pub use prefix::{
    block_chain, common_prefix, extend_block_chain, MAX_PENDING_PREFIXES, PENDING_GRACE,
};
pub use saturation::SaturationThresholds;
pub use scrape::{refused, scrape, scrape_all, ScrapeError};
pub use tracker::{
    pool_saturation, Accounting, BoundStats, LoadConfig, LoadTracker, LoadView, PendingChains,
    Phase,
};
pub use tracker_state::ReportMatch;
