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

use crate::types::EndpointId;

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
}

impl Peers {
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
    fn sums_saturate() {
        let big = PeerLoad {
            in_flight: u32::MAX,
            queued_prefill_tokens: u64::MAX,
        };
        assert_eq!(big.plus(big), big);
        assert!(PeerLoad::default().is_zero());
    }
}
