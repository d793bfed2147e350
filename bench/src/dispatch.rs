//! Oracle dispatchers for multi-turn workloads: routers that know every
//! engine's queue exactly, replayed over a run's arrivals in the FCFS
//! prefill queues of [`crate::queue`], a later turn that leaves its
//! conversation's engine reusing only its tenant's system prompt, and that
//! only on an engine that served the tenant before ([`queue::Held`]).
//!
//! [`crate::queue::sticky`] places each request at arrival where its first
//! token comes soonest. The dispatchers here go further in two ways a real
//! router could: they can hold requests in one central queue and hand each
//! engine a request only when it frees (late binding), taking the shortest
//! first; and they can price a move above its own prefill, since the
//! extra prefill a move adds delays whoever queues behind it. [`best`]
//! tries a small grid of both and keeps the lowest mean: a yardstick of how
//! close to perfect balance a router that must keep conversations' caches
//! can get on the same arrivals, by the same model (the best of these, not
//! a bound over every router).

use std::collections::HashMap;
use std::hash::Hash;

use crate::queue::{self, Held, TurnJob};

/// How a dispatcher holds and places requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dispatch {
    /// Hold requests in one central queue until an engine frees (late
    /// binding); otherwise place each at arrival.
    pub central: bool,
    /// From the central queue, the request that is quickest on the freed
    /// engine first; otherwise the oldest.
    pub shortest_first: bool,
    /// A move is taken only when it is sooner even with this share of the
    /// extra prefill it adds counted against it (0: selfish).
    pub move_penalty: f64,
}

impl Dispatch {
    /// The dispatcher in words, for reports.
    pub fn describe(&self) -> String {
        let place = match (self.central, self.shortest_first) {
            (false, _) => "placing each request at arrival",
            (true, false) => "holding requests in one central queue, oldest first",
            (true, true) => "holding requests in one central queue, quickest first",
        };
        if self.move_penalty == 0.0 {
            format!("{place}, moving a turn whenever that is sooner for it")
        } else {
            format!(
                "{place}, moving a turn only when that is sooner with {} the extra prefill it adds counted against it",
                penalty_words(self.move_penalty)
            )
        }
    }
}

fn penalty_words(p: f64) -> String {
    if p == 1.0 {
        "all of".into()
    } else {
        format!("{p}x")
    }
}

/// The grid [`best`] tries.
pub fn grid() -> Vec<Dispatch> {
    let mut out = Vec::new();
    for (central, shortest_first) in [(false, false), (true, false), (true, true)] {
        for move_penalty in [0.0, 0.5, 1.0, 2.0] {
            out.push(Dispatch {
                central,
                shortest_first,
                move_penalty,
            });
        }
    }
    out
}

/// TTFT of each of `jobs` (in their order) under `d` on `engines` engines.
pub fn run<K: Hash + Eq + Copy>(jobs: &[TurnJob<K>], engines: usize, d: Dispatch) -> Vec<f64> {
    if d.central {
        held(jobs, engines, d)
    } else {
        queue::sticky_priced(jobs, engines, d.move_penalty)
    }
}

/// The dispatcher of [`grid`] with the lowest mean TTFT over `jobs`, with
/// its TTFTs; None for no jobs.
pub fn best<K: Hash + Eq + Copy>(
    jobs: &[TurnJob<K>],
    engines: usize,
) -> Option<(Dispatch, Vec<f64>)> {
    lowest(&run_grid(jobs, engines), |_| true)
}

/// Every dispatcher of [`grid`] with its TTFTs over `jobs` (none for no
/// jobs).
pub fn run_grid<K: Hash + Eq + Copy>(
    jobs: &[TurnJob<K>],
    engines: usize,
) -> Vec<(Dispatch, Vec<f64>)> {
    if jobs.is_empty() {
        return Vec::new();
    }
    grid()
        .into_iter()
        .map(|d| (d, run(jobs, engines, d)))
        .collect()
}

/// Of `runs` ([`run_grid`]), the one with the lowest mean TTFT among the
/// dispatchers `keep` keeps (e.g. those that place at arrival).
pub fn lowest(
    runs: &[(Dispatch, Vec<f64>)],
    keep: impl Fn(&Dispatch) -> bool,
) -> Option<(Dispatch, Vec<f64>)> {
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    runs.iter()
        .filter(|(d, _)| keep(d))
        .min_by(|a, b| mean(&a.1).total_cmp(&mean(&b.1)))
        .cloned()
}

