//! A request whose pick fails open: held to this Envoy's share of its
//! tenant's budget, reported as admitted locally, refused when bound to a
//! stored response; and the ids and usage the indexer is told.

use kvasir_proto::v1::{Admission, Outcome, ReportPhase};
use serde_json::json;

use super::budget::{budgeted, picked_stream, reports, request};
use super::*;
use crate::host::MemShared;

/// A budgeted request of `acme` (at most 4 in flight) whose pick fails
/// open, on a VM of the process whose shared data is `shared`.
fn failed_open(shared: &Rc<Shared>, data: &MemShared) -> (Flow, Fake) {
    let (mut flow, mut h) = request(
        shared,
        "key-acme",
        "/v1/chat/completions",
        &chat("qwen", false),
    );
    h.shared = Some(data.same_process());
    grpc(&mut flow, &mut h, 7, 14, None);
    (flow, h)
}

fn finish(flow: &mut Flow, h: &mut Fake) {
    respond(
        flow,
        h,
        200,
        "application/json",
        &[r#"{"usage":{"prompt_tokens":9,"completion_tokens":3}}"#],
    );
}

#[test]
fn failed_open_requests_stay_within_the_tenants_concurrency() {
    let (shared, stats) = budgeted(json!({}));
    let data = MemShared::default();
    let mut open = Vec::new();
    for _ in 0..4 {
        let (flow, h) = failed_open(&shared, &data);
        assert!(h.resumed, "within the limit");
        open.push((flow, h));
    }
    let (_, h) = failed_open(&shared, &data);
    assert!(!h.resumed, "the fifth is refused");
    let (status, body) = reply_json(&h);
    assert_eq!(status, 429);
    assert_eq!(body["error"]["code"], "rate_limit_exceeded");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("concurrent requests"),
        "{body}"
    );
    assert_eq!(
        stats.counter(&format!("{P}.local_budget.limited.concurrent")),
        1
    );
    // Its end says the filter refused it without the pick's answer.
    let r = reports(&h);
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].outcome, r[0].admission),
        (Outcome::Rejected as i32, Admission::Local as i32)
    );
    // One ends: room for another.
    let (mut flow, mut h) = open.pop().unwrap();
    finish(&mut flow, &mut h);
    let done = reports(&h).pop().unwrap();
    assert_eq!(
        (done.phase, done.admission, done.budget_key.as_str()),
        (ReportPhase::Done as i32, Admission::Local as i32, "acme")
    );
    assert_eq!(
        (done.prompt_tokens, done.completion_tokens),
        (9, 3),
        "the indexer charges what was used"
    );
    let (_, h) = failed_open(&shared, &data);
    assert!(h.resumed);
    assert_eq!(stats.counter(&format!("{P}.local_budget.admitted")), 5);
}

#[test]
fn each_envoy_takes_its_share_of_the_limits() {
    let (shared, _) = budgeted(json!({}));
    let mut doc: Value = serde_json::from_slice(&shared.config.policy.to_json()).unwrap();
    doc["gatewayReplicas"] = json!(2);
    let bytes = serde_json::to_vec(&json!({"policy": doc, "filter": {}})).unwrap();
    let cfg = PluginConfig::from_bytes(&bytes).unwrap();
    assert_eq!(cfg.policy.gateway_replicas(), 2);
    let shared = Rc::new(Shared::new(cfg, Rc::new(MemStats::default())));
    let data = MemShared::default();
    let admitted = (0..4)
        .filter(|_| failed_open(&shared, &data).1.resumed)
        .count();
    assert_eq!(admitted, 2, "4 in flight divided by 2 replicas");
}

#[test]
fn without_shared_data_the_request_goes_on_and_is_counted() {
    let (shared, stats) = budgeted(json!({}));
    let (mut flow, mut h) = request(
        &shared,
        "key-acme",
        "/v1/chat/completions",
        &chat("qwen", false),
    );
    grpc(&mut flow, &mut h, 7, 14, None);
    assert!(h.resumed);
    assert_eq!(stats.counter(&format!("{P}.local_budget.unavailable")), 1);
}

#[test]
fn the_clients_request_id_is_never_the_accounting_id() {
    let (shared, _) = budgeted(json!({}));
    let ids: Vec<String> = (0..3)
        .map(|_| {
            let (_, h) = request(
                &shared,
                "key-acme",
                "/v1/chat/completions",
                &chat("qwen", false),
            );
            assert_eq!(
                h.header("x-request-id"),
                Some("req-1"),
                "the same client id"
            );
            let (_, _, msg, _) = h.calls.last().unwrap();
            PickRequest::decode(msg.as_slice()).unwrap().request_id
        })
        .collect();
    assert_eq!(ids[0], GATEWAY_ID);
    assert!(ids[0] != ids[1] && ids[1] != ids[2], "{ids:?}");
}

#[test]
fn an_abandoned_stream_is_charged_the_tokens_it_was_sent() {
    let (shared, stats) = budgeted(json!({}));
    let (mut flow, mut h) = picked_stream(&shared, "key-acme");
    h.resp_headers = vec![
        (":status".into(), "200".into()),
        ("content-type".into(), "text/event-stream".into()),
    ];
    h.cb = Cb::RespHeaders;
    flow.on_response_headers(&mut h, false);
    for _ in 0..100 {
        h.cb = Cb::RespBody;
        h.resp_chunk = b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n".to_vec();
        let n = h.resp_chunk.len();
        flow.on_response_body(&mut h, n, false);
    }
    // The client goes away: no usage chunk, no end of stream.
    h.cb = Cb::Log;
    flow.on_log(&mut h);
    let done = reports(&h).pop().unwrap();
    assert_eq!(done.phase, ReportPhase::Done as i32);
    assert_eq!(done.outcome, Outcome::Cancelled as i32);
    assert_eq!(done.completion_tokens, 100, "the content events sent");
    assert!(done.prompt_tokens > 0, "the prompt as counted");
    assert_eq!(stats.counter(&format!("{P}.completion_tokens")), 100);
}
