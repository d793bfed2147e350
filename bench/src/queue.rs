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
//! * [`sticky`]: every request goes to the engine where its first token
//!   comes soonest, but a later turn of a conversation that leaves the
//!   engine of its previous turn pays the prefill of what it would have
//!   found there, and a request on an engine that never served its tenant
//!   pays for the tenant's system prompt too ([`Held`]): what a router that
//!   knew every queue exactly and chose at arrival, selfishly, would get
//!   on a multi-turn workload. Perfect balance keeps every turn's reuse
//!   wherever it goes; this does not.
//!   [`crate::dispatch`] goes on from it: late binding, quickest first, a
//!   move priced for the delay it passes on.
//!
//! A yardstick, not a floor: real engines batch concurrent prefills into one
//! step (sharing its fixed cost), which no FCFS queue does, and interleave
//! decode steps, which these queues leave out; and a dispatcher that holds
//! engines back for short prompts can beat least-work-left on the mean.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};

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

/// A request of a multi-turn workload for [`sticky`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TurnJob<K> {
    /// Arrival and prefill time on the engine that holds its history (or,
    /// for a request with no earlier turn, on any engine that holds its
    /// tenant's system prompt).
    pub job: Job,
    /// Prefill time on any other engine.
    pub moved_service_ms: f64,
    /// Its conversation, when it continues one.
    pub conversation: Option<K>,
    /// Its tenant's shared prompt (the system prompt), by index, when it
    /// has one: only an engine that served that tenant holds it ([`Held`]).
    pub shared: Option<usize>,
    /// Prefill time on an engine that holds neither its conversation nor
    /// its `shared` prompt.
    pub cold_service_ms: f64,
}

/// The shared prompts ([`TurnJob::shared`]) each engine holds: every one it
/// has served. Never evicted, which favours the yardsticks built on it.
#[derive(Debug, Clone, Default)]
pub struct Held(Vec<HashSet<usize>>);

impl Held {
    /// Nothing held on `engines` engines.
    pub fn new(engines: usize) -> Self {
        Held(vec![HashSet::new(); engines])
    }

    /// Whether engine `e` holds `shared`; with none, a request finds what
    /// it shares with others anywhere.
    fn has(&self, e: usize, shared: Option<usize>) -> bool {
        shared.is_none_or(|s| self.0.get(e).is_some_and(|h| h.contains(&s)))
    }

    /// Engine `e` served `t`: it holds `t`'s shared prompt from now on.
    pub fn serve<K>(&mut self, e: usize, t: &TurnJob<K>) {
        if let (Some(s), Some(h)) = (t.shared, self.0.get_mut(e)) {
            h.insert(s);
        }
    }
}

impl<K: std::hash::Hash + Eq + Copy> TurnJob<K> {
    /// The engine its conversation was last served on, by `homes`.
    pub fn home(&self, homes: &HashMap<K, usize>) -> Option<usize> {
        self.conversation.and_then(|c| homes.get(&c).copied())
    }

    /// Its prefill time on engine `e` when its conversation lives on
    /// `home`: its own there; elsewhere, cold where `held` says `e` lacks
    /// its shared prompt, else moved (or its own, with no home).
    pub fn service_on(&self, home: Option<usize>, e: usize, held: &Held) -> f64 {
        match home {
            Some(h) if h == e => self.job.service_ms,
            _ if !held.has(e, self.shared) => self.cold_service_ms,
            Some(_) => self.moved_service_ms,
            None => self.job.service_ms,
        }
    }

    /// The prefill going to `e` adds over its own (0 at home).
    pub fn extra_on(&self, home: Option<usize>, e: usize, held: &Held) -> f64 {
        self.service_on(home, e, held) - self.job.service_ms
    }
}

/// TTFT of each of `jobs` (in their order) when each goes, in arrival
/// order, to the engine of `engines` where it would get its first token
/// soonest, each engine an FCFS queue: a request whose conversation was
/// last served on engine `h` costs its `service_ms` there and its
/// `moved_service_ms` elsewhere, and its conversation then lives where it
/// went. Ties go to the conversation's engine, then the lowest index.
pub fn sticky<K: std::hash::Hash + Eq + Copy>(jobs: &[TurnJob<K>], engines: usize) -> Vec<f64> {
    sticky_priced(jobs, engines, 0.0)
}

