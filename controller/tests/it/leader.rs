//! Leader election against kube-rs' mock API server: every request the
//! replicas make is checked (method, path, body) and answered with real API
//! JSON, Leases and `Status` failures alike.

use std::future::Future;
use std::time::Duration;

use http::{Method, Request, Response};
use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::client::Body;
use kube::{Api, Client};
use kvasir_controller::leader::{self, LeaseConfig};
use serde_json::{json, Value};
use tokio::sync::{oneshot, watch};
use tokio::time::{timeout, Instant};
use tower_test::mock::{self, Handle, SendResponse};

type ApiHandle = Handle<Request<Body>, Response<Body>>;
type Responder = SendResponse<Response<Body>>;

const NS: &str = "kvasir-system";
const NAME: &str = "kvasir-controller";
const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/kvasir-system/leases";
const LEASE: &str =
    "/apis/coordination.k8s.io/v1/namespaces/kvasir-system/leases/kvasir-controller";
/// Bounds every wait; far above anything a passing test needs.
const PATIENCE: Duration = Duration::from_secs(30);

fn replica(identity: &str) -> (Api<Lease>, LeaseConfig, ApiHandle) {
    let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(svc, "default");
    (
        Api::namespaced(client, NS),
        LeaseConfig::new(NS, NAME, identity),
        handle,
    )
}

/// The fixed clock of the `try_once` tests: T0 + `secs`.
fn at(secs: i64) -> Timestamp {
    let t0: Timestamp = "2026-03-04T05:06:07.123456Z"
        .parse()
        .expect("valid timestamp");
    t0 + SignedDuration::from_secs(secs)
}

/// A time as the API server writes it (MicroTime: six fractional digits).
fn stamp(time: Timestamp) -> Value {
    serde_json::to_value(MicroTime(time)).expect("MicroTime serializes")
}

/// A Lease as the API server returns it.
fn lease(holder: &str, renewed: Timestamp, duration: i32, transitions: i32, rv: &str) -> Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": NAME,
            "namespace": NS,
            "uid": "7c0a6f0e-3b52-4c1e-9d0b-2f1a52b9e0c4",
            "resourceVersion": rv,
            "creationTimestamp": "2026-03-04T05:00:00Z"
        },
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": duration,
            "acquireTime": stamp(renewed),
            "renewTime": stamp(renewed),
            "leaseTransitions": transitions
        }
    })
}

/// The object the API server stores from a write: what was sent, at a new version.
fn stored(body: &Value, rv: &str) -> Value {
    let mut object = body.clone();
    object["metadata"]["resourceVersion"] = json!(rv);
    object["metadata"]["uid"] = json!("7c0a6f0e-3b52-4c1e-9d0b-2f1a52b9e0c4");
    object
}

fn failure(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code
    })
}

fn not_found() -> Value {
    failure(
        404,
        "NotFound",
        "leases.coordination.k8s.io \"kvasir-controller\" not found",
    )
}

fn conflict() -> Value {
    failure(
        409,
        "Conflict",
        "Operation cannot be fulfilled on leases.coordination.k8s.io \"kvasir-controller\": the object has been modified; please apply your changes to the latest version and try again",
    )
}

/// The next request, which must be `method` on `path`; its JSON body (Null if empty).
async fn expect(handle: &mut ApiHandle, method: Method, path: &str) -> (Value, Responder) {
    let (request, respond) = timeout(PATIENCE, handle.next_request())
        .await
        .unwrap_or_else(|_| panic!("no {method} {path} came"))
        .expect("client alive");
    assert_eq!(request.method(), method, "method of the request to {path}");
    assert_eq!(request.uri().path(), path);
    let bytes = request
        .into_body()
        .collect_bytes()
        .await
        .expect("request body");
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).expect("JSON request body")
    };
    (body, respond)
}

fn answer(respond: Responder, code: u16, body: &Value) {
    let response = Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::from(serde_json::to_vec(body).expect("JSON")))
        .expect("response");
    respond.send_response(response);
}

/// GET answered with `body` (a Lease, or 404 when `None`).
async fn get(handle: &mut ApiHandle, body: Option<Value>) {
    let (_, respond) = expect(handle, Method::GET, LEASE).await;
    match body {
        Some(lease) => answer(respond, 200, &lease),
        None => answer(respond, 404, &not_found()),
    }
}

