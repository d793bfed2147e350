//! Picks against real `vllm-sim` processes over real ZMQ and HTTP: prefix
//! affinity with exact cached-token predictions, spreading of a shared
//! system prompt, load from scrapes, in-flight accounting, bad requests.

use crate::service_support;
use std::collections::HashMap;
use std::time::Duration;

use kvasir_cache_indexer::scoring::Weights;
use kvasir_proto::v1 as pb;
use service_support::*;

/// A chat sent to sim B; the follow-up turn is picked for B with the cached
/// tokens B then reports, and the prompt length B computes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follow_up_turn_goes_where_the_chat_lives() {
    let sims = Sim::start_many(3).await;
    let ix = start_indexer(&config(&sims.iter().collect::<Vec<_>>())).await;
    ix.wait_ready().await;
    let b = &sims[1];

    let mut chat = vec![
        (
            "system",
            format!("You are a careful assistant. {}", filler(1, 300)),
        ),
        ("user", format!("First question: {}", filler(2, 200))),
    ];
    let first = b.chat(&chat, 24).await;
    ix.wait_settled(&b.address()).await;

    chat.push(("assistant", reply(&first)));
    chat.push(("user", format!("Follow-up: {}", filler(3, 40))));
    let pick = ix.pick(chat_pick("turn-2", &chat)).await;
    assert_eq!(pick.endpoints.len(), 3, "all healthy endpoints, ordered");
    let top = &pick.endpoints[0];
    assert_eq!(
        top.address,
        b.address(),
        "the follow-up goes where the history is cached"
    );
    assert_eq!(pick.reason, "prefix");
    assert_eq!(pick.tokenize_mode, "tokenizer");
    assert!(
        top.predicted_cached_tokens > 500,
        "most of the history is cached: {top:?}"
    );
    assert!(pick.endpoints[1..]
        .iter()
        .all(|e| e.predicted_cached_tokens == 0));

    // In flight until reported.
    let st = ix.endpoint_state(&b.address()).await;
    assert_eq!(st.in_flight, 1);
    // Queued as prefill work: the uncached tokens plus attention's share.
    let work = kvasir_cache_indexer::scoring::prefill_work(
        pick.prompt_tokens,
        top.predicted_cached_tokens,
        kvasir_cache_indexer::scoring::Weights::default().attention,
    );
    assert_eq!(st.queued_prefill_tokens, work.round() as u64);
    assert!(st.queued_prefill_tokens > u64::from(pick.prompt_tokens - top.predicted_cached_tokens));

    let second = b.chat(&chat, 8).await;
    assert_eq!(
        prompt_tokens(&second),
        u64::from(pick.prompt_tokens),
        "same tokenization as the engine"
    );
    assert_eq!(
        cached_tokens(&second),
        u64::from(top.predicted_cached_tokens),
        "predicted cached tokens equal what the engine reports"
    );

    let rep = ix
        .report(pb::ReportRequest {
            pool: POOL.into(),
            request_id: "turn-2".into(),
            endpoint: b.address(),
            prompt_tokens: prompt_tokens(&second) as u32,
            cached_tokens: cached_tokens(&second) as u32,
            completion_tokens: 8,
            outcome: pb::Outcome::Success as i32,
            phase: pb::ReportPhase::Done as i32,
            ..Default::default()
        })
        .await;
    assert!(rep.matched);
    assert_eq!(ix.endpoint_state(&b.address()).await.in_flight, 0);
    ix.indexer.shutdown().await;
}

