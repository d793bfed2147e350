//! How a subscriber follows its endpoint: addresses, timeouts and caps.

use std::time::Duration;

use crate::discovery::EngineSource;
use crate::types::EndpointSpec;

/// How to follow one endpoint's KV events. Build it with
/// [`SubscriberConfig::new`] and adjust fields.
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// The engine endpoint: its `kv_events` PUB address, optional `replay`
    /// ROUTER address and `topic`.
    pub endpoint: EndpointSpec,
    /// The pool's block size. The index is authoritative (events with another
    /// size are skipped there); a mismatch with the index is logged at start.
    pub block_size: u32,
    /// Wait between attempts when the SUB socket cannot connect.
    pub reconnect: Duration,
    /// Longest wait for one TCP connect + ZMTP handshake.
    pub connect_timeout: Duration,
    /// Longest wait for the first / next reply of a replay.
    pub replay_timeout: Duration,
    /// Longest a whole replay may take (a replay that never ends times out).
    pub replay_deadline: Duration,
    /// With a replay endpoint: after this long without contact, probe the
    /// engine through replay.
    pub idle_probe: Duration,
    /// With a replay endpoint: failed probes for this long make the state
    /// [`SyncState::Disconnected`](super::state::SyncState::Disconnected).
    pub stale_after: Duration,
    /// Most live messages buffered while a replay runs; beyond it they are
    /// dropped and recovered as a gap.
    pub max_buffered: usize,
    /// Most batches one replay may deliver (vLLM buffers 10,000 by default).
    pub max_replay_batches: usize,
    /// Where to read the sockets when `endpoint.kv_events` is empty: the
    /// engine's `/kv_event_sources` (see [`SubscriberConfig::with_source`]).
    /// `None` with an empty address: nothing to follow ([`SyncState::NoSource`](super::state::SyncState::NoSource)).
    pub source: Option<EngineSource>,
    /// First wait before asking the engine again after an answer that gave
    /// nothing to follow (doubling up to `source_retry_max`).
    pub source_retry_min: Duration,
    /// Longest wait between two requests for the engine's sources.
    pub source_retry_max: Duration,
}

impl SubscriberConfig {
    /// Defaults: reconnect 1 s, connect timeout 2 s, replay reply timeout 3 s,
    /// replay deadline 60 s, idle probe 5 s, stale after 15 s, 100,000
    /// buffered messages, 1,000,000 replayed batches; no engine source,
    /// asked again after 0.5 s doubling to 30 s when it has one.
    pub fn new(endpoint: EndpointSpec, block_size: u32) -> Self {
        SubscriberConfig {
            endpoint,
            block_size,
            reconnect: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(2),
            replay_timeout: Duration::from_secs(3),
            replay_deadline: Duration::from_secs(60),
            idle_probe: Duration::from_secs(5),
            stale_after: Duration::from_secs(15),
            max_buffered: 100_000,
            max_replay_batches: 1_000_000,
            source: None,
            source_retry_min: Duration::from_millis(500),
            source_retry_max: Duration::from_secs(30),
        }
    }

    /// Reads the sockets from the engine (`client` GETs `/kv_event_sources`
    /// at the endpoint's address) when the endpoint has no events address;
    /// an address that is given wins, and the engine is not asked.
    pub fn with_source(mut self, client: &reqwest::Client) -> Self {
        if self.endpoint.kv_events.is_empty() {
            self.source = Some(EngineSource::new(client.clone(), &self.endpoint.address));
        }
        self
    }
}
