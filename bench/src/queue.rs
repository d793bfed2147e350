//! Queueing yardsticks: a run's requests replayed through first-come,
//! first-served prefill queues, each request's prefill priced as if it ran
//! alone ([`crate::bound::EngineModel::unqueued_ttft_ms`]).
//!
//! Replays of the same arrivals:
//!
//! * [`on_own_engines`]: every request queues on the engine that served it.
//!   Set against the run's measured TTFT it checks the model: where they
//!   agree, the split below is worth reading.
//! * [`balanced`]: every request goes to the engine whose queue empties
//!   first (least work left), which is one central FCFS queue in front of
//!   all engines: what a router that knew every engine's queued work
//!   exactly and never had to trade balance for a cache hit would get, at
//!   the reuse it is given. The gap between the two is the price a router
//!   paid in balance for its reuse (or for not knowing the queues).
//!
//! A yardstick, not a floor: real engines batch concurrent prefills into one
//! step (sharing its fixed cost), which no FCFS queue does, and interleave
//! decode steps, which these queues leave out; and a dispatcher that holds
//! engines back for short prompts can beat least-work-left on the mean.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// One request as the queues see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Job {
    /// Arrival, ms from the run's start.
    pub arrival_ms: f64,
    /// Prefill time alone on an idle engine, ms.
    pub service_ms: f64,
}

/// Time order of `jobs` (stable for equal arrivals).
pub(crate) fn by_arrival<T>(jobs: &[T], arrival: impl Fn(&T) -> f64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by(|&a, &b| arrival(&jobs[a]).total_cmp(&arrival(&jobs[b])));
    order
}

/// TTFT of each of `jobs` (in their order) when each queues FCFS on the
/// engine its key names.
pub fn on_own_engines<K: std::hash::Hash + Eq>(jobs: &[(Job, K)]) -> Vec<f64> {
    let mut free: HashMap<&K, f64> = HashMap::new();
    let mut ttft = vec![0.0; jobs.len()];
    for i in by_arrival(jobs, |(j, _)| j.arrival_ms) {
        let (j, k) = &jobs[i];
        let at = free.entry(k).or_insert(f64::NEG_INFINITY);
        let done = at.max(j.arrival_ms) + j.service_ms;
        *at = done;
        ttft[i] = done - j.arrival_ms;
    }
    ttft
}

/// A time for a heap: f64 has no total order of its own.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct At(pub(crate) f64);

impl Eq for At {}

impl PartialOrd for At {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for At {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// TTFT of each of `jobs` (in their order) when each goes, on arrival, to
/// whichever of `engines` FCFS queues empties first.
pub fn balanced(jobs: &[Job], engines: usize) -> Vec<f64> {
    let mut free: BinaryHeap<Reverse<At>> = (0..engines.max(1))
        .map(|_| Reverse(At(f64::NEG_INFINITY)))
        .collect();
    let mut ttft = vec![0.0; jobs.len()];
    for i in by_arrival(jobs, |j| j.arrival_ms) {
        let j = jobs[i];
        let Some(Reverse(At(at))) = free.pop() else {
            unreachable!("the heap holds at least one engine")
        };
        let done = at.max(j.arrival_ms) + j.service_ms;
        free.push(Reverse(At(done)));
        ttft[i] = done - j.arrival_ms;
    }
    ttft
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(arrival_ms: f64, service_ms: f64) -> Job {
        Job {
            arrival_ms,
            service_ms,
        }
    }

    #[test]
    fn own_engines_queue_in_arrival_order() {
        // Given out of time order: the 100 ms job at 0 is served first on
        // "a", so the one at 10 waits 90 ms; "b" is idle.
        let jobs = [
            (job(10.0, 50.0), "a"),
            (job(0.0, 100.0), "a"),
            (job(20.0, 30.0), "b"),
            (job(500.0, 40.0), "a"),
        ];
        assert_eq!(on_own_engines(&jobs), vec![140.0, 100.0, 30.0, 40.0]);
    }

    #[test]
    fn balanced_sends_each_job_where_the_queue_empties_first() {
        let jobs = [
            job(0.0, 100.0),
            job(0.0, 10.0),
            // Both engines busy: the one free at 10 takes it.
            job(5.0, 20.0),
            // Free at 30 and 100: waits until 30.
            job(6.0, 5.0),
        ];
        assert_eq!(balanced(&jobs, 2), vec![100.0, 10.0, 25.0, 29.0]);
        // One engine: a single FCFS queue.
        assert_eq!(balanced(&jobs, 1), vec![100.0, 110.0, 125.0, 129.0]);
    }

    #[test]
    fn balancing_never_loses_to_one_engine_per_job_stream() {
        // Everything on one engine of two, against least-work-left.
        let jobs: Vec<(Job, u8)> = (0..50)
            .map(|i| (job(i as f64 * 7.0, 10.0 + (i % 5) as f64 * 3.0), 0))
            .collect();
        let own: f64 = on_own_engines(&jobs).iter().sum();
        let plain: Vec<Job> = jobs.iter().map(|(j, _)| *j).collect();
        let bal: f64 = balanced(&plain, 2).iter().sum();
        assert!(bal < own, "{bal} vs {own}");
        // With idle engines to spare every job is served on arrival.
        let spare = balanced(&plain, 50);
        assert!(spare.iter().zip(&plain).all(|(t, j)| *t == j.service_ms));
    }
}
