//! One measured request, and the CSV the benchmark writes them to.
//!
//! Times are in *simulated* milliseconds: the wall time the client measured
//! divided by the simulators' time scale, so results read like a real
//! cluster's. (Everything the proxy and the client spend is scaled up the
//! same way, which is conservative for the routers that do more work.)

use std::fmt::Write as _;

/// How a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A 2xx answer, streamed to the end.
    Ok,
    /// The proxy or engine answered with an error status.
    HttpError,
    /// Not finished when the run's deadline came.
    Timeout,
    /// The connection or the stream failed.
    Error,
}

impl Outcome {
    /// The CSV spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::HttpError => "http_error",
            Outcome::Timeout => "timeout",
            Outcome::Error => "error",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "ok" => Outcome::Ok,
            "http_error" => Outcome::HttpError,
            "timeout" => Outcome::Timeout,
            "error" => Outcome::Error,
            _ => return None,
        })
    }
}

/// One request's measurements.
#[derive(Debug, Clone, PartialEq)]
pub struct Record {
    /// Index in the run (trace line, or order of planning for chats).
    pub id: usize,
    /// Tenant name.
    pub tenant: String,
    /// Conversation index (chat workload), none for a trace.
    pub conversation: Option<usize>,
    /// Turn within the conversation (0 for a trace).
    pub turn: usize,
    /// When it was sent, simulated seconds from the run's start.
    pub sent_s: f64,
    /// Time to the first token, ms (NaN when none came).
    pub ttft_ms: f64,
    /// Mean gap between tokens after the first, ms (NaN with < 2 tokens).
    pub itl_ms: f64,
    /// Send to end of stream, ms (NaN when it did not finish).
    pub e2e_ms: f64,
    /// usage.prompt_tokens.
    pub prompt_tokens: u64,
    /// usage.prompt_tokens_details.cached_tokens.
    pub cached_tokens: u64,
    /// usage.completion_tokens.
    pub completion_tokens: u64,
    /// The endpoint that served (`x-gateway-destination-endpoint-served`).
    pub endpoint: String,
    /// HTTP status (0 when there was none).
    pub status: u16,
    /// How it ended.
    pub outcome: Outcome,
    /// Error text, if any.
    pub error: String,
}

/// The CSV header line.
pub const HEADER: &str = "id,tenant,conversation,turn,sent_s,ttft_ms,itl_ms,e2e_ms,prompt_tokens,cached_tokens,completion_tokens,endpoint,status,outcome,error";

fn clean(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c == ',' || c == '\n' || c == '\r' {
                ' '
            } else {
                c
            }
        })
        .collect()
}

fn num(out: &mut String, v: f64) {
    if v.is_finite() {
        let _ = write!(out, "{v:.3}");
    }
}

impl Record {
    /// A request as it is sent: who and when, nothing measured yet, and the
    /// outcome a failure before any answer leaves ([`Outcome::Error`], no
    /// text); [`crate::client::send`] fills in the rest.
    pub fn unanswered(
        id: usize,
        tenant: String,
        conversation: Option<usize>,
        turn: usize,
        sent_s: f64,
    ) -> Record {
        Record {
            id,
            tenant,
            conversation,
            turn,
            sent_s,
            ttft_ms: f64::NAN,
            itl_ms: f64::NAN,
            e2e_ms: f64::NAN,
            prompt_tokens: 0,
            cached_tokens: 0,
            completion_tokens: 0,
            endpoint: String::new(),
            status: 0,
            outcome: Outcome::Error,
            error: String::new(),
        }
    }

    /// The same request given up on at the run's deadline: whatever was
    /// measured before is dropped, as the request never finished.
    pub fn timed_out(self) -> Record {
        Record {
            outcome: Outcome::Timeout,
            error: "deadline".into(),
            ..Record::unanswered(
                self.id,
                self.tenant,
                self.conversation,
                self.turn,
                self.sent_s,
            )
        }
    }

    /// The record as one CSV line (no newline). Text fields have commas and
    /// newlines replaced by spaces; NaN is written as an empty field.
    pub fn to_csv(&self) -> String {
        let mut o = String::with_capacity(128);
        let _ = write!(o, "{},{},", self.id, clean(&self.tenant));
        if let Some(c) = self.conversation {
            let _ = write!(o, "{c}");
        }
        let _ = write!(o, ",{},", self.turn);
        num(&mut o, self.sent_s);
        for v in [self.ttft_ms, self.itl_ms, self.e2e_ms] {
            o.push(',');
            num(&mut o, v);
        }
        let _ = write!(
            o,
            ",{},{},{},{},{},{},{}",
            self.prompt_tokens,
            self.cached_tokens,
            self.completion_tokens,
            clean(&self.endpoint),
            self.status,
            self.outcome.as_str(),
            clean(&self.error)
        );
        o
    }

