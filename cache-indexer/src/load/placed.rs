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

use crate::scoring::placements::{Placements, DEFAULT_MAX_ENDS};
use crate::types::EndpointId;

/// Recent placements of one pool, on the pool's own clock. Clones share
/// them (a chain completion remembers its prompt's end off the pick's
/// path).
#[derive(Debug, Clone)]
pub(crate) struct Placed {
    /// Time zero of the millisecond clock the counts decay on.
    epoch: Instant,
    inner: Arc<Mutex<Placements<EndpointId>>>,
}

impl Placed {
    /// Empty, counts halving every `half_life_ms`.
    pub(crate) fn new(half_life_ms: f64) -> Self {
        Placed {
            epoch: Instant::now(),
            inner: Arc::new(Mutex::new(Placements::new(half_life_ms, DEFAULT_MAX_ENDS))),
        }
    }

    fn ms(&self, at: Instant) -> f64 {
        at.saturating_duration_since(self.epoch).as_secs_f64() * 1000.0
    }

    /// Whether a prompt with this block chain starts a conversation
    /// (`None`, a prompt not looked up: unknown, so no), and each
    /// endpoint's recent count at `at`, in `endpoints` order.
    pub(crate) fn view(
        &self,
        chain: Option<&[u64]>,
        endpoints: impl Iterator<Item = EndpointId>,
        at: Instant,
    ) -> (bool, Vec<f64>) {
        let now = self.ms(at);
        let p = self.inner.lock();
        let starts = chain.is_some_and(|c| p.starts_conversation(c));
        (starts, endpoints.map(|e| p.recent(e, now)).collect())
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
        let mut p = self.inner.lock();
        p.place(endpoint, starts, now);
        if let Some(c) = whole_chain {
            p.remember_end(c);
        }
    }

    /// Remembers the end of a picked prompt's whole block chain.
    pub(crate) fn remember_end(&self, whole_chain: &[u64]) {
        self.inner.lock().remember_end(whole_chain);
    }

    /// Forgets an endpoint's count (gone, or back with an empty cache).
    pub(crate) fn forget(&self, endpoint: EndpointId) {
        self.inner.lock().forget(endpoint);
    }
}
