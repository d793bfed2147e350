//! The pool's recent placements ([`crate::scoring::placements`]): which
//! prompts continue a conversation, and how many conversations each
//! endpoint started lately. Read at rank, written at record.
//!
//! With shared load and `sharedLoad.placements` on, the replicas share
//! them ([`crate::shared_load::placed`]): this replica's conversation starts
//! (endpoint and time) and prompt ends since the last sharing round wait in
//! a bounded outbox for the round to publish, and the other replicas'
//! come back through [`Placed::merge_peers`] into the same counts and ends,
//! each start weighed by its age on this replica's clock. Without it only
//! this replica's picks are counted: a conversation another replica placed
//! shows here through the load terms while its turns run, and through the
//! prefix index afterwards, but its next turn here looks like a new one.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::scoring::placements::{Placements, DEFAULT_MAX_ENDS};
use crate::types::EndpointId;

/// Conversation starts an outbox holds for the next round; past it the
/// oldest go (a round that late has lost its point anyway).
pub const MAX_SHARED_STARTS: usize = 1024;
/// Prompt ends an outbox holds for the next round, likewise.
pub const MAX_SHARED_ENDS: usize = 4096;

/// Recent placements of one pool, on the pool's own clock. Clones share
/// them (a chain completion remembers its prompt's end off the pick's
/// path).
#[derive(Debug, Clone)]
pub(crate) struct Placed {
    /// Time zero of the millisecond clock the counts decay on.
    epoch: Instant,
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug)]
struct Inner {
    placements: Placements<EndpointId>,
    /// Each endpoint's engine restarts as last seen: a restart its event
    /// stream shows (before, or without, its health checks failing) empties
    /// its cache, so the conversations it started are gone with it.
    restarts: FxHashMap<EndpointId, u64>,
    /// When each endpoint's count was last forgotten (ms): another
    /// replica's start older than that was lost with it.
    cleared: FxHashMap<EndpointId, f64>,
    /// This replica's placements not yet published (sharing on only).
    outbox: Option<Outbox>,
    /// Other replicas' starts and ends merged so far.
    merged: (u64, u64),
}

#[derive(Debug, Default)]
struct Outbox {
    /// Endpoint and time (ms) of each conversation started here.
    starts: VecDeque<(EndpointId, f64)>,
    ends: VecDeque<u64>,
}

/// This replica's placements since the last take, for the other replicas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SharedPlacements {
    /// Conversations started: endpoint, and ms before the take.
    pub starts: Vec<(EndpointId, u64)>,
    /// Prompt ends remembered (last full block's chain hash).
    pub ends: Vec<u64>,
}

impl SharedPlacements {
    /// Whether there is nothing to publish.
    pub fn is_empty(&self) -> bool {
        self.starts.is_empty() && self.ends.is_empty()
    }
}

impl Inner {
    fn remember_end(&mut self, whole_chain: &[u64]) {
        self.placements.remember_end(whole_chain);
        if let (Some(o), Some(&end)) = (&mut self.outbox, whole_chain.last()) {
            push_bounded(&mut o.ends, end, MAX_SHARED_ENDS);
        }
    }

    fn forget(&mut self, e: EndpointId, now: f64) {
        self.placements.forget(e);
        self.cleared.insert(e, now);
    }
}

fn push_bounded<T>(q: &mut VecDeque<T>, v: T, max: usize) {
    if q.len() >= max {
        q.pop_front();
    }
    q.push_back(v);
}

impl Placed {
    /// Empty, counts halving every `half_life_ms`.
    pub(crate) fn new(half_life_ms: f64) -> Self {
        Placed {
            epoch: Instant::now(),
            inner: Arc::new(Mutex::new(Inner {
                placements: Placements::new(half_life_ms, DEFAULT_MAX_ENDS),
                restarts: FxHashMap::default(),
                cleared: FxHashMap::default(),
                outbox: None,
                merged: (0, 0),
            })),
        }
    }