    /// Parses a line written by [`Record::to_csv`].
    pub fn from_csv(line: &str) -> Result<Record, String> {
        let f: Vec<&str> = line.split(',').collect();
        if f.len() != 15 {
            return Err(format!("expected 15 fields, got {}", f.len()));
        }
        let float = |i: usize| -> Result<f64, String> {
            if f[i].is_empty() {
                Ok(f64::NAN)
            } else {
                f[i].parse()
                    .map_err(|e| format!("field {i} `{}`: {e}", f[i]))
            }
        };
        let int = |i: usize| -> Result<u64, String> {
            f[i].parse()
                .map_err(|e| format!("field {i} `{}`: {e}", f[i]))
        };
        Ok(Record {
            id: int(0)? as usize,
            tenant: f[1].to_string(),
            conversation: if f[2].is_empty() {
                None
            } else {
                Some(int(2)? as usize)
            },
            turn: int(3)? as usize,
            sent_s: float(4)?,
            ttft_ms: float(5)?,
            itl_ms: float(6)?,
            e2e_ms: float(7)?,
            prompt_tokens: int(8)?,
            cached_tokens: int(9)?,
            completion_tokens: int(10)?,
            endpoint: f[11].to_string(),
            status: int(12)? as u16,
            outcome: Outcome::parse(f[13]).ok_or_else(|| format!("bad outcome `{}`", f[13]))?,
            error: f[14].to_string(),
        })
    }
}

/// Parses a whole CSV file (header first).
pub fn parse_csv(text: &str) -> Result<Vec<Record>, String> {
    let mut lines = text.lines();
    match lines.next() {
        Some(h) if h == HEADER => {}
        _ => return Err("missing or unexpected header".into()),
    }
    lines
        .enumerate()
        .filter(|(_, l)| !l.is_empty())
        .map(|(i, l)| Record::from_csv(l).map_err(|e| format!("line {}: {e}", i + 2)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_round_trips_and_cleans_text() {
        let r = Record {
            id: 3,
            tenant: "t01".into(),
            conversation: Some(9),
            turn: 2,
            sent_s: 1.5,
            ttft_ms: 41.25,
            itl_ms: f64::NAN,
            e2e_ms: 300.0,
            prompt_tokens: 5000,
            cached_tokens: 4096,
            completion_tokens: 1,
            endpoint: "127.0.0.1:8001".into(),
            status: 200,
            outcome: Outcome::Ok,
            error: "a, b\nc".into(),
        };
        let line = r.to_csv();
        let back = Record::from_csv(&line).unwrap();
        assert_eq!(back.error, "a  b c");
        assert!(back.itl_ms.is_nan());
        assert_eq!(
            Record {
                error: "a  b c".into(),
                itl_ms: 0.0,
                ..r.clone()
            },
            Record {
                itl_ms: 0.0,
                ..back
            }
        );
        let text = format!("{HEADER}\n{line}\n");
        assert_eq!(parse_csv(&text).unwrap().len(), 1);
        assert!(parse_csv(&line).is_err());
        let bad = format!("{HEADER}\n1,2\n");
        assert_eq!(
            parse_csv(&bad).unwrap_err(),
            "line 2: expected 15 fields, got 2"
        );
    }

    #[test]
    fn a_timed_out_request_keeps_who_and_when_but_nothing_measured() {
        let sent = Record::unanswered(4, "t02".into(), Some(1), 3, 2.5);
        assert_eq!((sent.outcome, sent.error.as_str()), (Outcome::Error, ""));
        let half_measured = Record {
            status: 200,
            endpoint: "e:1".into(),
            ttft_ms: 12.0,
            ..sent.clone()
        };
        let t = half_measured.timed_out();
        assert_eq!(
            (t.outcome, t.error.as_str()),
            (Outcome::Timeout, "deadline")
        );
        assert_eq!(
            (t.id, t.tenant.as_str(), t.conversation, t.turn),
            (4, "t02", Some(1), 3)
        );
        assert_eq!((t.sent_s, t.status, t.endpoint.as_str()), (2.5, 0, ""));
        assert!(t.ttft_ms.is_nan() && t.itl_ms.is_nan() && t.e2e_ms.is_nan());
    }
}