/// Many distinct conversations behind one long system prompt, arriving as a
/// burst, must not all land on the one endpoint that caches the prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_system_prompt_spreads_across_endpoints() {
    let sims = Sim::start_many(3).await;
    let ix = start_indexer(&config(&sims.iter().collect::<Vec<_>>())).await;
    ix.wait_ready().await;
    let system = format!(
        "You are the support bot of ACME. Policies: {}",
        filler(10, 700)
    );
    // Warm one endpoint with the system prompt.
    sims[0]
        .chat(&[("system", system.clone()), ("user", "hello".into())], 4)
        .await;
    ix.wait_settled(&sims[0].address()).await;

    let n = 24;
    let mut picks = Vec::new();
    for i in 0..n {
        let msgs = vec![
            ("system", system.clone()),
            ("user", format!("Ticket {i}: {}", filler(100 + i, 60))),
        ];
        let p = ix.pick(chat_pick(&format!("t{i}"), &msgs)).await;
        picks.push((msgs, p));
    }
    let mut counts: HashMap<String, usize> = HashMap::new();
    for (_, p) in &picks {
        *counts.entry(p.endpoints[0].address.clone()).or_default() += 1;
    }
    eprintln!("burst of {n} picks: {counts:?}");
    let max = counts.values().copied().max().unwrap_or(0);
    assert_eq!(
        counts.len(),
        3,
        "the burst spreads over every endpoint: {counts:?}"
    );
    assert!(
        max * 10 <= n as usize * 6,
        "no endpoint takes more than 60%: {counts:?}"
    );
    assert_eq!(
        picks[0].1.endpoints[0].address,
        sims[0].address(),
        "the first goes to the cached prompt"
    );
    assert_eq!(picks[0].1.reason, "prefix");

    // Serve them where they were picked, report, and nothing stays in flight.
    let by_addr: HashMap<String, &Sim> = sims.iter().map(|s| (s.address(), s)).collect();
    for (i, (msgs, p)) in picks.iter().enumerate() {
        let sim = by_addr[&p.endpoints[0].address];
        let r = sim.chat(msgs, 2).await;
        // Served in pick order, each request finds what the indexer
        // predicted: the system prompt where an earlier pick had sent it.
        assert_eq!(
            cached_tokens(&r),
            u64::from(p.endpoints[0].predicted_cached_tokens),
            "request t{i} on {}",
            sim.address()
        );
        ix.report(pb::ReportRequest {
            pool: POOL.into(),
            request_id: format!("t{i}"),
            endpoint: sim.address(),
            cached_tokens: cached_tokens(&r) as u32,
            ..Default::default()
        })
        .await;
    }
    let st = ix.state().await;
    assert!(
        st.endpoints
            .iter()
            .all(|e| e.in_flight == 0 && e.queued_prefill_tokens == 0),
        "{st:?}"
    );
    ix.indexer.shutdown().await;
}

