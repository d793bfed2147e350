//! Picks whose answer the caller never used, ended as never served.
//!
//! A filter that times out waiting for a pick (the indexer stalled, the
//! stream slow) admits the request itself and, at its end, says so: a DONE
//! report with `ADMISSION_LOCAL`. The pick may still be processed after
//! that report (it waited in a socket while the indexer was stopped, or on
//! a stream the filter gave up), and reserve budget and count load that no
//! report will ever end. So such a report leaves a note under its request
//! id ([`Abandoned`]), and a pick finishing under a noted id ends itself at
//! once ([`Pool::end_if_abandoned`]). The note is taken before the report
//! touches the budget or the load, and the pick looks for it after it has
//! reserved and recorded, so whichever runs first, the reservation is
//! either released by the report or cancelled by the pick; cancelling
//! what a release already ended is a no-op. A pick whose answer cannot be
//! delivered (its stream is gone) is ended the same way
//! ([`Pool::end_unanswered`]).

use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::{Duration, Instant};

use lru::LruCache;
use parking_lot::Mutex;

use crate::budgets;
use crate::load::Phase;
use crate::metrics::Counter;
use crate::pool::Pool;

/// Notes kept at once per pool; the oldest go first.
pub const MAX_NOTES: usize = 65_536;
/// How long a note waits for its pick: longer than any stall after which
/// a pick is still worth processing.
pub const NOTE_TTL: Duration = Duration::from_secs(120);

/// Request ids whose filter admitted them without the pick's answer.
#[derive(Debug)]
pub struct Abandoned {
    notes: Mutex<LruCache<String, Instant>>,
    /// Picks ended because their request was admitted without them.
    pub ended: Counter,
    /// Picks ended because their answer could not be delivered.
    pub undelivered: Counter,
}

impl Default for Abandoned {
    fn default() -> Self {
        Abandoned {
            notes: Mutex::new(LruCache::new(
                NonZeroUsize::new(MAX_NOTES).unwrap_or(NonZeroUsize::MIN),
            )),
            ended: Counter::default(),
            undelivered: Counter::default(),
        }
    }
}

impl Abandoned {
    /// Notes that `request_id` was admitted without its pick's answer.
    pub fn note(&self, request_id: &str, now: Instant) {
        self.notes.lock().put(request_id.to_string(), now);
    }

    /// Whether `request_id` was noted within [`NOTE_TTL`] (the note is
    /// taken).
    pub fn take(&self, request_id: &str, now: Instant) -> bool {
        self.notes
            .lock()
            .pop(request_id)
            .is_some_and(|at| now.saturating_duration_since(at) < NOTE_TTL)
    }

