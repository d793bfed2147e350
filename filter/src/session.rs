//! One `kvasir.v1.Indexer/Session` stream per VM and indexer cluster:
//! picks and reports as messages on an open HTTP/2 stream instead of a
//! new gRPC call each (a `dispatch_grpc_call` sets up a new HTTP/2 stream
//! on the Envoy worker; a message on an open stream costs a fraction of
//! that; measured: bench/results/filter_notes.md).
//!
//! Every decision about the streams is here, without host calls:
//! [`Session`] is one stream's bookkeeping (which picks wait and until
//! when, framing, when to reopen); [`Sessions`] is a VM's streams, whose
//! methods take what happened (a pick is due, a send failed, the timer
//! ran, a message arrived, a stream ended) and return what the proxy-wasm
//! glue must do with host calls; [`Timer`] is the root's timer period.
//! A stream that is not open never holds a request back: the caller then
//! uses a unary call, which has its own timeout and fail-open path.

use std::cell::Cell;
use std::collections::HashMap;

use kvasir_proto::v1::{session_response, SessionResponse};
use prost::encoding::{encode_key, encode_varint, WireType};
use prost::Message;

use crate::host::DeferredCall;
use crate::pick::{self, pick_outcome_of, FailOpen, PickOutcome};

/// The `Session` method.
pub const METHOD: &str = "Session";

/// Wait before reopening after a stream failed (ms).
pub const RETRY_MS: u64 = 500;
/// Wait before retrying an indexer that does not implement `Session`
/// (UNIMPLEMENTED: an older indexer; unary calls serve meanwhile), ms.
pub const UNIMPLEMENTED_RETRY_MS: u64 = 60_000;
/// A stream whose picks time out while nothing at all has come back on it
/// for this long is stalled: it is given up (it would otherwise time out
/// every pick) and reopened later. Late answers prove a stream alive: one
/// that is slow under load (picks past their deadline, answers still
/// arriving) is kept, since giving it up would fail every pick waiting on
/// it and send the next ones as unary calls, which cost more.
pub const STALL_MS: u64 = 1_000;
/// How often the root's timer runs while stream picks wait (their
/// deadlines are checked on it), ms.
pub const DEADLINE_CHECK_MS: u64 = 5;
/// Set in every stream pick's token: Envoy's call tokens are small
/// counters (and a request matches only its own one pick anyway).
pub const TOKEN_BIT: u32 = 0x8000_0000;

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
    /// Answers decoded on the stream, waited for or not.
    answers: u64,
    /// `answers` when the stall clock was last set.
    answers_seen: u64,
    /// When something was last heard on the stream while picks waited
    /// (`None`: not since picks started waiting).
    heard_ns: Option<u64>,
    /// A pick timed out and nothing has been heard since: the stall clock
    /// keeps running across picks sent one after another (else each new
    /// pick would restart it and a stopped indexer under light, sequential
    /// traffic would never be given up).
    unanswered: bool,
}