/// Scrapes show a busy engine's running requests; picks then prefer the
/// idle one. Reports move in-flight accounting step by step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrapes_reflect_load_and_reports_decrement_in_flight() {
    // A real-time simulator (decode steps take ~6 ms) so requests stay running.
    let mut sims = Sim::start_all(&[&["--profile", "h100-8b", "--time-scale", "1"], &[]]).await;
    let idle = sims.pop().expect("idle");
    let busy = sims.pop().expect("busy");
    let ix = start_indexer(&config(&[&busy, &idle])).await;
    ix.wait_ready().await;

    let long: Vec<_> = (0..4)
        .map(|i| {
            let url = busy.url();
            tokio::spawn(async move {
                let body = serde_json::json!({
                    "model": MODEL,
                    "messages": [{"role": "user", "content": format!("long job {i}")}],
                    "max_tokens": 400
                });
                let _ = http_client()
                    .post(format!("{url}/v1/chat/completions"))
                    .json(&body)
                    .timeout(Duration::from_secs(30))
                    .send()
                    .await;
            })
        })
        .collect();
    wait_for(
        "scrape shows the busy engine running",
        Duration::from_secs(5),
        || async { ix.endpoint_state(&busy.address()).await.running >= 2 },
    )
    .await;
    let p = ix
        .pick(chat_pick("", &[("user", "a brand new question".into())]))
        .await;
    assert_eq!(
        p.endpoints[0].address,
        idle.address(),
        "the idle engine wins: {p:?}"
    );
    assert_eq!(p.reason, "load");
    let busy_score = p.endpoints[1].score.expect("score");
    assert!(
        busy_score.decode >= 2.0 * Weights::default().decode,
        "{busy_score:?}"
    );

    // In-flight accounting: PICK -> FIRST_TOKEN -> DONE.
    let msgs = [("user", filler(7, 100))];
    let p = ix.pick(chat_pick("acct-1", &msgs)).await;
    let to = p.endpoints[0].address.clone();
    let st = ix.endpoint_state(&to).await;
    let work = kvasir_cache_indexer::scoring::prefill_work(
        p.prompt_tokens,
        0,
        kvasir_cache_indexer::scoring::Weights::default().attention,
    );
    assert_eq!(
        (st.in_flight, st.queued_prefill_tokens),
        (1, work.round() as u64)
    );
    let report = |phase: pb::ReportPhase, id: &str| pb::ReportRequest {
        pool: POOL.into(),
        request_id: id.into(),
        endpoint: to.clone(),
        phase: phase as i32,
        ..Default::default()
    };
    assert!(
        ix.report(report(pb::ReportPhase::FirstToken, "acct-1"))
            .await
            .matched
    );
    let st = ix.endpoint_state(&to).await;
    assert_eq!((st.in_flight, st.queued_prefill_tokens), (1, 0));
    assert!(
        ix.report(report(pb::ReportPhase::Done, "acct-1"))
            .await
            .matched
    );
    assert_eq!(ix.endpoint_state(&to).await.in_flight, 0);
    assert!(
        !ix.report(report(pb::ReportPhase::Done, "acct-1"))
            .await
            .matched,
        "a second DONE is unmatched"
    );
    assert!(
        !ix.report(report(pb::ReportPhase::Done, "never-picked"))
            .await
            .matched
    );

    for t in long {
        let _ = t.await;
    }
    wait_for("busy engine drains", Duration::from_secs(10), || async {
        ix.endpoint_state(&busy.address()).await.running == 0
    })
    .await;
    ix.indexer.shutdown().await;
}

/// Malformed requests get INVALID_ARGUMENT with a message naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_invalid_argument() {
    let sim = Sim::start(&[]).await;
    let ix = start_indexer(&config(&[&sim])).await;
    let mut c = ix.client.clone();
    let check = |r: Result<tonic::Response<pb::PickResponse>, tonic::Status>, want: &str| {
        let s = r.expect_err("must fail");
        assert_eq!(s.code(), tonic::Code::InvalidArgument, "{s:?}");
        assert!(
            s.message().contains(want),
            "message `{}` should contain `{want}`",
            s.message()
        );
    };
    let good = chat_pick("x", &[("user", "hi".into())]);

    let mut r = good.clone();
    r.pool = "nope".into();
    check(c.pick(r).await, "unknown pool `nope`");
    let mut r = good.clone();
    r.pool = String::new();
    check(c.pick(r).await, "pool: must not be empty");
    let mut r = good.clone();
    r.prompt = None;
    check(
        c.pick(r).await,
        "prompt: one of chat, text or token_ids is required",
    );
    let mut r = good.clone();
    r.prompt = Some(pb::pick_request::Prompt::Chat(pb::Chat {
        messages: vec![],
    }));
    check(c.pick(r).await, "chat.messages: must not be empty");
    let mut r = good.clone();
    r.prompt = Some(pb::pick_request::Prompt::Chat(pb::Chat {
        messages: vec![pb::ChatMessage {
            role: String::new(),
            content: "x".into(),
        }],
    }));
    check(c.pick(r).await, "message 0 has no role");
    let mut r = good.clone();
    r.prompt = Some(pb::pick_request::Prompt::TokenIds(pb::TokenIds {
        ids: vec![],
    }));
    check(c.pick(r).await, "token_ids.ids: must not be empty");
    let mut r = good.clone();
    r.prompt = Some(pb::pick_request::Prompt::Text(String::new()));
    check(c.pick(r).await, "text: must not be empty");

    let s = c
        .report(pb::ReportRequest {
            pool: POOL.into(),
            ..Default::default()
        })
        .await
        .expect_err("empty request id");
    assert_eq!(s.code(), tonic::Code::InvalidArgument);
    assert!(s.message().contains("request_id"));
    let s = c
        .pool_state(pb::PoolStateRequest {
            pool: "nope".into(),
        })
        .await
        .expect_err("unknown pool");
    assert_eq!(s.code(), tonic::Code::InvalidArgument);

    // Text and token-id prompts work, and token ids pass through untouched.
    ix.wait_ready().await;
    let mut r = good.clone();
    r.prompt = Some(pb::pick_request::Prompt::Text(
        "plain completion prompt".into(),
    ));
    let p = c.pick(r).await.expect("text prompt").into_inner();
    assert_eq!(p.tokenize_mode, "tokenizer");
    let mut r = good;
    r.request_id = String::new();
    r.prompt = Some(pb::pick_request::Prompt::TokenIds(pb::TokenIds {
        ids: vec![1, 2, 3],
    }));
    let p = c.pick(r).await.expect("token ids").into_inner();
    assert_eq!(
        (p.prompt_tokens, p.tokenize_mode.as_str()),
        (3, "token_ids")
    );
    ix.indexer.shutdown().await;
}

