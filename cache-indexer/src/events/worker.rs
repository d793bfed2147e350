//! The subscriber task: the state machine that follows one engine's live
//! stream and fills gaps, restarts and rebuilds from its replay buffer (see
//! the protocol in [`super::subscriber`]).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use zeromq::{
    DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage,
};

use super::decode::decode_batch;
use super::state::{inc, unix_ms, IngestStats, Shared, SyncState};
use super::subscriber_config::SubscriberConfig;
use crate::index::PoolIndex;
use crate::types::EndpointId;
use source::SourceFollow;

mod source;

/// Applied batches remembered (seq, payload hash) to tell a duplicate from
/// an engine restart when a sequence number repeats.
const RECENT: usize = 4096;

/// The sequence number that ends a replay.
const END_SEQ: u64 = u64::MAX;

/// One message's parts.
struct Batch {
    seq: u64,
    payload: Bytes,
}

/// Why a replay did not complete.
#[derive(Debug, thiserror::Error)]
enum ReplayError {
    #[error("no replay endpoint configured")]
    NoEndpoint,
    #[error("connect to {0} failed: {1}")]
    Connect(String, String),
    #[error("send failed: {0}")]
    Send(String),
    #[error("receive failed: {0}")]
    Recv(String),
    #[error("timed out after {0} replies")]
    Timeout(usize),
    #[error("more than {0} batches")]
    TooLong(usize),
}

/// Why the endpoint is rebuilt from replay 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rebuild {
    /// Start-up: pick up everything still buffered (counted as a replay).
    Startup,
    /// The engine restarted, came back after being unreachable, or its
    /// history could not be proven (counted as a resync).
    Resync,
}

/// How a replay's replies are used.
enum Mode {
    /// Clear first, apply everything in order.
    Full,
    /// The first reply must be (seq, hash) we applied; then apply the rest.
    Verify { seq: u64, hash: u64 },
}

/// What a replay found.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    /// Applied (and, for `Verify`, proven continuous).
    Done,
    /// `Verify` found a different history or nothing at all: the engine
    /// restarted; a full resync is needed.
    Restarted,
    /// `Verify` could not find the anchor (evicted): the endpoint was
    /// cleared and rebuilt from what replay had.
    Resynced,
}

pub(super) struct Worker {
    endpoint: EndpointId,
    cfg: SubscriberConfig,
    index: Arc<PoolIndex>,
    shared: Arc<Shared>,
    /// Last applied (or skipped-as-undecodable) sequence number.
    last: Option<u64>,
    recent: VecDeque<(u64, u64)>,
    buffered: VecDeque<Batch>,
    /// Rebuild from scratch at the next contact (start, unreachable).
    need_full: bool,
    /// A rebuild whose replay failed: retried by the idle probe (not by
    /// every live message, which would stall the stream on timeouts).
    retry_full: Option<Rebuild>,
    /// Base of the idle-probe timer: last contact or last probe.
    last_contact: Instant,
    probe_failing_since: Option<Instant>,
    decode_error_logs: u64,
    /// The engine's `/kv_event_sources`, when the endpoint has no events
    /// address of its own.
    source: Option<SourceFollow>,
}

/// Parses `[topic, seq8, payload]`; `None` for a malformed message.
fn parse_live(msg: ZmqMessage) -> Option<(Bytes, u64, Bytes)> {
    let mut f = msg.into_vec();
    if f.len() != 3 {
        return None;
    }
    let payload = f.pop()?;
    let seq = f.pop()?;
    let topic = f.pop()?;
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((topic, u64::from_be_bytes(seq), payload))
}

/// Parses a replay reply: `["", topic, seq8, payload]` or, from older vLLM,
/// `["", seq8, payload]`; `None` for a malformed one.
fn parse_reply(msg: ZmqMessage) -> Option<(u64, Bytes)> {
    let mut f: VecDeque<Bytes> = msg.into_vecdeque();
    if f.front().is_some_and(|b| b.is_empty()) && f.len() >= 3 {
        f.pop_front();
    }
    let payload = f.pop_back()?;
    let seq = f.pop_back()?;
    if f.len() > 1 {
        return None;
    }
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload))
}