impl<W> Default for Session<W> {
    fn default() -> Self {
        Session {
            stream: Stream::Closed { retry_at_ns: 0 },
            wanted: false,
            next_id: 1,
            waiting: HashMap::new(),
            answers: 0,
            answers_seen: 0,
            heard_ns: None,
            unanswered: false,
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
        self.heard_ns = None;
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
        if self.waiting.is_empty() && !self.unanswered {
            // The stall clock starts when picks start waiting on a stream
            // that answered the last ones.
            self.heard_ns = None;
        }
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
        self.answers += 1;
        self.unanswered = false;
        let (_, w) = self.waiting.remove(&a.id)?;
        let outcome = match a.result {
            Some(session_response::Result::Pick(r)) => pick_outcome_of(r),
            Some(session_response::Result::Error(e)) => {
                PickOutcome::failed(FailOpen::of_status(e.code))
            }
            None => PickOutcome::failed(FailOpen::BadResponse),
        };
        Some((a.id, w, outcome))
    }

    /// Takes the picks whose deadline passed. When picks time out and
    /// nothing was heard on the stream for [`STALL_MS`], it is given up
    /// too: `true` means the caller must cancel it (its token was
    /// [`Session::token`] before this call).
    pub fn expire(&mut self, now_ns: u64) -> (Vec<(u64, W)>, bool) {
        if self.heard_ns.is_none() || self.answers != self.answers_seen {
            self.heard_ns = Some(now_ns);
            self.answers_seen = self.answers;
        }
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
        self.unanswered |= !out.is_empty();
        let silent_ns = now_ns.saturating_sub(self.heard_ns.unwrap_or(now_ns));
        let give_up = self.token().is_some() && !out.is_empty() && silent_ns >= STALL_MS * MS;
        if give_up {
            self.open_failed(now_ns);
            self.heard_ns = None;
            self.unanswered = false;
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

/// The token a request knows its stream pick `id` by.
pub fn pick_token(id: u64) -> u32 {
    TOKEN_BIT | (id as u32 & !TOKEN_BIT)
}

/// A pick's outcome for the request that waits for it (its
/// `Flow::on_pick_outcome`, as that request's context).
#[derive(Debug, PartialEq)]
pub struct Delivery<W> {
    /// The pick's token ([`pick_token`]).
    pub token: u32,
    /// Who waits.
    pub waiter: W,
    /// What the pick came to.
    pub outcome: PickOutcome,
}

impl<W> Delivery<W> {
    fn new(id: u64, waiter: W, outcome: PickOutcome) -> Self {
        Delivery {
            token: pick_token(id),
            waiter,
            outcome,
        }
    }
}

/// A message to send on an open stream, as the root context (which owns
/// the stream).
#[derive(Debug, PartialEq, Eq)]
pub struct StreamSend {
    /// The stream's token.
    pub stream: u32,
    /// The framed `SessionRequest`.
    pub frame: Vec<u8>,
}

/// How to start a pick ([`Sessions::pick`]).
#[derive(Debug, PartialEq, Eq)]
pub enum PickStep {
    /// Send it on the stream, then tell [`Sessions::pick_sent`] how that
    /// went.
    Stream {
        /// The pick's id in its session.
        id: u64,
        /// What to send where.
        send: StreamSend,
    },
    /// Make it a unary call. With `tick_within_ms` a stream is now wanted:
    /// the root's timer must run within that many ms to open it.
    Unary {
        /// See the variant.
        tick_within_ms: Option<u64>,
    },
}

/// What follows a pick's send on a stream ([`Sessions::pick_sent`]).
#[derive(Debug, PartialEq, Eq)]
pub enum PickSent {
    /// It waits on the stream under `token`; the root's timer must run
    /// within `tick_within_ms` to time it out.
    Waiting {
        /// The token the request waits for.
        token: u32,
        /// See the variant.
        tick_within_ms: u64,
    },
    /// The send failed: cancel `cancel` (still as the root; the stream is
    /// of no use any more) and make the pick a unary call.
    Unary {
        /// The stream to cancel.
        cancel: u32,
    },
}

/// What the root's timer must do for the streams ([`Sessions::upkeep`]),
/// in this order.
#[derive(Debug, PartialEq)]
pub struct Upkeep<W> {
    /// Stalled streams to cancel (each counted as `session.stalled`).
    pub cancel: Vec<u32>,
    /// Picks past their deadline, failed open as timeouts.
    pub deliver: Vec<Delivery<W>>,
    /// Clusters to open a stream to now, from this root callback (so the
    /// stream's callbacks come to the root); then [`Sessions::opened`] or
    /// [`Sessions::open_failed`].
    pub open: Vec<String>,
}

/// What a message on a stream calls for ([`Sessions::message`]).
#[derive(Debug, PartialEq)]
pub enum Answer<W> {
    /// Not one of the streams, or unreadable: nothing.
    Ignore,
    /// An answer nobody waits for (timed out already) or that does not
    /// decode: counted as `session.unmatched`.
    Unmatched,
    /// Hand this to its request.
    Deliver(Delivery<W>),
}

/// A stream that ended ([`Sessions::closed`]).
#[derive(Debug, PartialEq)]
pub struct Ended<W> {
    /// Its indexer cluster.
    pub cluster: String,
    /// Its waiting picks, failed open.
    pub deliver: Vec<Delivery<W>>,
}

/// A VM's `Session` streams, one per indexer cluster; `W` is what hands an
/// outcome back to a request.
#[derive(Debug)]
pub struct Sessions<W> {
    enabled: bool,
    by_cluster: HashMap<String, Session<W>>,
    /// Open stream token -> its cluster.
    streams: HashMap<u32, String>,
}

impl<W> Default for Sessions<W> {
    fn default() -> Self {
        Sessions {
            enabled: true,
            by_cluster: HashMap::new(),
            streams: HashMap::new(),
        }
    }
}

impl<W> Sessions<W> {
    /// Turns streams on or off (`indexerSession`); off, every pick and
    /// report is a unary call.
    pub fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
    }

    /// A request's pick to `cluster`: on the open stream, or a unary call
    /// (and a stream wanted, opened on a later tick: only the root may
    /// open one). `waiter` is made only when the pick goes on the stream.
    /// `clock` (ns) is read only with streams on: it is a host call.
    pub fn pick(
        &mut self,
        cluster: &str,
        msg: &[u8],
        timeout_ms: u32,
        clock: impl FnOnce() -> u64,
        waiter: impl FnOnce() -> W,
    ) -> PickStep {
        if !self.enabled {
            return PickStep::Unary {
                tick_within_ms: None,
            };
        }
        let now_ns = clock();
        if let Some(s) = self.by_cluster.get_mut(cluster) {
            if let Some(stream) = s.token() {
                let deadline_ns = now_ns + u64::from(timeout_ms) * MS;
                let (id, frame) = s.pick(msg, deadline_ns, waiter());
                return PickStep::Stream {
                    id,
                    send: StreamSend { stream, frame },
                };
            }
        }
        // No stream yet, or again after a failure.
        let s = match self.by_cluster.get_mut(cluster) {
            Some(s) => s,
            None => self.by_cluster.entry(cluster.to_string()).or_default(),
        };
        let tick_within_ms = match s.open_due_in_ms(now_ns) {
            Some(_) => None, // wanted already, the timer knows
            None => {
                s.want();
                Some(s.open_due_in_ms(now_ns).unwrap_or(0).max(1))
            }
        };
        PickStep::Unary { tick_within_ms }
    }

    /// How the send of [`PickStep::Stream`] went; `clock` (ns) is read
    /// only when it failed.
    pub fn pick_sent(
        &mut self,
        cluster: &str,
        stream: u32,
        id: u64,
        sent: bool,
        clock: impl FnOnce() -> u64,
    ) -> PickSent {
        if sent {
            return PickSent::Waiting {
                token: pick_token(id),
                tick_within_ms: DEADLINE_CHECK_MS,
            };
        }
        if let Some(s) = self.by_cluster.get_mut(cluster) {
            s.forget(id);
        }
        PickSent::Unary {
            cancel: self.send_failed(cluster, stream, clock()),
        }
    }

    /// A fire-and-forget call for the stream, if it may go there: only
    /// reports (nothing waits for them), and only on an open stream; else
    /// `None`, and it is a unary call.
    pub fn detached(&mut self, call: &DeferredCall) -> Option<StreamSend> {
        if call.method != pick::REPORT || !self.enabled {
            return None;
        }
        let s = self.by_cluster.get_mut(&call.cluster)?;
        let stream = s.token()?;
        Some(StreamSend {
            stream,
            frame: s.report(&call.msg),
        })
    }

    /// A send on `stream` failed: the stream is given up (its waiters time
    /// out) and may reopen later. Returns the stream to cancel, as the
    /// root.
    pub fn send_failed(&mut self, cluster: &str, stream: u32, now_ns: u64) -> u32 {
        if let Some(s) = self.by_cluster.get_mut(cluster) {
            s.open_failed(now_ns);
        }
        self.streams.remove(&stream);
        stream
    }

    /// The root's timer ran: picks past their deadline fail open, a
    /// stalled stream is given up, wanted streams are opened.
    pub fn upkeep(&mut self, now_ns: u64) -> Upkeep<W> {
        let mut up = Upkeep {
            cancel: Vec::new(),
            deliver: Vec::new(),
            open: Vec::new(),
        };
        for (cluster, s) in self.by_cluster.iter_mut() {
            let token = s.token();
            let (gone, give_up) = s.expire(now_ns);
            up.deliver.extend(
                gone.into_iter()
                    .map(|(id, w)| Delivery::new(id, w, PickOutcome::failed(FailOpen::Timeout))),
            );
            if let (true, Some(t)) = (give_up, token) {
                self.streams.remove(&t);
                up.cancel.push(t);
            }
            if s.should_open(now_ns) {
                up.open.push(cluster.clone());
            }
        }
        up
    }

    /// A stream to `cluster` was opened under `stream`.
    pub fn opened(&mut self, cluster: String, stream: u32) {
        if let Some(s) = self.by_cluster.get_mut(&cluster) {
            s.opened(stream);
            self.streams.insert(stream, cluster);
        }
    }

    /// Opening a stream to `cluster` failed at once (unknown cluster...).
    pub fn open_failed(&mut self, cluster: &str, now_ns: u64) {
        if let Some(s) = self.by_cluster.get_mut(cluster) {
            s.open_failed(now_ns);
        }
    }

    /// A message arrived on `stream`; `read` reads it (a host call, made
    /// only for a stream of ours).
    pub fn message(&mut self, stream: u32, read: impl FnOnce() -> Option<Vec<u8>>) -> Answer<W> {
        let Some(cluster) = self.streams.get(&stream) else {
            return Answer::Ignore;
        };
        let Some(bytes) = read() else {
            return Answer::Ignore;
        };
        match self
            .by_cluster
            .get_mut(cluster)
            .and_then(|s| s.answer(&bytes))
        {
            Some((id, w, outcome)) => Answer::Deliver(Delivery::new(id, w, outcome)),
            None => Answer::Unmatched,
        }
    }

    /// `stream` ended with gRPC `status`; `None` for a stream given up
    /// already (nothing to do).
    pub fn closed(&mut self, stream: u32, status: u32, now_ns: u64) -> Option<Ended<W>> {
        let cluster = self.streams.remove(&stream)?;
        let deliver = self
            .by_cluster
            .get_mut(&cluster)
            .map(|s| {
                s.closed(status, now_ns)
                    .into_iter()
                    .map(|(id, w, why)| Delivery::new(id, w, PickOutcome::failed(why)))
                    .collect()
            })
            .unwrap_or_default();
        Some(Ended { cluster, deliver })
    }

    /// How soon the root's timer must run for the streams: to open a
    /// wanted one, and every [`DEADLINE_CHECK_MS`] while picks wait.
    pub fn timer_need_ms(&self, now_ns: u64) -> Option<u64> {
        let open = self
            .by_cluster
            .values()
            .filter_map(|s| s.open_due_in_ms(now_ns))
            .min()
            .map(|ms| ms.max(1));
        let deadlines = self
            .by_cluster
            .values()
            .any(|s| s.waiting() > 0)
            .then_some(DEADLINE_CHECK_MS);
        open.into_iter().chain(deadlines).min()
    }

    /// Picks waiting on every stream.
    pub fn waiting(&self) -> usize {
        self.by_cluster.values().map(Session::waiting).sum()
    }
}

/// The root context's timer period (ms, 0 = off), shared by the streams,
/// the queued fire-and-forget calls and the `PoolState` polls. Each
/// method returns the period to set, if it changes; [`Timer::set`] once
/// Envoy took it.
#[derive(Debug, Default)]
pub struct Timer {
    period_ms: Cell<u64>,
}

impl Timer {
    /// The timer's period now.
    pub fn period_ms(&self) -> u64 {
        self.period_ms.get()
    }

    /// Envoy now runs the timer every `ms`.
    pub fn set(&self, ms: u64) {
        self.period_ms.set(ms);
    }

    /// To run within `ms`: shortens the period, never lengthens it.
    pub fn within(&self, ms: u64) -> Option<u64> {
        let now = self.period_ms.get();
        (now == 0 || ms < now).then_some(ms)
    }

    /// The period for what is pending (the timer is retimed on each tick
    /// and when a stream ends): 1 ms for queued calls, the streams' need,
    /// the poll period, or off.
    pub fn retime(&self, calls_queued: bool, streams_ms: Option<u64>, poll_ms: u64) -> Option<u64> {
        let needs = [
            calls_queued.then_some(1),
            streams_ms,
            (poll_ms > 0).then_some(poll_ms),
        ];
        let want = needs.into_iter().flatten().min().unwrap_or(0);
        (want != self.period_ms.get()).then_some(want)
    }
}

#[cfg(test)]
#[path = "session_tests.rs"]
mod tests;
