//! One `kvasir.v1.Indexer/Session` stream per VM and indexer cluster:
//! picks and reports as messages on an open HTTP/2 stream instead of a
//! new gRPC call each (a `dispatch_grpc_call` costs an Envoy worker about
//! 0.1 ms; a message on an open stream a fraction of that).
//!
//! This module is the stream's bookkeeping, without host calls: which
//! picks wait for an answer and until when, framing a request around an
//! already encoded `PickRequest` / `ReportRequest`, and when to (re)open.
//! A stream that is not open never holds a request back: the caller then
//! uses a unary call, which has its own timeout and fail-open path.

use std::collections::HashMap;

use kvasir_proto::v1::{session_response, SessionResponse};
use prost::encoding::{encode_key, encode_varint, WireType};
use prost::Message;

use crate::pick::{pick_outcome_of, FailOpen, PickOutcome};

/// The `Session` method.
pub const METHOD: &str = "Session";

/// Wait before reopening after a stream failed (ms).
pub const RETRY_MS: u64 = 500;
/// Wait before retrying an indexer that does not implement `Session`
/// (UNIMPLEMENTED: an older indexer; unary calls serve meanwhile), ms.
pub const UNIMPLEMENTED_RETRY_MS: u64 = 60_000;
/// Picks timed out in a row, with no answer between them, after which the
/// stream is given up (a stalled stream would otherwise time out every
/// pick) and reopened later.
pub const MAX_TIMEOUTS_IN_A_ROW: u32 = 8;

const MS: u64 = 1_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stream {
    /// Not open; may be opened from `retry_at_ns` on.
    Closed { retry_at_ns: u64 },
    /// Open under this token.
    Open { token: u32 },
}

/// One stream and the picks waiting on it; `W` is what the caller needs
/// to hand an answer back (the request's context).
#[derive(Debug)]
pub struct Session<W> {
    stream: Stream,
    /// A request found the stream closed and wants it opened.
    wanted: bool,
    next_id: u64,
    waiting: HashMap<u64, (u64, W)>,
    timeouts_in_a_row: u32,
}

impl<W> Default for Session<W> {
    fn default() -> Self {
        Session {
            stream: Stream::Closed { retry_at_ns: 0 },
            wanted: false,
            next_id: 1,
            waiting: HashMap::new(),
            timeouts_in_a_row: 0,
        }
    }
}

fn frame(id: u64, field: u32, msg: &[u8]) -> Vec<u8> {
    // A SessionRequest: field 1 the id, then the call as an embedded
    // message (length-delimited), which is exactly the encoded request.
    let mut b = Vec::with_capacity(msg.len() + 24);
    encode_key(1, WireType::Varint, &mut b);
    encode_varint(id, &mut b);
    encode_key(field, WireType::LengthDelimited, &mut b);
    encode_varint(msg.len() as u64, &mut b);
    b.extend_from_slice(msg);
    b
}

impl<W> Session<W> {
    /// The open stream's token.
    pub fn token(&self) -> Option<u32> {
        match self.stream {
            Stream::Open { token } => Some(token),
            Stream::Closed { .. } => None,
        }
    }

    /// Notes that a request found the stream closed (the root opens it on
    /// its next tick: a stream must be opened by the root context, which
    /// outlives requests and gets the stream's callbacks).
    pub fn want(&mut self) {
        self.wanted = true;
    }

    /// When the root should next try to open the stream: `Some(ms)` from
    /// `now_ns` (0 = now) while one is wanted and closed.
    pub fn open_due_in_ms(&self, now_ns: u64) -> Option<u64> {
        match self.stream {
            Stream::Closed { retry_at_ns } if self.wanted => {
                Some(retry_at_ns.saturating_sub(now_ns).div_ceil(MS))
            }
            _ => None,
        }
    }

    /// Whether the root should open the stream now.
    pub fn should_open(&self, now_ns: u64) -> bool {
        matches!(self.stream, Stream::Closed { retry_at_ns } if self.wanted && now_ns >= retry_at_ns)
    }

    /// The stream was opened.
    pub fn opened(&mut self, token: u32) {
        self.stream = Stream::Open { token };
        self.wanted = false;
        self.timeouts_in_a_row = 0;
    }

    /// Opening failed at once (unknown cluster...).
    pub fn open_failed(&mut self, now_ns: u64) {
        self.stream = Stream::Closed {
            retry_at_ns: now_ns + RETRY_MS * MS,
        };
    }

