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
    /// Tokens of its picks waiting.
    waiting: u64,
    weight: u32,
}

/// In-flight work and waiting picks per tenant, with their sums.
#[derive(Debug, Default)]
pub struct Shares {
    tenants: HashMap<String, Held>,
    tokens: u64,
    waiting: u64,
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

    /// A pick of `tenant` of `tokens` starts waiting.
    pub fn queue(&mut self, tenant: &str, weight: u32, tokens: u64) {
        let h = self.entry(tenant, weight);
        h.queued += 1;
        h.waiting = h.waiting.saturating_add(tokens);
        self.waiting = self.waiting.saturating_add(tokens);
    }

    /// A pick of `tenant` of `tokens` stops waiting (released, expired or
    /// cancelled).
    pub fn unqueue(&mut self, tenant: &str, tokens: u64) {
        if let Some(h) = self.tenants.get_mut(tenant) {
            h.queued = h.queued.saturating_sub(1);
            let n = if h.queued == 0 {
                h.waiting
            } else {
                tokens.min(h.waiting)
            };
            h.waiting -= n;
            self.waiting -= n;
            self.forget_idle(tenant);
        }
    }

    /// Whether `tenant` holds more than its weighted share of the work in
    /// flight, among the tenants active now. A tenant holding nothing, or
    /// alone, is not.
    pub fn over_share(&self, tenant: &str) -> bool {
        self.over_share_by(tenant, 0.0)
    }

    /// Whether `tenant` holds more than `1 + slack` times its weighted
    /// share of the work in flight ([`Shares::over_share`] at 0): with
    /// tenants of equal demand, whoever is momentarily above the mean is
    /// over a share of exactly its weight, and the reserve would slow it
    /// for noise; `slack` keeps it for the tenants clearly above theirs.
    pub fn over_share_by(&self, tenant: &str, slack: f64) -> bool {
        self.over_share_of(tenant, slack, false)
    }

    /// [`Shares::over_share_by`], of the work in flight or, with
    /// `waiting`, of the work in flight and waiting (its demand): a
    /// flooding tenant whose picks wait at the gateway holds no more than
    /// its share in flight (the fair order releases it that much), but it
    /// demands more.
    pub fn over_share_of(&self, tenant: &str, slack: f64, waiting: bool) -> bool {
        if self.tenants.len() < 2 {
            return false;
        }
        let Some(h) = self.tenants.get(tenant) else {
            return false;
        };
        let (mine, all) = if waiting {
            (
                h.tokens.saturating_add(h.waiting),
                self.tokens.saturating_add(self.waiting),
            )
        } else {
            (h.tokens, self.tokens)
        };
        if slack <= 0.0 {
            // mine / all > weight / weights, without division.
            return u128::from(mine) * u128::from(self.weights)
                > u128::from(all) * u128::from(h.weight);
        }
        let share = all as f64 * f64::from(h.weight) / self.weights as f64;
        mine as f64 > share * (1.0 + slack)
    }

    /// Tokens of `tenant`'s picks waiting.
    pub fn waiting(&self, tenant: &str) -> u64 {
        self.tenants.get(tenant).map_or(0, |h| h.waiting)
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
        s.queue("a", 1, 0);
        assert!(!s.over_share("a"));
        // Another tenant waiting makes it active: "a" now holds all of it.
        s.queue("b", 1, 0);
        assert!(s.over_share("a"));
        assert!(!s.over_share("b"));
        s.unqueue("b", 0);
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
        s.queue("a", 3, 0);
        s.end("a", 300);
        assert!(s.over_share("b"), "b holds all, a still waits");
        s.unqueue("a", 0);
        assert_eq!((s.active(), s.total()), (1, 100));
        assert!(!s.over_share("b"));
        s.end("b", 100);
        assert_eq!((s.active(), s.total(), s.weights), (0, 0, 0));
        s.end("nobody", 5);
        s.unqueue("nobody", 0);
        assert_eq!(s.active(), 0);
    }

    #[test]
    fn slack_leaves_a_tenant_just_above_its_share_alone() {
        let mut s = Shares::new();
        for (t, n) in [("a", 300), ("b", 200), ("c", 250), ("d", 250)] {
            s.start(t, 1, n);
        }
        // a holds 300 of 1000, its share 250: over it by 20%.
        assert!(s.over_share("a"));
        assert!(s.over_share_by("a", 0.1));
        assert!(!s.over_share_by("a", 0.25), "1.2x is within 1.25x");
        assert!(!s.over_share_by("a", 0.5));
        s.start("a", 1, 700);
        // 1000 of 1700 against a share of 425: well past 1.5x.
        assert!(s.over_share_by("a", 0.5));
        assert!(!s.over_share_by("b", 0.0) && !s.over_share_by("b", 0.5));
        // Alone, never.
        let mut one = Shares::new();
        one.start("a", 1, 5);
        assert!(!one.over_share_by("a", 0.0) && !one.over_share_by("a", 2.0));
    }

    #[test]
    fn a_flooding_tenants_waiting_picks_count_in_its_demand() {
        let mut s = Shares::new();
        for t in ["a", "b", "c", "d"] {
            s.start(t, 1, 1000);
        }
        // a's share in flight is exact, but it has 9000 tokens waiting.
        s.queue("a", 1, 9000);
        assert!(!s.over_share_of("a", 0.0, false));
        assert!(s.over_share_of("a", 0.0, true));
        assert!(s.over_share_of("a", 1.0, true), "10000 of 13000 > 2 x 3250");
        assert!(!s.over_share_of("b", 0.0, true));
        s.unqueue("a", 9000);
        assert!(!s.over_share_of("a", 0.0, true));
        assert_eq!(s.waiting("a"), 0);
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
                    2 => { s.queue(names[t], w, tokens); queued[t] += 1; }
                    _ => if queued[t] > 0 { queued[t] -= 1; s.unqueue(names[t], tokens); },
                }
                let tokens: u64 = started.iter().map(|(_, n)| n).sum();
                prop_assert_eq!(s.total(), tokens);
                let active = (0..4)
                    .filter(|&i| queued[i] > 0 || started.iter().any(|(u, _)| *u == i))
                    .count();
                prop_assert_eq!(s.active(), active);
                let weights: u64 = s.tenants.values().map(|h| u64::from(h.weight)).sum();
                let waiting: u64 = s.tenants.values().map(|h| h.waiting).sum();
                prop_assert_eq!(s.waiting, waiting);
                for (i, n) in names.iter().enumerate() {
                    if queued[i] == 0 {
                        prop_assert_eq!(s.waiting(n), 0);
                    }
                }
                prop_assert_eq!(s.weights, weights);
                let over = names.iter().filter(|n| s.over_share(n)).count();
                prop_assert!(active == 0 || over < active);
            }
        }
    }
}
