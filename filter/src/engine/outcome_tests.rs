//! Outcomes and reports through the engine: clients that go away,
//! trailers, pool-state polls, when reports are dispatched, and how an
//! engine's cut stream, 4xx and 5xx are reported.

use super::*;

#[test]
fn a_client_that_goes_away_is_accounted_as_cancelled() {
    let (mut flow, mut h, stats) = answered("200", true, b"data: {\"choices\":[{}]}\n\n");
    h.cb = Cb::Log;
    flow.on_log(&mut h);
    assert_eq!(stats.counter(&format!("{P}.responses.cancelled")), 1);
    let r = ReportRequest::decode(h.detached[0].2.as_slice()).unwrap();
    assert_eq!(r.outcome, kvasir_proto::v1::Outcome::Cancelled as i32);
    assert!(!stats
        .histograms
        .borrow()
        .contains_key(&format!("{P}.e2e_ms")));
}

#[test]
fn pool_state_polls_and_answers() {
    let set = json!({
        "tenantSource": {"header": "x-tenant"},
        "tenants": [{"name": "acme"}],
        "pools": [{"name": "main", "models": ["qwen"], "cluster": "pool", "indexerCluster": "indexer"}],
        "policies": [{"name": "shed", "match": {"poolState": {"pool": "main", "saturationAbove": 0.9}},
                      "action": {"shed": {"retryAfterS": 1}}}],
        "defaultAction": {"route": {"pool": "main"}}
    });
    let set = kvasir_policy::parse_json(&set.to_string()).unwrap();
    let cfg = PluginConfig::from_bytes(&kvasir_policy::compile(&set).unwrap().to_json()).unwrap();
    let stats = Rc::new(MemStats::default());
    let shared = Rc::new(Shared::new(cfg, stats.clone()));
    let polls = shared.pool_state_polls();
    assert_eq!(polls.len(), 1);
    assert_eq!(polls[0].0, "indexer");
    let answer = kvasir_proto::v1::PoolStateResponse {
        pool: "main".into(),
        pool_saturation: 0.95,
        endpoints: vec![kvasir_proto::v1::EndpointState {
            healthy: true,
            ..Default::default()
        }],
        ..Default::default()
    }
    .encode_to_vec();
    shared.on_pool_state(0, 0, Some(&answer), 1_000_000_000);
    assert_eq!(
        stats
            .gauges
            .borrow()
            .get("kvasir.pool.main.saturation_permille"),
        Some(&950)
    );
    // Now the shed policy holds (the fake clock is within poolStateMaxAgeMs).
    let mut flow = Flow::new(shared.clone());
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("x-tenant", "acme")],
        &chat("qwen", false),
    );
    headers(&mut flow, &mut h);
    body(&mut flow, &mut h);
    assert_eq!(reply_json(&h).0, 429);
    shared.on_pool_state(0, 14, None, 2_000_000_000);
    assert_eq!(stats.counter("kvasir.pool.main.state_poll.error"), 1);
    // An answer with no healthy endpoint (an indexer before its first
    // scrape) is not saturation: the learnt value stays.
    let cold = kvasir_proto::v1::PoolStateResponse {
        pool: "main".into(),
        pool_saturation: 1.0,
        endpoints: vec![kvasir_proto::v1::EndpointState::default()],
        ..Default::default()
    }
    .encode_to_vec();
    shared.on_pool_state(0, 0, Some(&cold), 2_000_000_000);
    assert_eq!(
        stats
            .gauges
            .borrow()
            .get("kvasir.pool.main.saturation_permille"),
        Some(&950)
    );
}

#[test]
fn a_body_ending_in_trailers_is_refused_not_forwarded_undecided() {
    let (shared, stats) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme")],
        &chat("blocked-model", false),
    );
    headers(&mut flow, &mut h);
    h.cb = Cb::ReqBody;
    let n = h.body.len();
    assert_eq!(flow.on_request_body(&mut h, n, false), Verdict::Pause);
    h.cb = Cb::ReqTrailers;
    assert_eq!(flow.on_request_trailers(&mut h), Verdict::Pause);
    let (status, j) = reply_json(&h);
    assert_eq!(
        (status, j["error"]["code"].as_str()),
        (400, Some("unsupported_trailers"))
    );
    assert_eq!(
        stats.counter("kvasir.tenant.acme.model.unknown.requests.invalid"),
        1
    );
}

