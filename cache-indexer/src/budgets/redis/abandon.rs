//! Reserve calls whose answer never came back, and their undoing.
//!
//! A reserve that times out (or whose connection breaks) is decided
//! without Redis (`onStoreDown`), but its `EVALSHA` may already be on its
//! way: in the socket of a stopped server, in a kernel buffer, on a slow
//! link. When Redis reads it, it runs and opens a reservation nobody owns:
//! the request was admitted (or refused) elsewhere and its reports settle
//! there, so the reservation holds one of the tenant's `maxConcurrent`
//! slots and its tokens until it is old enough to be dropped (the pool's
//! in-flight timeout, 300 s by default). A stall of a second could lock a
//! tenant out for minutes.
//!
//! So each reserve attempt carries a token of its own, kept with the
//! reservation it opens, and an attempt given up on is remembered here
//! ([`Abandoned`]) until Redis answers an `abandon` of it. The abandons
//! ride in front of the store's next call, in the same pipeline (one round
//! trip; Redis runs them first): the first pick after Redis answers again
//! finds the slots free. The script's `abandon` is idempotent and never
//! touches another's slot:
//!
//! * it cancels the reservation under the request id only if that
//!   attempt's token opened it; a reservation of another attempt (the same
//!   request picked again, on this replica or another) is left alone;
//! * otherwise (the reserve has not run yet, may never run, or already
//!   ended) it remembers the token for [`ABANDON_TTL`], and a reserve
//!   carrying it opens nothing. The abandon travels on a new connection
//!   and may reach Redis before the reserve still queued in the old one:
//!   remembering the token makes their order irrelevant.
//!
//! Why this and not a short lease extended once the answer is seen: a
//! lease costs every admitted pick a second round trip and expires live
//! reservations whose confirmation is late; abandons cost nothing until a
//! call fails. Why not a release sent right behind the reserve on the same
//! connection: a broken connection loses both, while the reserve may
//! already have run.
//!
//! The same list carries the ends (release, cancel) of requests whose
//! reservation is in Redis but whose report could not reach it (Redis
//! stalled or in its retry delay; the local budgets do not know the id):
//! sent late, each gives back the slot it holds. Both are idempotent in
//! the script (a second release or cancel finds nothing open).
//!
//! The list is bounded ([`MAX_ABANDONED`]): past it the oldest is dropped
//! (its reservation, if it ran, expires as before) and counted.

use std::collections::hash_map::RandomState;
use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::metrics::Counter;

/// Reserve attempts remembered at once until their abandon is answered.
pub const MAX_ABANDONED: usize = 1024;
/// Abandons sent in front of one call (the rest ride on the next ones),
/// so that a pick after a long outage is not held up by all of them.
pub const ABANDONS_PER_CALL: usize = 32;
/// How long Redis remembers an abandoned attempt's token when its reserve
/// has not run: a reserve still in flight after that is not undone (its
/// reservation is dropped at its max age, as before).
pub const ABANDON_TTL: Duration = Duration::from_secs(5 * 60);

/// One call to make once Redis answers again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abandon {
    /// The budget key.
    pub key: String,
    /// The request id it reserved under.
    pub id: String,
    /// What to undo.
    pub undo: Undo,
}

/// What an [`Abandon`] does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Undo {
    /// Abandons the reserve attempt with this token.
    Reserve(String),
    /// Releases the request (its final usage, if the report had one).
    Release(Option<kvasir_budget::Usage>),
    /// Cancels the request (never served).
    Cancel,
}

/// The attempts given up on, oldest first, and what became of them.
#[derive(Debug)]
pub struct Abandoned {
    pending: Mutex<VecDeque<Abandon>>,
    cap: usize,
    /// This process's token prefix (random), then a counter.
    seed: u64,
    next: AtomicU64,
    /// Calls given up on (each remembered once).
    pub given_up: Counter,
    /// Of those, answered by Redis.
    pub answered: Counter,
    /// Dropped: the list was full, or Redis answered an error.
    pub dropped: Counter,
}

impl Default for Abandoned {
    fn default() -> Self {
        Abandoned::new(MAX_ABANDONED)
    }
}

impl Abandoned {
    /// A list of at most `cap` attempts.
    pub fn new(cap: usize) -> Self {
        Abandoned {
            pending: Mutex::new(VecDeque::new()),
            cap: cap.max(1),
            seed: RandomState::new().build_hasher().finish(),
            next: AtomicU64::new(0),
            given_up: Counter::default(),
            answered: Counter::default(),
            dropped: Counter::default(),
        }
    }

    /// A token no other attempt (of any replica, in all likelihood: 64
    /// random bits per process) carries.
    pub fn token(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{:x}.{n:x}", self.seed)
    }

    /// Remembers an attempt given up on.
    pub fn push(&self, a: Abandon) {
        self.given_up.inc();
        let mut p = self.pending.lock();
        p.push_back(a);
        self.trim(&mut p);
    }

    /// Up to `n` of the oldest, taken out to be sent.
    pub fn take(&self, n: usize) -> Vec<Abandon> {
        let mut p = self.pending.lock();
        let n = n.min(p.len());
        p.drain(..n).collect()
    }

    /// Puts back, in front, those whose call failed.
    pub fn put_back(&self, back: Vec<Abandon>) {
        let mut p = self.pending.lock();
        for a in back.into_iter().rev() {
            p.push_front(a);
        }
        self.trim(&mut p);
    }

    fn trim(&self, p: &mut VecDeque<Abandon>) {
        while p.len() > self.cap {
            p.pop_front();
            self.dropped.inc();
        }
    }

    /// Attempts waiting for their abandon to be answered.
    pub fn len(&self) -> usize {
        self.pending.lock().len()
    }

    /// Whether none is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(i: usize) -> Abandon {
        Abandon {
            key: "k".into(),
            id: format!("r{i}"),
            undo: Undo::Reserve(format!("t{i}")),
        }
    }

    #[test]
    fn bounded_oldest_dropped_and_counted_order_kept() {
        let l = Abandoned::new(3);
        for i in 0..5 {
            l.push(a(i));
        }
        assert_eq!(l.len(), 3);
        assert_eq!(l.given_up.get(), 5);
        assert_eq!(l.dropped.get(), 2);
        let sent = l.take(2);
        assert_eq!(sent, vec![a(2), a(3)]);
        l.push(a(5));
        l.push(a(6));
        // The failed call's two go back in front, and being the oldest
        // beyond the bound, are dropped.
        l.put_back(sent);
        assert_eq!(l.take(10), vec![a(4), a(5), a(6)]);
        assert_eq!(l.dropped.get(), 4);
        assert!(l.is_empty());
    }

    #[test]
    fn tokens_differ() {
        let (x, y) = (Abandoned::default(), Abandoned::default());
        let t = [x.token(), x.token(), y.token()];
        assert_ne!(t[0], t[1]);
        assert_ne!(t[0], t[2]);
        assert!(t.iter().all(|s| !s.contains(' ')));
    }
}