/// Runs `round` against the mock while `scenario` plays the API server.
async fn with_server<T>(round: impl Future<Output = T>, scenario: impl Future<Output = ()>) -> T {
    timeout(PATIENCE, async { tokio::join!(round, scenario).0 })
        .await
        .expect("round finished in time")
}

fn spec(body: &Value) -> &Value {
    &body["spec"]
}

/// A lease write names its holder, when it took the lease, when it last
/// renewed it, and how many handovers came before.
fn assert_holds(
    body: &Value,
    holder: &str,
    acquired: Timestamp,
    renewed: Timestamp,
    transitions: i32,
) {
    let spec = spec(body);
    assert_eq!(spec["holderIdentity"], holder);
    assert_eq!(spec["acquireTime"], stamp(acquired));
    assert_eq!(spec["renewTime"], stamp(renewed));
    assert_eq!(spec["leaseTransitions"], transitions);
}

/// The client sent nothing more: the mock's stream ends (every sender of
/// requests is gone) without one.
async fn no_more_requests(handle: &mut ApiHandle, why: &str) {
    let more = timeout(PATIENCE, handle.next_request())
        .await
        .expect("mock closes");
    assert!(more.is_none(), "{why}");
}

#[tokio::test]
async fn first_replica_creates_the_lease_and_leads() {
    let (api, cfg, mut handle) = replica("pod-a");
    let leads = with_server(leader::try_once(&api, &cfg, at(0)), async {
        get(&mut handle, None).await;
        let (body, respond) = expect(&mut handle, Method::POST, LEASES).await;
        assert_eq!(body["metadata"]["name"], NAME);
        assert_eq!(body["metadata"]["namespace"], NS);
        assert_holds(&body, "pod-a", at(0), at(0), 0);
        assert_eq!(spec(&body)["leaseDurationSeconds"], 15);
        answer(respond, 201, &stored(&body, "1"));
    })
    .await;
    assert!(leads.expect("no API error"));
}

#[tokio::test]
async fn second_replica_follows_a_fresh_lease_without_writing() {
    let (api, cfg, mut handle) = replica("pod-b");
    let leads = with_server(leader::try_once(&api, &cfg, at(5)), async {
        get(&mut handle, Some(lease("pod-a", at(0), 15, 0, "1"))).await;
    })
    .await;
    assert!(!leads.expect("no API error"));
    // Every request the client could have made has been made: none was a write.
    drop(api);
    no_more_requests(&mut handle, "a follower must not write").await;
}

#[tokio::test]
async fn leader_renews_keeping_acquire_time_and_transitions() {
    let (api, cfg, mut handle) = replica("pod-a");
    let leads = with_server(leader::try_once(&api, &cfg, at(2)), async {
        get(&mut handle, Some(lease("pod-a", at(0), 15, 3, "41"))).await;
        let (body, respond) = expect(&mut handle, Method::PUT, LEASE).await;
        assert_eq!(
            body["metadata"]["resourceVersion"], "41",
            "the PUT must be conditional"
        );
        assert_holds(&body, "pod-a", at(0), at(2), 3);
        answer(respond, 200, &stored(&body, "42"));
    })
    .await;
    assert!(leads.expect("no API error"));
}

#[tokio::test]
async fn leader_change_when_the_holder_stops_renewing() {
    let (api_a, cfg_a, mut a) = replica("pod-a");
    let (api_b, cfg_b, mut b) = replica("pod-b");

    // pod-a creates the lease at T0.
    let created = with_server(leader::try_once(&api_a, &cfg_a, at(0)), async {
        get(&mut a, None).await;
        let (body, respond) = expect(&mut a, Method::POST, LEASES).await;
        answer(respond, 201, &stored(&body, "1"));
    })
    .await;
    assert!(created.expect("no API error"));
    let held_by_a = lease("pod-a", at(0), 15, 0, "1");

    // pod-b, while the lease is fresh, follows.
    let b_leads = with_server(
        leader::try_once(&api_b, &cfg_b, at(5)),
        get(&mut b, Some(held_by_a.clone())),
    )
    .await;
    assert!(!b_leads.expect("no API error"));

    // pod-a stops renewing; 16 s after its last renewal the lease has expired
    // and pod-b takes it over.
    let b_leads = with_server(leader::try_once(&api_b, &cfg_b, at(16)), async {
        get(&mut b, Some(held_by_a.clone())).await;
        let (body, respond) = expect(&mut b, Method::PUT, LEASE).await;
        assert_eq!(body["metadata"]["resourceVersion"], "1");
        assert_holds(&body, "pod-b", at(16), at(16), 1);
        assert_eq!(spec(&body)["leaseDurationSeconds"], 15);
        answer(respond, 200, &stored(&body, "2"));
    })
    .await;
    assert!(b_leads.expect("no API error"));

    // pod-a comes back: it sees pod-b's fresh lease and does not lead.
    let a_leads = with_server(
        leader::try_once(&api_a, &cfg_a, at(17)),
        get(&mut a, Some(lease("pod-b", at(16), 15, 1, "2"))),
    )
    .await;
    assert!(!a_leads.expect("no API error"));
}

