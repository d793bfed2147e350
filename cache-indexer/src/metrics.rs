//! The indexer's own counters and histograms, updated on the hot path.
//!
//! Plain relaxed atomics rather than a metrics crate's handles: the set is
//! fixed (per pool, per decision / tokenize mode), an update is one atomic
//! add, and nothing here knows about the exposition; `/metrics` reads them
//! (and the values owned elsewhere: index sizes, subscriber counters,
//! scraped load) at scrape time, see [`crate::exposition`]. Every metric is
//! described in the cache-indexer README.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::tokenize::TokenizeMode;

/// Bucket bounds (seconds) of latency histograms: 10 us .. 1 s, dense
/// around the pick targets (0.5 ms at 4k tokens, 2 ms at 32k).
pub const LATENCY_BUCKETS: [f64; 16] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.000_75, 0.001, 0.002, 0.005, 0.01,
    0.025, 0.05, 0.1, 0.25, 1.0,
];

/// A fixed-bucket histogram of durations.
#[derive(Debug)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_ns: AtomicU64::new(0),
        }
    }
}

impl Histogram {
    /// Records one duration.
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        if let Some(i) = LATENCY_BUCKETS.iter().position(|b| s <= *b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(
            u64::try_from(d.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Observations per bucket of [`LATENCY_BUCKETS`] (not cumulative;
    /// those above the last bound are only in [`Histogram::count`]).
    pub fn buckets(&self) -> [u64; LATENCY_BUCKETS.len()] {
        std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed))
    }

    /// Sum of the observations, seconds.
    pub fn sum_seconds(&self) -> f64 {
        self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9
    }
}

/// A relaxed atomic counter.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`.
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    /// Adds one.
    pub fn inc(&self) {
        self.add(1);
    }
    /// The value.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// What a pick answered, as counted and labelled: the contract's
/// decision, so the `decision` label and the answer's `reason` come from
/// one table ([`PickDecision::as_label`]).
pub use kvasir_proto::v1::Decision as PickDecision;

/// Hot-path metrics of one pool.
#[derive(Debug, Default)]
pub struct PoolMetrics {
    /// Picks answered, by [`PickDecision::position`].
    pub picks: [Counter; PickDecision::KNOWN.len()],
    /// Picks refused as invalid (INVALID_ARGUMENT).
    pub pick_invalid: Counter,
    /// Pick latency inside the service (tokenize + match + score).
    pub pick_latency: Histogram,
    /// Tokenization latency by [`TokenizeMode::position`].
    pub tokenize_latency: [Histogram; TokenizeMode::KNOWN.len()],
    /// Tokenizations that failed for a reason other than the request
    /// (render timeouts...): the pick went on by load.
    pub tokenize_failures: Counter,
    /// Picks whose prompt was tokenized only up to where no engine (nor a
    /// pick in prefill) holds its blocks: the rest cannot be a hit.
    pub tokenize_stopped: Counter,
    /// Picks whose tokenization the pool's `tokenizeBudget` stopped.
    pub tokenize_limited: Counter,
    /// Estimated prompt tokens those picks did not tokenize.
    pub tokens_not_tokenized: Counter,
    /// Stopped picks whose whole chain was not computed afterwards because
    /// enough completions were already running.
    pub chain_completions_skipped: Counter,
    /// Reports that matched an in-flight pick.
    pub reports_matched: Counter,
    /// Reports for unknown request ids.
    pub reports_unmatched: Counter,
    /// DONE reports by outcome: success, error, cancelled, timeout, rejected,
    /// client_error.
    pub reports_by_outcome: [Counter; 6],
    /// In-flight picks dropped by the lost-report timeout.
    pub in_flight_expired: Counter,
    /// Predicted cached tokens of picks whose DONE report came from the
    /// picked endpoint.
    pub predicted_cached_tokens: Counter,
    /// Cached tokens those reports gave (usage.prompt_tokens_details).
    pub reported_cached_tokens: Counter,
}

impl PoolMetrics {
    /// Counts a pick.
    pub fn count_pick(&self, d: PickDecision) {
        // Every answer has a decision: UNSPECIFIED is not counted.
        if let Some(i) = d.position() {
            self.picks[i].inc();
        }
    }
    /// Records a tokenization.
    pub fn observe_tokenize(&self, m: TokenizeMode, d: Duration) {
        if let Some(i) = m.position() {
            self.tokenize_latency[i].observe(d);
        }
    }
}

/// `Session` stream metrics of one indexer (all pools).
#[derive(Debug, Default)]
pub struct SessionMetrics {
    opened: Counter,
    closed: Counter,
    /// Picks received on sessions.
    pub picks: Counter,
    /// Reports received on sessions.
    pub reports: Counter,
    /// Of those reports, the ones refused (unknown pool, no request id).
    pub failed_reports: Counter,
    /// Session requests with no call in them.
    pub invalid: Counter,
}

impl SessionMetrics {
    /// A stream opened.
    pub fn opened(&self) {
        self.opened.inc();
    }
    /// A stream's caller side ended.
    pub fn closed(&self) {
        self.closed.inc();
    }
    /// Streams ever opened.
    pub fn opened_total(&self) -> u64 {
        self.opened.get()
    }
    /// Streams open now.
    pub fn open(&self) -> u64 {
        self.opened.get().saturating_sub(self.closed.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pick_decisions_count_in_their_own_slot() {
        for (i, d) in PickDecision::KNOWN.into_iter().enumerate() {
            let m = PoolMetrics::default();
            m.count_pick(d);
            let counted: Vec<u64> = m.picks.iter().map(Counter::get).collect();
            assert_eq!(counted.iter().sum::<u64>(), 1, "{d:?}");
            assert_eq!(counted[i], 1, "{d:?}");
        }
    }
}
