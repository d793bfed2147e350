//! The streams' decisions, natively: one stream's bookkeeping
//! ([`Session`]), what a VM's streams call for on each event
//! ([`Sessions`]), and the root's timer period ([`Timer`]).

use super::*;
use crate::pick::NoPick;
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
    assert_eq!(
        (w, out.result),
        (1, Err(NoPick::FailOpen(FailOpen::GrpcError)))
    );
    assert!(s.answer(b"\xff\xff").is_none(), "garbage is dropped");
    // An answer that names a non-address is a bad response, as in unary.
    let (c, _) = s.pick(b"", 100, 3);
    let (_, _, out) = s.answer(&answer(c, picked("evil.example"))).unwrap();
    assert_eq!(out.result, Err(NoPick::FailOpen(FailOpen::BadResponse)));
}

#[test]
fn deadlines_expire_and_a_stalled_stream_is_given_up() {
    let mut s: Session<u32> = Session::default();
    s.opened(3);
    s.pick(b"", 50, 1);
    s.pick(b"", 80, 2);
    let (gone, give_up) = s.expire(10);
    assert!(gone.is_empty() && !give_up, "the stall clock starts");
    let (gone, give_up) = s.expire(60);
    assert_eq!(
        (gone.iter().map(|g| g.1).collect::<Vec<_>>(), give_up),
        (vec![1], false)
    );
    // Nothing heard for the stall time while picks time out: given up.
    let stalled = 10 + STALL_MS * MS;
    for i in 0..50 {
        s.pick(b"", stalled, 10 + i);
    }
    let (gone, give_up) = s.expire(stalled);
    assert_eq!(gone.len(), 51);
    assert!(give_up);
    assert_eq!(s.token(), None);
    s.want();
    assert_eq!(s.open_due_in_ms(stalled), Some(RETRY_MS));
    assert!(!s.should_open(stalled), "not before the retry wait");
    assert!(s.should_open(stalled + RETRY_MS * MS));
}

#[test]
fn a_slow_stream_that_still_answers_is_kept() {
    let mut s: Session<u32> = Session::default();
    s.opened(3);
    let mut now = 0;
    let mut late = Vec::new();
    // Under load: every pick times out, but the answers keep coming,
    // late, so the stream is alive and its other picks may still make it.
    for round in 0..40u32 {
        let (id, _) = s.pick(b"", now + 50 * MS, round);
        late.push(id);
        if round >= 2 {
            let old = late[round as usize - 2];
            assert!(
                s.answer(&answer(old, picked("10.0.0.1:8000"))).is_none(),
                "nobody waits"
            );
        }
        now += 100 * MS;
        let (gone, give_up) = s.expire(now);
        assert_eq!(gone.len(), 1);
        assert!(!give_up, "round {round}: late answers keep it");
    }
    assert!(now > 3 * STALL_MS * MS);
    assert_eq!(s.token(), Some(3));
}

#[test]
fn an_idle_streams_first_timeout_starts_the_stall_clock() {
    let mut s: Session<u32> = Session::default();
    s.opened(3);
    // Long idle, then a pick that times out: not a stall yet.
    let t = 60 * STALL_MS * MS;
    s.pick(b"", t + 50 * MS, 1);
    let (gone, give_up) = s.expire(t + 60 * MS);
    assert_eq!(gone.len(), 1);
    assert!(!give_up);
}

#[test]
fn picks_sent_one_at_a_time_into_a_silent_stream_still_stall_it() {
    let mut s: Session<u32> = Session::default();
    s.opened(3);
    // One request at a time, each pick timing out after 200 ms, the timer
    // every 5 ms: nothing comes back, so the stream is given up once a
    // second of silence has passed, though no pick waited that long.
    let (mut now, mut given_up_at) = (0, None);
    for i in 0..10u32 {
        s.pick(b"", now + 200 * MS, i);
        let deadline = now + 200 * MS;
        while now < deadline {
            now += 5 * MS;
            let (_, give_up) = s.expire(now);
            if give_up {
                given_up_at = Some(now);
            }
        }
        if given_up_at.is_some() {
            break;
        }
        now += MS; // the next request arrives
    }
    let at = given_up_at.expect("the silent stream is given up");
    assert!(
        (STALL_MS * MS..STALL_MS * MS + 250 * MS).contains(&at),
        "{at}"
    );
    assert_eq!(s.token(), None);
}