#[tokio::test]
async fn old_leader_renewing_from_a_stale_read_gets_409_and_does_not_lead() {
    let (api, cfg, mut handle) = replica("pod-a");
    let leads = with_server(leader::try_once(&api, &cfg, at(17)), async {
        // Read before pod-b's takeover landed.
        get(&mut handle, Some(lease("pod-a", at(0), 15, 0, "1"))).await;
        let (body, respond) = expect(&mut handle, Method::PUT, LEASE).await;
        assert_eq!(body["metadata"]["resourceVersion"], "1");
        answer(respond, 409, &conflict());
    })
    .await;
    assert!(!leads.expect("a conflict is a lost round, not an error"));
}

#[tokio::test]
async fn racing_takeovers_exactly_one_wins() {
    let (api_a, cfg_a, mut a) = replica("pod-a");
    let (api_b, cfg_b, mut b) = replica("pod-b");
    let expired = lease("pod-old", at(-30), 15, 4, "7");
    let (a_leads, b_leads) = with_server(
        async {
            tokio::join!(
                leader::try_once(&api_a, &cfg_a, at(0)),
                leader::try_once(&api_b, &cfg_b, at(0))
            )
        },
        async {
            get(&mut a, Some(expired.clone())).await;
            get(&mut b, Some(expired.clone())).await;
            let (body_a, respond_a) = expect(&mut a, Method::PUT, LEASE).await;
            let (body_b, respond_b) = expect(&mut b, Method::PUT, LEASE).await;
            for (body, who) in [(&body_a, "pod-a"), (&body_b, "pod-b")] {
                assert_eq!(body["metadata"]["resourceVersion"], "7");
                assert_eq!(spec(body)["holderIdentity"], who);
                assert_eq!(spec(body)["leaseTransitions"], 5);
            }
            // Both wrote against version 7: the API server lets one through.
            answer(respond_a, 200, &stored(&body_a, "8"));
            answer(respond_b, 409, &conflict());
        },
    )
    .await;
    assert!(a_leads.expect("no API error"));
    assert!(!b_leads.expect("the loser follows"));
}

#[tokio::test]
async fn racing_creates_exactly_one_wins() {
    let (api_a, cfg_a, mut a) = replica("pod-a");
    let (api_b, cfg_b, mut b) = replica("pod-b");
    let (a_leads, b_leads) = with_server(
        async {
            tokio::join!(
                leader::try_once(&api_a, &cfg_a, at(0)),
                leader::try_once(&api_b, &cfg_b, at(0))
            )
        },
        async {
            get(&mut a, None).await;
            get(&mut b, None).await;
            let (body_a, respond_a) = expect(&mut a, Method::POST, LEASES).await;
            let (_, respond_b) = expect(&mut b, Method::POST, LEASES).await;
            answer(respond_a, 201, &stored(&body_a, "1"));
            answer(
                respond_b,
                409,
                &failure(
                    409,
                    "AlreadyExists",
                    "leases.coordination.k8s.io \"kvasir-controller\" already exists",
                ),
            );
        },
    )
    .await;
    assert!(a_leads.expect("no API error"));
    assert!(!b_leads.expect("the loser follows"));
}

#[tokio::test]
async fn lease_deleted_under_a_renewal_is_a_lost_round() {
    let (api, cfg, mut handle) = replica("pod-a");
    let leads = with_server(leader::try_once(&api, &cfg, at(2)), async {
        get(&mut handle, Some(lease("pod-a", at(0), 15, 0, "1"))).await;
        let (_, respond) = expect(&mut handle, Method::PUT, LEASE).await;
        answer(respond, 404, &not_found());
    })
    .await;
    assert!(!leads.expect("no API error"));
}

