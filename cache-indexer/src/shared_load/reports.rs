//! Reports that reached the wrong replica (`<keyPrefix><pool>:reports`).
//!
//! A filter sends a pick and its reports on one `Session` stream, so they
//! reach one replica; but a pick made before the stream opened (a unary
//! call, which Envoy balances per call) or on a stream that was reopened
//! elsewhere may have its reports land on another replica. There they
//! match nothing, and the replica that answered the pick keeps it in
//! prefill until the prefill horizon (30 s by default): its queued prefill
//! is counted on that engine, by it and, through the shared load, by every
//! replica, long after the engine finished it. So each round a replica
//! adds the reports that matched none of its picks to a stream per pool,
//! and every replica applies the others' to its own picks
//! ([`crate::load::LoadTracker::peer_report`]). Bounded like the
//! placements' stream (about 4,096 entries kept, 256 read per round, at
//! most [`MAX_ENTRY_REPORTS`] per entry); a failed round loses its entry,
//! and the horizon still ends such a pick.

use redis::Value;

use super::placed::{field, StreamCursor};
use crate::load::Phase;

/// Format tag of an entry.
const FORMAT: &str = "u1";
/// Field of the reports in an entry.
pub const REPORTS_FIELD: &str = "u";
/// Most reports in one entry; the rest wait for the next round.
pub const MAX_ENTRY_REPORTS: usize = 512;
/// Longest request id forwarded (ids are printable ASCII without spaces).
pub const MAX_ID_BYTES: usize = 128;

/// `u1 F<id> D<id> ...`: F a first token, D a done. Ids that are not
/// printable ASCII without spaces, or longer than [`MAX_ID_BYTES`], are
/// left out.
pub fn encode(reports: &[(String, Phase)]) -> String {
    let mut out = String::from(FORMAT);
    for (id, phase) in reports.iter().take(MAX_ENTRY_REPORTS) {
        if id.is_empty() || id.len() > MAX_ID_BYTES || !id.bytes().all(|b| b.is_ascii_graphic()) {
            continue;
        }
        out.push(' ');
        out.push(match phase {
            Phase::FirstToken => 'F',
            Phase::Done => 'D',
        });
        out.push_str(id);
    }
    out
}

/// The reports of an entry; `None` when it is not one.
pub fn decode(text: &str) -> Option<Vec<(String, Phase)>> {
    let mut items = text.split(' ');
    if items.next()? != FORMAT {
        return None;
    }
    let mut out = Vec::new();
    for item in items {
        if out.len() == MAX_ENTRY_REPORTS || item.len() > MAX_ID_BYTES + 1 {
            return None;
        }
        let phase = match item.as_bytes().first()? {
            b'F' => Phase::FirstToken,
            b'D' => Phase::Done,
            _ => return None,
        };
        let id = &item[1..];
        if id.is_empty() {
            return None;
        }
        out.push((id.to_owned(), phase));
    }
    Some(out)
}

/// What a read of the stream gave: the other replicas' unmatched reports
/// in order, and entries that did not decode.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct PeerReports {
    /// The reports, in the order they were received.
    pub reports: Vec<(String, Phase)>,
    /// Entries that did not decode.
    pub refused: usize,
}

/// Where this replica is in the stream.
#[derive(Debug, Default)]
pub struct ReportsTable {
    cursor: StreamCursor,
}

impl ReportsTable {
    /// The `XRANGE` start ([`StreamCursor::start`]).
    pub fn start(&self) -> String {
        self.cursor.start()
    }

    /// Reads an `XRANGE` reply: entries after the last read, `own`'s left out.
    pub fn merge(&mut self, own: &str, reply: Value) -> PeerReports {
        let (entries, refused) = self.cursor.read(own, reply);
        let mut out = PeerReports {
            refused,
            ..PeerReports::default()
        };
        for (_, fields) in entries {
            match field(&fields, REPORTS_FIELD).and_then(decode) {
                Some(r) => out.reports.extend(r),
                None => out.refused += 1,
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, replica: &str, reports: &str) -> Value {
        let b = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        Value::Array(vec![
            b(id),
            Value::Array(vec![b("r"), b(replica), b("u"), b(reports)]),
        ])
    }

    #[test]
    fn reports_round_trip_and_odd_ids_are_left_out() {
        let r = vec![
            ("req-1".to_string(), Phase::FirstToken),
            ("has space".to_string(), Phase::Done),
            ("req-1".to_string(), Phase::Done),
        ];
        let text = encode(&r);
        assert_eq!(text, "u1 Freq-1 Dreq-1");
        assert_eq!(
            decode(&text),
            Some(vec![
                ("req-1".to_string(), Phase::FirstToken),
                ("req-1".to_string(), Phase::Done)
            ])
        );
        assert_eq!(decode("u1"), Some(vec![]));
        for bad in ["", "q1 Fx", "u1 Xreq", "u1 F", "u1  Freq"] {
            assert_eq!(decode(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_read_skips_own_and_already_read_entries_and_counts_bad_ones() {
        let mut t = ReportsTable::default();
        assert_eq!(t.start(), "-");
        let reply = Value::Array(vec![
            entry("5-0", "a", "u1 Dx"),
            entry("6-0", "b", "u1 Fy Dy"),
            entry("7-0", "b", "garbage"),
        ]);
        let got = t.merge("a", reply);
        assert_eq!(
            got.reports,
            vec![
                ("y".to_string(), Phase::FirstToken),
                ("y".to_string(), Phase::Done)
            ]
        );
        assert_eq!(got.refused, 1);
        assert_eq!(t.start(), "7-1");
        // The same entries again (a slow read): nothing new.
        let again = Value::Array(vec![entry("6-0", "b", "u1 Fy")]);
        assert_eq!(t.merge("a", again), PeerReports::default());
    }
}