    /// Notes held.
    pub fn len(&self) -> usize {
        self.notes.lock().len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Pool {
    /// Ends a finished pick at once when its request was admitted without
    /// it (see the module docs). Returns whether it did.
    pub(crate) fn end_if_abandoned(&self, request_id: &str, budget_key: Option<&str>) -> bool {
        if request_id.is_empty() || !self.abandoned.take(request_id, Instant::now()) {
            return false;
        }
        self.abandoned.ended.inc();
        self.end_never_served(request_id, budget_key);
        true
    }

    /// Ends a pick whose answer could not be delivered: the caller is gone
    /// and will route without it.
    pub fn end_unanswered(&self, request_id: &str, budget_key: Option<&str>) {
        if request_id.is_empty() {
            return;
        }
        self.abandoned.undelivered.inc();
        self.end_never_served(request_id, budget_key);
    }

    fn end_never_served(&self, request_id: &str, budget_key: Option<&str>) {
        self.load.report(request_id, Phase::Done);
        if self.flow.enabled() {
            self.flow.settle(request_id, 0);
        }
        self.capacity_freed();
        let b = Arc::clone(&self.budgets);
        let (key, id) = (budget_key.map(str::to_owned), request_id.to_owned());
        budgets::run_detached(async move {
            b.cancel(key.as_deref(), &id).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::{EngineLoad, LoadConfig, LoadTracker};
    use crate::scoring::Weights;
    use crate::tokenize::RequestTokenizer;
    use crate::types::EndpointSpec;
    use kvasir_proto::v1 as pb;

    fn pool() -> Pool {
        let pool = Pool::new(
            "p",
            "m",
            4,
            RequestTokenizer::Approx,
            LoadTracker::new(LoadConfig::default()),
            Weights::default(),
        );
        pool.set_endpoints(vec![EndpointSpec::loopback(0)], |_| None);
        for e in pool.endpoints().iter() {
            pool.load
                .record_scrape(e.id, Some(EngineLoad::default()), Instant::now());
        }
        pool
    }

    /// A pick of tenant `t`, which may have one request in flight.
    fn pick(request_id: &str) -> pb::PickRequest {
        pb::PickRequest {
            pool: "p".into(),
            tenant: "t".into(),
            request_id: request_id.into(),
            prompt: Some(pb::pick_request::Prompt::TokenIds(pb::TokenIds {
                ids: (0..64).collect(),
            })),
            budget: Some(pb::Budget {
                key: "t".into(),
                max_concurrent: 1,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn local_done(request_id: &str) -> pb::ReportRequest {
        pb::ReportRequest {
            pool: "p".into(),
            request_id: request_id.into(),
            phase: pb::ReportPhase::Done as i32,
            outcome: pb::Outcome::Success as i32,
            completion_tokens: 5,
            prompt_tokens: 64,
            budget_key: "t".into(),
            admission: pb::Admission::Local as i32,
            ..Default::default()
        }
    }

    fn admitted(r: &pb::PickResponse) -> bool {
        !r.endpoints.is_empty()
    }

    #[tokio::test]
    async fn a_pick_processed_after_its_local_end_holds_nothing() {
        let pool = pool();
        // The filter gave up, admitted the request itself and ended it;
        // only then does the indexer get to the pick.
        pool.report(&local_done("r1")).unwrap();
        assert!(admitted(&pool.pick(pick("r1")).await.unwrap()));
        assert_eq!(pool.budgets.open_reservations(), 0);
        assert_eq!(pool.abandoned.ended.get(), 1);
        assert_eq!(pool.load.in_flight_total(), 0);
        // The tenant's one slot is free: no lockout.
        assert!(admitted(&pool.pick(pick("r2")).await.unwrap()));
        assert_eq!(pool.budgets.open_reservations(), 1);
    }

    #[tokio::test]
    async fn a_local_end_after_the_pick_releases_it() {
        let pool = pool();
        assert!(admitted(&pool.pick(pick("r1")).await.unwrap()));
        assert_eq!(pool.budgets.open_reservations(), 1);
        pool.report(&local_done("r1")).unwrap();
        assert_eq!(pool.budgets.open_reservations(), 0);
        assert!(admitted(&pool.pick(pick("r2")).await.unwrap()));
        assert_eq!(pool.abandoned.ended.get(), 0, "nothing left to end");
    }

    #[tokio::test]
    async fn an_undelivered_answer_gives_everything_back() {
        let pool = pool();
        assert!(admitted(&pool.pick(pick("r1")).await.unwrap()));
        pool.end_unanswered("r1", Some("t"));
        assert_eq!(pool.budgets.open_reservations(), 0);
        assert_eq!(pool.load.in_flight_total(), 0);
        assert!(admitted(&pool.pick(pick("r2")).await.unwrap()));
    }

    #[test]
    fn a_note_is_taken_once_and_expires() {
        let a = Abandoned::default();
        let t0 = Instant::now();
        a.note("r1", t0);
        assert!(a.take("r1", t0));
        assert!(!a.take("r1", t0), "taken");
        a.note("r2", t0);
        assert!(!a.take("r2", t0 + NOTE_TTL), "too old");
        assert!(a.is_empty());
    }
}
