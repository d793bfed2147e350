//! One subscriber task per engine endpoint: follows vLLM's KV-event stream
//! over ZMQ and keeps the pool's [`PoolIndex`] in step with the engine.
//!
//! # Protocol (FACTS.md "vLLM KV-cache events")
//!
//! * Live: a SUB socket subscribed to the endpoint's topic receives
//!   `[topic, seq (8 bytes BE), payload]`; `seq` starts at 0 per engine
//!   process and grows by one per batch.
//! * Replay: a DEALER sends `["", start_seq (8 bytes BE)]` to the engine's
//!   ROUTER and gets every buffered batch with `seq >= start` as
//!   `["", topic, seq, payload]` (older vLLM: no topic frame), then
//!   `["", "", 0xFF x 8, ""]`. Each replay uses a fresh DEALER, so a late
//!   answer to an abandoned replay can never be mistaken for a new one.
//!
//! # What the task does
//!
//! * **Start**: connect, then replay from 0 (everything still buffered) and
//!   apply it, buffering live messages meanwhile; live batches the replay
//!   already covered are dropped as duplicates. Without a replay endpoint the
//!   first live batch is the baseline.
//! * **Gap** (`seq > last + 1`): replay from `last`. The first reply must be
//!   batch `last` with the payload hash remembered for it: that proves the
//!   engine is the same process and the history continues, and the rest fills
//!   the gap in order. When replay cannot prove or cover it (the buffer no
//!   longer has `last`, no replay endpoint, timeout), the endpoint is cleared
//!   and rebuilt from whatever replay has (`resyncs`).
//! * **Engine restart** (`seq` went backwards and the payload is not one we
//!   applied, or replay shows a different history): clear the endpoint and
//!   start over from replay 0 (`restarts`).
//! * **Liveness**: ZMQ PUB/SUB has no heartbeat and an idle engine sends
//!   nothing. With a replay endpoint, after `idle_probe` of silence the task
//!   probes the engine with a verified replay from `last` (this also picks up
//!   a lost last batch, which no later batch would reveal). Probes that fail
//!   for `stale_after` turn the state to [`SyncState::Disconnected`]; so does a
//!   TCP disconnect seen by the SUB socket (it reconnects by itself; on
//!   reconnect the history is verified again; the service's
//!   [`SubscriberHandle::on_disconnect`] hook hears of it at once) and
//!   [`SubscriberHandle::mark_unreachable`]. The subscriber never removes the
//!   endpoint from the index itself: the service decides (from the state, the
//!   idle time and its own health checks) and calls
//!   [`PoolIndex::remove_endpoint`]; after `mark_unreachable`, the next
//!   contact rebuilds the endpoint from scratch.
//!
//! * **Engine-advertised sockets**: an endpoint without an events address
//!   (and a [`SubscriberConfig::source`]) first asks the engine's
//!   `/kv_event_sources` (vLLM 0.34) where it publishes; until it gets an
//!   answer it can follow the state is [`SyncState::NoSource`] and it asks
//!   again with backoff. It asks again when the stream shows the engine
//!   went away or restarted (a disconnect, [`SubscriberHandle::mark_unreachable`],
//!   a restart seen in the sequence numbers): when the answer changed, the
//!   endpoint is rebuilt from the new sockets; when the engine now says
//!   it publishes nothing, the endpoint is cleared.
//!
//! Every wait is bounded (connect timeout, per-reply and overall replay
//! deadlines, buffered-message and replayed-batch caps), and undecodable
//! messages are counted and skipped: nothing an engine sends stops the task.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::state::{unix_ms, DisconnectHook, Shared};
use super::worker::Worker;
use crate::index::PoolIndex;
use crate::types::EndpointId;

pub use super::state::{IngestStats, IngestStatsSnapshot, SyncState};
pub use super::subscriber_config::SubscriberConfig;

/// Owns a running subscriber; the task stops when this is dropped (or on
/// [`SubscriberHandle::stop`]).
pub struct SubscriberHandle {
    endpoint: EndpointId,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for SubscriberHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubscriberHandle")
            .field("endpoint", &self.endpoint)
            .field("state", &self.state())
            .finish()
    }
}

impl SubscriberHandle {
    /// The endpoint this subscriber feeds.
    pub fn endpoint(&self) -> EndpointId {
        self.endpoint
    }

    /// Current sync state.
    pub fn state(&self) -> SyncState {
        SyncState::from_u8(self.shared.state.load(Ordering::Relaxed))
    }

    /// The KV-events address followed: the configured one, or the one the
    /// engine advertised (empty while there is none).
    pub fn kv_events(&self) -> String {
        self.shared.kv_events.lock().clone()
    }

    /// Live counters.
    pub fn stats(&self) -> &IngestStats {
        &self.shared.stats
    }

    /// Time since the last contact with the engine (a live message or an
    /// answered replay/probe); `None` before the first.
    pub fn idle_for(&self) -> Option<Duration> {
        let t = self
            .shared
            .stats
            .last_contact_unix_ms
            .load(Ordering::Relaxed);
        (t != 0).then(|| Duration::from_millis(unix_ms().saturating_sub(t)))
    }

    /// The service's health hint: the engine is unreachable (e.g. its health
    /// checks fail) and the service is about to drop it from the index (or
    /// already has). The state becomes [`SyncState::Disconnected`] and the
    /// next contact with the engine rebuilds the endpoint from scratch
    /// (clear + replay from 0), because the index may have lost it meanwhile.
    pub fn mark_unreachable(&self) {
        self.shared.unreachable.store(true, Ordering::Relaxed);
        self.shared
            .state
            .store(SyncState::Disconnected as u8, Ordering::Relaxed);
        self.shared.wake.notify_one();
    }

    /// Calls `hook` each time the live socket sees its engine disconnect
    /// (replacing any earlier hook). A disconnect is a hint, not a verdict:
    /// an engine that died closes it, but so may a network blip, so the
    /// hook should check the engine rather than drop it.
    pub fn on_disconnect(&self, hook: DisconnectHook) {
        *self.shared.on_disconnect.lock() = Some(hook);
    }

    /// Waits until the state is `want` or `timeout` passes; returns whether
    /// it got there (for tests and start-up readiness).
    pub async fn wait_for_state(&self, want: SyncState, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.state() == want {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stops the task now (dropping the handle does the same).
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for SubscriberHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts following `cfg.endpoint`'s KV events into `index` (as the index's
/// endpoint `cfg.endpoint.id()`). Must be called inside a tokio runtime; the
/// task runs until the handle is dropped.
pub fn spawn_subscriber(cfg: SubscriberConfig, index: Arc<PoolIndex>) -> SubscriberHandle {
    let endpoint = cfg.endpoint.id();
    if cfg.block_size != index.block_size() {
        tracing::warn!(
            %endpoint,
            config = cfg.block_size,
            index = index.block_size(),
            "subscriber block size differs from the pool index; the index's wins"
        );
    }
    let shared = Arc::new(Shared {
        state: AtomicU8::new(SyncState::Connecting as u8),
        stats: IngestStats::default(),
        unreachable: AtomicBool::new(false),
        wake: Notify::new(),
        kv_events: parking_lot::Mutex::new(cfg.endpoint.kv_events.clone()),
        on_disconnect: parking_lot::Mutex::new(None),
    });
    let worker = Worker::new(cfg, index, shared.clone());
    let task = tokio::spawn(worker.run());
    SubscriberHandle {
        endpoint,
        shared,
        task,
    }
}
