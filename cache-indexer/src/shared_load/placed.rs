//! The pure half of sharing recent placements ([`crate::load::Placed`]):
//! which endpoints started conversations lately, and which prompts continue
//! one. Unlike the load entries these are events, not a state: a
//! conversation another replica started on an engine stays there whether
//! that replica lives or not, and each replica's counts decay on its own
//! clock. So they go through a Redis stream per pool,
//! `<keyPrefix><pool>:placed`: a replica with placements since its last
//! round adds one entry (`XADD ... MAXLEN ~` [`STREAM_MAX_ENTRIES`]) with
//! its id and [`encode`]'s text, and every round reads the entries after
//! the last one it read (`XRANGE`, at most [`READ_ENTRIES`]), skipping its
//! own, in the same pipelined round trip as the load hashes.
//!
//! Times: an entry's id is the Redis server's clock at the add, each start
//! in it says how many ms before its round it happened, and the round also
//! asks the server's `TIME`; so a reader knows each start's age without any
//! clock shared between replicas, and counts what is left of it
//! ([`crate::scoring::placements::Placements::place_at`]).

use std::fmt::Write as _;

use redis::Value;

use crate::load::{SharedPlacements, MAX_SHARED_ENDS, MAX_SHARED_STARTS};
use crate::types::EndpointId;

/// Version tag of the entry format; an entry without it is not read.
const FORMAT: &str = "q1";
/// Entries a pool's stream keeps (trimmed approximately at each add): at
/// one entry per replica per round, seconds of history, which a reader
/// that was away (or just started) reads from the oldest.
pub const STREAM_MAX_ENTRIES: usize = 4096;
/// Entries read per pool and round; a reader further behind catches up
/// over the next rounds.
pub const READ_ENTRIES: usize = 256;
/// The entry's field naming its replica.
pub const REPLICA_FIELD: &str = "r";
/// The entry's field holding [`encode`]'s text.
pub const PLACED_FIELD: &str = "p";

/// The entry's text: `q1 <id>:<ms before>,...;<end>,...`, ids and prompt
/// ends in hex.
pub fn encode(s: &SharedPlacements) -> String {
    let mut out = format!("{FORMAT} ");
    for (i, (id, before)) in s.starts.iter().enumerate() {
        let sep = if i > 0 { "," } else { "" };
        // Writing into a String does not fail.
        let _ = write!(out, "{sep}{id}:{before}");
    }
    out.push(';');
    for (i, end) in s.ends.iter().enumerate() {
        let sep = if i > 0 { "," } else { "" };
        let _ = write!(out, "{sep}{end:x}");
    }
    out
}

/// An entry read back; `None` for anything [`encode`] does not write, or
/// more starts or ends than an outbox holds.
pub fn decode(text: &str) -> Option<SharedPlacements> {
    let body = text.strip_prefix(FORMAT)?.strip_prefix(' ')?;
    let (starts, ends) = body.split_once(';')?;
    let mut out = SharedPlacements::default();
    for item in starts.split(',').filter(|s| !s.is_empty()) {
        if out.starts.len() == MAX_SHARED_STARTS {
            return None;
        }
        let (id, before) = item.split_once(':')?;
        out.starts
            .push((EndpointId(hex(id)?), before.parse().ok()?));
    }
    for item in ends.split(',').filter(|s| !s.is_empty()) {
        if out.ends.len() == MAX_SHARED_ENDS {
            return None;
        }
        out.ends.push(hex(item)?);
    }
    Some(out)
}

fn hex(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 16 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(s, 16).ok()
}

/// A stream entry's id, `<ms>-<seq>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct StreamId {
    /// The server's clock at the add, ms since the Unix epoch.
    pub ms: u64,
    /// Its number within that millisecond.
    pub seq: u64,
}

impl StreamId {
    /// Parses `<ms>-<seq>`.
    pub fn parse(s: &str) -> Option<StreamId> {
        let (ms, seq) = s.split_once('-')?;
        Some(StreamId {
            ms: ms.parse().ok()?,
            seq: seq.parse().ok()?,
        })
    }

    /// The smallest id after this one (`XRANGE`'s start, inclusive).
    pub fn next(&self) -> String {
        match self.seq.checked_add(1) {
            Some(seq) => format!("{}-{seq}", self.ms),
            None => format!("{}-0", self.ms.saturating_add(1)),
        }
    }
}

