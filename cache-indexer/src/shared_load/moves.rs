//! Flow control's share of shared load: each replica's picks placed on and
//! ended at each endpoint, so another replica's flow control sees them
//! within one round instead of one scrape (see [`crate::flow`]).
//!
//! A replica publishes its tracker's running totals
//! ([`crate::load::LoadTracker::own_moves`]), never reset, in its field of
//! a third hash, `<keyPrefix><pool>:flow`: `f1 <id>:<placed>:<done>,...`.
//! A reader turns each live replica's totals into the increments since its
//! previous read ([`MovesTable::merge`]) and its flow control counts them as
//! placements and ends seen at the read, kept until its own next scrape of
//! the endpoint. Totals rather than a count "since the scrape" because the
//! replicas scrape an engine at different moments: a count relative to the
//! writer's scrape would leave out placements the reader's older scrape
//! never saw, and count again ones its newer scrape shows.
//!
//! Its own hash, not the load entry, because the load entry's reader
//! refuses any entry with a field it does not know: replicas of the
//! previous version keep reading the load hash as before and never read
//! this one; a replica without this hash's field adds no moves. Fields of
//! an item past the two are skipped, so a later version may add some.

use std::collections::HashMap;
use std::fmt::Write as _;

use super::merge::{MAX_ENTRY_ENDPOINTS, MAX_PEERS};
use crate::types::EndpointId;

/// Version tag of the entry format; an entry without it is not read.
const FORMAT: &str = "f1";

/// One endpoint's running totals, as a replica publishes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Totals {
    /// Picks placed on it.
    pub placed: u64,
    /// Of those, picks that ended (reported done, or moved by a retry).
    pub done: u64,
}

/// Moves on one endpoint seen in one read: increments of the live
/// replicas' totals since the previous read, summed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Moves {
    /// Picks placed.
    pub placed: u32,
    /// Picks ended.
    pub done: u32,
}

impl Moves {
    /// Whether nothing moved.
    pub fn is_zero(&self) -> bool {
        self.placed == 0 && self.done == 0
    }
}

/// The entry's text: `f1 <id>:<placed>:<done>,...`, the id in hex as
/// [`EndpointId`] prints it.
pub fn encode(totals: &[(EndpointId, u64, u64)]) -> String {
    let mut s = format!("{FORMAT} ");
    for (i, (id, placed, done)) in totals.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        // Writing into a String does not fail.
        let _ = write!(s, "{id}:{placed}:{done}");
    }
    s
}

/// An entry read back; `None` for another format, garbage or more than
/// [`MAX_ENTRY_ENDPOINTS`] endpoints. Fields of an item past the second
/// count are skipped (a later version's additions).
pub fn decode(text: &str) -> Option<HashMap<EndpointId, Totals>> {
    let body = text.strip_prefix(FORMAT)?.strip_prefix(' ')?;
    let mut out = HashMap::new();
    if body.is_empty() {
        return Some(out);
    }
    for item in body.split(',') {
        if out.len() == MAX_ENTRY_ENDPOINTS {
            return None;
        }
        let mut f = item.split(':');
        let id = u64::from_str_radix(f.next()?, 16).ok()?;
        let placed = f.next()?.parse().ok()?;
        let done = f.next()?.parse().ok()?;
        out.insert(EndpointId(id), Totals { placed, done });
    }
    Some(out)
}

/// What one reader remembers of each live replica's totals between reads.
#[derive(Debug, Default)]
pub struct MovesTable {
    last: HashMap<String, HashMap<EndpointId, Totals>>,
}

/// What [`MovesTable::merge`] gives for one read.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct MergedMoves {
    /// Moves per endpoint since the previous read, endpoints with none
    /// left out.
    pub moves: HashMap<EndpointId, Moves>,
    /// Entries that could not be read.
    pub refused: usize,
}

impl MovesTable {
    /// Merges one read of the flow hash (`fields`: replica id and entry)
    /// for the replicas in `live` (sorted; this one is never in it). A
    /// replica seen for the first time, or again after it was not live or
    /// had no entry, gives its totals as a base and no moves: they may be
    /// old. (A replica writes its flow entry before its load entry, in the
    /// same pipeline, so a reader that finds it live finds its entry too,
    /// and its first entry comes with its first round, before its picks.)
    /// A total that went down (the replica restarted, or dropped the
    /// endpoint and took it back) counts from zero.
    pub fn merge(&mut self, live: &[String], fields: Vec<(String, String)>) -> MergedMoves {
        let mut out = MergedMoves::default();
        let mut seen = HashMap::with_capacity(live.len().min(MAX_PEERS));
        for (field, text) in fields {
            if live.binary_search(&field).is_err() {
                continue;
            }
            let Some(totals) = decode(&text) else {
                out.refused += 1;
                // Its base stays for its next readable entry.
                if let Some(before) = self.last.remove(&field) {
                    seen.insert(field, before);
                }
                continue;
            };
            if let Some(before) = self.last.get(&field) {
                add_moves(&mut out.moves, before, &totals);
            }
            seen.insert(field, totals);
        }
        self.last = seen;
        out.moves.retain(|_, m| !m.is_zero());
        out
    }

    /// Replicas remembered, for tests.
    pub fn remembered(&self) -> usize {
        self.last.len()
    }
}

/// Adds the increments from `before` to `now` to `moves`.
fn add_moves(
    moves: &mut HashMap<EndpointId, Moves>,
    before: &HashMap<EndpointId, Totals>,
    now: &HashMap<EndpointId, Totals>,
) {
    for (id, t) in now {
        let b = before.get(id).copied().unwrap_or_default();
        let placed = increment(b.placed, t.placed);
        let done = increment(b.done, t.done);
        if placed == 0 && done == 0 {
            continue;
        }
        let m = moves.entry(*id).or_default();
        m.placed = m.placed.saturating_add(placed);
        m.done = m.done.saturating_add(done);
    }
}

/// `now - before`, or `now` when the total went down; saturating.
fn increment(before: u64, now: u64) -> u32 {
    let d = if now >= before { now - before } else { now };
    u32::try_from(d).unwrap_or(u32::MAX)
}

#[cfg(test)]
#[path = "moves_tests.rs"]
mod tests;