/// The central queue: requests wait until an engine frees; a freed engine
/// takes, of the requests it may take, the oldest or the quickest on it.
/// A request may go to any engine unless its conversation lives on another
/// one that would, with `move_penalty` applied, still give it its first
/// token sooner. No engine idles while a request it may take waits; of
/// several idle engines, the one idle longest chooses first.
fn held<K: Hash + Eq + Copy>(jobs: &[TurnJob<K>], engines: usize, d: Dispatch) -> Vec<f64> {
    let order = queue::by_arrival(jobs, |t| t.job.arrival_ms);
    let mut free = vec![f64::NEG_INFINITY; engines.max(1)];
    let mut held = Held::new(free.len());
    let mut home: HashMap<K, usize> = HashMap::new();
    let mut waiting: Vec<usize> = Vec::new();
    let mut ttft = vec![0.0; jobs.len()];
    let (mut next, mut now) = (0, f64::NEG_INFINITY);
    while next < order.len() || !waiting.is_empty() {
        while next < order.len() && jobs[order[next]].job.arrival_ms <= now {
            waiting.push(order[next]);
            next += 1;
        }
        let mut started = false;
        // The engine idle longest chooses first, so new conversations
        // spread over the idle engines instead of filling the first.
        let mut idle: Vec<usize> = (0..free.len()).filter(|&e| free[e] <= now).collect();
        idle.sort_by(|&a, &b| free[a].total_cmp(&free[b]).then(a.cmp(&b)));
        for e in idle {
            let Some(w) = pick(jobs, &waiting, e, now, (&free, &held), &home, d) else {
                continue;
            };
            let i = waiting.remove(w);
            let t = &jobs[i];
            let done = now + t.service_on(t.home(&home), e, &held);
            free[e] = done;
            held.serve(e, t);
            if let Some(c) = t.conversation {
                home.insert(c, e);
            }
            ttft[i] = done - t.job.arrival_ms;
            started = true;
        }
        if started {
            continue;
        }
        let arrival = order.get(next).map(|&i| jobs[i].job.arrival_ms);
        let freed = free
            .iter()
            .copied()
            .filter(|&f| f > now)
            .min_by(f64::total_cmp);
        match (arrival, freed) {
            (Some(a), Some(f)) => now = a.min(f),
            (Some(t), None) | (None, Some(t)) => now = t,
            // Every engine idle and nothing may start: cannot happen, as a
            // request may always start on its conversation's engine.
            (None, None) => break,
        }
    }
    ttft
}