#[tokio::test]
async fn released_lease_is_taken_at_once() {
    let (api, cfg, mut handle) = replica("pod-b");
    let leads = with_server(leader::try_once(&api, &cfg, at(0)), async {
        let mut released = lease("", at(0), 1, 2, "9");
        released["spec"]["holderIdentity"] = json!("");
        get(&mut handle, Some(released)).await;
        let (body, respond) = expect(&mut handle, Method::PUT, LEASE).await;
        assert_eq!(spec(&body)["holderIdentity"], "pod-b");
        assert_eq!(spec(&body)["leaseTransitions"], 3);
        assert_eq!(spec(&body)["leaseDurationSeconds"], 15);
        answer(respond, 200, &stored(&body, "10"));
    })
    .await;
    assert!(leads.expect("no API error"));
}

#[tokio::test]
async fn server_errors_are_returned() {
    let (api, cfg, mut handle) = replica("pod-a");
    let result = with_server(leader::try_once(&api, &cfg, at(0)), async {
        let (_, respond) = expect(&mut handle, Method::GET, LEASE).await;
        answer(
            respond,
            500,
            &failure(500, "InternalError", "etcdserver: request timed out"),
        );
    })
    .await;
    assert!(
        result.is_err(),
        "a 500 is neither leading nor following: {result:?}"
    );
}

// `run`, on tokio's paused clock: sleeps and deadlines advance instantly
// once every task waits, so seconds-long timings run in milliseconds. The
// API server's answers carry real wall-clock times, as `run` writes them.

fn spawn_run(
    identity: &str,
) -> (
    ApiHandle,
    watch::Receiver<bool>,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let (svc, handle) = mock::pair::<Request<Body>, Response<Body>>();
    let client = Client::new(svc, "default");
    let (leading_tx, leading) = watch::channel(false);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(leader::run(
        client,
        LeaseConfig::new(NS, NAME, identity),
        leading_tx,
        async {
            // A dropped sender stops the replica too.
            let _ = stopped.await;
        },
    ));
    (handle, leading, stop, task)
}

/// `run` returns, without a panic.
async fn returns(task: tokio::task::JoinHandle<()>) {
    timeout(PATIENCE, task)
        .await
        .expect("run returns")
        .expect("run did not panic");
}

async fn becomes(leading: &mut watch::Receiver<bool>, value: bool) {
    timeout(PATIENCE, leading.wait_for(|now| *now == value))
        .await
        .unwrap_or_else(|_| panic!("leading never became {value}"))
        .expect("run alive");
}

/// pod-a's `run` creates the lease and leads; returns when it does.
async fn lead(handle: &mut ApiHandle, leading: &mut watch::Receiver<bool>) -> Instant {
    get(handle, None).await;
    let (body, respond) = expect(handle, Method::POST, LEASES).await;
    let written = Instant::now();
    assert_eq!(spec(&body)["holderIdentity"], "pod-a");
    answer(respond, 201, &stored(&body, "1"));
    becomes(leading, true).await;
    written
}

#[tokio::test(start_paused = true)]
async fn run_steps_down_within_the_renew_deadline_when_renewals_fail() {
    let (mut handle, mut leading, stop, task) = spawn_run("pod-a");
    let written = lead(&mut handle, &mut leading).await;
    // Every renewal after that fails.
    let stepped_down = async {
        loop {
            let (_, respond) = expect(&mut handle, Method::GET, LEASE).await;
            answer(
                respond,
                500,
                &failure(500, "InternalError", "etcdserver: request timed out"),
            );
        }
    };
    tokio::select! {
        () = becomes(&mut leading, false) => {}
        () = stepped_down => unreachable!("the scenario loops"),
    }
    let led_for = written.elapsed();
    // 10 s renew deadline: down by then, so before the 15 s lease can expire
    // for anyone else; and not long before, since renewals were retried.
    assert!(
        led_for <= Duration::from_secs(10),
        "led {led_for:?} without renewing"
    );
    assert!(
        led_for >= Duration::from_secs(8),
        "gave up after {led_for:?}"
    );
    drop(stop);
    // Shutdown tries to release the lease it may still hold.
    get(
        &mut handle,
        Some(lease("pod-a", Timestamp::now(), 15, 0, "1")),
    )
    .await;
    let (body, respond) = expect(&mut handle, Method::PUT, LEASE).await;
    assert_eq!(spec(&body)["holderIdentity"], "");
    answer(respond, 200, &stored(&body, "2"));
    returns(task).await;
}