impl Worker {
    /// A worker for `cfg.endpoint` that has applied nothing yet.
    pub(super) fn new(cfg: SubscriberConfig, index: Arc<PoolIndex>, shared: Arc<Shared>) -> Self {
        let source = cfg
            .source
            .clone()
            .filter(|_| cfg.endpoint.kv_events.is_empty())
            .map(|e| SourceFollow::new(e, cfg.source_retry_min, cfg.source_retry_max));
        Worker {
            source,
            endpoint: cfg.endpoint.id(),
            cfg,
            index,
            shared,
            last: None,
            recent: VecDeque::with_capacity(RECENT),
            buffered: VecDeque::new(),
            need_full: true,
            retry_full: None,
            last_contact: Instant::now(),
            probe_failing_since: None,
            decode_error_logs: 0,
        }
    }

    fn set_state(&self, s: SyncState) {
        self.shared.state.store(s as u8, Ordering::Relaxed);
    }

    fn state(&self) -> SyncState {
        SyncState::from_u8(self.shared.state.load(Ordering::Relaxed))
    }

    fn stats(&self) -> &IngestStats {
        &self.shared.stats
    }

    fn contact(&mut self) {
        self.last_contact = Instant::now();
        self.probe_failing_since = None;
        self.stats()
            .last_contact_unix_ms
            .store(unix_ms(), Ordering::Relaxed);
    }

    fn has_replay(&self) -> bool {
        self.cfg.endpoint.replay.is_some()
    }

