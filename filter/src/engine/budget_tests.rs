//! Budgets and flow control through the request flow: what the pick
//! carries and how long it may take, the 429s of refused picks with their
//! headers and rejected reports, the `x-ratelimit-*` headers of admitted
//! responses, and the `USAGE` reports of a streaming response.

use kvasir_proto::v1::{BudgetStatus, LimitedBy, Outcome, ReportPhase};

use super::*;

/// The test policy set with a budget on tenant acme (beta has none), the
/// pool's queue wait and acme's weight set in the compiled document.
pub(super) fn budgeted(settings: Value) -> (Rc<Shared>, Rc<MemStats>) {
    let set = json!({
        "tenantSource": api_key(),
        "tenants": [
            {"name": "acme", "apiKeyHashes": [key_hash("key-acme")],
             "budget": {"tokensPerMinute": 6000, "requestsPerMinute": 60, "maxConcurrent": 4}},
            {"name": "beta", "apiKeyHashes": [key_hash("key-beta")]}
        ],
        "pools": [{"name": "main", "models": ["qwen"], "cluster": "pool", "indexerCluster": "indexer", "indexerTimeoutMs": 40}],
        "policies": [],
        "defaultAction": {"route": {"pool": "main"}}
    });
    let set = kvasir_policy::parse_json(&set.to_string()).unwrap();
    let mut doc: Value =
        serde_json::from_slice(&kvasir_policy::compile(&set).unwrap().to_json()).unwrap();
    doc["pools"][0]["maxQueueWaitMs"] = json!(2000);
    for t in doc["tenants"].as_array_mut().unwrap() {
        if t["name"] == "acme" {
            t["weight"] = json!(5);
        }
    }
    let bytes = serde_json::to_vec(&json!({"policy": doc, "filter": settings})).unwrap();
    let cfg = PluginConfig::from_bytes(&bytes).unwrap();
    let stats = Rc::new(MemStats::default());
    let s: Rc<dyn Stats> = stats.clone();
    (Rc::new(Shared::new(cfg, s)), stats)
}

pub(super) fn request(shared: &Rc<Shared>, key: &str, path: &str, body_json: &str) -> (Flow, Fake) {
    let mut flow = Flow::new(shared.clone());
    let auth = format!("Bearer {key}");
    let mut h = Fake::new(path, &[("authorization", &auth)], body_json);
    headers(&mut flow, &mut h);
    assert_eq!(
        body(&mut flow, &mut h),
        Verdict::Pause,
        "waits for its pick"
    );
    (flow, h)
}

fn status(limited_by: &str) -> BudgetStatus {
    // Both, as an indexer writes them while the words are on the wire.
    BudgetStatus {
        limited_by: limited_by.into(),
        refused_by: LimitedBy::from_label(limited_by) as i32,
        retry_after_ms: if limited_by.is_empty() { 0 } else { 4_200 },
        limit_requests: 60,
        remaining_requests: 59,
        reset_requests_ms: 1_000,
        limit_tokens: 6_000,
        remaining_tokens: 120,
        reset_tokens_ms: 58_800,
    }
}

fn answer(decision: PickDecision, addrs: &[&str], st: Option<BudgetStatus>) -> Vec<u8> {
    let mut a = PickResponse::decode(pick_answer(addrs, 1.0).as_slice()).unwrap();
    a.decision = decision as i32;
    a.budget = st;
    a.encode_to_vec()
}

pub(super) fn reports(h: &Fake) -> Vec<ReportRequest> {
    h.detached
        .iter()
        .filter(|(_, m, _)| m == "Report")
        .map(|(_, _, b)| ReportRequest::decode(b.as_slice()).unwrap())
        .collect()
}