#[tokio::test(start_paused = true)]
async fn run_steps_down_at_the_deadline_when_the_api_server_hangs() {
    let (mut handle, mut leading, stop, task) = spawn_run("pod-a");
    let written = lead(&mut handle, &mut leading).await;
    // The renewal's GET is never answered.
    let (_, unanswered) = expect(&mut handle, Method::GET, LEASE).await;
    becomes(&mut leading, false).await;
    let led_for = written.elapsed();
    assert!(
        led_for <= Duration::from_secs(10),
        "led {led_for:?} without renewing"
    );
    drop(unanswered);
    drop(stop);
    drop(handle);
    returns(task).await;
}

#[tokio::test(start_paused = true)]
async fn run_renews_while_leading_and_releases_the_lease_on_shutdown() {
    let (mut handle, mut leading, stop, task) = spawn_run("pod-a");
    let written = lead(&mut handle, &mut leading).await;

    // A renewal every retry period.
    get(
        &mut handle,
        Some(lease("pod-a", Timestamp::now(), 15, 0, "1")),
    )
    .await;
    let (body, respond) = expect(&mut handle, Method::PUT, LEASE).await;
    assert_eq!(written.elapsed(), Duration::from_secs(2));
    assert_eq!(body["metadata"]["resourceVersion"], "1");
    assert_eq!(spec(&body)["holderIdentity"], "pod-a");
    answer(respond, 200, &stored(&body, "2"));
    assert!(*leading.borrow());

    stop.send(()).expect("run alive");
    becomes(&mut leading, false).await;
    get(&mut handle, Some(stored(&body, "2"))).await;
    let (body, respond) = expect(&mut handle, Method::PUT, LEASE).await;
    // Stopped writing before handing the lease over.
    assert!(!*leading.borrow());
    assert_eq!(body["metadata"]["resourceVersion"], "2");
    let spec = spec(&body);
    assert_eq!(spec["holderIdentity"], "", "released, as client-go does");
    assert_eq!(spec["leaseDurationSeconds"], 1);
    assert_eq!(spec["leaseTransitions"], 0);
    answer(respond, 200, &stored(&body, "3"));
    returns(task).await;
}

#[tokio::test(start_paused = true)]
async fn run_follower_takes_a_released_lease_on_its_next_round() {
    let (mut handle, mut leading, stop, task) = spawn_run("pod-b");
    get(
        &mut handle,
        Some(lease("pod-a", Timestamp::now(), 15, 0, "5")),
    )
    .await;
    // Following: the next round comes a retry period later, with no write.
    let (_, respond) = expect(&mut handle, Method::GET, LEASE).await;
    let followed_at = Instant::now();
    assert!(!*leading.borrow());
    let mut released = lease("", Timestamp::now(), 1, 0, "6");
    released["spec"]["holderIdentity"] = json!("");
    answer(respond, 200, &released);
    let (body, respond) = expect(&mut handle, Method::PUT, LEASE).await;
    assert_eq!(
        followed_at.elapsed(),
        Duration::ZERO,
        "no waiting out a released lease"
    );
    assert_eq!(body["metadata"]["resourceVersion"], "6");
    assert_eq!(spec(&body)["holderIdentity"], "pod-b");
    assert_eq!(spec(&body)["leaseTransitions"], 1);
    answer(respond, 200, &stored(&body, "7"));
    becomes(&mut leading, true).await;

    stop.send(()).expect("run alive");
    becomes(&mut leading, false).await;
    get(&mut handle, Some(stored(&body, "7"))).await;
    let (body, respond) = expect(&mut handle, Method::PUT, LEASE).await;
    assert_eq!(spec(&body)["holderIdentity"], "");
    answer(respond, 200, &stored(&body, "8"));
    returns(task).await;
}

#[tokio::test(start_paused = true)]
async fn run_follower_does_not_write_or_release() {
    let (mut handle, leading, stop, task) = spawn_run("pod-b");
    for _ in 0..3 {
        get(
            &mut handle,
            Some(lease("pod-a", Timestamp::now(), 15, 0, "5")),
        )
        .await;
    }
    assert!(!*leading.borrow());
    stop.send(()).expect("run alive");
    returns(task).await;
    no_more_requests(&mut handle, "a follower must not write, even on shutdown").await;
}