#[test]
fn a_response_ending_in_trailers_is_complete() {
    let (shared, stats) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme")],
        &chat("qwen", false),
    );
    headers(&mut flow, &mut h);
    body(&mut flow, &mut h);
    grpc(&mut flow, &mut h, 7, 14, None);
    h.resp_headers = vec![
        (":status".into(), "200".into()),
        ("content-type".into(), "application/json".into()),
    ];
    h.cb = Cb::RespHeaders;
    flow.on_response_headers(&mut h, false);
    h.cb = Cb::RespBody;
    h.resp_chunk = br#"{"usage":{"prompt_tokens":2,"completion_tokens":1}}"#.to_vec();
    let n = h.resp_chunk.len();
    flow.on_response_body(&mut h, n, false);
    h.cb = Cb::Idle;
    assert_eq!(flow.on_response_trailers(&mut h), Verdict::Continue);
    h.cb = Cb::Log;
    flow.on_log(&mut h);
    assert_eq!(stats.counter(&format!("{P}.responses.2xx")), 1);
    assert_eq!(stats.counter(&format!("{P}.responses.cancelled")), 0);
    assert_eq!(stats.counter(&format!("{P}.completion_tokens")), 1);
}

/// A request on a host that defers detached calls, picked (to
/// 127.0.0.1:9001) and with its 200 response headers seen.
fn picked_and_answering(shared: &Rc<Shared>) -> (Flow, Fake) {
    let mut flow = Flow::new(shared.clone());
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme")],
        &chat("qwen", false),
    );
    h.defers = true;
    headers(&mut flow, &mut h);
    body(&mut flow, &mut h);
    grpc(
        &mut flow,
        &mut h,
        7,
        0,
        Some(pick_answer(&["127.0.0.1:9001"], 0.1)),
    );
    h.resp_headers = vec![
        (":status".into(), "200".into()),
        ("content-type".into(), "application/json".into()),
    ];
    h.cb = Cb::RespHeaders;
    assert_eq!(flow.on_response_headers(&mut h, false), Verdict::Continue);
    (flow, h)
}

#[test]
fn reports_wait_for_the_tick_or_the_streams_log_callback() {
    let (shared, stats) = config(api_key(), json!({"reportFirstToken": true}));
    let (mut flow, mut h) = picked_and_answering(&shared);
    let first = "{\"usage\":{\"prompt_tokens\":20,";
    h.cb = Cb::RespBody;
    h.resp_chunk = first.as_bytes().to_vec();
    assert_eq!(
        flow.on_response_body(&mut h, first.len(), false),
        Verdict::Continue
    );
    // The first byte's report is queued for the root, not dispatched ...
    assert!(h.detached.is_empty());
    assert_eq!(h.deferred.len(), 1);
    let phase = |m: &[u8]| ReportRequest::decode(m).unwrap().phase;
    assert_eq!(
        phase(&h.deferred[0].msg),
        kvasir_proto::v1::ReportPhase::FirstToken as i32
    );
    assert_eq!(
        (
            h.deferred[0].cluster.as_str(),
            h.deferred[0].method,
            h.deferred[0].pool_name.as_str()
        ),
        ("indexer", "Report", "main")
    );
    // ... the end of the response queues the done report behind it ...
    let rest = "\"completion_tokens\":2}}";
    h.resp_chunk = rest.as_bytes().to_vec();
    assert_eq!(
        flow.on_response_body(&mut h, rest.len(), true),
        Verdict::Continue
    );
    assert!(h.detached.is_empty());
    assert_eq!(h.deferred.len(), 2);
    // ... and the stream's log callback (after the response was written)
    // sends both, in order.
    h.cb = Cb::Log;
    flow.on_log(&mut h);
    assert!(h.deferred.is_empty());
    let phases: Vec<i32> = h.detached.iter().map(|(_, _, m)| phase(m)).collect();
    assert_eq!(
        phases,
        vec![
            kvasir_proto::v1::ReportPhase::FirstToken as i32,
            kvasir_proto::v1::ReportPhase::Done as i32
        ]
    );
    let done = ReportRequest::decode(h.detached[1].2.as_slice()).unwrap();
    assert_eq!(
        (done.request_id.as_str(), done.endpoint.as_str()),
        (GATEWAY_ID, "127.0.0.1:9001")
    );
    assert_eq!(done.outcome, kvasir_proto::v1::Outcome::Success as i32);
    assert_eq!(stats.counter("kvasir.pool.main.report.sent"), 2);
}

/// A pool whose flow control counts queued prefill work gets first-token
/// reports with the shared setting off; other pools do not.
#[test]
fn a_pool_counting_prefill_work_reports_first_tokens() {
    let first = "{\"usage\":";
    let phases = |pool_extra: Value| {
        let (shared, _) = config_with_pool(api_key(), json!({}), pool_extra);
        let (mut flow, mut h) = picked_and_answering(&shared);
        h.cb = Cb::RespBody;
        h.resp_chunk = first.as_bytes().to_vec();
        flow.on_response_body(&mut h, first.len(), false);
        h.deferred
            .iter()
            .map(|d| ReportRequest::decode(d.msg.as_slice()).unwrap().phase)
            .collect::<Vec<_>>()
    };
    let work = json!({"flowControl": {"enabled": true, "saturatedPrefillTokens": 65536}});
    assert_eq!(
        phases(work),
        vec![kvasir_proto::v1::ReportPhase::FirstToken as i32]
    );
    let requests_only = json!({"flowControl": {"enabled": true}});
    assert!(phases(requests_only).is_empty());
    assert!(phases(json!({})).is_empty());
}

