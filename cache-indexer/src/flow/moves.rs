//! What moved on each endpoint since its last scrape, as flow control's
//! estimate counts it ([`super::estimate`]): this replica's placements
//! and, with shared load, the other replicas' placements and ends.

use std::collections::VecDeque;
use std::time::Instant;

use super::estimate::Since;
use super::Inner;
use crate::load::LoadView;
use crate::types::EndpointId;

/// Sharing rounds whose peer moves are remembered per endpoint between two
/// scrapes; past it the oldest are forgotten (a round every 5 ms at the
/// least, so this covers a scrape interval of 5 s).
const MAX_PEER_READS_PER_ENDPOINT: usize = 1024;

/// Other replicas' moves on one endpoint (see [`PoolFlow::peer_moves`]).
#[derive(Debug, Default)]
pub(super) struct PeerMoves {
    pub(super) placed: Batches,
    pub(super) ended: Batches,
}

/// Counts, each with the time it is taken to have happened at, oldest
/// first, and their sum (a pick's look adds no loop over them).
#[derive(Debug, Default)]
pub(super) struct Batches {
    q: VecDeque<(Instant, u32)>,
    sum: u64,
}

impl Batches {
    /// Appends a batch, forgetting the oldest past
    /// [`MAX_PEER_READS_PER_ENDPOINT`].
    pub(super) fn push(&mut self, at: Instant, n: u32) {
        if self.q.len() >= MAX_PEER_READS_PER_ENDPOINT {
            self.pop();
        }
        self.q.push_back((at, n));
        self.sum += u64::from(n);
    }

    fn pop(&mut self) {
        if let Some((_, n)) = self.q.pop_front() {
            self.sum -= u64::from(n);
        }
    }

    /// Drops the batches at or before `scraped` (the scrape shows them);
    /// returns the sum left.
    fn since(&mut self, scraped: Option<Instant>) -> u32 {
        if let Some(scraped) = scraped {
            while self.q.front().is_some_and(|(t, _)| *t <= scraped) {
                self.pop();
            }
        }
        u32::try_from(self.sum).unwrap_or(u32::MAX)
    }
}

/// What moved on each endpoint of `loads` after its last scrape (this
/// replica's placements, the other replicas' placements and ends),
/// forgetting older moves and the endpoints that left.
pub(super) fn since_scrape(
    g: &mut Inner,
    loads: &[(EndpointId, LoadView)],
    now: Instant,
) -> Vec<Since> {
    let Inner { placed, peer, .. } = g;
    let present = |id: &EndpointId| loads.iter().any(|(l, _)| l == id);
    if placed.len() > loads.len() {
        placed.retain(|id, _| present(id));
    }
    if peer.len() > loads.len() {
        peer.retain(|id, _| present(id));
    }
    loads
        .iter()
        .map(|(id, v)| {
            let scraped = v.last_scrape_age.and_then(|a| now.checked_sub(a));
            let mut since = Since::default();
            if let Some(q) = placed.get_mut(id) {
                if let Some(scraped) = scraped {
                    while q.front().is_some_and(|t| *t <= scraped) {
                        q.pop_front();
                    }
                }
                since.placed = u32::try_from(q.len()).unwrap_or(u32::MAX);
            }
            if let Some(m) = peer.get_mut(id) {
                since.placed = since.placed.saturating_add(m.placed.since(scraped));
                since.peer_done = m.ended.since(scraped);
            }
            since
        })
        .collect()
}