fn headers_of(r: &LocalReply) -> Vec<(&str, &str)> {
    r.headers
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

const RATE_HEADERS: [(&str, &str); 6] = [
    ("x-ratelimit-limit-requests", "60"),
    ("x-ratelimit-remaining-requests", "59"),
    ("x-ratelimit-reset-requests", "1s"),
    ("x-ratelimit-limit-tokens", "6000"),
    ("x-ratelimit-remaining-tokens", "120"),
    ("x-ratelimit-reset-tokens", "58.8s"),
];

#[test]
fn budget_weight_and_wait_ride_the_pick_whose_deadline_covers_the_wait() {
    let (shared, _) = budgeted(json!({}));
    let (_, mut h) = request(
        &shared,
        "key-acme",
        "/v1/chat/completions",
        &chat("qwen", false),
    );
    let (_, _, msg, timeout) = h.calls.pop().unwrap();
    assert_eq!(timeout, 40 + 2000, "the pool's timeout plus its queue wait");
    let p = PickRequest::decode(msg.as_slice()).unwrap();
    assert_eq!((p.weight, p.max_wait_ms), (5, 2000));
    let b = p.budget.unwrap();
    assert_eq!(
        (
            b.key.as_str(),
            b.tokens_per_minute,
            b.requests_per_minute,
            b.max_concurrent
        ),
        ("acme", 6000, 60, 4)
    );
    assert_eq!((b.prompt_tokens_per_minute, b.max_tokens), (0, 4));
    assert_eq!(b.cached_token_weight_permille, 1000, "the compiled default");
    // A tenant without a budget sends none, with the default weight.
    let (_, mut h) = request(
        &shared,
        "key-beta",
        "/v1/chat/completions",
        &chat("qwen", false),
    );
    let (_, _, msg, timeout) = h.calls.pop().unwrap();
    let p = PickRequest::decode(msg.as_slice()).unwrap();
    assert_eq!((p.budget, p.weight, timeout), (None, 1, 2040));
}

#[test]
fn a_stream_pick_waits_as_long_as_the_queue_may_hold_it() {
    let (shared, _) = budgeted(json!({}));
    let sessions = Rc::new(RefCell::new(Sessions::default()));
    {
        let mut s = sessions.borrow_mut();
        s.pick("indexer", b"", 40, || 0, || unreachable!());
        assert_eq!(s.upkeep(0).open, vec!["indexer".to_string()]);
        s.opened("indexer".into(), 3);
    }
    let mut flow = Flow::new(shared.clone());
    let mut h = Fake::new(
        "/v1/chat/completions",
        &[("authorization", "Bearer key-acme")],
        &chat("qwen", false),
    );
    h.sessions = Some(Rc::clone(&sessions));
    headers(&mut flow, &mut h);
    assert_eq!(body(&mut flow, &mut h), Verdict::Pause);
    assert!(h.calls.is_empty(), "on the stream");
    // Sent at about `now`: still waiting well past the pool's 40 ms...
    let sent = h.now.get();
    let up = sessions.borrow_mut().upkeep(sent + 2_000 * 1_000_000);
    assert!(
        up.deliver.is_empty(),
        "the queue's wait is part of the deadline"
    );
    // ...and failed open only after timeout + wait.
    let up = sessions.borrow_mut().upkeep(sent + 2_041 * 1_000_000);
    assert_eq!(up.deliver.len(), 1);
}

#[test]
fn rate_limited_openai_chat_gets_openais_429_and_a_rejected_report() {
    let (shared, stats) = budgeted(json!({}));
    let (mut flow, mut h) = request(
        &shared,
        "key-acme",
        "/v1/chat/completions",
        &chat("qwen", false),
    );
    let a = answer(PickDecision::RateLimited, &[], Some(status("tokens")));
    grpc(&mut flow, &mut h, 7, 0, Some(a));
    assert!(!h.resumed, "answered here, not forwarded");
    let (code, b) = reply_json(&h);
    assert_eq!(code, 429);
    assert_eq!(
        b,
        json!({"error": {
            "message": "Rate limit reached for tenant `acme` on tokens per min (TPM): Limit 6000, Remaining 120. Please try again in 4.2s.",
            "type": "tokens", "param": null, "code": "rate_limit_exceeded"}})
    );
    let mut want = vec![
        ("content-type", "application/json"),
        ("x-kvasir-reply", "filter"),
        ("retry-after", "5"),
    ];
    want.extend(RATE_HEADERS);
    assert_eq!(headers_of(h.replied.as_ref().unwrap()), want);
    assert_eq!(stats.counter(&format!("{P}.rate_limited.tokens")), 1);
    assert_eq!(stats.counter("kvasir.pool.main.pick.rate_limited"), 1);
    assert_eq!(stats.counter("kvasir.pool.main.failopen"), 0);
    let r = reports(&h);
    assert_eq!(r.len(), 1);
    assert_eq!(
        (r[0].phase, r[0].outcome),
        (ReportPhase::Done as i32, Outcome::Rejected as i32)
    );
    assert_eq!(
        (
            r[0].budget_key.as_str(),
            r[0].request_id.as_str(),
            r[0].endpoint.as_str()
        ),
        ("acme", GATEWAY_ID, "")
    );
    // The stream's end accounts nothing more.
    h.cb = Cb::Log;
    flow.on_log(&mut h);
    assert_eq!(reports(&h).len(), 1);
    assert_eq!(stats.counter(&format!("{P}.responses.2xx")), 0);
}

#[test]
fn rate_limited_anthropic_messages_gets_anthropics_429() {
    let (shared, _) = budgeted(json!({}));
    let msgs = r#"{"model":"qwen","max_tokens":16,"messages":[{"role":"user","content":"hi"}]}"#;
    let (mut flow, mut h) = request(&shared, "key-acme", "/v1/messages", msgs);
    let a = answer(PickDecision::RateLimited, &[], Some(status("requests")));
    grpc(&mut flow, &mut h, 7, 0, Some(a));
    let (code, b) = reply_json(&h);
    assert_eq!(code, 429);
    assert_eq!(
        b,
        json!({"type": "error", "error": {"type": "rate_limit_error",
            "message": "This request would exceed the rate limit for tenant `acme` on requests per min (RPM): Limit 60, Remaining 59. Please try again in 4.2s."}})
    );
    let mut want = vec![
        ("content-type", "application/json"),
        ("x-kvasir-reply", "filter"),
        ("retry-after", "5"),
    ];
    want.extend(RATE_HEADERS);
    assert_eq!(headers_of(h.replied.as_ref().unwrap()), want);
}

#[test]
fn a_shed_pick_is_a_429_that_gives_its_reservation_back() {
    let (shared, stats) = budgeted(json!({}));
    // An unbudgeted tenant: no x-ratelimit headers, no budget key.
    let (mut flow, mut h) = request(
        &shared,
        "key-beta",
        "/v1/chat/completions",
        &chat("qwen", false),
    );
    let mut a = PickResponse::decode(answer(PickDecision::Shed, &[], None).as_slice()).unwrap();
    a.shed_cause = "max_wait".into();
    a.queued_ms = 2000;
    grpc(&mut flow, &mut h, 7, 0, Some(a.encode_to_vec()));
    let (code, b) = reply_json(&h);
    assert_eq!(code, 429);
    assert_eq!(b["error"]["code"], "shed");
    assert_eq!(
        b["error"]["message"],
        "The pool `main` is saturated and the request waited 2000 ms for room, its longest. Please try again later."
    );
    assert_eq!(
        headers_of(h.replied.as_ref().unwrap()),
        vec![
            ("content-type", "application/json"),
            ("x-kvasir-reply", "filter"),
            ("retry-after", "1")
        ]
    );
    let beta = "kvasir.tenant.beta.model.qwen";
    assert_eq!(stats.counter(&format!("{beta}.shed.max_wait")), 1);
    assert_eq!(stats.counter("kvasir.pool.main.pick.shed"), 1);
    assert_eq!(
        stats.histograms.borrow()[&format!("{beta}.queue_wait_ms")],
        vec![2000]
    );
    let r = reports(&h);
    assert_eq!((r.len(), r[0].outcome), (1, Outcome::Rejected as i32));
    assert_eq!(r[0].budget_key, "");
    // A budgeted tenant's shed pick: its headers, and its key to cancel.
    let (mut flow, mut h) = request(
        &shared,
        "key-acme",
        "/v1/chat/completions",
        &chat("qwen", false),
    );
    let mut a =
        PickResponse::decode(answer(PickDecision::Shed, &[], Some(status(""))).as_slice()).unwrap();
    a.shed_cause = "pool_full".into();
    grpc(&mut flow, &mut h, 7, 0, Some(a.encode_to_vec()));
    let got = headers_of(h.replied.as_ref().unwrap());
    assert_eq!(got[2], ("retry-after", "1"));
    assert_eq!(&got[3..], &RATE_HEADERS);
    let r = reports(&h);
    assert_eq!(
        (r[0].outcome, r[0].budget_key.as_str()),
        (Outcome::Rejected as i32, "acme")
    );
    assert_eq!(stats.counter(&format!("{P}.shed.pool_full")), 1);
    assert_eq!(
        stats.counter(&format!("{P}.requests.shed")),
        0,
        "not a policy shed"
    );
}

#[test]
fn admitted_responses_carry_the_budget_headers() {
    for streaming in [false, true] {
        let (shared, stats) = budgeted(json!({}));
        let (mut flow, mut h) = request(
            &shared,
            "key-acme",
            "/v1/chat/completions",
            &chat("qwen", streaming),
        );
        let mut a = PickResponse::decode(
            answer(PickDecision::Prefix, &["127.0.0.1:9001"], Some(status(""))).as_slice(),
        )
        .unwrap();
        a.queued_ms = 35;
        grpc(&mut flow, &mut h, 7, 0, Some(a.encode_to_vec()));
        assert!(h.resumed);
        let (ct, chunk) = if streaming {
            (
                "text/event-stream",
                "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: [DONE]\n\n",
            )
        } else {
            (
                "application/json",
                r#"{"usage":{"prompt_tokens":3,"completion_tokens":1}}"#,
            )
        };
        respond(&mut flow, &mut h, 200, ct, &[chunk]);
        let got: Vec<(&str, &str)> = h
            .added_resp
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(got, RATE_HEADERS.to_vec(), "streaming {streaming}");
        let hist = stats.histograms.borrow();
        assert_eq!(hist[&format!("{P}.queue_wait_ms")], vec![35]);
        assert_eq!(hist["kvasir.pool.main.queue_wait_ms"], vec![35]);
        let done = reports(&h).pop().unwrap();
        assert_eq!(
            (done.phase, done.budget_key.as_str()),
            (ReportPhase::Done as i32, "acme")
        );
    }
    // A pick that did not wait records no wait; a tenant without a budget
    // status gets no headers.
    let (shared, stats) = budgeted(json!({}));
    let (mut flow, mut h) = request(
        &shared,
        "key-beta",
        "/v1/chat/completions",
        &chat("qwen", false),
    );
    grpc(
        &mut flow,
        &mut h,
        7,
        0,
        Some(pick_answer(&["127.0.0.1:9001"], 0.1)),
    );
    respond(&mut flow, &mut h, 200, "application/json", &["{}"]);
    assert!(h.added_resp.is_empty());
    assert!(stats
        .histograms
        .borrow()
        .keys()
        .all(|k| !k.ends_with("queue_wait_ms")));
    assert_eq!(reports(&h).pop().unwrap().budget_key, "");
}

/// A streaming chat answer of `n` content chunks for a picked request,
/// each chunk fed at the time `at(i)` (ns) sets.
pub(super) fn stream_answer(flow: &mut Flow, h: &mut Fake, n: usize, at: impl Fn(usize) -> u64) {
    h.resp_headers = vec![
        (":status".into(), "200".into()),
        ("content-type".into(), "text/event-stream".into()),
    ];
    h.cb = Cb::RespHeaders;
    flow.on_response_headers(h, false);
    for i in 0..n {
        h.cb = Cb::RespBody;
        h.now.set(at(i));
        h.resp_chunk = b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n".to_vec();
        let n = h.resp_chunk.len();
        flow.on_response_body(h, n, false);
    }
    h.cb = Cb::RespBody;
    h.resp_chunk = br#"data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":300}}

data: [DONE]

"#
    .to_vec();
    let n = h.resp_chunk.len();
    flow.on_response_body(h, n, true);
    h.cb = Cb::Log;
    flow.on_log(h);
    h.cb = Cb::Idle;
}

pub(super) fn picked_stream(shared: &Rc<Shared>, key: &str) -> (Flow, Fake) {
    let (mut flow, mut h) = request(shared, key, "/v1/chat/completions", &chat("qwen", true));
    grpc(
        &mut flow,
        &mut h,
        7,
        0,
        Some(pick_answer(&["127.0.0.1:9001"], 0.1)),
    );
    (flow, h)
}

fn usage_reports(h: &Fake) -> Vec<ReportRequest> {
    reports(h)
        .into_iter()
        .filter(|r| r.phase == ReportPhase::Usage as i32)
        .collect()
}

#[test]
fn usage_is_reported_every_64_content_events() {
    let (shared, stats) = budgeted(json!({}));
    let (mut flow, mut h) = picked_stream(&shared, "key-acme");
    // 1 ms apart: only the event count triggers.
    stream_answer(&mut flow, &mut h, 200, |i| {
        10_000_000_000 + i as u64 * 1_000_000
    });
    let u = usage_reports(&h);
    let completions: Vec<u32> = u.iter().map(|r| r.completion_tokens).collect();
    assert_eq!(
        completions,
        vec![65, 129, 193],
        "the first chunk starts the count"
    );
    assert!(u
        .iter()
        .all(|r| r.budget_key == "acme" && r.request_id == GATEWAY_ID));
    assert_eq!(stats.counter(&format!("{P}.usage_reports")), 3);
    let done = reports(&h).pop().unwrap();
    assert_eq!(
        (done.phase, done.completion_tokens, done.budget_key.as_str()),
        (ReportPhase::Done as i32, 300, "acme")
    );
}

#[test]
fn usage_is_reported_after_a_second_of_a_slow_stream() {
    let (shared, _) = budgeted(json!({}));
    let (mut flow, mut h) = picked_stream(&shared, "key-acme");
    // One chunk every 400 ms: a report at 1.2 s and 2.4 s since the first.
    stream_answer(&mut flow, &mut h, 8, |i| {
        10_000_000_000 + i as u64 * 400_000_000
    });
    let completions: Vec<u32> = usage_reports(&h)
        .iter()
        .map(|r| r.completion_tokens)
        .collect();
    assert_eq!(completions, vec![4, 7]);
}

#[test]
fn usage_is_not_reported_for_tenants_without_a_budget() {
    let (shared, stats) = budgeted(json!({}));
    let (mut flow, mut h) = picked_stream(&shared, "key-beta");
    stream_answer(&mut flow, &mut h, 200, |i| {
        10_000_000_000 + i as u64 * 100_000_000
    });
    assert!(usage_reports(&h).is_empty());
    assert_eq!(
        stats.counter("kvasir.tenant.beta.model.qwen.usage_reports"),
        0
    );
    let done = reports(&h).pop().unwrap();
    assert_eq!(
        (done.phase, done.budget_key.as_str()),
        (ReportPhase::Done as i32, "")
    );
}

#[test]
fn a_budgeted_request_reports_even_when_reports_are_off_or_the_pick_failed_open() {
    // Reports off: a budgeted request still settles and releases.
    let (shared, _) = budgeted(json!({"report": false}));
    let (mut flow, mut h) = picked_stream(&shared, "key-acme");
    stream_answer(&mut flow, &mut h, 70, |i| {
        10_000_000_000 + i as u64 * 1_000_000
    });
    let phases: Vec<i32> = reports(&h).iter().map(|r| r.phase).collect();
    assert_eq!(
        phases,
        vec![ReportPhase::Usage as i32, ReportPhase::Done as i32]
    );
    let (mut flow, mut h) = picked_stream(&shared, "key-beta");
    stream_answer(&mut flow, &mut h, 70, |i| {
        10_000_000_000 + i as u64 * 1_000_000
    });
    assert!(reports(&h).is_empty(), "reports off for the unbudgeted");
    // The pick timed out at the filter: the indexer may have reserved, so
    // its end is reported with the key (and nothing while it streams).
    let (shared, _) = budgeted(json!({}));
    let (mut flow, mut h) = request(
        &shared,
        "key-acme",
        "/v1/chat/completions",
        &chat("qwen", true),
    );
    grpc(&mut flow, &mut h, 7, 4, None);
    assert!(h.resumed);
    stream_answer(&mut flow, &mut h, 70, |i| {
        10_000_000_000 + i as u64 * 1_000_000
    });
    let r = reports(&h);
    assert_eq!(r.len(), 1);
    assert_eq!(
        (
            r[0].phase,
            r[0].outcome,
            r[0].budget_key.as_str(),
            r[0].completion_tokens
        ),
        (
            ReportPhase::Done as i32,
            Outcome::Success as i32,
            "acme",
            300
        )
    );
}
