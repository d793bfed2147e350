//! What a subscriber shares with its handle: the sync state and the ingest
//! counters, all atomics so `/metrics` reads them without a lock.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;

/// Where a subscriber stands with its engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SyncState {
    /// Connecting sockets / doing the initial replay has not started yet.
    Connecting,
    /// Caught up: every batch up to the last known sequence number is applied.
    InSync,
    /// Filling the start-up history or a gap from the engine's replay buffer.
    Replaying,
    /// The endpoint was cleared and is being rebuilt (replay could not cover
    /// a gap, the engine restarted, or it came back after being unreachable).
    Resyncing,
    /// No contact: TCP disconnect, probes failing, or marked unreachable.
    Disconnected,
    /// Nothing to subscribe to: the endpoint has no events address and the
    /// engine's `/kv_event_sources` is unreachable, malformed, or says it
    /// publishes none (retried with backoff; picks use the endpoint by load).
    NoSource,
}

impl SyncState {
    pub(super) fn from_u8(v: u8) -> Self {
        match v {
            0 => SyncState::Connecting,
            1 => SyncState::InSync,
            2 => SyncState::Replaying,
            3 => SyncState::Resyncing,
            5 => SyncState::NoSource,
            _ => SyncState::Disconnected,
        }
    }

    /// Lower-case name for logs and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            SyncState::Connecting => "connecting",
            SyncState::InSync => "in_sync",
            SyncState::Replaying => "replaying",
            SyncState::Resyncing => "resyncing",
            SyncState::Disconnected => "disconnected",
            SyncState::NoSource => "no_source",
        }
    }
}

/// Counters of one subscriber: relaxed atomics, safe to read at any time
/// (e.g. for `/metrics`); [`IngestStats::snapshot`] copies them.
#[derive(Debug)]
pub struct IngestStats {
    /// Messages received on the live SUB socket.
    pub messages: AtomicU64,
    /// Batches applied to the index (live and replayed).
    pub batches_applied: AtomicU64,
    /// Events applied (all kinds).
    pub events_applied: AtomicU64,
    /// Blocks newly indexed.
    pub blocks_stored: AtomicU64,
    /// Blocks removed from the index.
    pub blocks_removed: AtomicU64,
    /// `AllBlocksCleared` events applied.
    pub all_cleared: AtomicU64,
    /// Events the index skipped (non-GPU medium, other block size, unknown
    /// parent, non-full-attention group) or the decoder did not know.
    pub skipped_events: AtomicU64,
    /// Undecodable messages (bad frames or payloads); each is skipped.
    pub decode_errors: AtomicU64,
    /// Live batches that replay had already applied, dropped.
    pub duplicates: AtomicU64,
    /// Gaps in the sequence numbers detected.
    pub gaps: AtomicU64,
    /// Replays requested (start-up, gaps, reconnects, resyncs and the
    /// replays idle probes make).
    pub replays: AtomicU64,
    /// Batches received through replay and applied.
    pub replayed_batches: AtomicU64,
    /// Times the endpoint was cleared and rebuilt.
    pub resyncs: AtomicU64,
    /// Engine restarts detected.
    pub restarts: AtomicU64,
    /// Unix time in ms of the last engine restart detected (0 = none): what
    /// the engine held in memory before it (stored Responses API responses)
    /// is gone.
    pub last_restart_unix_ms: AtomicU64,
    /// Idle probes sent.
    pub probes: AtomicU64,
    /// Replays or probes that failed (connect error, timeout, too long).
    pub replay_failures: AtomicU64,
    /// Successful SUB connects and reconnects.
    pub connects: AtomicU64,
    /// Live messages dropped because the replay-time buffer was full.
    pub buffer_overflows: AtomicU64,
    /// Requests for the engine's `/kv_event_sources` (endpoints without an
    /// events address).
    pub source_lookups: AtomicU64,
    /// Of those, the ones that gave nothing to subscribe to (unreachable,
    /// malformed, events off, no such route).
    pub source_failures: AtomicU64,
    /// Times the engine advertised other sockets than the ones followed
    /// and the subscriber moved to them.
    pub source_changes: AtomicU64,
    /// Last applied sequence number (`u64::MAX` before the first).
    pub last_seq: AtomicU64,
    /// Unix time in ms of the last contact with the engine (0 = never).
    pub last_contact_unix_ms: AtomicU64,
}