/// Which of `waiting` idle engine `e` takes at `now`, given when each
/// engine frees and the shared prompts each holds, as an index into it.
fn pick<K: Hash + Eq + Copy>(
    jobs: &[TurnJob<K>],
    waiting: &[usize],
    e: usize,
    now: f64,
    (free, held): (&[f64], &Held),
    home: &HashMap<K, usize>,
    d: Dispatch,
) -> Option<usize> {
    let may = |t: &TurnJob<K>| match t.home(home) {
        Some(h) if h != e => {
            let (service, extra) = (t.service_on(Some(h), e, held), t.extra_on(Some(h), e, held));
            free[h].max(now) + t.job.service_ms > now + service + d.move_penalty * extra
        }
        _ => true,
    };
    let key = |t: &TurnJob<K>| {
        let first = if d.shortest_first {
            t.service_on(t.home(home), e, held)
        } else {
            0.0
        };
        (first, t.job.arrival_ms)
    };
    waiting
        .iter()
        .enumerate()
        .filter(|(_, &i)| may(&jobs[i]))
        .min_by(|(_, &a), (_, &b)| {
            let (ka, kb) = (key(&jobs[a]), key(&jobs[b]));
            ka.0.total_cmp(&kb.0).then(ka.1.total_cmp(&kb.1))
        })
        .map(|(w, _)| w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::tests::{of_tenant, turn};

    const FCFS: Dispatch = Dispatch {
        central: true,
        shortest_first: false,
        move_penalty: 0.0,
    };

    #[test]
    fn at_arrival_with_no_penalty_is_sticky() {
        let jobs = [
            turn(0.0, 100.0, 100.0, None),
            turn(0.0, 100.0, 100.0, Some(2)),
            turn(50.0, 50.0, 500.0, Some(2)),
            turn(60.0, 10.0, 30.0, Some(2)),
        ];
        let d = Dispatch {
            central: false,
            ..FCFS
        };
        assert_eq!(run(&jobs, 2, d), queue::sticky(&jobs, 2));
    }

    #[test]
    fn a_central_queue_serves_the_quickest_first_when_asked() {
        // One engine, busy with a long job; two wait behind it.
        let jobs = [
            turn(0.0, 100.0, 100.0, None),
            turn(1.0, 50.0, 50.0, None),
            turn(2.0, 10.0, 10.0, None),
        ];
        assert_eq!(run(&jobs, 1, FCFS), vec![100.0, 149.0, 158.0]);
        let sjf = Dispatch {
            shortest_first: true,
            ..FCFS
        };
        assert_eq!(run(&jobs, 1, sjf), vec![100.0, 159.0, 108.0]);
    }

    #[test]
    fn a_held_turn_waits_for_its_engine_unless_moving_is_sooner() {
        let jobs = [
            // Conversation 1 lives on engine 0 (busy until 100).
            turn(0.0, 100.0, 100.0, Some(1)),
            // A new conversation on engine 1, free at 20.
            turn(0.0, 20.0, 20.0, Some(2)),
            // Conversation 1's turn at 10: 5 ms at home (done 105), 60 ms
            // elsewhere (engine 1 at 20: done 80): it moves.
            turn(10.0, 5.0, 60.0, Some(1)),
        ];
        assert_eq!(run(&jobs, 2, FCFS), vec![100.0, 20.0, 70.0]);
        // Counting the 55 ms extra it adds (20 + 60 + 55 > 105) it stays.
        let priced = Dispatch {
            move_penalty: 1.0,
            ..FCFS
        };
        assert_eq!(run(&jobs, 2, priced), vec![100.0, 20.0, 95.0]);
    }

    #[test]
    fn a_tenants_system_prompt_is_held_only_where_the_tenant_ran() {
        let tenant = |t: TurnJob<u32>| of_tenant(t, 0, 200.0);
        let jobs = [
            // The tenant's first conversation: engine 0, cold.
            tenant(turn(0.0, 200.0, 200.0, Some(1))),
            // Another at 300: engine 1 has been idle longest but never
            // served the tenant, so it prefills the system prompt there.
            tenant(turn(300.0, 20.0, 20.0, Some(2))),
            // A third at 600: both engines hold the prompt now.
            tenant(turn(600.0, 20.0, 20.0, Some(3))),
        ];
        assert_eq!(run(&jobs, 2, FCFS), vec![200.0, 200.0, 20.0]);
        // Quickest first on the same arrivals changes nothing here: one
        // request waits at a time.
        let sjf = Dispatch {
            shortest_first: true,
            ..FCFS
        };
        assert_eq!(run(&jobs, 2, sjf), vec![200.0, 200.0, 20.0]);
    }

    #[test]
    fn the_engine_idle_longest_takes_a_new_conversation() {
        let jobs = [
            turn(0.0, 100.0, 100.0, Some(1)),
            turn(0.0, 10.0, 10.0, Some(2)),
            // Engine 1 has been idle since 10, engine 0 since 100: this
            // long new conversation goes to engine 1 ...
            turn(200.0, 1000.0, 1000.0, Some(3)),
            // ... so conversation 1's turn finds its engine free.
            turn(201.0, 10.0, 500.0, Some(1)),
        ];
        assert_eq!(run(&jobs, 2, FCFS), vec![100.0, 10.0, 1000.0, 10.0]);
    }

    #[test]
    fn the_best_of_the_grid_is_no_worse_than_placing_at_arrival() {
        // Many short conversations on 3 engines with a long job now and then.
        let jobs: Vec<TurnJob<u32>> = (0..300)
            .map(|i| {
                let here = if i % 17 == 0 {
                    400.0
                } else {
                    20.0 + (i % 5) as f64 * 7.0
                };
                let conv = (i % 23) as u32;
                turn(i as f64 * 15.0, here, here * 6.0, (i >= 23).then_some(conv))
            })
            .collect();
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (d, best) = best(&jobs, 3).unwrap();
        assert!(mean(&best) <= mean(&queue::sticky(&jobs, 3)), "{d:?}");
        assert!(grid().contains(&d));
        // The best that places at arrival is no better, and no worse than
        // `sticky`, which is one of them.
        let (a, at_arrival) = lowest(&run_grid(&jobs, 3), |d| !d.central).unwrap();
        assert!(!a.central);
        assert!(mean(&best) <= mean(&at_arrival));
        assert!(mean(&at_arrival) <= mean(&queue::sticky(&jobs, 3)));
        assert_eq!(best.len(), jobs.len());
        assert!(super::best::<u32>(&[], 3).is_none());
    }
}