/// [`sticky`] with a move chosen as if it finished later by
/// `move_penalty` times the extra prefill it adds (the delay it passes to
/// whoever queues behind it); it still finishes when it does.
pub fn sticky_priced<K: std::hash::Hash + Eq + Copy>(
    jobs: &[TurnJob<K>],
    engines: usize,
    move_penalty: f64,
) -> Vec<f64> {
    let mut free = vec![f64::NEG_INFINITY; engines.max(1)];
    let mut held = Held::new(free.len());
    let mut home: HashMap<K, usize> = HashMap::new();
    let mut ttft = vec![0.0; jobs.len()];
    for i in by_arrival(jobs, |t| t.job.arrival_ms) {
        let t = &jobs[i];
        let h = t.home(&home);
        let done_on = |e: usize| free[e].max(t.job.arrival_ms) + t.service_on(h, e, &held);
        let priced = |e: usize| done_on(e) + move_penalty * t.extra_on(h, e, &held);
        let mut best = h.unwrap_or(0);
        for e in 0..free.len() {
            if priced(e) < priced(best) {
                best = e;
            }
        }
        let done = done_on(best);
        free[best] = done;
        held.serve(best, t);
        if let Some(c) = t.conversation {
            home.insert(c, best);
        }
        ttft[i] = done - t.job.arrival_ms;
    }
    ttft
}

#[cfg(test)]
pub(crate) mod tests {
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

    /// A multi-turn job for tests (here: on its conversation's engine).
    pub(crate) fn turn(
        arrival_ms: f64,
        here: f64,
        moved: f64,
        conversation: Option<u32>,
    ) -> TurnJob<u32> {
        TurnJob {
            job: job(arrival_ms, here),
            moved_service_ms: moved,
            conversation,
            shared: None,
            cold_service_ms: moved,
        }
    }

    /// `t` as a request of tenant `shared`, costing `cold` ms where that
    /// tenant never ran.
    pub(crate) fn of_tenant(t: TurnJob<u32>, shared: usize, cold: f64) -> TurnJob<u32> {
        TurnJob {
            shared: Some(shared),
            cold_service_ms: cold,
            ..t
        }
    }

    #[test]
    fn a_later_turn_stays_unless_leaving_is_sooner_even_at_its_full_prefill() {
        let jobs = [
            // Conversation 1 starts on engine 0, conversation 2 on engine 1.
            turn(0.0, 100.0, 100.0, Some(1)),
            turn(0.0, 100.0, 100.0, Some(2)),
            // Engine 0 is busy until 100, engine 1 until 100: conversation
            // 1's turn stays (150 there against 100 + 500 elsewhere).
            turn(50.0, 50.0, 500.0, Some(1)),
            // A long job from a new conversation takes engine 1 until 1100.
            turn(60.0, 1000.0, 1000.0, None),
            // Conversation 2's turn: its engine is busy until 1100, so
            // leaving for engine 0 (free at 150) at its full prefill wins.
            turn(70.0, 10.0, 300.0, Some(2)),
            // Its next turn now lives on engine 0.
            turn(600.0, 10.0, 300.0, Some(2)),
        ];
        let t = sticky(&jobs, 2);
        assert_eq!(t, vec![100.0, 100.0, 100.0, 1040.0, 380.0, 10.0]);
    }

    #[test]
    fn a_request_pays_its_system_prompt_where_its_tenant_never_ran() {
        let tenant = |t: TurnJob<u32>, cold: f64| of_tenant(t, 7, cold);
        let jobs = [
            // Tenant 7's first conversation takes engine 0 until 100.
            tenant(turn(0.0, 100.0, 100.0, Some(1)), 100.0),
            // Its next conversation at 10: 10 ms where the system prompt
            // is (engine 0, done 110), 150 ms on engine 1 (done 160).
            tenant(turn(10.0, 10.0, 10.0, Some(2)), 150.0),
            // A request of no tenant goes anywhere at its own prefill.
            turn(20.0, 10.0, 10.0, None),
        ];
        assert_eq!(sticky(&jobs, 2), vec![100.0, 100.0, 10.0]);
        // Without the tenant, engine 1 serves it at once.
        let free: Vec<TurnJob<u32>> = jobs
            .iter()
            .map(|t| TurnJob { shared: None, ..*t })
            .collect();
        assert_eq!(sticky(&free, 2), vec![100.0, 10.0, 10.0]);
        // Once engine 1 served the tenant, it holds the prompt.
        let mut held = Held::new(2);
        assert_eq!(jobs[1].service_on(None, 1, &held), 150.0);
        held.serve(1, &jobs[0]);
        assert_eq!(jobs[1].service_on(None, 1, &held), 10.0);
        assert_eq!(jobs[1].extra_on(None, 1, &held), 0.0);
    }

    #[test]
    fn without_conversations_it_is_least_work_left() {
        let jobs: Vec<TurnJob<u32>> = [(0.0, 100.0), (0.0, 100.0), (10.0, 50.0), (20.0, 5.0)]
            .iter()
            .map(|&(a, s)| turn(a, s, s, None))
            .collect();
        let plain: Vec<Job> = jobs.iter().map(|t| t.job).collect();
        assert_eq!(sticky(&jobs, 2), balanced(&plain, 2));
    }
}
