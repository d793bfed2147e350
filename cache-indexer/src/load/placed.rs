//! The pool's recent placements ([`crate::scoring::placements`]): which
//! prompts continue a conversation, and how many conversations each
//! endpoint started lately. Read at rank, written at record.
//!
//! Only this replica's picks are counted: a conversation another replica
//! placed shows here through the load terms while its turns run, and
//! through the prefix index afterwards.

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;

use crate::scoring::placements::{Placements, DEFAULT_MAX_ENDS};
use crate::types::EndpointId;

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
}

impl Placed {
    /// Empty, counts halving every `half_life_ms`.
    pub(crate) fn new(half_life_ms: f64) -> Self {
        Placed {
            epoch: Instant::now(),
            inner: Arc::new(Mutex::new(Inner {
                placements: Placements::new(half_life_ms, DEFAULT_MAX_ENDS),
                restarts: FxHashMap::default(),
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
        let mut g = self.inner.lock();
        let Inner {
            placements,
            restarts: seen,
        } = &mut *g;
        let starts = chain.is_some_and(|c| placements.starts_conversation(c));
        let counts = endpoints
            .map(|(e, restarts)| {
                let last = seen.entry(e).or_insert(restarts);
                if *last != restarts {
                    *last = restarts;
                    placements.forget(e);
                }
                placements.recent(e, now)
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
        let p = &mut self.inner.lock().placements;
        p.place(endpoint, starts, now);
        if let Some(c) = whole_chain {
            p.remember_end(c);
        }
    }

    /// Remembers the end of a picked prompt's whole block chain.
    pub(crate) fn remember_end(&self, whole_chain: &[u64]) {
        self.inner.lock().placements.remember_end(whole_chain);
    }

    /// Forgets an endpoint's count (gone, or back with an empty cache).
    pub(crate) fn forget(&self, endpoint: EndpointId) {
        let mut g = self.inner.lock();
        g.placements.forget(endpoint);
        g.restarts.remove(&endpoint);
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
}
