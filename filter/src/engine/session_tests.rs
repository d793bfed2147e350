//! Picks on the VM's `Session` stream, end to end natively: the fake host
//! does with [`Sessions`]' steps what the wasm host does, and the root's
//! deliveries reach the request through `Flow::on_pick_outcome`.

use kvasir_proto::v1::{session_request, session_response, SessionRequest, SessionResponse};

use super::*;
use crate::pick::NoPick;
use crate::session::{Answer, Delivery, TOKEN_BIT};

const ENDPOINT: &str = "x-gateway-destination-endpoint";

/// Sessions with a stream (token 3) open to the pool's indexer, as the
/// root opens it after a first (unary) pick.
fn open_stream() -> Rc<RefCell<Sessions<u32>>> {
    let sessions = Rc::new(RefCell::new(Sessions::default()));
    let mut s = sessions.borrow_mut();
    s.pick("indexer", b"", 40, || 0, || unreachable!());
    assert_eq!(s.upkeep(0).open, vec!["indexer".to_string()]);
    s.opened("indexer".into(), 3);
    drop(s);
    sessions
}

/// A routed chat request of tenant acme, known to the streams as
/// `waiter`, up to its pick.
fn routed(
    shared: &Rc<Shared>,
    sessions: &Rc<RefCell<Sessions<u32>>>,
    waiter: u32,
) -> (Flow, Fake, Verdict) {
    let mut flow = Flow::new(shared.clone());
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme")],
        &chat("qwen", false),
    );
    h.sessions = Some(Rc::clone(sessions));
    h.waiter = waiter;
    headers(&mut flow, &mut h);
    let v = body(&mut flow, &mut h);
    (flow, h, v)
}

/// The root hands a delivery to its request, as that request's context
/// (in a gRPC callback of the root's).
fn deliver(flow: &mut Flow, h: &mut Fake, d: Delivery<u32>) {
    h.cb = Cb::Grpc;
    flow.on_pick_outcome(h, d.token, d.outcome);
    h.cb = Cb::Idle;
}

fn answer(frame: &[u8], addr: &str) -> Vec<u8> {
    let id = SessionRequest::decode(frame).unwrap().id;
    SessionResponse {
        id,
        result: Some(session_response::Result::Pick(
            PickResponse::decode(pick_answer(&[addr], 0.25).as_slice()).unwrap(),
        )),
    }
    .encode_to_vec()
}

#[test]
fn a_pick_on_the_stream_is_answered_to_its_request() {
    let (shared, stats) = config(api_key(), json!({}));
    let sessions = open_stream();
    let (mut flow, mut h, v) = routed(&shared, &sessions, 1);
    assert_eq!(v, Verdict::Pause, "waits for the stream's answer");
    assert!(h.calls.is_empty(), "no unary call");
    let (stream, frame) = h.stream_sent.pop().unwrap();
    assert_eq!(stream, 3);
    let Some(session_request::Call::Pick(pick)) =
        SessionRequest::decode(frame.as_slice()).unwrap().call
    else {
        panic!("not a pick")
    };
    assert_eq!((pick.pool.as_str(), pick.tenant.as_str()), ("main", "acme"));
    // Another request's answer, or a unary token, is not this one's.
    grpc(
        &mut flow,
        &mut h,
        7,
        0,
        Some(pick_answer(&["10.0.0.9:1"], 0.1)),
    );
    assert!(!h.resumed);
    let a = answer(&frame, "127.0.0.1:9002");
    let Answer::Deliver(d) = sessions.borrow_mut().message(3, || Some(a)) else {
        panic!("not delivered")
    };
    assert_eq!(d.waiter, 1);
    assert_ne!(d.token & TOKEN_BIT, 0);
    let mut other = Delivery {
        token: d.token ^ 1,
        waiter: 1,
        outcome: d.outcome.clone(),
    };
    other.outcome.result = Err(NoPick::FailOpen(FailOpen::Timeout));
    deliver(&mut flow, &mut h, other);
    assert!(!h.resumed, "a token of another pick");
    deliver(&mut flow, &mut h, d);
    assert!(h.resumed);
    assert_eq!(h.header(ENDPOINT), Some("127.0.0.1:9002"));
    assert_eq!(stats.counter("kvasir.pool.main.pick.ok"), 1);
    assert_eq!(
        stats
            .gauges
            .borrow()
            .get("kvasir.pool.main.saturation_permille"),
        Some(&250)
    );
    assert_eq!(sessions.borrow().timer_need_ms(0), None, "nothing waits");
}

