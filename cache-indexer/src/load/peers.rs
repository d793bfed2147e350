//! The load other indexer replicas placed on this pool's endpoints, as last
//! read from the shared store (see [`crate::shared_load`]), and the state
//! of that sharing for `/metrics`.
//!
//! Kept apart from this replica's own in-flight table: the tracker adds it
//! to its views' load terms, never to its own counts, so a replica's own
//! picks are counted once (its entry is left out when the store is read)
//! and what it publishes is only its own.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::peer_chains::SampledChain;
use super::prefix::MAX_PENDING_PREFIXES;
use crate::types::EndpointId;

/// Other replicas' chains kept per endpoint: each replica publishes at most
/// [`MAX_PENDING_PREFIXES`] per endpoint; past this many replicas' worth
/// the rest are left out, bounding a pick's matching work.
pub const MAX_PEER_CHAINS_PER_ENDPOINT: usize = 4 * MAX_PENDING_PREFIXES;

/// One endpoint's load as one or more other replicas placed it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerLoad {
    /// In-flight picks.
    pub in_flight: u32,
    /// Queued prefill tokens of those picks.
    pub queued_prefill_tokens: u64,
}

impl PeerLoad {
    /// Whether it adds nothing.
    pub fn is_zero(&self) -> bool {
        self.in_flight == 0 && self.queued_prefill_tokens == 0
    }

    /// `self + other`, saturating (a malformed peer entry must not wrap).
    pub fn plus(self, other: PeerLoad) -> PeerLoad {
        PeerLoad {
            in_flight: self.in_flight.saturating_add(other.in_flight),
            queued_prefill_tokens: self
                .queued_prefill_tokens
                .saturating_add(other.queued_prefill_tokens),
        }
    }
}

/// Other replicas' picks still in prefill, as one read of the store gave
/// them (see [`crate::shared_load`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PeerPending {
    /// Their sampled chains per endpoint, the live replicas' only.
    pub chains: HashMap<EndpointId, Vec<SampledChain>>,
    /// Entries of that read refused (malformed, oversized), load entries
    /// included.
    pub refused: usize,
}

/// What the sharing of load with other replicas is doing, per pool.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PeerStats {
    /// Whether load is shared at all (a `sharedLoad` section).
    pub enabled: bool,
    /// Other replicas whose entries are live, as of the last good read.
    pub peers: usize,
    /// Their in-flight picks on this pool's endpoints, summed, as the views
    /// use them now (0 once the last read is too old).
    pub peer_in_flight: u64,
    /// Their queued prefill tokens, likewise.
    pub peer_queued_prefill_tokens: u64,
    /// Time since the last good read (`None` before the first).
    pub read_age: Option<Duration>,
    /// Whether the views use this replica's own counts only: sharing is on
    /// but the last good read is older than the TTL (or there was none).
    pub local_only: bool,
    /// Rounds with the store that succeeded.
    pub rounds: u64,
    /// Rounds that failed (store unreachable, timed out, refused).
    pub failures: u64,
    /// Other replicas' picks in prefill whose chains the views match now
    /// (0 once the last read is too old).
    pub peer_pending_chains: usize,
    /// Peer entries refused so far (malformed, oversized).
    pub refused: u64,
}

/// Peer load held by a tracker.
#[derive(Debug, Default)]
pub(crate) struct Peers {
    enabled: bool,
    loads: HashMap<EndpointId, PeerLoad>,
    peers: usize,
    read_at: Option<Instant>,
    /// The loads are used until then; afterwards the views fall back to
    /// this replica's own counts.
    valid_until: Option<Instant>,
    rounds: u64,
    failures: u64,
    pending: HashMap<EndpointId, Vec<SampledChain>>,
    refused: u64,
}

