//! Recent placements: the memory behind the `placement` term
//! ([`crate::Weights::placement`]).
//!
//! Two things, both fed by the caller at pick time (times are passed in, so
//! this stays free of clocks like the rest of the crate):
//!
//! * **Which prompts continue a conversation.** Every pick's prompt end
//!   (the chain hash of its last full block) is remembered. A later prompt
//!   whose block chain holds one of those ends *before its own last block*
//!   extends an earlier prompt by at least a block: a later turn of that
//!   conversation, a follow-up built on its answer. Chain hashes identify a
//!   whole prefix, so one lookup per block decides it. A prompt that
//!   extends none *starts* a conversation (or is a one-shot request): it
//!   shares at most a system prompt or a template with what came before.
//!   Only the distinct content matters: a prompt that merely repeats an
//!   earlier one (a retry, or two questions short enough to fit in the
//!   same last partial block) is not a continuation of it.
//! * **How many conversations each endpoint was given recently.** A count
//!   per endpoint of the picks that started a conversation there, decaying
//!   with a half-life: a conversation's later turns follow it (their
//!   history is cached there), so this is the load an endpoint has
//!   committed to beyond what is running on it now.
//!
//! Both are bounded: ends in first-in first-out order up to a capacity
//! (a conversation idle longer than the capacity's worth of picks starts
//! over, which costs it at most the `placement` term), counts one per
//! endpoint until [`Placements::forget`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::Hash;

/// Default number of prompt ends remembered per pool.
pub const DEFAULT_MAX_ENDS: usize = 65_536;

/// Recent placements of one pool, keyed by endpoint `K`.
#[derive(Debug, Clone)]
pub struct Placements<K> {
    half_life_ms: f64,
    /// Per endpoint: the count as of the time given, in ms.
    counts: HashMap<K, (f64, f64)>,
    ends: HashSet<u64>,
    /// `ends` in insertion order, for first-in first-out eviction.
    order: VecDeque<u64>,
    max_ends: usize,
}

impl<K: Eq + Hash + Copy> Placements<K> {
    /// Empty, counts halving every `half_life_ms` (a non-positive or
    /// non-finite half-life never decays), at most `max_ends` prompt ends
    /// (at least 1).
    pub fn new(half_life_ms: f64, max_ends: usize) -> Self {
        Placements {
            half_life_ms,
            counts: HashMap::new(),
            ends: HashSet::new(),
            order: VecDeque::new(),
            max_ends: max_ends.max(1),
        }
    }

    /// Whether a prompt with this full-block chain starts a conversation:
    /// no remembered prompt end lies before its last block. An empty chain
    /// (a prompt shorter than a block) extends nothing.
    pub fn starts_conversation(&self, chain: &[u64]) -> bool {
        let Some((_, before_last)) = chain.split_last() else {
            return true;
        };
        // Later turns extend the previous turn, whose end lies near the
        // chain's own: look from the back.
        !before_last.iter().rev().any(|h| self.ends.contains(h))
    }

    /// Conversations started on `key`, decayed to `now_ms`.
    pub fn recent(&self, key: K, now_ms: f64) -> f64 {
        self.counts
            .get(&key)
            .map_or(0.0, |&(n, at)| n * self.decay(now_ms - at))
    }

    /// Records a pick of a prompt with this full-block chain to `key`:
    /// [`Placements::place`] and [`Placements::remember_end`].
    pub fn record(&mut self, key: K, chain: &[u64], starts: bool, now_ms: f64) {
        self.place(key, starts, now_ms);
        self.remember_end(chain);
    }

    /// Counts a pick to `key`: one more conversation there when it
    /// `starts` one, nothing otherwise.
    pub fn place(&mut self, key: K, starts: bool, now_ms: f64) {
        if starts {
            let n = self.recent(key, now_ms) + 1.0;
            self.counts.insert(key, (n, now_ms));
        }
    }

    /// Counts a conversation started on `key` at `at_ms` and learnt of at
    /// `now_ms` (another replica's placement, read later): it adds what is
    /// left of it after its decay, so a late count weighs as if counted on
    /// time. A start dated after `now_ms` counts whole.
    pub fn place_at(&mut self, key: K, at_ms: f64, now_ms: f64) {
        let weight = self.decay(now_ms - at_ms);
        if weight.is_finite() && weight > 0.0 {
            let n = self.recent(key, now_ms) + weight;
            self.counts.insert(key, (n, now_ms));
        }
    }