    /// Outer loop: (re)connect the SUB socket and follow it.
    pub(super) async fn run(mut self) {
        tracing::info!(
            endpoint = %self.endpoint,
            kv_events = %self.cfg.endpoint.kv_events,
            replay = ?self.cfg.endpoint.replay,
            from_engine = self.has_engine_source(),
            "kv-event subscriber starting"
        );
        loop {
            if !self.ensure_source().await {
                continue;
            }
            self.set_state(SyncState::Connecting);
            let mut opts = SocketOptions::default();
            opts.connect_timeout(self.cfg.connect_timeout);
            let mut sub = SubSocket::with_options(opts);
            let monitor = sub.monitor();
            let connected = async {
                sub.subscribe(&self.cfg.endpoint.topic).await?;
                sub.connect(&self.cfg.endpoint.kv_events).await
            };
            let limit = self.cfg.connect_timeout + Duration::from_secs(1);
            match tokio::time::timeout(limit, connected).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(endpoint = %self.endpoint, error = %e, "kv events: connect failed");
                    self.set_state(SyncState::Disconnected);
                    self.recheck_source();
                    tokio::time::sleep(self.cfg.reconnect).await;
                    continue;
                }
                Err(_) => {
                    tracing::debug!(endpoint = %self.endpoint, "kv events: connect timed out");
                    self.set_state(SyncState::Disconnected);
                    self.recheck_source();
                    tokio::time::sleep(self.cfg.reconnect).await;
                    continue;
                }
            }
            inc(&self.stats().connects, 1);
            self.follow(&mut sub, monitor).await;
        }
    }

    /// Follows one connected SUB socket (it reconnects by itself, so this
    /// returns only if the socket is unusable, or the engine now advertises
    /// other sockets or none).
    async fn follow(
        &mut self,
        sub: &mut SubSocket,
        mut monitor: futures::channel::mpsc::Receiver<SocketEvent>,
    ) {
        // The initial sync (start-up, or after a failed connect earlier).
        self.initial_sync(sub).await;
        let mut monitor_open = true;
        let mut seen_connected = false;
        let mut recv_errors = 0u32;
        loop {
            self.drain_buffered(sub).await;
            if self.retry_full.is_some() {
                // Known to be missing history until a rebuild succeeds.
                self.promote(SyncState::Resyncing);
            } else if self.buffered.is_empty() && !self.need_full {
                self.promote(SyncState::InSync);
            }
            let probe_at = tokio::time::Instant::from_std(self.last_contact + self.cfg.idle_probe);
            let source_at = self.source_due();
            tokio::select! {
                _ = self.shared.wake.notified() => {
                    if self.shared.unreachable.swap(false, Ordering::Relaxed) {
                        tracing::info!(endpoint = %self.endpoint, "kv events: marked unreachable");
                        self.need_full = true;
                        self.set_state(SyncState::Disconnected);
                        self.recheck_source();
                    }
                }
                r = sub.recv() => match r {
                    Ok(msg) => {
                        recv_errors = 0;
                        self.on_live_message(sub, msg).await;
                    }
                    Err(e) => {
                        // The socket reports a broken peer and reconnects by
                        // itself; back off a little so a stream of errors
                        // cannot spin.
                        recv_errors = recv_errors.saturating_add(1);
                        tracing::debug!(endpoint = %self.endpoint, error = %e, "kv events: receive error");
                        if recv_errors > 1000 {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                },
                ev = monitor.next(), if monitor_open => match ev {
                    Some(SocketEvent::Disconnected(_)) => {
                        tracing::info!(endpoint = %self.endpoint, "kv events: engine disconnected");
                        self.set_state(SyncState::Disconnected);
                        // Cloned out so the hook runs without the lock.
                        let hook = self.shared.on_disconnect.lock().clone();
                        if let Some(hook) = hook {
                            hook();
                        }
                        self.recheck_source();
                    }
                    Some(SocketEvent::Connected(..)) => {
                        if seen_connected {
                            // A reconnect: same engine or a new process?
                            inc(&self.stats().connects, 1);
                            tracing::info!(endpoint = %self.endpoint, "kv events: reconnected");
                            self.contact();
                            if self.state() == SyncState::Disconnected && !self.need_full {
                                // Contact again (without replay this is all
                                // we learn until the next batch).
                                self.set_state(SyncState::Connecting);
                            }
                            self.catch_up(sub).await;
                        }
                        seen_connected = true;
                    }
                    Some(_) => {}
                    None => monitor_open = false,
                },
                _ = tokio::time::sleep_until(probe_at), if self.has_replay() => {
                    self.probe(sub).await;
                }
                // The engine may have come back elsewhere: when it now
                // advertises other sockets, reconnect to them.
                _ = tokio::time::sleep_until(source_at.unwrap_or(probe_at)), if source_at.is_some() => {
                    if self.source_due_now().await {
                        return;
                    }
                }
            }
        }
    }

    /// Moves to `to` unless the state is Disconnected: a disconnected
    /// subscriber stays so until contact. A compare-and-swap, so a
    /// concurrent [`SubscriberHandle::mark_unreachable`](super::SubscriberHandle::mark_unreachable) is never overwritten.
    fn promote(&self, to: SyncState) {
        let cur = self.shared.state.load(Ordering::Relaxed);
        if cur == SyncState::Disconnected as u8 || cur == to as u8 {
            return;
        }
        let _ =
            self.shared
                .state
                .compare_exchange(cur, to as u8, Ordering::Relaxed, Ordering::Relaxed);
    }

    async fn initial_sync(&mut self, sub: &mut SubSocket) {
        if !self.need_full {
            self.catch_up(sub).await;
            return;
        }
        if self.has_replay() {
            self.full_sync(sub, Rebuild::Startup).await;
        } else {
            // Nothing to replay: the first live batch is the baseline.
            self.index.clear_endpoint(self.endpoint);
            self.reset_history();
            self.need_full = false;
        }
    }

    fn reset_history(&mut self) {
        self.last = None;
        self.recent.clear();
        self.stats().last_seq.store(u64::MAX, Ordering::Relaxed);
    }

    /// Clear the endpoint and rebuild it from replay 0 (or, without replay,
    /// from the next live batch). Returns whether the replay completed; if
    /// not, the idle probe retries it.
    async fn full_sync(&mut self, sub: &mut SubSocket, why: Rebuild) -> bool {
        self.set_state(match why {
            Rebuild::Startup => SyncState::Replaying,
            Rebuild::Resync => SyncState::Resyncing,
        });
        match why {
            Rebuild::Startup => inc(&self.stats().replays, 1),
            Rebuild::Resync => {
                inc(&self.stats().resyncs, 1);
                if self.has_replay() {
                    inc(&self.stats().replays, 1);
                }
            }
        }
        self.index.clear_endpoint(self.endpoint);
        self.reset_history();
        self.need_full = false;
        self.retry_full = None;
        if !self.has_replay() {
            return true;
        }
        match self.replay(sub, 0, Mode::Full).await {
            Ok(_) => true,
            Err(e) => {
                inc(&self.stats().replay_failures, 1);
                tracing::warn!(endpoint = %self.endpoint, error = %e, "kv events: full replay failed");
                // Keep what arrived; the idle probe tries again.
                self.retry_full = Some(why);
                false
            }
        }
    }

    /// Bring the endpoint up to date after a gap, a reconnect or a probe,
    /// proving the history continues; falls back to a resync.
    async fn catch_up(&mut self, sub: &mut SubSocket) {
        let Some(last) = self.last else {
            // Nothing applied yet: everything replay has is new.
            if self.has_replay() {
                self.full_sync(sub, Rebuild::Startup).await;
            }
            return;
        };
        if !self.has_replay() {
            return;
        }
        let hash = self
            .recent
            .back()
            .filter(|(s, _)| *s == last)
            .map(|(_, h)| *h)
            .unwrap_or(0);
        self.set_state(SyncState::Replaying);
        inc(&self.stats().replays, 1);
        match self
            .replay(sub, last, Mode::Verify { seq: last, hash })
            .await
        {
            Ok(Outcome::Done) | Ok(Outcome::Resynced) => {}
            Ok(Outcome::Restarted) => {
                self.stats().restarted();
                self.recheck_source();
                tracing::info!(endpoint = %self.endpoint, "kv events: engine restarted (history changed)");
                self.full_sync(sub, Rebuild::Resync).await;
            }
            Err(e) => {
                inc(&self.stats().replay_failures, 1);
                tracing::warn!(endpoint = %self.endpoint, error = %e, "kv events: replay failed");
            }
        }
    }

    /// Idle probe: a verified replay from `last` (or a full sync when a
    /// rebuild is pending). Failing probes turn the state to Disconnected
    /// after `stale_after`.
    async fn probe(&mut self, sub: &mut SubSocket) {
        inc(&self.stats().probes, 1);
        // Re-arm first so a failing probe is retried after another
        // `idle_probe`, not immediately.
        self.last_contact = Instant::now();
        let before = self.stats().replay_failures.load(Ordering::Relaxed);
        let prev_state = self.state();
        if let Some(why) = self.retry_full {
            self.full_sync(sub, why).await;
        } else if self.need_full {
            self.full_sync(sub, Rebuild::Resync).await;
        } else {
            self.catch_up(sub).await;
        }
        if self.stats().replay_failures.load(Ordering::Relaxed) != before {
            let since = *self.probe_failing_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= self.cfg.stale_after
                || matches!(prev_state, SyncState::Disconnected)
            {
                self.set_state(SyncState::Disconnected);
            } else {
                self.set_state(prev_state);
            }
        }
    }

    /// Counts a live message and splits it into (seq, payload); None when it
    /// is malformed (counted as a decode error) or for another topic.
    fn accept_live(&mut self, msg: ZmqMessage) -> Option<(u64, Bytes)> {
        inc(&self.stats().messages, 1);
        let Some((topic, seq, payload)) = parse_live(msg) else {
            self.decode_error("malformed message frames (want [topic, seq8, payload])");
            return None;
        };
        // SUB filters by prefix; an exact topic is what we follow.
        (topic.as_ref() == self.cfg.endpoint.topic.as_bytes()).then_some((seq, payload))
    }

    async fn on_live_message(&mut self, sub: &mut SubSocket, msg: ZmqMessage) {
        let Some((seq, payload)) = self.accept_live(msg) else {
            return;
        };
        self.contact();
        if matches!(self.state(), SyncState::Disconnected) {
            self.set_state(SyncState::Connecting);
        }
        self.buffered.push_back(Batch { seq, payload });
        self.drain_buffered(sub).await;
    }

    /// Processes buffered live batches in arrival order (each may start a
    /// replay, which buffers further live batches).
    async fn drain_buffered(&mut self, sub: &mut SubSocket) {
        // Bounded: each step consumes a message; replays only add what the
        // engine sent meanwhile (capped by `max_buffered`).
        while let Some(b) = self.buffered.pop_front() {
            self.on_live(sub, b).await;
        }
    }

    async fn on_live(&mut self, sub: &mut SubSocket, b: Batch) {
        if self.need_full {
            // Back after being unreachable. The rebuild's replay normally
            // includes this batch: the dedupe below drops it then.
            self.full_sync(sub, Rebuild::Resync).await;
        }
        let Some(last) = self.last else {
            self.apply(b.seq, &b.payload, false);
            return;
        };
        if b.seq == last.wrapping_add(1) {
            self.apply(b.seq, &b.payload, false);
            return;
        }
        if b.seq <= last {
            let h = xxhash_rust::xxh3::xxh3_64(&b.payload);
            if self
                .recent
                .iter()
                .rev()
                .any(|&(s, rh)| s == b.seq && rh == h)
            {
                inc(&self.stats().duplicates, 1);
                return;
            }
            // A sequence number we applied with other content, or one far
            // behind: a new engine process.
            self.stats().restarted();
            self.recheck_source();
            tracing::info!(endpoint = %self.endpoint, seq = b.seq, last, "kv events: engine restarted (sequence went back)");
            self.full_sync(sub, Rebuild::Resync).await;
            // The replay normally covered this batch; if it did not, it is
            // the next one or starts the new history.
            self.after_recovery(b);
            return;
        }
        // A gap: batches last+1 .. seq-1 were lost.
        inc(&self.stats().gaps, 1);
        tracing::debug!(endpoint = %self.endpoint, last, seq = b.seq, "kv events: gap");
        if self.has_replay() {
            self.catch_up(sub).await;
        }
        self.after_recovery(b);
    }

    /// After a replay triggered by `b`: drop it if covered, apply it if it is
    /// next, otherwise the gap is not coverable: clear and start from it.
    fn after_recovery(&mut self, b: Batch) {
        match self.last {
            Some(last) if b.seq <= last => {
                inc(&self.stats().duplicates, 1);
            }
            Some(last) if b.seq == last.wrapping_add(1) => self.apply(b.seq, &b.payload, false),
            None => self.apply(b.seq, &b.payload, false),
            Some(_) => {
                inc(&self.stats().resyncs, 1);
                tracing::warn!(endpoint = %self.endpoint, seq = b.seq, "kv events: gap not coverable by replay; endpoint cleared");
                self.set_state(SyncState::Resyncing);
                self.index.clear_endpoint(self.endpoint);
                self.reset_history();
                self.apply(b.seq, &b.payload, false);
            }
        }
    }

    fn decode_error(&mut self, why: &str) {
        inc(&self.stats().decode_errors, 1);
        self.decode_error_logs += 1;
        // Garbage can arrive fast: log the first few, then every 1000th.
        if self.decode_error_logs <= 10 || self.decode_error_logs.is_multiple_of(1000) {
            tracing::warn!(endpoint = %self.endpoint, count = self.decode_error_logs, "kv events: {why}");
        }
    }

    /// Decodes and applies one batch, and records it as the last one.
    fn apply(&mut self, seq: u64, payload: &[u8], replayed: bool) {
        let hash = xxhash_rust::xxh3::xxh3_64(payload);
        match decode_batch(payload) {
            Ok(batch) => {
                let o = self.index.apply(self.endpoint, &batch);
                let s = self.stats();
                inc(&s.batches_applied, 1);
                inc(&s.events_applied, batch.events.len() as u64);
                inc(&s.blocks_stored, o.stored as u64);
                inc(&s.blocks_removed, o.removed as u64);
                inc(&s.all_cleared, o.cleared as u64);
                inc(
                    &s.skipped_events,
                    (o.skipped_events + batch.ignored_events) as u64,
                );
                if replayed {
                    inc(&s.replayed_batches, 1);
                }
            }
            Err(e) => {
                // Replay would return the same bytes: count it and move on.
                let why = format!("undecodable batch seq {seq}: {e}");
                self.decode_error(&why);
            }
        }
        self.last = Some(seq);
        if self.recent.len() == RECENT {
            self.recent.pop_front();
        }
        self.recent.push_back((seq, hash));
        self.stats().last_seq.store(seq, Ordering::Relaxed);
    }

    fn buffer_live(&mut self, msg: ZmqMessage) {
        let Some((seq, payload)) = self.accept_live(msg) else {
            return;
        };
        if self.buffered.len() >= self.cfg.max_buffered {
            // Recovered later as a gap.
            inc(&self.stats().buffer_overflows, 1);
            return;
        }
        self.buffered.push_back(Batch { seq, payload });
    }

    /// One replay from `start`, applying replies as they arrive while live
    /// messages are buffered.
    async fn replay(
        &mut self,
        sub: &mut SubSocket,
        start: u64,
        mode: Mode,
    ) -> Result<Outcome, ReplayError> {
        let addr = self
            .cfg
            .endpoint
            .replay
            .clone()
            .ok_or(ReplayError::NoEndpoint)?;
        let deadline = tokio::time::Instant::now() + self.cfg.replay_deadline;
        let mut opts = SocketOptions::default();
        opts.connect_timeout(self.cfg.connect_timeout);
        let mut dealer = DealerSocket::with_options(opts);
        let connect_limit = self.cfg.connect_timeout + Duration::from_millis(500);
        match tokio::time::timeout(connect_limit, dealer.connect(&addr)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(ReplayError::Connect(addr, e.to_string())),
            Err(_) => return Err(ReplayError::Connect(addr, "timed out".into())),
        }
        let req = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&start.to_be_bytes()),
        ])
        .map_err(|e| ReplayError::Send(e.to_string()))?;
        match tokio::time::timeout(self.cfg.replay_timeout, dealer.send(req)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(ReplayError::Send(e.to_string())),
            Err(_) => return Err(ReplayError::Send("timed out".into())),
        }
        let mut replies = 0usize;
        let mut verified = matches!(mode, Mode::Full);
        let mut outcome = Outcome::Done;
        loop {
            let reply_by = (tokio::time::Instant::now() + self.cfg.replay_timeout).min(deadline);
            let msg = tokio::select! {
                r = dealer.recv() => match r {
                    Ok(m) => m,
                    Err(e) => return Err(ReplayError::Recv(e.to_string())),
                },
                m = sub.recv() => {
                    if let Ok(m) = m {
                        self.buffer_live(m);
                    }
                    continue;
                }
                _ = tokio::time::sleep_until(reply_by) => return Err(ReplayError::Timeout(replies)),
            };
            let Some((seq, payload)) = parse_reply(msg) else {
                self.decode_error("malformed replay reply frames");
                continue;
            };
            if seq == END_SEQ {
                self.contact();
                if !verified {
                    // The engine has nothing at or after our last batch:
                    // it restarted (a live engine keeps its latest batches).
                    return Ok(Outcome::Restarted);
                }
                return Ok(outcome);
            }
            replies += 1;
            if replies > self.cfg.max_replay_batches {
                return Err(ReplayError::TooLong(self.cfg.max_replay_batches));
            }
            if !verified {
                let Mode::Verify { seq: want, hash } = mode else {
                    unreachable!("Full mode starts verified")
                };
                verified = true;
                if seq == want {
                    if xxhash_rust::xxh3::xxh3_64(&payload) == hash {
                        // Same process, same history: the rest is the gap.
                        continue;
                    }
                    return Ok(Outcome::Restarted);
                }
                // The buffer no longer has our last batch: what is in it is
                // all there is. Rebuild from it.
                inc(&self.stats().resyncs, 1);
                tracing::warn!(endpoint = %self.endpoint, want, first = seq, "kv events: replay cannot cover the gap; resyncing from replay");
                self.set_state(SyncState::Resyncing);
                self.index.clear_endpoint(self.endpoint);
                self.reset_history();
                outcome = Outcome::Resynced;
            }
            match self.last {
                Some(last) if seq <= last => continue,
                Some(last) if seq != last.wrapping_add(1) => {
                    // A hole inside the engine's own buffer: nothing
                    // can fill it.
                    inc(&self.stats().gaps, 1);
                }
                _ => {}
            }
            self.apply(seq, &payload, true);
        }
    }
}