#[test]
fn a_stream_pick_past_its_timeout_fails_open() {
    let (shared, stats) = config(api_key(), json!({}));
    let sessions = open_stream();
    let (mut flow, mut h, v) = routed(&shared, &sessions, 1);
    assert_eq!(v, Verdict::Pause);
    let now = h.now.get();
    // The pool's indexerTimeoutMs is 40.
    assert!(sessions.borrow_mut().upkeep(now).deliver.is_empty());
    let mut up = sessions.borrow_mut().upkeep(now + 40 * 1_000_000);
    assert!(up.cancel.is_empty(), "one timeout is no stall");
    let d = up.deliver.pop().unwrap();
    assert_eq!(d.waiter, 1);
    deliver(&mut flow, &mut h, d);
    assert!(h.resumed);
    assert_eq!(h.header(ENDPOINT), None);
    assert_eq!(stats.counter("kvasir.pool.main.pick.timeout"), 1);
    assert_eq!(stats.counter("kvasir.pool.main.failopen"), 1);
    assert_eq!(stats.counter(&format!("{P}.failopen")), 1);
    // Its late answer is nobody's.
    let (_, frame) = h.stream_sent.pop().unwrap();
    let late = answer(&frame, "127.0.0.1:9002");
    assert_eq!(
        sessions.borrow_mut().message(3, || Some(late)),
        Answer::Unmatched
    );
}

#[test]
fn a_stream_that_ends_fails_its_requests_open_as_unavailable() {
    let (shared, stats) = config(api_key(), json!({}));
    let sessions = open_stream();
    let (mut f1, mut h1, _) = routed(&shared, &sessions, 1);
    let (mut f2, mut h2, _) = routed(&shared, &sessions, 2);
    let ended = sessions.borrow_mut().closed(3, 14, h1.now.get()).unwrap();
    assert_eq!(ended.cluster, "indexer");
    for d in ended.deliver {
        match d.waiter {
            1 => deliver(&mut f1, &mut h1, d),
            _ => deliver(&mut f2, &mut h2, d),
        }
    }
    for h in [&h1, &h2] {
        assert!(h.resumed);
        assert_eq!(h.header(ENDPOINT), None);
    }
    assert_eq!(stats.counter("kvasir.pool.main.pick.unavailable"), 2);
    // The next request's pick is a unary call (and wants the stream back).
    let (mut f3, mut h3, v) = routed(&shared, &sessions, 3);
    assert_eq!(v, Verdict::Pause);
    assert!(h3.stream_sent.is_empty());
    let (cluster, method, _, _) = h3.calls[0].clone();
    assert_eq!((cluster.as_str(), method.as_str()), ("indexer", "Pick"));
    grpc(
        &mut f3,
        &mut h3,
        7,
        0,
        Some(pick_answer(&["127.0.0.1:9001"], 0.1)),
    );
    assert_eq!(h3.header(ENDPOINT), Some("127.0.0.1:9001"));
    assert!(sessions.borrow().timer_need_ms(0).is_some());
}

#[test]
fn a_failed_send_cancels_the_stream_and_the_pick_goes_unary() {
    let (shared, stats) = config(api_key(), json!({}));
    let sessions = open_stream();
    let mut flow = Flow::new(shared.clone());
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme")],
        &chat("qwen", false),
    );
    h.sessions = Some(Rc::clone(&sessions));
    h.stream_send_ok = false;
    headers(&mut flow, &mut h);
    assert_eq!(body(&mut flow, &mut h), Verdict::Pause);
    assert_eq!(h.cancelled, vec![3]);
    assert_eq!(h.calls.len(), 1, "the pick went unary");
    grpc(
        &mut flow,
        &mut h,
        7,
        0,
        Some(pick_answer(&["127.0.0.1:9001"], 0.1)),
    );
    assert!(h.resumed);
    assert_eq!(h.header(ENDPOINT), Some("127.0.0.1:9001"));
    assert_eq!(stats.counter("kvasir.pool.main.pick.ok"), 1);
    assert_eq!(sessions.borrow().waiting(), 0);
    assert_eq!(
        sessions
            .borrow_mut()
            .message(3, || panic!("not our stream")),
        Answer::Ignore
    );
}

#[test]
fn with_sessions_off_the_pick_is_a_unary_call() {
    let (shared, _) = config(api_key(), json!({}));
    let sessions = open_stream();
    sessions.borrow_mut().set_enabled(false);
    let (_, h, v) = routed(&shared, &sessions, 1);
    assert_eq!(v, Verdict::Pause);
    assert!(h.stream_sent.is_empty());
    assert_eq!(h.calls.len(), 1);
}
