//! Following the sockets an engine advertises (`/kv_event_sources`) for an
//! endpoint configured without an events address.
//!
//! The engine is asked before the first connect, and again whenever the
//! stream suggests the engine may have changed: a disconnect, a failed
//! connect, the service marking it unreachable, a restart seen in the
//! sequence numbers. While the subscriber has nothing to follow, or is
//! disconnected, the requests repeat with a doubling backoff; once it has
//! contact they stop.

use std::time::Duration;

use tokio::time::Instant;

use super::{inc, SyncState, Worker};
use crate::discovery::{EngineSource, ResolvedSource, SourceError};

/// The engine-advertised side of one subscriber.
pub(super) struct SourceFollow {
    engine: EngineSource,
    /// What the engine advertised and is followed; `None` before the first
    /// usable answer or after the engine withdrew it.
    followed: Option<ResolvedSource>,
    /// When to ask again; `None`: no reason to.
    due: Option<Instant>,
    backoff: Duration,
    min: Duration,
    max: Duration,
    /// The last failure logged at warn, so a failing engine logs once per
    /// distinct failure rather than once per retry.
    warned: Option<String>,
}

impl SourceFollow {
    pub(super) fn new(engine: EngineSource, min: Duration, max: Duration) -> Self {
        SourceFollow {
            engine,
            followed: None,
            due: None,
            backoff: min,
            min,
            max: max.max(min),
            warned: None,
        }
    }
}

/// What asking the engine did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Asked {
    /// The same sockets as followed.
    Same,
    /// New sockets: the endpoint is rebuilt from them at the next connect.
    Moved,
    /// The engine now says it publishes nothing to follow: the endpoint
    /// was cleared.
    Withdrawn,
    /// No usable answer; what was followed (if anything) is kept.
    Failed,
}

impl Worker {
    /// Whether the sockets come from the engine.
    pub(super) fn has_engine_source(&self) -> bool {
        self.source.is_some()
    }

    /// The deadline of the next request to the engine, if one is due.
    pub(super) fn source_due(&self) -> Option<Instant> {
        self.source.as_ref().and_then(|s| s.due)
    }

    /// The stream suggests the engine changed: ask it (now, unless a
    /// request is already scheduled).
    pub(super) fn recheck_source(&mut self) {
        if let Some(s) = self.source.as_mut() {
            s.due.get_or_insert_with(Instant::now);
        }
    }

    /// Before (re)connecting: true when there are sockets to connect to.
    /// With an engine source and nothing followed, asks the engine (after
    /// waiting out the backoff) and, if it still gives nothing, sets
    /// [`SyncState::NoSource`] and returns false.
    pub(super) async fn ensure_source(&mut self) -> bool {
        let Some(s) = self.source.as_ref() else {
            return true;
        };
        let now = Instant::now();
        let due = s.due.is_none_or(|t| t <= now);
        if s.followed.is_some() && !due {
            return true;
        }
        if let Some(t) = s.due.filter(|t| *t > now) {
            tokio::time::sleep_until(t).await;
        }
        let asked = self.ask_engine().await;
        self.after_ask(asked);
        let followed = self.source.as_ref().is_some_and(|s| s.followed.is_some());
        if !followed {
            self.set_state(SyncState::NoSource);
        }
        followed
    }

    /// A scheduled request while following: true when the subscriber must
    /// reconnect (new sockets, or none any more).
    pub(super) async fn source_due_now(&mut self) -> bool {
        let asked = self.ask_engine().await;
        self.after_ask(asked);
        matches!(asked, Asked::Moved | Asked::Withdrawn)
    }

    /// Schedules the next request: soon while the subscriber has nothing to
    /// follow or no contact, never once it is connected.
    fn after_ask(&mut self, asked: Asked) {
        let disconnected = self.state() == SyncState::Disconnected;
        let Some(s) = self.source.as_mut() else {
            return;
        };
        let need = s.followed.is_none() || disconnected;
        if asked == Asked::Moved || !need {
            s.due = None;
            s.backoff = s.min;
            return;
        }
        s.due = Some(Instant::now() + s.backoff);
        s.backoff = (s.backoff * 2).min(s.max);
    }

    /// One request to the engine, applied.
    async fn ask_engine(&mut self) -> Asked {
        let Some(s) = self.source.as_ref() else {
            return Asked::Failed;
        };
        let engine = s.engine.clone();
        inc(&self.stats().source_lookups, 1);
        match engine.lookup().await {
            Ok(r) => self.follow_source(r),
            Err(e) => self.source_failed(&e),
        }
    }

    fn follow_source(&mut self, r: ResolvedSource) -> Asked {
        let endpoint = self.endpoint;
        let Some(s) = self.source.as_mut() else {
            return Asked::Failed;
        };
        s.warned = None;
        // Only the sockets matter: ranks coming and going behind the same
        // rank 0 (elastic scaling) need no rebuild.
        let sockets = |f: &ResolvedSource| (f.kv_events.clone(), f.replay.clone(), f.topic.clone());
        if s.followed.as_ref().map(sockets) == Some(sockets(&r)) {
            s.followed = Some(r);
            return Asked::Same;
        }
        tracing::info!(%endpoint, url = s.engine.url(), kv_events = %r.kv_events, replay = ?r.replay, topic = %r.topic, rank = r.rank, "kv events: following the sockets the engine advertises");
        if r.ranks.len() > 1 {
            tracing::warn!(%endpoint, ranks = ?r.ranks, followed = r.rank, "kv events: the engine has several data-parallel ranks; only the lowest is followed, the other ranks' cached blocks are not indexed");
        }
        if let Some(replay) = &r.unusable_replay {
            tracing::warn!(%endpoint, replay = %replay, "kv events: the advertised replay socket is not reachable from here; following without replay");
        }
        let moved = s.followed.is_some();
        self.cfg.endpoint.kv_events = r.kv_events.clone();
        self.cfg.endpoint.replay = r.replay.clone();
        self.cfg.endpoint.topic = r.topic.clone();
        *self.shared.kv_events.lock() = r.kv_events.clone();
        s.followed = Some(r);
        if moved {
            // Other sockets mean another engine process: what the index
            // holds for the old one is rebuilt at the next connect.
            inc(&self.stats().source_changes, 1);
            self.stats().restarted();
        }
        self.need_full = true;
        Asked::Moved
    }

    fn source_failed(&mut self, e: &SourceError) -> Asked {
        let endpoint = self.endpoint;
        inc(&self.stats().source_failures, 1);
        let Some(s) = self.source.as_mut() else {
            return Asked::Failed;
        };
        let text = e.to_string();
        if s.warned.as_deref() != Some(text.as_str()) {
            tracing::warn!(%endpoint, kind = e.kind(), error = %text, retry_in = ?s.backoff, "kv events: no usable /kv_event_sources from the engine; the endpoint serves picks by load only");
            s.warned = Some(text);
        } else {
            tracing::debug!(%endpoint, kind = e.kind(), "kv events: /kv_event_sources still unusable");
        }
        if !(e.withdraws() && s.followed.is_some()) {
            return Asked::Failed;
        }
        s.followed = None;
        self.cfg.endpoint.kv_events.clear();
        self.cfg.endpoint.replay = None;
        self.cfg.endpoint.topic.clear();
        self.shared.kv_events.lock().clear();
        self.index.clear_endpoint(self.endpoint);
        self.reset_history();
        self.need_full = true;
        self.set_state(SyncState::NoSource);
        Asked::Withdrawn
    }
}
