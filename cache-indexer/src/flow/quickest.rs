//! Quickest first (`releaseOrder: quickestFirst`): when the fair order
//! gives a tenant its turn, which of its waiting picks goes is priced on the
//! endpoint that has room now (the one a release finds the most room on):
//! the least prefill left to do there goes first
//! ([`kvasir_flowcontrol::FlowQueue::pop_quickest_where`], with its aging
//! bound). This is the benchmark replay's central queue
//! (`central:quickest:0.5:2048`, bench/src/replay/place.rs) inside the
//! fair shares and bands:
//!
//! * a pick's price on an endpoint is its uncached prompt tokens there, by
//!   the prefix match the pick made when it arrived ([`Price`]; the index
//!   is not looked up again at release, so a release costs one pass over
//!   the tenant's waiting picks whatever their prompts' length);
//! * a pick the endpoint "may not take" is priced last: one whose best
//!   holder (most of its prompt cached, least backlog among equals) would
//!   give it its first token sooner, with a move priced [`MOVE_PENALTY`]
//!   times the extra prefill it adds, backlogs in uncached tokens;
//! * among equals, and among picks priced last, arrival order.
//!
//! A pick priced last is still released when nothing cheaper waits (the
//! queue never holds a pick back when there is room); the ranking then
//! weighs its holder's queue against the prefill a move costs, as for
//! every released pick ([`super::passage`]).

use crate::load::LoadView;
use crate::types::EndpointId;

use super::estimate::backlog_tokens;

/// Share of a move's extra prefill counted against taking a pick away
/// from the endpoint that holds most of its prompt: the replay's central
/// queue at 0.5 was the router that won on held-out traffic.
pub const MOVE_PENALTY: f64 = 0.5;

/// What a waiting pick's prefill would be on each endpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Price {
    /// Its prompt's tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens each endpoint holds (cached, by the pick's prefix
    /// match); endpoints absent hold none.
    pub cached: Vec<(EndpointId, u64)>,
}

impl Price {
    /// Prompt tokens `id` holds (at most the prompt).
    pub fn cached_on(&self, id: EndpointId) -> u64 {
        self.cached
            .iter()
            .find(|(e, _)| *e == id)
            .map_or(0, |(_, n)| (*n).min(self.prompt_tokens))
    }

    /// Prompt tokens `id` would have to prefill.
    pub fn uncached_on(&self, id: EndpointId) -> u64 {
        self.prompt_tokens - self.cached_on(id)
    }
}

/// The endpoint a release is for, with every healthy endpoint's prefill
/// backlog (uncached tokens), to price waiting picks on it.
#[derive(Debug)]
pub(crate) struct Taker {
    id: EndpointId,
    backlogs: Vec<(EndpointId, u64)>,
}

impl Taker {
    /// The release for `id`, among the healthy endpoints of `loads`.
    pub(crate) fn new(id: EndpointId, loads: &[(EndpointId, LoadView)]) -> Self {
        let backlogs = loads
            .iter()
            .filter(|(_, v)| v.healthy)
            .map(|(e, v)| (*e, backlog_tokens(v)))
            .collect();
        Taker { id, backlogs }
    }

    fn backlog(&self, id: EndpointId) -> u64 {
        self.backlogs
            .iter()
            .find(|(e, _)| *e == id)
            .map_or(0, |(_, n)| *n)
    }

    /// `price`'s cost on the taker: its uncached prompt tokens there when
    /// the taker may take it, else `u64::MAX` (after every pick it may
    /// take; see the module docs).
    pub(crate) fn cost(&self, price: &Price) -> u64 {
        let here = price.uncached_on(self.id);
        if self.may_take(price, here) {
            here
        } else {
            u64::MAX
        }
    }

    /// Whether the pick's best holder would not give it its first token
    /// sooner than the taker, the move priced [`MOVE_PENALTY`] times the
    /// extra prefill it adds.
    fn may_take(&self, price: &Price, here: u64) -> bool {
        let mine = price.cached_on(self.id);
        // The best holder: most cached, least backlog among equals.
        let holder = price
            .cached
            .iter()
            .map(|(e, _)| (*e, price.cached_on(*e)))
            .filter(|(e, n)| *n > mine && self.backlogs.iter().any(|(b, _)| b == e))
            .map(|(e, n)| (e, n, self.backlog(e)))
            .max_by(|a, b| a.1.cmp(&b.1).then(b.2.cmp(&a.2)));
        let Some((holder, _, holder_backlog)) = holder else {
            // Nobody healthy holds more of it.
            return true;
        };
        let there = price.uncached_on(holder);
        let holder_first = holder_backlog as f64 + there as f64;
        let extra = here.saturating_sub(there) as f64;
        let taker_first = self.backlog(self.id) as f64 + here as f64 + MOVE_PENALTY * extra;
        holder_first > taker_first
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(backlog: u64) -> LoadView {
        LoadView {
            healthy: true,
            queued_prefill_tokens: backlog,
            ..Default::default()
        }
    }

    fn price(prompt: u64, cached: &[(u64, u64)]) -> Price {
        Price {
            prompt_tokens: prompt,
            cached: cached.iter().map(|(e, n)| (EndpointId(*e), *n)).collect(),
        }
    }

    #[test]
    fn a_pick_costs_its_uncached_tokens_on_the_taker() {
        let loads = [(EndpointId(1), view(0)), (EndpointId(2), view(0))];
        let t = Taker::new(EndpointId(1), &loads);
        assert_eq!(t.cost(&price(4_000, &[])), 4_000);
        assert_eq!(t.cost(&price(4_000, &[(1, 3_000)])), 1_000);
        // More cached than the prompt (whole blocks): nothing left.
        assert_eq!(t.cost(&price(100, &[(1, 112)])), 0);
    }

    #[test]
    fn a_pick_its_holder_would_start_sooner_is_priced_last() {
        // Endpoint 2 holds 3,000 of the 4,000 tokens with a backlog of
        // 1,000: its first token after 2,000 tokens; on the idle taker
        // after 4,000 + 0.5 x 3,000. Priced last.
        let loads = [(EndpointId(1), view(0)), (EndpointId(2), view(1_000))];
        let t = Taker::new(EndpointId(1), &loads);
        assert_eq!(t.cost(&price(4_000, &[(2, 3_000)])), u64::MAX);
        // With a backlog of 6,000 on the holder the taker is sooner.
        let loads = [(EndpointId(1), view(0)), (EndpointId(2), view(6_000))];
        let t = Taker::new(EndpointId(1), &loads);
        assert_eq!(t.cost(&price(4_000, &[(2, 3_000)])), 4_000);
        // A holder that is not healthy does not count.
        let mut sick = view(0);
        sick.healthy = false;
        let loads = [(EndpointId(1), view(0)), (EndpointId(2), sick)];
        let t = Taker::new(EndpointId(1), &loads);
        assert_eq!(t.cost(&price(4_000, &[(2, 3_000)])), 4_000);
    }

    #[test]
    fn holding_as_much_as_the_best_holder_may_take() {
        let loads = [(EndpointId(1), view(500)), (EndpointId(2), view(0))];
        let t = Taker::new(EndpointId(1), &loads);
        assert_eq!(t.cost(&price(4_000, &[(1, 3_000), (2, 3_000)])), 1_000);
    }
}