    /// Registers a pick and frames it; the id is the pick's token.
    pub fn pick(&mut self, pick_request: &[u8], deadline_ns: u64, waiter: W) -> (u64, Vec<u8>) {
        let id = self.next_id;
        self.next_id += 1;
        self.waiting.insert(id, (deadline_ns, waiter));
        (id, frame(id, 2, pick_request))
    }

    /// Frames a report (never answered, so nothing waits).
    pub fn report(&mut self, report_request: &[u8]) -> Vec<u8> {
        let id = self.next_id;
        self.next_id += 1;
        frame(id, 3, report_request)
    }

    /// Forgets a pick whose message could not be sent.
    pub fn forget(&mut self, id: u64) {
        self.waiting.remove(&id);
    }

    /// Picks waiting for an answer.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// An answer from the stream: the waiter and its outcome, or `None`
    /// for an answer nobody waits for (timed out already) or that does not
    /// decode.
    pub fn answer(&mut self, bytes: &[u8]) -> Option<(u64, W, PickOutcome)> {
        let a = SessionResponse::decode(bytes).ok()?;
        let (_, w) = self.waiting.remove(&a.id)?;
        self.timeouts_in_a_row = 0;
        let outcome = match a.result {
            Some(session_response::Result::Pick(r)) => pick_outcome_of(r),
            Some(session_response::Result::Error(e)) => {
                PickOutcome::failed(FailOpen::of_status(e.code))
            }
            None => PickOutcome::failed(FailOpen::BadResponse),
        };
        Some((a.id, w, outcome))
    }

    /// Takes the picks whose deadline passed. When too many timed out in a
    /// row the stream is given up too: `true` means the caller must cancel
    /// it (its token was [`Session::token`] before this call).
    pub fn expire(&mut self, now_ns: u64) -> (Vec<(u64, W)>, bool) {
        let due: Vec<u64> = self
            .waiting
            .iter()
            .filter(|(_, (d, _))| *d <= now_ns)
            .map(|(id, _)| *id)
            .collect();
        let mut out = Vec::with_capacity(due.len());
        for id in due {
            if let Some((_, w)) = self.waiting.remove(&id) {
                out.push((id, w));
            }
        }
        self.timeouts_in_a_row = self
            .timeouts_in_a_row
            .saturating_add(u32::try_from(out.len()).unwrap_or(u32::MAX));
        let give_up = self.token().is_some() && self.timeouts_in_a_row >= MAX_TIMEOUTS_IN_A_ROW;
        if give_up {
            self.open_failed(now_ns);
            self.timeouts_in_a_row = 0;
        }
        (out, give_up)
    }