#[test]
fn an_answer_after_a_timeout_restarts_the_stall_clock() {
    let mut s: Session<u32> = Session::default();
    s.opened(3);
    let (a, _) = s.pick(b"", 200 * MS, 1);
    s.expire(5 * MS);
    assert_eq!(s.expire(200 * MS).0.len(), 1);
    // The timed-out pick's answer arrives late: the stream is alive.
    assert!(s.answer(&answer(a, picked("10.0.0.1:8000"))).is_none());
    // Long after, a pick that times out is not a stall yet.
    let t = 10 * STALL_MS * MS;
    s.pick(b"", t + 200 * MS, 2);
    s.expire(t + 5 * MS);
    let (gone, give_up) = s.expire(t + 200 * MS);
    assert_eq!(gone.len(), 1);
    assert!(!give_up);
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

// `Sessions`: what each event calls for.

const IX: &str = "indexer";

fn never() -> u64 {
    panic!("the clock is a host call: not read here")
}

fn call(method: &'static str) -> DeferredCall {
    DeferredCall {
        cluster: IX.into(),
        method,
        msg: ReportRequest {
            pool: "main".into(),
            request_id: "r".into(),
            ..Default::default()
        }
        .encode_to_vec(),
        timeout_ms: 100,
        pool_name: "main".into(),
    }
}

/// Sessions with an open stream (token 7) to `IX`, as the root gets them:
/// a first pick goes unary and wants one, the timer opens it.
fn open_sessions() -> Sessions<u32> {
    let mut s = Sessions::default();
    assert_eq!(
        s.pick(IX, b"", 40, || 0, || unreachable!()),
        PickStep::Unary {
            tick_within_ms: Some(1)
        }
    );
    let up = s.upkeep(0);
    assert_eq!(
        up,
        Upkeep {
            cancel: vec![],
            deliver: vec![],
            open: vec![IX.to_string()]
        }
    );
    s.opened(IX.into(), 7);
    s
}

fn stream_pick(s: &mut Sessions<u32>, now: u64, waiter: u32) -> (u64, StreamSend) {
    match s.pick(IX, b"pick", 40, || now, || waiter) {
        PickStep::Stream { id, send } => (id, send),
        other => panic!("not on the stream: {other:?}"),
    }
}

#[test]
fn with_streams_off_every_pick_is_unary_and_nothing_is_read() {
    let mut s: Sessions<u32> = Sessions::default();
    s.set_enabled(false);
    let step = s.pick(IX, b"", 40, never, || unreachable!());
    assert_eq!(
        step,
        PickStep::Unary {
            tick_within_ms: None
        }
    );
    assert_eq!(s.timer_need_ms(0), None, "no stream is ever wanted");
    assert_eq!(s.upkeep(0).open, Vec::<String>::new());
    assert_eq!(s.detached(&call(pick::REPORT)), None);
}

#[test]
fn a_pick_without_a_stream_goes_unary_and_wants_one_opened() {
    let mut s: Sessions<u32> = Sessions::default();
    // The first: unary, and the root's timer must run within 1 ms to
    // open the stream (the waiter is never made for a unary pick).
    let step = s.pick(IX, b"", 40, || 5, || unreachable!());
    assert_eq!(
        step,
        PickStep::Unary {
            tick_within_ms: Some(1)
        }
    );
    assert_eq!(s.timer_need_ms(5), Some(1));
    // Wanted already: the timer knows.
    let step = s.pick(IX, b"", 40, || 6, || unreachable!());
    assert_eq!(
        step,
        PickStep::Unary {
            tick_within_ms: None
        }
    );
    // The tick opens it; until it is open picks stay unary.
    assert_eq!(s.upkeep(7).open, vec![IX.to_string()]);
    s.open_failed(IX, 7);
    assert_eq!(
        s.upkeep(8).open,
        Vec::<String>::new(),
        "not before the retry wait"
    );
    // Still wanted: the timer comes back for it after the wait.
    assert_eq!(s.timer_need_ms(8), Some(RETRY_MS));
    let step = s.pick(IX, b"", 40, || 9, || unreachable!());
    assert_eq!(
        step,
        PickStep::Unary {
            tick_within_ms: None
        }
    );
    assert_eq!(s.upkeep(7 + RETRY_MS * MS).open, vec![IX.to_string()]);
    s.opened(IX.into(), 9);
    assert_eq!(s.timer_need_ms(7 + RETRY_MS * MS), None);
    let (_, send) = stream_pick(&mut s, 0, 1);
    assert_eq!(send.stream, 9);
}

#[test]
fn a_pick_on_an_open_stream_is_framed_and_waits_under_its_token() {
    let mut s = open_sessions();
    let pick = PickRequest {
        pool: "main".into(),
        request_id: "r".into(),
        ..Default::default()
    };
    let step = s.pick(IX, &pick.encode_to_vec(), 40, || 1_000, || 3);
    let PickStep::Stream { id, send } = step else {
        panic!("{step:?}")
    };
    assert_eq!(send.stream, 7);
    let r = SessionRequest::decode(send.frame.as_slice()).unwrap();
    assert_eq!(
        (r.id, r.call),
        (id, Some(session_request::Call::Pick(pick)))
    );
    // Sent: the request waits for its token, the timer checks deadlines.
    let after = s.pick_sent(IX, 7, id, true, never);
    assert_eq!(
        after,
        PickSent::Waiting {
            token: pick_token(id),
            tick_within_ms: DEADLINE_CHECK_MS
        }
    );
    assert_eq!(s.waiting(), 1);
    assert_eq!(s.timer_need_ms(1_000), Some(DEADLINE_CHECK_MS));
    // The deadline is the pick's timeout from now.
    assert!(s.upkeep(1_000 + 40 * MS - 1).deliver.is_empty());
    let up = s.upkeep(1_000 + 40 * MS);
    assert_eq!(
        up.deliver,
        vec![Delivery {
            token: pick_token(id),
            waiter: 3,
            outcome: PickOutcome::failed(FailOpen::Timeout)
        }]
    );
}

#[test]
fn a_failed_send_gives_the_stream_up_and_the_pick_goes_unary() {
    let mut s = open_sessions();
    let (id, send) = stream_pick(&mut s, 0, 1);
    assert_eq!(
        s.pick_sent(IX, send.stream, id, false, || 1_000),
        PickSent::Unary { cancel: 7 }
    );
    assert_eq!(s.waiting(), 0, "the pick does not wait on the stream");
    // The stream is gone: its messages and its end are nobody's.
    let read = || -> Option<Vec<u8>> { panic!("not read: not our stream") };
    assert_eq!(s.message(7, read), Answer::Ignore);
    assert_eq!(s.closed(7, 14, 2_000), None);
    // The next pick is unary and wants a stream after the retry wait.
    assert_eq!(
        s.pick(IX, b"", 40, || 1_000, || unreachable!()),
        PickStep::Unary {
            tick_within_ms: Some(RETRY_MS)
        }
    );
    assert!(s.upkeep(1_000 + RETRY_MS * MS - 1).open.is_empty());
    assert_eq!(s.upkeep(1_000 + RETRY_MS * MS).open, vec![IX.to_string()]);
}

#[test]
fn only_reports_ride_the_stream_and_only_while_it_is_open() {
    let mut fresh: Sessions<u32> = Sessions::default();
    assert_eq!(fresh.detached(&call(pick::REPORT)), None, "no stream yet");
    let mut s = open_sessions();
    assert_eq!(s.detached(&call(pick::POOL_STATE)), None, "answered: unary");
    let c = call(pick::REPORT);
    let send = s.detached(&c).unwrap();
    assert_eq!(send.stream, 7);
    let r = SessionRequest::decode(send.frame.as_slice()).unwrap();
    assert_eq!(
        r.call,
        Some(session_request::Call::Report(
            ReportRequest::decode(c.msg.as_slice()).unwrap()
        ))
    );
    assert_eq!(s.waiting(), 0, "nothing waits for a report");
    // A failed send gives the stream up; the report goes unary.
    assert_eq!(s.send_failed(IX, 7, 0), 7);
    assert_eq!(s.detached(&c), None);
    assert_eq!(s.closed(7, 0, 0), None);
    let mut s = open_sessions();
    s.set_enabled(false);
    assert_eq!(s.detached(&c), None, "streams off");
}

#[test]
fn answers_are_delivered_to_their_waiter_once() {
    let mut s = open_sessions();
    let (id, _) = stream_pick(&mut s, 0, 4);
    s.pick_sent(IX, 7, id, true, never);
    let unknown = || -> Option<Vec<u8>> { panic!("not read: not our stream") };
    assert_eq!(s.message(8, unknown), Answer::Ignore);
    assert_eq!(s.message(7, || None), Answer::Ignore, "unreadable");
    assert_eq!(
        s.message(7, || Some(b"\xff\xff".to_vec())),
        Answer::Unmatched
    );
    let a = answer(id, picked("10.0.0.1:8000"));
    match s.message(7, || Some(a.clone())) {
        Answer::Deliver(d) => {
            assert_eq!((d.token, d.waiter), (pick_token(id), 4));
            assert_eq!(d.outcome.result.unwrap().header, "10.0.0.1:8000");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        s.message(7, || Some(a)),
        Answer::Unmatched,
        "answered already"
    );
    assert_eq!(s.waiting(), 0);
    assert_eq!(s.timer_need_ms(0), None, "nothing to time out");
}

#[test]
fn a_stalled_stream_is_cancelled_and_its_picks_time_out() {
    let mut s = open_sessions();
    let mut ids = Vec::new();
    for w in 0..8 {
        let (id, _) = stream_pick(&mut s, 0, w);
        s.pick_sent(IX, 7, id, true, never);
        ids.push(id);
    }
    // The stall clock starts at the first tick with picks waiting; the
    // picks time out later while nothing comes back.
    let up = s.upkeep(MS);
    assert!(up.cancel.is_empty() && up.deliver.is_empty());
    let stalled = MS + STALL_MS * MS;
    let up = s.upkeep(stalled);
    assert_eq!(up.cancel, vec![7]);
    let mut tokens: Vec<u32> = up.deliver.iter().map(|d| d.token).collect();
    tokens.sort_unstable();
    assert_eq!(
        tokens,
        ids.iter().map(|&i| pick_token(i)).collect::<Vec<_>>()
    );
    assert!(up
        .deliver
        .iter()
        .all(|d| d.outcome.result == Err(NoPick::FailOpen(FailOpen::Timeout))));
    assert!(up.open.is_empty());
    // Given up: its end is nobody's, and the next pick is unary.
    assert_eq!(s.closed(7, 1, stalled), None);
    assert_eq!(
        s.pick(IX, b"", 40, || stalled, || unreachable!()),
        PickStep::Unary {
            tick_within_ms: Some(RETRY_MS)
        }
    );
}

#[test]
fn a_stream_that_ends_fails_its_waiters_at_once_and_reopens_later() {
    let mut s = open_sessions();
    let (a, _) = stream_pick(&mut s, 0, 1);
    let (b, _) = stream_pick(&mut s, 0, 2);
    let mut ended = s.closed(7, 14, 1_000).unwrap();
    assert_eq!(ended.cluster, IX);
    ended.deliver.sort_by_key(|d| d.waiter);
    assert_eq!(
        ended.deliver,
        vec![
            Delivery {
                token: pick_token(a),
                waiter: 1,
                outcome: PickOutcome::failed(FailOpen::Unavailable)
            },
            Delivery {
                token: pick_token(b),
                waiter: 2,
                outcome: PickOutcome::failed(FailOpen::Unavailable)
            }
        ]
    );
    assert_eq!(s.closed(7, 14, 1_000), None, "once");
    assert!(
        s.upkeep(2_000).deliver.is_empty(),
        "nothing left to time out"
    );
    assert_eq!(
        s.pick(IX, b"", 40, || 1_000, || unreachable!()),
        PickStep::Unary {
            tick_within_ms: Some(RETRY_MS)
        }
    );
    // UNIMPLEMENTED (an older indexer): retried much later.
    assert_eq!(s.upkeep(1_000 + RETRY_MS * MS).open, vec![IX.to_string()]);
    s.opened(IX.into(), 8);
    let ended = s.closed(8, 12, 0).unwrap();
    assert!(ended.deliver.is_empty());
    assert_eq!(
        s.pick(IX, b"", 40, || 0, || unreachable!()),
        PickStep::Unary {
            tick_within_ms: Some(UNIMPLEMENTED_RETRY_MS)
        }
    );
}

#[test]
fn stream_pick_tokens_never_meet_envoys_call_tokens() {
    for id in [1, 2, 0x7fff_ffff, 0x8000_0000, u64::MAX] {
        assert_ne!(pick_token(id) & TOKEN_BIT, 0);
    }
    assert_eq!(pick_token(5), TOKEN_BIT | 5);
}

// `Timer`: the root's period.

#[test]
fn the_timer_runs_as_often_as_the_most_urgent_need() {
    let t = Timer::default();
    assert_eq!(t.period_ms(), 0);
    assert_eq!(t.within(5), Some(5), "off: on");
    t.set(5);
    assert_eq!(t.within(5), None);
    assert_eq!(t.within(9), None, "never lengthened by a request");
    assert_eq!(t.within(1), Some(1));
    t.set(1);
    // Retimed on each tick: queued calls 1 ms, then the streams' need,
    // then the polls, else off.
    assert_eq!(t.retime(true, Some(5), 1_000), None);
    assert_eq!(t.retime(false, Some(5), 1_000), Some(5));
    t.set(5);
    assert_eq!(t.retime(false, None, 1_000), Some(1_000));
    assert_eq!(t.retime(false, Some(3), 2), Some(2));
    assert_eq!(t.retime(false, None, 0), Some(0));
    t.set(0);
    assert_eq!(t.retime(false, None, 0), None);
}