/// The fallback tokenizer modes against real engines: `render` asks the
/// engine for the exact ids (so predictions stay exact); `approx` matches a
/// conversation against the indexer's own pick history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn render_and_approx_modes() {
    use kvasir_cache_indexer::config::TokenizerSource;
    let sims = Sim::start_many(2).await;
    let mut cfg = config(&sims.iter().collect::<Vec<_>>());
    let mut approx = cfg.pools[0].clone();
    cfg.pools[0].tokenizer = TokenizerSource::Render;
    approx.name = "approx".into();
    approx.tokenizer = TokenizerSource::Approx;
    cfg.pools.push(approx);
    let ix = start_indexer(&cfg).await;
    ix.wait_ready().await;

    // render: exact ids from the engine, exact predictions.
    let b = &sims[1];
    let mut chat = vec![("user", format!("Render me: {}", filler(21, 250)))];
    let first = b.chat(&chat, 16).await;
    ix.wait_settled(&b.address()).await;
    chat.push(("assistant", reply(&first)));
    chat.push(("user", "and then?".into()));
    let p = ix.pick(chat_pick("", &chat)).await;
    assert_eq!(p.tokenize_mode, "render");
    assert_eq!(p.endpoints[0].address, b.address());
    let second = b.chat(&chat, 4).await;
    assert_eq!(u64::from(p.prompt_tokens), prompt_tokens(&second));
    assert_eq!(
        u64::from(p.endpoints[0].predicted_cached_tokens),
        cached_tokens(&second)
    );

    // approx: the second turn follows the first pick.
    let approx_pick = |id: &str, msgs: &[(&str, String)]| {
        let mut r = chat_pick(id, msgs);
        r.pool = "approx".into();
        r
    };
    let convo = vec![("system", filler(22, 300)), ("user", "first".to_string())];
    let p1 = ix.pick(approx_pick("a1", &convo)).await;
    assert_eq!(p1.tokenize_mode, "approx");
    // The first turn completes before the second is sent.
    ix.report(pb::ReportRequest {
        pool: "approx".into(),
        request_id: "a1".into(),
        endpoint: p1.endpoints[0].address.clone(),
        ..Default::default()
    })
    .await;
    let mut next = convo.clone();
    next.push(("assistant", "reply".into()));
    next.push(("user", "second".into()));
    let p2 = ix.pick(approx_pick("a2", &next)).await;
    assert_eq!(
        p2.endpoints[0].address, p1.endpoints[0].address,
        "follows its own history"
    );
    assert_eq!(p2.reason, "prefix");
    assert!(p2.endpoints[0].predicted_cached_tokens > 100);

    let metrics = ix.metrics().await;
    assert!(metrics.contains("kvasir_indexer_tokenize_mode{pool=\"sims\",mode=\"render\"} 1"));
    assert!(metrics.contains("kvasir_indexer_tokenize_mode{pool=\"approx\",mode=\"approx\"} 1"));
    ix.indexer.shutdown().await;
}