    /// The stream ended with a gRPC status: every waiting pick fails open
    /// (returned with its id and why), and the stream may reopen after a
    /// while.
    pub fn closed(&mut self, status: u32, now_ns: u64) -> Vec<(u64, W, FailOpen)> {
        let wait_ms = match status {
            0 => 0,
            12 => UNIMPLEMENTED_RETRY_MS,
            _ => RETRY_MS,
        };
        self.stream = Stream::Closed {
            retry_at_ns: now_ns + wait_ms * MS,
        };
        let why = if status == 0 {
            FailOpen::Unavailable
        } else {
            FailOpen::of_status(status)
        };
        self.waiting
            .drain()
            .map(|(id, (_, w))| (id, w, why))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvasir_proto::v1::{
        session_request, CallError, PickRequest, PickResponse, PickedEndpoint, ReportRequest,
        SessionRequest,
    };

    fn answer(id: u64, result: Option<session_response::Result>) -> Vec<u8> {
        SessionResponse { id, result }.encode_to_vec()
    }

    fn picked(addr: &str) -> Option<session_response::Result> {
        Some(session_response::Result::Pick(PickResponse {
            endpoints: vec![PickedEndpoint {
                address: addr.into(),
                ..Default::default()
            }],
            ..Default::default()
        }))
    }

    #[test]
    fn frames_are_session_requests_around_the_encoded_call() {
        let mut s: Session<u32> = Session::default();
        let pick = PickRequest {
            pool: "main".into(),
            request_id: "r".into(),
            ..Default::default()
        };
        let (id, bytes) = s.pick(&pick.encode_to_vec(), 10, 7);
        let r = SessionRequest::decode(bytes.as_slice()).unwrap();
        assert_eq!(r.id, id);
        assert_eq!(r.call, Some(session_request::Call::Pick(pick)));
        let rep = ReportRequest {
            pool: "main".into(),
            request_id: "r".into(),
            ..Default::default()
        };
        let r = SessionRequest::decode(s.report(&rep.encode_to_vec()).as_slice()).unwrap();
        assert_ne!(r.id, id);
        assert_eq!(r.call, Some(session_request::Call::Report(rep)));
        assert_eq!(s.waiting(), 1, "reports wait for nothing");
    }

    #[test]
    fn answers_go_to_their_waiter_once() {
        let mut s: Session<u32> = Session::default();
        s.opened(3);
        let (a, _) = s.pick(b"", 100, 1);
        let (b, _) = s.pick(b"", 100, 2);
        let (id, w, out) = s.answer(&answer(b, picked("10.0.0.1:8000"))).unwrap();
        assert_eq!((id, w), (b, 2));
        assert_eq!(out.result.unwrap().header, "10.0.0.1:8000");
        assert!(s.answer(&answer(b, picked("10.0.0.1:8000"))).is_none());
        let err = Some(session_response::Result::Error(CallError {
            code: 3,
            message: "pool: unknown pool `x`".into(),
        }));
        let (_, w, out) = s.answer(&answer(a, err)).unwrap();
        assert_eq!((w, out.result), (1, Err(FailOpen::GrpcError)));
        assert!(s.answer(b"\xff\xff").is_none(), "garbage is dropped");
        // An answer that names a non-address is a bad response, as in unary.
        let (c, _) = s.pick(b"", 100, 3);
        let (_, _, out) = s.answer(&answer(c, picked("evil.example"))).unwrap();
        assert_eq!(out.result, Err(FailOpen::BadResponse));
    }

    #[test]
    fn deadlines_expire_and_a_stalled_stream_is_given_up() {
        let mut s: Session<u32> = Session::default();
        s.opened(3);
        s.pick(b"", 50, 1);
        s.pick(b"", 80, 2);
        let (gone, give_up) = s.expire(60);
        assert_eq!(
            (gone.iter().map(|g| g.1).collect::<Vec<_>>(), give_up),
            (vec![1], false)
        );
        // An answer resets the run of timeouts.
        let (id, _) = s.pick(b"", 100, 3);
        s.answer(&answer(id, picked("10.0.0.1:8000"))).unwrap();
        for i in 0..MAX_TIMEOUTS_IN_A_ROW {
            s.pick(b"", 200, 10 + i);
        }
        let (gone, give_up) = s.expire(200);
        assert_eq!(gone.len() as u32, MAX_TIMEOUTS_IN_A_ROW + 1);
        assert!(give_up);
        assert_eq!(s.token(), None);
        s.want();
        assert_eq!(s.open_due_in_ms(200), Some(RETRY_MS));
        assert!(!s.should_open(200), "not before the retry wait");
        assert!(s.should_open(200 + RETRY_MS * MS));
    }

    #[test]
    fn a_close_fails_every_waiter_and_sets_the_retry() {
        let mut s: Session<u32> = Session::default();
        assert!(!s.should_open(0), "only once a request wants it");
        assert_eq!(s.open_due_in_ms(0), None);
        s.want();
        assert!(s.should_open(0));
        assert_eq!(s.open_due_in_ms(0), Some(0));
        s.opened(5);
        assert!(!s.should_open(0));
        assert_eq!(s.open_due_in_ms(0), None);
        let (a, _) = s.pick(b"", 50, 1);
        let (b, _) = s.pick(b"", 50, 2);
        let mut failed = s.closed(14, 1000);
        failed.sort_by_key(|f| f.0);
        assert_eq!(
            failed,
            vec![(a, 1, FailOpen::Unavailable), (b, 2, FailOpen::Unavailable)]
        );
        assert_eq!(s.waiting(), 0);
        s.want();
        assert!(!s.should_open(1000 + RETRY_MS * MS - 1));
        assert!(s.should_open(1000 + RETRY_MS * MS));
        s.opened(6);
        s.closed(12, 0);
        s.want();
        assert!(!s.should_open(RETRY_MS * MS));
        assert!(s.should_open(UNIMPLEMENTED_RETRY_MS * MS));
        s.opened(7);
        s.closed(0, 5);
        s.want();
        assert!(s.should_open(5), "a clean end reopens at once");
    }
}