/// The server's clock from a `TIME` reply, in ms.
pub fn server_ms(v: Value) -> Option<u64> {
    let Value::Array(parts) = v else {
        return None;
    };
    let [secs, micros] = parts.as_slice() else {
        return None;
    };
    let secs: u64 = text(secs)?.parse().ok()?;
    let micros: u64 = text(micros)?.parse().ok()?;
    Some(secs.saturating_mul(1000).saturating_add(micros / 1000))
}

fn text(v: &Value) -> Option<&str> {
    match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

/// Other replicas' placements out of one read.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct PeerPlacements {
    /// Conversations started: endpoint, and age at the read in ms.
    pub starts: Vec<(EndpointId, f64)>,
    /// Prompt ends.
    pub ends: Vec<u64>,
    /// Entries that could not be read (left out).
    pub refused: usize,
}

/// Where a reader is in one of the shared streams (placements, reports):
/// the last entry it read.
#[derive(Debug, Default)]
pub(crate) struct StreamCursor {
    last: Option<StreamId>,
}

impl StreamCursor {
    /// Where the next read starts (`XRANGE <start> + COUNT ...`): after the
    /// last entry read, or the oldest kept for a first read.
    pub fn start(&self) -> String {
        self.last.map_or_else(|| "-".into(), |id| id.next())
    }

    /// The entries of one `XRANGE` reply after the last one read and not
    /// written by `own` (this replica), as id and fields, with the count of
    /// those that could not be split (a reply that is not an array counts
    /// one). The cursor moves past every entry it could read.
    pub fn read(&mut self, own: &str, reply: Value) -> (Vec<Entry>, usize) {
        let Value::Array(entries) = reply else {
            return (Vec::new(), 1);
        };
        let (mut out, mut refused) = (Vec::new(), 0);
        for entry in entries {
            let Some((id, fields)) = split_entry(entry) else {
                refused += 1;
                continue;
            };
            if self.last.is_some_and(|l| id <= l) {
                continue;
            }
            self.last = Some(id);
            if field(&fields, REPLICA_FIELD) != Some(own) {
                out.push((id, fields));
            }
        }
        (out, refused)
    }
}

/// A stream entry: its id and its field pairs.
pub(crate) type Entry = (StreamId, Vec<(String, String)>);

/// What a reader remembers of a pool's placements stream.
#[derive(Debug, Default)]
pub struct PlacedTable {
    cursor: StreamCursor,
}

impl PlacedTable {
    /// Where the next read starts ([`StreamCursor::start`]).
    pub fn start(&self) -> String {
        self.cursor.start()
    }

    /// Merges one `XRANGE` reply, read when the server's clock said
    /// `server_ms` (`None`: ages from the entries alone). Entries of `own`
    /// (this replica) are skipped; an entry that does not parse is refused
    /// and counted, and the read moves past it all the same.
    pub fn merge(&mut self, own: &str, reply: Value, server_ms: Option<u64>) -> PeerPlacements {
        let (entries, refused) = self.cursor.read(own, reply);
        let mut out = PeerPlacements {
            refused,
            ..PeerPlacements::default()
        };
        for (id, fields) in entries {
            let Some(s) = field(&fields, PLACED_FIELD).and_then(decode) else {
                out.refused += 1;
                continue;
            };
            let lag = server_ms.map_or(0, |now| now.saturating_sub(id.ms));
            out.starts.extend(
                s.starts
                    .into_iter()
                    .map(|(e, before)| (e, lag.saturating_add(before) as f64)),
            );
            out.ends.extend(s.ends);
        }
        out
    }
}

/// An entry `[id, [field, value, ...]]` as its id and field pairs.
pub(crate) fn split_entry(entry: Value) -> Option<(StreamId, Vec<(String, String)>)> {
    let Value::Array(parts) = entry else {
        return None;
    };
    let [id, fields] = parts.as_slice() else {
        return None;
    };
    let id = StreamId::parse(text(id)?)?;
    let Value::Array(flat) = fields else {
        return None;
    };
    let pairs = flat
        .chunks(2)
        .filter_map(|kv| match kv {
            [k, v] => Some((text(k)?.to_owned(), text(v)?.to_owned())),
            _ => None,
        })
        .collect();
    Some((id, pairs))
}

pub(crate) fn field<'a>(fields: &'a [(String, String)], name: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

#[cfg(test)]
#[path = "placed_tests.rs"]
mod tests;