#[test]
fn a_new_request_sends_the_reports_still_queued_before_it_is_picked() {
    let (shared, stats) = config(api_key(), json!({"reportFirstToken": true}));
    let (mut flow, mut h) = picked_and_answering(&shared);
    let first = "{\"usage\":";
    h.cb = Cb::RespBody;
    h.resp_chunk = first.as_bytes().to_vec();
    assert_eq!(
        flow.on_response_body(&mut h, first.len(), false),
        Verdict::Continue
    );
    assert_eq!(
        h.deferred.len(),
        1,
        "the first-token report waits for the tick"
    );
    // Another request on this VM arrives before the tick (its host shares
    // the VM's queue): its headers send the queued report first.
    let mut next = Flow::new(shared.clone());
    let mut h2 = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme")],
        &chat("qwen", false),
    );
    h2.defers = true;
    h2.deferred = std::mem::take(&mut h.deferred);
    headers(&mut next, &mut h2);
    assert!(h2.deferred.is_empty());
    assert_eq!(h2.detached.len(), 1);
    assert_eq!(h2.detached[0].1, "Report");
    assert!(h2.calls.is_empty(), "the pick comes after, with the body");
    assert_eq!(stats.counter("kvasir.pool.main.report.sent"), 1);
}

/// A chat request picked (to 127.0.0.1:9001) whose response started with
/// `status` and one body chunk, `stream` deciding SSE or JSON.
fn answered(status: &str, stream: bool, chunk: &[u8]) -> (Flow, Fake, Rc<MemStats>) {
    let (shared, stats) = config(api_key(), json!({}));
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme")],
        &chat("qwen", stream),
    );
    headers(&mut flow, &mut h);
    body(&mut flow, &mut h);
    grpc(
        &mut flow,
        &mut h,
        7,
        0,
        Some(pick_answer(&["127.0.0.1:9001"], 0.1)),
    );
    let ct = if stream {
        "text/event-stream"
    } else {
        "application/json"
    };
    h.resp_headers = vec![
        (":status".into(), status.into()),
        ("content-type".into(), ct.into()),
    ];
    h.cb = Cb::RespHeaders;
    flow.on_response_headers(&mut h, false);
    h.cb = Cb::RespBody;
    h.resp_chunk = chunk.to_vec();
    flow.on_response_body(&mut h, chunk.len(), !stream);
    (flow, h, stats)
}

/// An engine that dies mid-stream: Envoy cannot retry once bytes flowed, so
/// the stream is counted as cut (not as a client that went away) and
/// reported as an error, which the indexer counts against the engine.
#[test]
fn a_stream_cut_by_the_upstream_is_counted_and_reported_as_an_error() {
    for (details, class, outcome) in [
        (
            Some("upstream_reset_after_response_started{remote_reset}"),
            "cut",
            kvasir_proto::v1::Outcome::Error,
        ),
        (
            Some("downstream_remote_disconnect"),
            "cancelled",
            kvasir_proto::v1::Outcome::Cancelled,
        ),
        (None, "cancelled", kvasir_proto::v1::Outcome::Cancelled),
    ] {
        let (mut flow, mut h, stats) = answered("200", true, b"data: {\"choices\":[{}]}\n\n");
        h.cb = Cb::Log;
        h.code_details = details.map(str::to_string);
        flow.on_log(&mut h);
        assert_eq!(
            stats.counter(&format!("{P}.responses.{class}")),
            1,
            "{details:?}"
        );
        let r = ReportRequest::decode(h.detached[0].2.as_slice()).unwrap();
        assert_eq!(r.outcome, outcome as i32, "{details:?}");
    }
}

/// A 4xx from the engine is the request's fault: reported as a client
/// error, which the indexer never counts against the engine; a 5xx is an
/// error.
#[test]
fn engine_4xx_is_reported_as_a_client_error_and_5xx_as_an_error() {
    for (status, outcome) in [
        ("400", kvasir_proto::v1::Outcome::ClientError),
        ("404", kvasir_proto::v1::Outcome::ClientError),
        ("500", kvasir_proto::v1::Outcome::Error),
        ("503", kvasir_proto::v1::Outcome::Error),
    ] {
        let (mut flow, mut h, _) = answered(status, false, br#"{"error":{"message":"x"}}"#);
        h.cb = Cb::Log;
        flow.on_log(&mut h);
        let r = ReportRequest::decode(h.detached[0].2.as_slice()).unwrap();
        assert_eq!(r.outcome, outcome as i32, "{status}");
    }
}
