//! Re-checking room on a timer while picks wait: a held pick is released
//! when the estimate says an engine has room, not at the next report,
//! scrape or sharing round.
//!
//! The estimate changes with time alone (an engine's queued prefill drains
//! at its learned prefill rate, `load::drain`), so something has to look
//! again while picks wait. No task of its own: one of the waiting picks,
//! the *ticker*, runs [`RECHECK_PERIOD`] timer in its wait and calls the
//! pool's release on each tick ([`crate::Pool::capacity_freed`]). There is
//! at most one ticker per pool ([`Recheck::claim`]); when it leaves the
//! queue (released, expired or gone) it hands the role to another waiting
//! pick ([`Recheck::wanted`]), so the timer runs exactly while picks wait
//! and stops when the queue empties. With flow control off no pick waits
//! and nothing ticks.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

/// How often the ticker looks again: a fraction of a typical prefill
/// (10 ms is ~100 prefill tokens per 10k tokens/s of engine rate), and
/// one release pass per pool per period at most.
pub const RECHECK_PERIOD: Duration = Duration::from_millis(10);

/// A pool's re-check timer role (see the module docs).
#[derive(Debug, Default)]
pub struct Recheck {
    ticking: AtomicBool,
    wanted: Notify,
    ticks: AtomicU64,
}

impl Recheck {
    /// The ticker's role, if no waiting pick holds it; held until the
    /// returned guard is dropped.
    pub fn claim(&self) -> Option<Ticker<'_>> {
        self.ticking
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            // (Lazily: a guard built and dropped would free the role.)
            .then(|| Ticker { recheck: self })
    }

    /// Whether a waiting pick holds the ticker's role now.
    pub fn ticking(&self) -> bool {
        self.ticking.load(Ordering::Acquire)
    }

    /// Resolves when a ticker left: a waiting pick without the role then
    /// tries [`Recheck::claim`]. (A hand-off nobody awaited wakes the next
    /// waiter once, which then finds the role taken or takes it.)
    pub async fn wanted(&self) {
        self.wanted.notified().await;
    }

    /// Release passes the timer ran so far.
    pub fn ticks(&self) -> u64 {
        self.ticks.load(Ordering::Relaxed)
    }
}

/// The ticker's role, held by one waiting pick; dropped, it is handed on.
#[derive(Debug)]
pub struct Ticker<'r> {
    recheck: &'r Recheck,
}

impl Ticker<'_> {
    /// Counts one release pass of the timer.
    pub fn tick(&self) {
        self.recheck.ticks.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Ticker<'_> {
    fn drop(&mut self) {
        self.recheck.ticking.store(false, Ordering::Release);
        self.recheck.wanted.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_ticker_at_a_time_and_the_role_is_free_once_it_leaves() {
        let r = Recheck::default();
        assert!(!r.ticking(), "nothing waits: no timer");
        let t = r.claim().expect("the first waiter ticks");
        assert!(r.ticking());
        assert!(r.claim().is_none(), "a second waiter does not");
        t.tick();
        t.tick();
        assert_eq!(r.ticks(), 2);
        drop(t);
        assert!(!r.ticking(), "stopped when the ticker left");
        let again = r.claim();
        assert!(again.is_some(), "another waiter takes it over");
    }

    #[tokio::test]
    async fn a_leaving_ticker_wakes_a_waiter_to_take_over() {
        let r = std::sync::Arc::new(Recheck::default());
        let t = r.claim().expect("free");
        let waiter = {
            let r = std::sync::Arc::clone(&r);
            tokio::spawn(async move {
                loop {
                    if let Some(t) = r.claim() {
                        t.tick();
                        return;
                    }
                    r.wanted().await;
                }
            })
        };
        // The waiter cannot take the role while it is held.
        tokio::task::yield_now().await;
        assert_eq!(r.ticks(), 0);
        drop(t);
        tokio::time::timeout(Duration::from_secs(10), waiter)
            .await
            .expect("woken within the bound")
            .expect("the waiter ran");
        assert_eq!(r.ticks(), 1, "it took the role over and ticked");
        assert!(!r.ticking(), "and gave it back when it left");
    }
}
