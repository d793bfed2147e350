//! Who holds how much of a pool's in-flight work, for the reserve: a
//! tenant over its weighted fair share may only take room that tenants
//! under their share would not need ([`crate::room_bound`]).
//!
//! A tenant's share is of the in-flight work (tokens: prompt plus output
//! estimate of the picks let through or released and not done yet), split
//! by weight between the tenants active now: those with work in flight or
//! picks waiting. A tenant alone is never over its share, so flow control
//! stays work-conserving for it.

use std::collections::HashMap;

#[derive(Debug, Default, Clone, Copy)]
struct Held {
    tokens: u64,
    picks: u64,
    queued: usize,
    weight: u32,
}

/// In-flight work and waiting picks per tenant, with their sums.
#[derive(Debug, Default)]
pub struct Shares {
    tenants: HashMap<String, Held>,
    tokens: u64,
    weights: u64,
}

impl Shares {
    /// Nothing held.
    pub fn new() -> Self {
        Shares::default()
    }

    /// A pick of `tenant` (`weight`, 0 taken as 1) starts: `tokens` in flight.
    pub fn start(&mut self, tenant: &str, weight: u32, tokens: u64) {
        let h = self.entry(tenant, weight);
        h.tokens = h.tokens.saturating_add(tokens);
        h.picks += 1;
        self.tokens = self.tokens.saturating_add(tokens);
    }

    /// A pick of `tenant` started with `tokens` is done (or was never
    /// placed). Unknown tenants change nothing.
    pub fn end(&mut self, tenant: &str, tokens: u64) {
        let Some(h) = self.tenants.get_mut(tenant) else {
            return;
        };
        let n = tokens.min(h.tokens);
        h.tokens -= n;
        h.picks = h.picks.saturating_sub(1);
        if h.picks == 0 {
            // (What is left is rounding from a changed charge: nothing runs.)
            self.tokens -= h.tokens;
            h.tokens = 0;
        }
        self.tokens -= n;
        self.forget_idle(tenant);
    }

    /// A pick of `tenant` starts waiting.
    pub fn queue(&mut self, tenant: &str, weight: u32) {
        self.entry(tenant, weight).queued += 1;
    }

    /// A pick of `tenant` stops waiting (released, expired or cancelled).
    pub fn unqueue(&mut self, tenant: &str) {
        if let Some(h) = self.tenants.get_mut(tenant) {
            h.queued = h.queued.saturating_sub(1);
            self.forget_idle(tenant);
        }
    }

    /// Whether `tenant` holds more than its weighted share of the work in
    /// flight, among the tenants active now. A tenant holding nothing, or
    /// alone, is not.
    pub fn over_share(&self, tenant: &str) -> bool {
        if self.tenants.len() < 2 {
            return false;
        }
        let Some(h) = self.tenants.get(tenant) else {
            return false;
        };
        // held / total > weight / weights, without division.
        u128::from(h.tokens) * u128::from(self.weights)
            > u128::from(self.tokens) * u128::from(h.weight)
    }

    /// Tokens `tenant` has in flight.
    pub fn held(&self, tenant: &str) -> u64 {
        self.tenants.get(tenant).map_or(0, |h| h.tokens)
    }

    /// Tokens in flight, all tenants.
    pub fn total(&self) -> u64 {
        self.tokens
    }

    /// Tenants active (work in flight or picks waiting).
    pub fn active(&self) -> usize {
        self.tenants.len()
    }

    fn entry(&mut self, tenant: &str, weight: u32) -> &mut Held {
        let weight = weight.max(1);
        let h = self.tenants.entry(tenant.to_owned()).or_default();
        // The latest weight holds (a policy reload may change it).
        self.weights = self.weights - u64::from(h.weight) + u64::from(weight);
        h.weight = weight;
        h
    }

    fn forget_idle(&mut self, tenant: &str) {
        if let Some(h) = self.tenants.get(tenant) {
            if h.picks == 0 && h.queued == 0 {
                self.weights -= u64::from(h.weight);
                self.tenants.remove(tenant);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_tenant_alone_is_never_over_its_share() {
        let mut s = Shares::new();
        s.start("a", 1, 100_000);
        assert!(!s.over_share("a"));
        s.queue("a", 1);
        assert!(!s.over_share("a"));
        // Another tenant waiting makes it active: "a" now holds all of it.
        s.queue("b", 1);
        assert!(s.over_share("a"));
        assert!(!s.over_share("b"));
        s.unqueue("b");
        assert!(!s.over_share("a"));
        assert_eq!(s.active(), 1);
    }

    #[test]
    fn shares_follow_weights() {
        let mut s = Shares::new();
        s.start("a", 3, 300);
        s.start("b", 1, 100);
        // 300 of 400 at weight 3 of 4: exactly its share, not over.
        assert!(!s.over_share("a") && !s.over_share("b"));
        s.start("b", 1, 1);
        assert!(s.over_share("b") && !s.over_share("a"));
        s.end("b", 1);
        s.queue("a", 3);
        s.end("a", 300);
        assert!(s.over_share("b"), "b holds all, a still waits");
        s.unqueue("a");
        assert_eq!((s.active(), s.total()), (1, 100));
        assert!(!s.over_share("b"));
        s.end("b", 100);
        assert_eq!((s.active(), s.total(), s.weights), (0, 0, 0));
        s.end("nobody", 5);
        s.unqueue("nobody");
        assert_eq!(s.active(), 0);
    }

    proptest! {
        /// The sums match the tenants' figures after any sequence, a
        /// tenant is forgotten once it holds and waits nothing, and at
        /// most all but one active tenant are over their share, never all.
        #[test]
        fn sums_stay_consistent(ops in proptest::collection::vec(
            (0..4usize, 0..4u8, 1..4u32, 0..50_000u64), 0..200)) {
            let names = ["a", "b", "c", "d"];
            let mut s = Shares::new();
            let mut started: Vec<(usize, u64)> = Vec::new();
            let mut queued = [0usize; 4];
            for (t, op, w, tokens) in ops {
                match op {
                    0 => { s.start(names[t], w, tokens); started.push((t, tokens)); }
                    1 => if let Some(i) = started.iter().position(|(u, _)| *u == t) {
                        let (_, n) = started.remove(i);
                        s.end(names[t], n);
                    },
                    2 => { s.queue(names[t], w); queued[t] += 1; }
                    _ => if queued[t] > 0 { queued[t] -= 1; s.unqueue(names[t]); },
                }
                let tokens: u64 = started.iter().map(|(_, n)| n).sum();
                prop_assert_eq!(s.total(), tokens);
                let active = (0..4)
                    .filter(|&i| queued[i] > 0 || started.iter().any(|(u, _)| *u == i))
                    .count();
                prop_assert_eq!(s.active(), active);
                let weights: u64 = s.tenants.values().map(|h| u64::from(h.weight)).sum();
                prop_assert_eq!(s.weights, weights);
                let over = names.iter().filter(|n| s.over_share(n)).count();
                prop_assert!(active == 0 || over < active);
            }
        }
    }
}