    fn ms(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.epoch).as_secs_f64() * 1000.0
    }

    /// Whether a prompt with this block chain starts a conversation
    /// (`None`, a prompt not looked up: unknown, so no), and each
    /// endpoint's recent count at `at`, in `endpoints` order. Each endpoint
    /// comes with its engine restarts so far: a count that grew forgets the
    /// endpoint's placements first.
    pub(crate) fn view(
        &self,
        chain: Option<&[u64]>,
        endpoints: impl Iterator<Item = (EndpointId, u64)>,
        at: Instant,
    ) -> (bool, Vec<f64>) {
        let now = self.ms(at);
        let mut guard = self.inner.lock();
        let g = &mut *guard;
        let starts = chain.is_some_and(|c| g.placements.starts_conversation(c));
        let counts = endpoints
            .map(|(e, restarts)| {
                let last = g.restarts.entry(e).or_insert(restarts);
                if *last != restarts {
                    *last = restarts;
                    g.forget(e, now);
                }
                g.placements.recent(e, now)
            })
            .collect();
        (starts, counts)
    }

    /// Records a pick to `endpoint` that `starts` a conversation or not,
    /// and the end of its prompt's whole block chain when known now
    /// (`None`: a chain completion remembers it later, or nobody does).
    pub(crate) fn record(
        &self,
        endpoint: EndpointId,
        starts: bool,
        whole_chain: Option<&[u64]>,
        at: Instant,
    ) {
        let now = self.ms(at);
        let mut g = self.inner.lock();
        g.placements.place(endpoint, starts, now);
        if let (true, Some(o)) = (starts, &mut g.outbox) {
            push_bounded(&mut o.starts, (endpoint, now), MAX_SHARED_STARTS);
        }
        if let Some(c) = whole_chain {
            g.remember_end(c);
        }
    }

    /// Remembers the end of a picked prompt's whole block chain.
    pub(crate) fn remember_end(&self, whole_chain: &[u64]) {
        self.inner.lock().remember_end(whole_chain);
    }

    /// Forgets an endpoint's count (gone, or back with an empty cache).
    pub(crate) fn forget(&self, endpoint: EndpointId) {
        let now = self.ms(Instant::now());
        let mut g = self.inner.lock();
        g.forget(endpoint, now);
        g.restarts.remove(&endpoint);
    }

    /// From now on, keeps this replica's placements for
    /// [`Placed::take_shared`] (the sharing round calls it once).
    pub(crate) fn share(&self) {
        let mut g = self.inner.lock();
        if g.outbox.is_none() {
            g.outbox = Some(Outbox::default());
        }
    }

    /// This replica's placements since the last take (empty when sharing
    /// is off), their times as whole ms before `at` (rounded: the clock is
    /// f64, so 30 ms can read as 29.99...).
    pub(crate) fn take_shared(&self, at: Instant) -> SharedPlacements {
        let now = self.ms(at);
        let mut g = self.inner.lock();
        let Some(o) = &mut g.outbox else {
            return SharedPlacements::default();
        };
        let starts = o
            .starts
            .drain(..)
            .map(|(e, t)| (e, (now - t).max(0.0).round() as u64))
            .collect();
        SharedPlacements {
            starts,
            ends: o.ends.drain(..).collect(),
        }
    }

    /// Merges other replicas' placements read at `at`: each start with
    /// its age then (ms) counts what is left of it, unless its endpoint's
    /// count was forgotten after it started (a restart took it); each end
    /// is remembered as this replica's own are (and not published again).
    pub(crate) fn merge_peers(&self, starts: &[(EndpointId, f64)], ends: &[u64], at: Instant) {
        let now = self.ms(at);
        let mut g = self.inner.lock();
        for &(e, age) in starts {
            let started = now - age.max(0.0);
            if g.cleared.get(&e).is_some_and(|&c| c > started) {
                continue;
            }
            g.placements.place_at(e, started, now);
        }
        for &end in ends {
            g.placements.remember_end(&[end]);
        }
        g.merged.0 += starts.len() as u64;
        g.merged.1 += ends.len() as u64;
    }

    /// Other replicas' starts and ends merged so far.
    pub(crate) fn merged(&self) -> (u64, u64) {
        self.inner.lock().merged
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_restart_forgets_the_conversations_it_started() {
        let p = Placed::new(60_000.0);
        let (a, b) = (EndpointId(1), EndpointId(2));
        let t = Instant::now();
        for _ in 0..3 {
            p.record(a, true, None, t);
        }
        p.record(b, true, None, t);
        let (_, counts) = p.view(None, [(a, 0), (b, 0)].into_iter(), t);
        assert!(counts[0] > 2.9 && counts[1] > 0.9, "{counts:?}");
        // a's event stream saw a restart: its count goes, b's stays.
        let (_, counts) = p.view(None, [(a, 1), (b, 0)].into_iter(), t);
        assert_eq!(counts[0], 0.0);
        assert!(counts[1] > 0.9, "{counts:?}");
        // Seen once: a placement after it counts again.
        p.record(a, true, None, t);
        let (_, counts) = p.view(None, [(a, 1), (b, 0)].into_iter(), t);
        assert!(counts[0] > 0.9, "{counts:?}");
    }

    #[test]
    fn shared_placements_wait_for_the_round_only_when_sharing() {
        let p = Placed::new(60_000.0);
        let (a, b) = (EndpointId(1), EndpointId(2));
        let t = Instant::now();
        p.record(a, true, Some(&[1, 2]), t);
        assert!(p.take_shared(t).is_empty(), "not sharing yet");
        p.share();
        p.record(a, true, Some(&[3, 4]), t);
        p.record(b, false, Some(&[3, 4, 5]), t);
        p.remember_end(&[6, 7]);
        let later = t + std::time::Duration::from_millis(30);
        let s = p.take_shared(later);
        assert_eq!(s.starts, vec![(a, 30)]);
        assert_eq!(s.ends, vec![4, 5, 7]);
        assert!(p.take_shared(later).is_empty(), "taken once");
    }

    #[test]
    fn the_outbox_keeps_the_newest() {
        let p = Placed::new(60_000.0);
        p.share();
        let t = Instant::now();
        for i in 0..(MAX_SHARED_ENDS as u64 + 5) {
            p.record(EndpointId(i), true, Some(&[i]), t);
        }
        let s = p.take_shared(t);
        assert_eq!(s.starts.len(), MAX_SHARED_STARTS);
        assert_eq!(s.ends.len(), MAX_SHARED_ENDS);
        assert_eq!(s.ends.last(), Some(&(MAX_SHARED_ENDS as u64 + 4)));
        assert_eq!(s.ends.first(), Some(&5));
    }

    #[test]
    fn peers_placements_count_by_age_and_continue_conversations() {
        let p = Placed::new(1_000.0);
        let (a, b) = (EndpointId(1), EndpointId(2));
        let t = Instant::now() + std::time::Duration::from_secs(10);
        // One start just now on a, one a half-life ago on b; a prompt end.
        p.merge_peers(&[(a, 0.0), (b, 1_000.0)], &[42], t);
        let (starts, counts) = p.view(Some(&[41, 42, 43]), [(a, 0), (b, 0)].into_iter(), t);
        assert!(!starts, "a later turn of the peer's conversation");
        assert!((counts[0] - 1.0).abs() < 1e-9, "{counts:?}");
        assert!((counts[1] - 0.5).abs() < 1e-9, "{counts:?}");
        assert_eq!(p.merged(), (2, 1));
        // Merged placements are not published again.
        p.share();
        p.merge_peers(&[(a, 0.0)], &[43], t);
        assert!(p.take_shared(t).is_empty());
    }

    #[test]
    fn a_peers_start_from_before_a_restart_is_not_counted() {
        let p = Placed::new(60_000.0);
        let a = EndpointId(1);
        let t = Instant::now() + std::time::Duration::from_secs(10);
        p.view(None, [(a, 0)].into_iter(), t);
        // a restarted at t: forgotten.
        p.view(None, [(a, 1)].into_iter(), t);
        // A peer's start 50 ms before t, read after: lost with the cache.
        let read = t + std::time::Duration::from_millis(20);
        p.merge_peers(&[(a, 70.0)], &[], read);
        let (_, counts) = p.view(None, [(a, 1)].into_iter(), read);
        assert_eq!(counts[0], 0.0);
        // One placed after the restart counts.
        p.merge_peers(&[(a, 10.0)], &[], read);
        let (_, counts) = p.view(None, [(a, 1)].into_iter(), read);
        assert!(counts[0] > 0.9, "{counts:?}");
    }
}
