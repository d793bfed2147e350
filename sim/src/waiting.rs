//! The scheduler's waiting queue under vLLM's two policies
//! (`vllm/v1/core/sched/request_queue.py`): FCFS is a deque (new requests
//! at the back, preempted ones back at the front); PRIORITY is ordered by
//! (priority, arrival time), lower first, and a preempted request goes back
//! to its ordered place rather than the front.

use std::collections::VecDeque;

/// vLLM's `--scheduling-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SchedulingPolicy {
    /// First come, first served (vLLM's default).
    #[default]
    Fcfs,
    /// Lower `priority` first, earlier arrival breaking ties.
    Priority,
}

impl SchedulingPolicy {
    /// vLLM's name for the policy.
    pub fn as_str(self) -> &'static str {
        match self {
            SchedulingPolicy::Fcfs => "fcfs",
            SchedulingPolicy::Priority => "priority",
        }
    }
}

/// What the queue needs to know of a queued request.
pub trait Queued {
    /// Engine-wide request id, increasing with submission.
    fn id(&self) -> u64;
    /// The request's `priority` (lower is served earlier).
    fn priority(&self) -> i64;
    /// Virtual arrival time, seconds.
    fn arrival(&self) -> f64;
}

/// vLLM's `Request.__lt__`: priority, then arrival time. vLLM's last
/// tie-break is the request id string (random uuids); the simulator's is
/// its submission counter, so equal arrivals keep submission order.
pub fn before<T: Queued>(a: &T, b: &T) -> bool {
    (a.priority(), a.arrival(), a.id()) < (b.priority(), b.arrival(), b.id())
}

/// The waiting queue; the front is the next request to admit.
#[derive(Debug)]
pub struct WaitingQueue<T> {
    policy: SchedulingPolicy,
    items: VecDeque<T>,
}

impl<T: Queued> WaitingQueue<T> {
    /// An empty queue under `policy`.
    pub fn new(policy: SchedulingPolicy) -> Self {
        WaitingQueue {
            policy,
            items: VecDeque::new(),
        }
    }

    /// vLLM's `add_request`: a new arrival.
    pub fn add(&mut self, item: T) {
        match self.policy {
            SchedulingPolicy::Fcfs => self.items.push_back(item),
            SchedulingPolicy::Priority => self.insert_ordered(item),
        }
    }

    /// vLLM's `prepend_request`: a preempted request going back.
    pub fn prepend(&mut self, item: T) {
        match self.policy {
            SchedulingPolicy::Fcfs => self.items.push_front(item),
            SchedulingPolicy::Priority => self.insert_ordered(item),
        }
    }

    // The deque stays sorted, so the front is the heap's minimum; the
    // waiting queue is short next to the cost of a step.
    fn insert_ordered(&mut self, item: T) {
        let at = self.items.partition_point(|x| before(x, &item));
        self.items.insert(at, item);
    }

    /// The next request to admit.
    pub fn front_mut(&mut self) -> Option<&mut T> {
        self.items.front_mut()
    }

    /// Takes the next request to admit.
    pub fn pop_front(&mut self) -> Option<T> {
        self.items.pop_front()
    }

    /// Removes the request with this id (an abort).
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let i = self.items.iter().position(|s| s.id() == id)?;
        self.items.remove(i)
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The ids in admission order.
    pub fn ids(&self) -> Vec<u64> {
        self.items.iter().map(Queued::id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct R(u64, i64, f64);

    impl Queued for R {
        fn id(&self) -> u64 {
            self.0
        }
        fn priority(&self) -> i64 {
            self.1
        }
        fn arrival(&self) -> f64 {
            self.2
        }
    }

    #[test]
    fn fcfs_ignores_priority_and_prepends_preempted() {
        let mut q = WaitingQueue::new(SchedulingPolicy::Fcfs);
        q.add(R(1, 5, 0.0));
        q.add(R(2, -5, 1.0));
        q.prepend(R(3, 9, 2.0));
        assert_eq!(q.ids(), vec![3, 1, 2]);
    }

    #[test]
    fn priority_orders_by_priority_then_arrival_then_id() {
        let mut q = WaitingQueue::new(SchedulingPolicy::Priority);
        q.add(R(1, 0, 1.0));
        q.add(R(2, 1, 0.0));
        q.add(R(3, -1, 2.0));
        q.add(R(4, 0, 0.5));
        q.add(R(5, 0, 1.0));
        // A preempted request goes back to its ordered place, not the front.
        q.prepend(R(6, 1, 0.1));
        assert_eq!(q.ids(), vec![3, 4, 1, 5, 2, 6]);
        assert_eq!(q.remove(1).map(|r| r.0), Some(1));
        assert_eq!(q.pop_front().map(|r| r.0), Some(3));
        assert_eq!(q.len(), 4);
    }
}