    /// Remembers the end of a picked prompt's full-block chain, so that
    /// prompts extending it continue its conversation. The whole prompt's
    /// chain: the end of only its head would make every prompt sharing
    /// that head look like a later turn.
    pub fn remember_end(&mut self, chain: &[u64]) {
        if let Some(&end) = chain.last() {
            if self.ends.insert(end) {
                self.order.push_back(end);
            }
            while self.order.len() > self.max_ends {
                if let Some(old) = self.order.pop_front() {
                    self.ends.remove(&old);
                }
            }
        }
    }

    /// Forgets an endpoint's count (it left the pool, or came back with an
    /// empty cache: its conversations are gone).
    pub fn forget(&mut self, key: K) {
        self.counts.remove(&key);
    }

    /// Prompt ends remembered.
    pub fn ends(&self) -> usize {
        self.ends.len()
    }

    fn decay(&self, elapsed_ms: f64) -> f64 {
        if !(self.half_life_ms.is_finite() && self.half_life_ms > 0.0) {
            return 1.0;
        }
        (-elapsed_ms.max(0.0) / self.half_life_ms).exp2()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_that_extends_an_earlier_one_continues_it() {
        let mut p = Placements::<u8>::new(1000.0, 16);
        let turn1 = [1, 2, 3, 4];
        assert!(p.starts_conversation(&turn1));
        p.record(0, &turn1, true, 0.0);
        // The next turn: turn 1's blocks, then its answer and question.
        assert!(!p.starts_conversation(&[1, 2, 3, 4, 5, 6]));
        // A sibling conversation shares the system prompt (blocks 1, 2)
        // and diverges before turn 1's end: it starts its own.
        assert!(p.starts_conversation(&[1, 2, 7, 8]));
        // The same prompt again extends nothing: a repeat, not a turn.
        assert!(p.starts_conversation(&turn1));
        assert!(p.starts_conversation(&[]));
    }

    #[test]
    fn counts_grow_with_started_conversations_and_decay() {
        let mut p = Placements::<u8>::new(1000.0, 16);
        p.record(0, &[1], true, 0.0);
        p.record(0, &[1, 2], false, 0.0);
        p.record(1, &[3], true, 0.0);
        p.record(0, &[4], true, 0.0);
        assert_eq!(p.recent(0, 0.0), 2.0);
        assert_eq!(p.recent(1, 0.0), 1.0);
        assert_eq!(p.recent(2, 0.0), 0.0);
        assert!((p.recent(0, 1000.0) - 1.0).abs() < 1e-12);
        assert!((p.recent(0, 3000.0) - 0.25).abs() < 1e-12);
        // A clock that steps back does not grow counts.
        assert_eq!(p.recent(0, -5.0), 2.0);
        p.record(0, &[5], true, 1000.0);
        assert!((p.recent(0, 1000.0) - 2.0).abs() < 1e-12);
        p.forget(0);
        assert_eq!(p.recent(0, 1000.0), 0.0);
        // No half-life: no decay.
        let mut q = Placements::<u8>::new(0.0, 16);
        q.record(0, &[1], true, 0.0);
        assert_eq!(q.recent(0, 1e12), 1.0);
    }

    #[test]
    fn a_start_learnt_late_weighs_what_is_left_of_it() {
        let mut p = Placements::<u8>::new(1000.0, 16);
        p.place(0, true, 0.0);
        // Started at 0, learnt of at 1000: half of it is left, as of the
        // one counted at 0 on time.
        p.place_at(1, 0.0, 1000.0);
        assert!((p.recent(1, 1000.0) - 0.5).abs() < 1e-12);
        assert!((p.recent(0, 1000.0) - p.recent(1, 1000.0)).abs() < 1e-12);
        // Adds to what is there, and decays on from there.
        p.place_at(0, 1000.0, 1000.0);
        assert!((p.recent(0, 2000.0) - 0.75).abs() < 1e-12);
        // A start dated later than now (clocks disagree) counts whole.
        p.place_at(2, 5000.0, 1000.0);
        assert_eq!(p.recent(2, 1000.0), 1.0);
    }

    #[test]
    fn ends_are_bounded_oldest_first() {
        let mut p = Placements::<u8>::new(1000.0, 2);
        p.record(0, &[10], true, 0.0);
        p.record(0, &[20], true, 0.0);
        p.record(0, &[20], false, 0.0);
        assert_eq!(p.ends(), 2);
        p.record(0, &[30], true, 0.0);
        assert_eq!(p.ends(), 2);
        assert!(p.starts_conversation(&[10, 11]), "10 was evicted");
        assert!(!p.starts_conversation(&[20, 21]));
        assert!(!p.starts_conversation(&[30, 31]));
    }
}
