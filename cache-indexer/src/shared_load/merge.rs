//! The pure half of shared load: how a replica's load is written into its
//! field of the pool's hash, and how the fields read back become the other
//! replicas' summed load, with dead replicas left out.
//!
//! Liveness needs no clock shared between replicas: every publish carries a
//! sequence number that grows (a heartbeat bumps it even when the load did
//! not change), and a reader calls a replica dead once its number has not
//! moved for the TTL on the reader's own monotonic clock. A replica that
//! stops (crash, partition from the store) thus stops counting within the
//! TTL of the reader's first read of its last entry.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use crate::load::PeerLoad;
use crate::types::EndpointId;

/// Version tag of the entry format; an entry without it is not read.
const FORMAT: &str = "v1";
/// Endpoints one entry may list; an entry with more is not read (a pool's
/// endpoints are far fewer; the bound keeps a bad writer from costing a
/// reader).
pub const MAX_ENTRY_ENDPOINTS: usize = 4096;
/// Replicas read per pool; fields past it (by name) are left out.
pub const MAX_PEERS: usize = 256;
/// A dead replica's field is deleted from the hash once its number has not
/// moved for this many TTLs: long enough that a live replica cut off from
/// the store for a while is not deleted under it (it would write again
/// anyway), short enough that the hash does not grow with restarts.
pub const FORGET_AFTER_TTLS: u32 = 10;

/// One replica's entry: its sequence number and its per-endpoint load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Grows with every publish.
    pub seq: u64,
    /// Load per endpoint, endpoints without any left out.
    pub loads: Vec<(EndpointId, PeerLoad)>,
}

/// The entry's text: `v1 <seq> <id>:<in flight>:<queued prefill>,...`,
/// the id in hex as [`EndpointId`] prints it.
pub fn encode(seq: u64, loads: &[(EndpointId, PeerLoad)]) -> String {
    let mut s = format!("{FORMAT} {seq} ");
    for (i, (id, l)) in loads.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        // Writing into a String does not fail.
        let _ = write!(s, "{id}:{}:{}", l.in_flight, l.queued_prefill_tokens);
    }
    s
}

/// An entry read back; `None` for anything [`encode`] does not write.
pub fn decode(text: &str) -> Option<Entry> {
    let mut parts = text.splitn(3, ' ');
    if parts.next()? != FORMAT {
        return None;
    }
    let seq = parts.next()?.parse().ok()?;
    let body = parts.next()?;
    let mut loads = Vec::new();
    if !body.is_empty() {
        for item in body.split(',') {
            if loads.len() == MAX_ENTRY_ENDPOINTS {
                return None;
            }
            loads.push(decode_item(item)?);
        }
    }
    Some(Entry { seq, loads })
}

fn decode_item(item: &str) -> Option<(EndpointId, PeerLoad)> {
    let mut f = item.split(':');
    let id = u64::from_str_radix(f.next()?, 16).ok()?;
    let in_flight = f.next()?.parse().ok()?;
    let queued_prefill_tokens = f.next()?.parse().ok()?;
    if f.next().is_some() {
        return None;
    }
    let load = PeerLoad {
        in_flight,
        queued_prefill_tokens,
    };
    Some((EndpointId(id), load))
}

/// What a read of the pool's hash gave.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Merged {
    /// The live replicas' load per endpoint, summed (this one's never).
    pub loads: HashMap<EndpointId, PeerLoad>,
    /// Live replicas other than this one.
    pub live: usize,
    /// Their fields, sorted: whose pending entries are read
    /// ([`super::pending::merge`]).
    pub live_fields: Vec<String>,
    /// Fields that could not be read (another format, garbage).
    pub malformed: usize,
    /// Fields of replicas dead for [`FORGET_AFTER_TTLS`] TTLs: to delete.
    pub forget: Vec<String>,
}

#[derive(Debug, Clone, Copy)]
struct Seen {
    seq: u64,
    /// When this reader last saw `seq` change (or first saw the field).
    changed_at: Instant,
}

/// What one reader remembers of each replica's field between reads.
#[derive(Debug, Default)]
pub struct PeerTable {
    seen: HashMap<String, Seen>,
}

impl PeerTable {
    /// Merges one read of the hash (`fields`: replica id and entry text)
    /// at `now`: `own` (this replica's field) is skipped, replicas whose
    /// number has not moved for `ttl` are dead and add nothing.
    pub fn merge(
        &mut self,
        own: &str,
        mut fields: Vec<(String, String)>,
        now: Instant,
        ttl: Duration,
    ) -> Merged {
        fields.retain(|(f, _)| f != own);
        fields.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        fields.truncate(MAX_PEERS);
        let mut out = Merged::default();
        // Forget what is no longer in the hash, so the table stays as
        // small as the hash.
        self.seen
            .retain(|f, _| fields.binary_search_by(|(k, _)| k.as_str().cmp(f)).is_ok());
        for (field, text) in fields {
            let Some(entry) = decode(&text) else {
                out.malformed += 1;
                continue;
            };
            let seen = self.observe(&field, entry.seq, now);
            let quiet = now.saturating_duration_since(seen.changed_at);
            if quiet >= ttl.saturating_mul(FORGET_AFTER_TTLS) {
                out.forget.push(field);
                continue;
            }
            if quiet >= ttl {
                continue;
            }
            out.live += 1;
            out.live_fields.push(field);
            for (id, l) in entry.loads {
                let sum = out.loads.entry(id).or_default();
                *sum = sum.plus(l);
            }
        }
        out.loads.retain(|_, l| !l.is_zero());
        out
    }

    fn observe(&mut self, field: &str, seq: u64, now: Instant) -> Seen {
        match self.seen.get_mut(field) {
            Some(s) => {
                if s.seq != seq {
                    *s = Seen {
                        seq,
                        changed_at: now,
                    };
                }
                *s
            }
            None => {
                let s = Seen {
                    seq,
                    changed_at: now,
                };
                self.seen.insert(field.to_string(), s);
                s
            }
        }
    }

    /// Replicas remembered (live or not), for tests.
    pub fn remembered(&self) -> usize {
        self.seen.len()
    }
}

#[cfg(test)]
#[path = "merge_tests.rs"]
mod tests;