impl Peers {
    /// Takes the other replicas' chains of one read; they are used while
    /// the loads of the same read are (see [`Peers::set`]).
    pub(crate) fn set_pending(&mut self, mut p: PeerPending) {
        for chains in p.chains.values_mut() {
            chains.truncate(MAX_PEER_CHAINS_PER_ENDPOINT);
        }
        p.chains.retain(|_, c| !c.is_empty());
        self.pending = p.chains;
        self.refused += p.refused as u64;
    }

    /// Leading blocks of `chain` that some other replica's pick to `id`,
    /// still in prefill, shares (0 once the read is too old). Bounded: a
    /// constant-time check and a binary search over at most
    /// [`super::peer_chains::MAX_SAMPLES`] hashes per chain.
    pub(crate) fn pending_matched(&self, id: EndpointId, chain: &[u64], now: Instant) -> usize {
        if chain.is_empty() || !self.valid(now) {
            return 0;
        }
        let Some(chains) = self.pending.get(&id) else {
            return 0;
        };
        let mut best = 0;
        for c in chains {
            best = best.max(c.matched(chain));
            if best >= chain.len() {
                break;
            }
        }
        best
    }

    /// Whether some other replica's pick in prefill may hold all of
    /// `chain` (see [`SampledChain::may_hold`]).
    pub(crate) fn pending_may_hold(&self, chain: &[u64], now: Instant) -> bool {
        self.valid(now) && self.pending.values().flatten().any(|c| c.may_hold(chain))
    }

    /// Takes a good read: `loads` summed over `peers` live replicas, used
    /// until `now + ttl`.
    pub(crate) fn set(
        &mut self,
        loads: HashMap<EndpointId, PeerLoad>,
        peers: usize,
        now: Instant,
        ttl: Duration,
    ) {
        self.enabled = true;
        self.loads = loads;
        self.peers = peers;
        self.read_at = Some(now);
        self.valid_until = Some(now + ttl);
        self.rounds += 1;
    }

    /// Counts a failed round; the last read stays in use until its TTL.
    pub(crate) fn failed(&mut self) {
        self.enabled = true;
        self.failures += 1;
    }

    /// Whether the held loads may be used at `now`.
    fn valid(&self, now: Instant) -> bool {
        self.valid_until.is_some_and(|t| now < t)
    }

    /// The peers' load on `id` at `now` (zero once the read is too old).
    pub(crate) fn load(&self, id: EndpointId, now: Instant) -> PeerLoad {
        if !self.valid(now) {
            return PeerLoad::default();
        }
        self.loads.get(&id).copied().unwrap_or_default()
    }

