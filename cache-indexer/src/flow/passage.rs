//! A pick's pass through flow control: what it holds from its release (or
//! its going at once) to its placement: its place among the picks in
//! transit, its work in its tenant's share, its fair-share charge and how
//! its engine priority is set.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvasir_flowcontrol::{prefill_priority, Shares};
use parking_lot::Mutex;

/// A pick let through or released and not placed yet: it counts as load
/// (in transit) until [`super::PoolFlow::placed`] or its drop (the caller went
/// away after its release).
#[derive(Debug)]
pub struct Passage {
    pub(super) in_transit: Option<Arc<Transit>>,
    /// Its tokens, counted in `in_transit`.
    pub(super) tokens: u64,
    pub(super) queued: Duration,
    /// Its fair-share charge, to settle later.
    pub(super) charge: Option<Charge>,
    /// Its work in its tenant's share, ended on drop unless placed.
    pub(super) share: Option<ShareGuard>,
    /// How its vLLM `priority` is set, with `enginePriority` on.
    pub(super) engine_rank: Option<EngineRank>,
}

/// How a pass's vLLM `priority` is set (`enginePriorityBy`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum EngineRank {
    /// Fixed when it was bound (by its tenant's share).
    Fixed(i32),
    /// Its band, refined by the prefill left on the engine it is placed on.
    ByPrefill(i32),
}

/// Picks in transit and their tokens.
#[derive(Debug, Default)]
pub(super) struct Transit {
    pub(super) picks: AtomicUsize,
    pub(super) tokens: AtomicU64,
}

/// A pick's fair-share charge, kept from its placement to its report.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Charge {
    pub(super) request_id: String,
    pub(super) tenant: String,
    pub(super) priority: i32,
    pub(super) weight: u32,
    pub(super) tokens: u64,
    /// Whether it waited (only then the queue's tags are settled).
    pub(super) queued: bool,
    /// When it was placed.
    pub(super) at: Instant,
}

/// A pass's work in its tenant's share: ended when the pass is dropped
/// unplaced; a placed pick's moves to its charge.
#[derive(Debug)]
pub(super) struct ShareGuard {
    pub(super) shares: Arc<Mutex<Shares>>,
    pub(super) tenant: String,
    pub(super) tokens: u64,
    pub(super) armed: bool,
}

impl Drop for ShareGuard {
    fn drop(&mut self) {
        if self.armed {
            self.shares.lock().end(&self.tenant, self.tokens);
        }
    }
}

impl Passage {
    /// A pass that counts nothing (flow control off).
    pub fn free() -> Self {
        Passage {
            in_transit: None,
            tokens: 0,
            queued: Duration::ZERO,
            charge: None,
            share: None,
            engine_rank: None,
        }
    }

    /// How long the pick waited in the queue.
    pub fn queued(&self) -> Duration {
        self.queued
    }

    /// The vLLM `priority` its engine is to serve it at (the pool's
    /// `enginePriority`; `None` when off), placed where `uncached_tokens`
    /// of its prompt are not cached: by its tenant's share as it was when
    /// the pick was bound, or (`enginePriorityBy: prefill`) by its band and
    /// that prefill ([`kvasir_flowcontrol::prefill_priority`]).
    pub fn engine_priority(&self, uncached_tokens: u64) -> Option<i32> {
        self.engine_rank.map(|r| match r {
            EngineRank::Fixed(p) => p,
            EngineRank::ByPrefill(band) => prefill_priority(band, uncached_tokens),
        })
    }
}

impl Drop for Passage {
    fn drop(&mut self) {
        if let Some(n) = self.in_transit.take() {
            n.picks.fetch_sub(1, Ordering::AcqRel);
            n.tokens.fetch_sub(self.tokens, Ordering::AcqRel);
        }
    }
}