impl Default for IngestStats {
    fn default() -> Self {
        IngestStats {
            messages: AtomicU64::new(0),
            batches_applied: AtomicU64::new(0),
            events_applied: AtomicU64::new(0),
            blocks_stored: AtomicU64::new(0),
            blocks_removed: AtomicU64::new(0),
            all_cleared: AtomicU64::new(0),
            skipped_events: AtomicU64::new(0),
            decode_errors: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            replayed_batches: AtomicU64::new(0),
            resyncs: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            last_restart_unix_ms: AtomicU64::new(0),
            probes: AtomicU64::new(0),
            replay_failures: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            buffer_overflows: AtomicU64::new(0),
            source_lookups: AtomicU64::new(0),
            source_failures: AtomicU64::new(0),
            source_changes: AtomicU64::new(0),
            last_seq: AtomicU64::new(u64::MAX),
            last_contact_unix_ms: AtomicU64::new(0),
        }
    }
}

/// A plain copy of [`IngestStats`] (field meanings are the same).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct IngestStatsSnapshot {
    pub messages: u64,
    pub batches_applied: u64,
    pub events_applied: u64,
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    pub all_cleared: u64,
    pub skipped_events: u64,
    pub decode_errors: u64,
    pub duplicates: u64,
    pub gaps: u64,
    pub replays: u64,
    pub replayed_batches: u64,
    pub resyncs: u64,
    pub restarts: u64,
    pub probes: u64,
    pub replay_failures: u64,
    pub connects: u64,
    pub buffer_overflows: u64,
    pub source_lookups: u64,
    pub source_failures: u64,
    pub source_changes: u64,
    /// `None` before the first applied batch.
    pub last_seq: Option<u64>,
    pub last_contact_unix_ms: u64,
}

impl IngestStats {
    /// A copy of every counter (each read on its own; good enough for metrics).
    pub fn snapshot(&self) -> IngestStatsSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let last = l(&self.last_seq);
        IngestStatsSnapshot {
            messages: l(&self.messages),
            batches_applied: l(&self.batches_applied),
            events_applied: l(&self.events_applied),
            blocks_stored: l(&self.blocks_stored),
            blocks_removed: l(&self.blocks_removed),
            all_cleared: l(&self.all_cleared),
            skipped_events: l(&self.skipped_events),
            decode_errors: l(&self.decode_errors),
            duplicates: l(&self.duplicates),
            gaps: l(&self.gaps),
            replays: l(&self.replays),
            replayed_batches: l(&self.replayed_batches),
            resyncs: l(&self.resyncs),
            restarts: l(&self.restarts),
            probes: l(&self.probes),
            replay_failures: l(&self.replay_failures),
            connects: l(&self.connects),
            buffer_overflows: l(&self.buffer_overflows),
            source_lookups: l(&self.source_lookups),
            source_failures: l(&self.source_failures),
            source_changes: l(&self.source_changes),
            last_seq: (last != u64::MAX).then_some(last),
            last_contact_unix_ms: l(&self.last_contact_unix_ms),
        }
    }
}

impl IngestStats {
    /// Counts an engine restart and notes when it was seen.
    pub(super) fn restarted(&self) {
        inc(&self.restarts, 1);
        self.last_restart_unix_ms
            .store(unix_ms(), Ordering::Relaxed);
    }
}

pub(super) fn inc(a: &AtomicU64, n: u64) {
    a.fetch_add(n, Ordering::Relaxed);
}

pub(super) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// State shared between the task and its handle.
pub(super) struct Shared {
    pub(super) state: AtomicU8,
    pub(super) stats: IngestStats,
    pub(super) unreachable: AtomicBool,
    pub(super) wake: Notify,
    /// The KV-events address followed (as configured, or as the engine
    /// advertised it; empty while there is none).
    pub(super) kv_events: parking_lot::Mutex<String>,
    /// Called when the live socket loses its engine (see
    /// [`SubscriberHandle::on_disconnect`](super::SubscriberHandle::on_disconnect)).
    pub(super) on_disconnect: parking_lot::Mutex<Option<DisconnectHook>>,
}

/// What a subscriber calls when its engine's socket disconnects: the
/// service probes the engine's health at once instead of waiting for its
/// next scrape. It must return quickly (it runs on the subscriber's task).
pub type DisconnectHook = std::sync::Arc<dyn Fn() + Send + Sync>;