    /// The stats at `now`.
    pub(crate) fn stats(&self, now: Instant) -> PeerStats {
        let valid = self.valid(now);
        let total = if valid {
            self.loads
                .values()
                .fold(PeerLoad::default(), |a, l| a.plus(*l))
        } else {
            PeerLoad::default()
        };
        PeerStats {
            enabled: self.enabled,
            peers: if valid { self.peers } else { 0 },
            peer_in_flight: u64::from(total.in_flight),
            peer_queued_prefill_tokens: total.queued_prefill_tokens,
            read_age: self.read_at.map(|t| now.saturating_duration_since(t)),
            local_only: self.enabled && !valid,
            rounds: self.rounds,
            failures: self.failures,
            peer_pending_chains: if valid {
                self.pending.values().map(Vec::len).sum()
            } else {
                0
            },
            refused: self.refused,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_are_used_until_the_ttl_then_dropped() {
        let mut p = Peers::default();
        let (e, now) = (EndpointId(7), Instant::now());
        let l = PeerLoad {
            in_flight: 2,
            queued_prefill_tokens: 300,
        };
        assert_eq!(p.load(e, now), PeerLoad::default());
        assert!(!p.stats(now).enabled);
        p.set(HashMap::from([(e, l)]), 1, now, Duration::from_secs(1));
        assert_eq!(p.load(e, now + Duration::from_millis(999)), l);
        assert_eq!(p.load(EndpointId(8), now), PeerLoad::default());
        let s = p.stats(now);
        assert_eq!((s.peers, s.peer_in_flight, s.local_only), (1, 2, false));
        p.failed();
        let later = now + Duration::from_secs(1);
        assert_eq!(p.load(e, later), PeerLoad::default());
        let s = p.stats(later);
        assert_eq!(
            (
                s.peers,
                s.peer_in_flight,
                s.local_only,
                s.failures,
                s.rounds
            ),
            (0, 0, true, 1, 1)
        );
        assert_eq!(s.read_age, Some(Duration::from_secs(1)));
    }

    #[test]
    fn views_take_the_longer_of_own_and_peers_pending_matches_until_the_ttl() {
        use crate::load::{block_chain, LoadConfig, LoadTracker};
        use std::sync::Arc;
        let t = LoadTracker::new(LoadConfig::default());
        let (a, b, now) = (EndpointId(1), EndpointId(2), Instant::now());
        t.add_endpoint(a);
        t.add_endpoint(b);
        let tokens: Vec<u32> = (0..120 * 16).collect();
        let request = block_chain(&tokens, 16);
        let own: Arc<[u64]> = request[..10].into();
        t.record_pick("own", a, 160, 0, Some(own), now);
        let peer = SampledChain::of(&request[..100]).unwrap();
        let pending = PeerPending {
            chains: HashMap::from([(b, vec![peer])]),
            refused: 2,
        };
        t.set_peer_pending(pending);
        let ttl = Duration::from_secs(1);
        t.set_peer_loads(HashMap::new(), 1, now, ttl);
        let matched = |at| -> Vec<usize> {
            let views = t.views_matching([a, b], at, Some(&request));
            views.iter().map(|v| v.pending_matched_blocks).collect()
        };
        assert_eq!(matched(now), vec![10, 100]);
        assert!(t.pending_holds(&request[..50]));
        let s = t.peer_stats(now);
        assert_eq!((s.peer_pending_chains, s.refused), (1, 2));
        // Past the read's TTL only this replica's own picks match.
        assert_eq!(matched(now + ttl), vec![10, 0]);
        assert_eq!(t.peer_stats(now + ttl).peer_pending_chains, 0);
        // A newer read without the chain drops it.
        t.set_peer_pending(PeerPending::default());
        t.set_peer_loads(HashMap::new(), 1, now, ttl);
        assert_eq!(matched(now), vec![10, 0]);
        assert!(!t.pending_holds(&request[..50]));
    }

    #[test]
    fn own_moves_are_running_totals_of_picks_placed_and_ended() {
        use crate::load::{LoadConfig, LoadTracker, Phase};
        let t = LoadTracker::new(LoadConfig::default());
        let (a, b, now) = (EndpointId(1), EndpointId(2), Instant::now());
        t.add_endpoint(a);
        t.add_endpoint(b);
        assert!(t.own_moves().is_empty());
        t.record_pick("r1", a, 10, 0, None, now);
        t.record_pick("r2", a, 10, 0, None, now);
        assert_eq!(t.own_moves(), vec![(a, 2, 0)]);
        // A first token ends nothing; a DONE does.
        t.report("r1", Phase::FirstToken);
        t.report("r1", Phase::Done);
        assert_eq!(t.own_moves(), vec![(a, 2, 1)]);
        // A retry moves r2 to b: it left a, as if done there.
        t.record_pick("r2", b, 10, 0, None, now);
        assert_eq!(t.own_moves(), vec![(a, 2, 2), (b, 1, 0)]);
        // Unknown DONEs and picks without an id change nothing.
        t.report("nobody", Phase::Done);
        t.record_pick("", a, 10, 0, None, now);
        assert_eq!(t.own_moves(), vec![(a, 2, 2), (b, 1, 0)]);
    }

    #[test]
    fn sums_saturate() {
        let big = PeerLoad {
            in_flight: u32::MAX,
            queued_prefill_tokens: u64::MAX,
        };
        assert_eq!(big.plus(big), big);
        assert!(PeerLoad::default().is_zero());
    }
}
