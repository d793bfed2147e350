use std::sync::Arc;
use std::time::Instant;

use kvasir_proto::v1 as pb;

use super::*;
use crate::history::DEFAULT_PICK_HISTORY_BLOCKS;
use crate::load::{block_chain, EngineLoad, LoadConfig, LoadTracker};
use crate::pools::Pools;
use crate::scoring::Weights;
use crate::service::IndexerService;
use crate::tokenize::RequestTokenizer;
use crate::types::{EndpointId, EndpointSpec, IndexSource};

fn pool_with(n: usize, tokenizer: RequestTokenizer) -> Pool {
    pool_indexed(
        n,
        tokenizer,
        IndexSource::Events,
        DEFAULT_PICK_HISTORY_BLOCKS,
    )
}

/// Pool `p` of model `m`, 4-token blocks, default load and weights, no
/// endpoints.
fn empty_pool(tokenizer: RequestTokenizer) -> Pool {
    Pool::new(
        "p",
        "m",
        4,
        tokenizer,
        LoadTracker::new(LoadConfig::default()),
        Weights::default(),
    )
}

fn pool_indexed(
    n: usize,
    tokenizer: RequestTokenizer,
    source: IndexSource,
    history_blocks: usize,
) -> Pool {
    let pool = empty_pool(tokenizer).with_index(source, history_blocks);
    pool.set_idle_loopback_endpoints(n);
    pool
}

fn ids_req(id: &str, ids: Vec<u32>) -> pb::PickRequest {
    pb::PickRequest {
        pool: "p".into(),
        request_id: id.into(),
        prompt: Some(pb::pick_request::Prompt::TokenIds(pb::TokenIds { ids })),
        ..Default::default()
    }
}

fn store(pool: &Pool, address: &str, ids: &[u32]) {
    let blocks = ids.len() / 4;
    let hashes = (0..blocks as u64)
        .map(|i| EngineHash::U64(1000 + i))
        .collect();
    let batch = stored_batch(hashes, ids[..blocks * 4].to_vec(), 4);
    pool.index.apply(EndpointId::from_address(address), &batch);
    pool.index.flush_blocking();
}

#[tokio::test]
async fn picks_the_endpoint_holding_the_prefix_and_accounts_it() {
    let pool = pool_with(3, RequestTokenizer::Approx);
    let ids: Vec<u32> = (0..40).collect();
    store(&pool, "127.0.0.1:8001", &ids);
    let r = pool.pick(ids_req("r1", ids.clone())).await.unwrap();
    assert_eq!(r.endpoints.len(), 3);
    assert_eq!(r.endpoints[0].address, "127.0.0.1:8001");
    assert_eq!(
        r.endpoints[0].predicted_cached_tokens, 36,
        "last block recomputed"
    );
    assert_eq!(r.reason, "prefix");
    assert_eq!(r.tokenize_mode, "token_ids");
    assert_eq!(r.prompt_tokens, 40);
    let st = pool.state();
    assert_eq!(st.endpoints[1].in_flight, 1);
    assert_eq!(st.endpoints[1].queued_prefill_tokens, 4);
    assert_eq!(st.endpoints[1].indexed_blocks, 10);
    let rep = pool
        .report(&pb::ReportRequest {
            pool: "p".into(),
            request_id: "r1".into(),
            endpoint: "127.0.0.1:8001".into(),
            cached_tokens: 36,
            ..Default::default()
        })
        .unwrap();
    assert!(rep.matched);
    assert_eq!(pool.state().endpoints[1].in_flight, 0);
    assert_eq!(pool.metrics.predicted_cached_tokens.get(), 36);
    assert_eq!(pool.metrics.reported_cached_tokens.get(), 36);
}

#[tokio::test]
async fn bad_requests_are_invalid() {
    let pools = Pools::new(vec![Arc::new(pool_with(1, RequestTokenizer::Approx))]);
    let svc = IndexerService::new(Arc::new(pools));
    let mut r = ids_req("x", vec![1]);
    r.pool = "nope".into();
    assert_eq!(
        svc.pick(r).await.unwrap_err(),
        ServiceError::UnknownPool("nope".into())
    );
    let mut r = ids_req("x", vec![]);
    assert_eq!(
        svc.pick(r.clone()).await.unwrap_err().to_string(),
        "token_ids.ids: must not be empty"
    );
    r.prompt = None;
    assert!(svc
        .pick(r.clone())
        .await
        .unwrap_err()
        .to_string()
        .starts_with("prompt:"));
    r.prompt = Some(pb::pick_request::Prompt::Chat(pb::Chat {
        messages: vec![],
    }));
    assert_eq!(
        svc.pick(r).await.unwrap_err().to_string(),
        "chat.messages: must not be empty"
    );
    let status: tonic::Status = ServiceError::UnknownPool("x".into()).into();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
}

#[tokio::test]
async fn approx_mode_remembers_its_own_picks() {
    let pool = pool_with(4, RequestTokenizer::Approx);
    // The second is the first's next turn (a sibling conversation would
    // be spread: the placement term).
    let chat =
        |turns: &[&str]| pb::PickRequest {
            pool: "p".into(),
            request_id: format!("r-{}", turns.len()),
            prompt: Some(pb::pick_request::Prompt::Chat(pb::Chat {
                messages: std::iter::once(("system", "x".repeat(400)))
                    .chain(turns.iter().enumerate().map(|(i, t)| {
                        (if i % 2 == 0 { "user" } else { "assistant" }, t.to_string())
                    }))
                    .map(|(role, content)| pb::ChatMessage {
                        role: role.into(),
                        content,
                    })
                    .collect(),
            })),
            ..Default::default()
        };
    let first = pool.pick(chat(&["one"])).await.unwrap();
    assert_eq!(first.tokenize_mode, "approx");
    pool.report(&pb::ReportRequest {
        pool: "p".into(),
        request_id: "r-1".into(),
        ..Default::default()
    })
    .unwrap();
    let second = pool.pick(chat(&["one", "sure", "two"])).await.unwrap();
    assert_eq!(second.endpoints[0].address, first.endpoints[0].address);
    assert_eq!(second.reason, "prefix");
    assert!(second.endpoints[0].predicted_cached_tokens >= 96);
}

#[tokio::test]
async fn salted_requests_are_not_matched_and_unhealthy_are_skipped() {
    let pool = pool_with(2, RequestTokenizer::Approx);
    let ids: Vec<u32> = (0..40).collect();
    store(&pool, "127.0.0.1:8000", &ids);
    let mut r = ids_req("s", ids);
    r.hints = Some(pb::Hints {
        cache_salt: "tenant-a".into(),
        ..Default::default()
    });
    let out = pool.pick(r).await.unwrap();
    assert_eq!(out.reason, "no_index");
    assert!(out.endpoints.iter().all(|e| e.predicted_cached_tokens == 0));
    let e0 = pool.endpoints()[0].id;
    for _ in 0..3 {
        pool.load.record_scrape(e0, None, Instant::now());
    }
    let out = pool.pick(ids_req("t", vec![1, 2, 3])).await.unwrap();
    assert_eq!(out.endpoints.len(), 1);
    assert_eq!(out.endpoints[0].address, "127.0.0.1:8001");
}

#[tokio::test]
async fn render_failure_picks_by_load() {
    let tokenizer = RequestTokenizer::Render {
        client: reqwest::Client::builder().no_proxy().build().unwrap(),
        model: "m".into(),
        timeout: std::time::Duration::from_millis(200),
    };
    let pool = empty_pool(tokenizer);
    // Nothing listens on port 1: the render call is refused.
    let spec = EndpointSpec {
        address: "127.0.0.1:1".into(),
        kv_events: "tcp://127.0.0.1:2".into(),
        replay: None,
        metrics_url: None,
        topic: String::new(),
    };
    pool.set_endpoints(vec![spec], |_| None);
    let id = pool.endpoints()[0].id;
    pool.load
        .record_scrape(id, Some(EngineLoad::default()), Instant::now());
    let req = pb::PickRequest {
        pool: "p".into(),
        prompt: Some(pb::pick_request::Prompt::Text("hello".into())),
        ..Default::default()
    };
    let out = pool.pick(req).await.unwrap();
    assert_eq!(out.reason, "no_index");
    assert_eq!(out.endpoints[0].address, "127.0.0.1:1");
    assert_eq!(pool.metrics.tokenize_failures.get(), 1);
}

fn done(pool: &Pool, id: &str) {
    pool.report(&pb::ReportRequest {
        pool: "p".into(),
        request_id: id.into(),
        ..Default::default()
    })
    .unwrap();
}

/// Token ids: a shared head of `shared` tokens, then a tail unique to
/// `n`.
fn prompt(shared: u32, tail: u32, n: u32) -> Vec<u32> {
    (0..shared)
        .chain((0..tail).map(|i| 1_000_000 * (n + 1) + i))
        .collect()
}

#[tokio::test]
async fn picks_mode_sends_a_shared_prefix_where_it_went() {
    // Token ids bypass the tokenizer; with index picks they are matched
    // against the history whatever the pool's tokenize mode.
    let render = RequestTokenizer::Render {
        client: reqwest::Client::builder().no_proxy().build().unwrap(),
        model: "m".into(),
        timeout: std::time::Duration::from_millis(200),
    };
    for tokenizer in [RequestTokenizer::Approx, render] {
        let pool = pool_indexed(3, tokenizer, IndexSource::Picks, 10_000);
        assert!(!pool.wants_events());
        assert_eq!(pool.readiness(), (true, Vec::new()));
        // The KV-event index says 8002 holds the prompt: ignored.
        let first_ids = prompt(2000, 40, 1);
        store(&pool, "127.0.0.1:8002", &first_ids);
        let first = pool.pick(ids_req("r1", first_ids.clone())).await.unwrap();
        assert_eq!(first.reason, "load", "nothing in the history yet");
        assert!(first
            .endpoints
            .iter()
            .all(|e| e.predicted_cached_tokens == 0));
        let home = first.endpoints[0].address.clone();
        let home_id = EndpointId::from_address(&home);
        assert_eq!(pool.history_blocks(home_id), Some(510));
        assert_eq!(
            pool.state()
                .endpoints
                .iter()
                .find(|e| e.address == home)
                .unwrap()
                .indexed_blocks,
            510,
            "PoolState shows the history with index picks"
        );
        done(&pool, "r1");

        // Same 2000-token head, other tail: goes home, predicted from
        // the history.
        let second_ids = prompt(2000, 60, 2);
        let second = pool.pick(ids_req("r2", second_ids.clone())).await.unwrap();
        assert_eq!(second.reason, "prefix");
        assert_eq!(second.endpoints[0].address, home);
        assert_eq!(second.endpoints[0].predicted_cached_tokens, 2000);
        assert!(second.endpoints[1..]
            .iter()
            .all(|e| e.predicted_cached_tokens == 0));
        assert_eq!(pool.history_blocks(home_id), Some(525), "15 new blocks");
        // No pending-prefill matching with index picks: r2 (still in
        // prefill) left no chain in the load tracker.
        let chain = block_chain(&second_ids, 4);
        let ids: Vec<EndpointId> = pool.endpoints().iter().map(|e| e.id).collect();
        let views = pool
            .load
            .views_matching(ids.iter().copied(), Instant::now(), Some(&chain));
        assert!(views.iter().all(|v| v.pending_matched_blocks == 0));
        assert_eq!(
            pool.state()
                .endpoints
                .iter()
                .map(|e| e.in_flight)
                .sum::<u32>(),
            1
        );

        // A salted request is neither matched nor recorded.
        let mut salted = ids_req("s", prompt(2000, 80, 3));
        salted.hints = Some(pb::Hints {
            cache_salt: "t".into(),
            ..Default::default()
        });
        let out = pool.pick(salted).await.unwrap();
        assert_eq!(out.reason, "no_index");
        let total: usize = ids.iter().filter_map(|id| pool.history_blocks(*id)).sum();
        assert_eq!(total, 525);

        // An endpoint that went away forgets its history.
        pool.clear_endpoint(home_id);
        assert_eq!(pool.history_blocks(home_id), Some(0));
    }
}

#[tokio::test]
async fn events_mode_keeps_pending_prefill_matching() {
    let pool = pool_with(2, RequestTokenizer::Approx);
    assert!(pool.wants_events());
    let first = pool.pick(ids_req("r1", prompt(400, 8, 1))).await.unwrap();
    let home = EndpointId::from_address(&first.endpoints[0].address);
    let chain = block_chain(&prompt(400, 8, 2), 4);
    let views = pool
        .load
        .views_matching([home], Instant::now(), Some(&chain));
    assert_eq!(
        views[0].pending_matched_blocks, 100,
        "r1 is in prefill there"
    );
    assert_eq!(
        pool.history_blocks(home),
        Some(0),
        "token ids use the events, not the approx history"
    );
}

#[tokio::test]
async fn picks_mode_history_is_bounded_and_evicts_the_oldest() {
    // One endpoint, 20 blocks of history; prompts of 10 blocks.
    let pool = pool_indexed(1, RequestTokenizer::Approx, IndexSource::Picks, 20);
    let id = pool.endpoints()[0].id;
    let p = |n: u32| prompt(0, 40, n);
    for n in 1..=3 {
        let r = pool.pick(ids_req(&format!("r{n}"), p(n))).await.unwrap();
        assert_eq!(r.reason, "load");
        done(&pool, &format!("r{n}"));
        assert!(pool.history_blocks(id).unwrap() <= 20, "capacity respected");
    }
    assert_eq!(pool.history_blocks(id), Some(20));
    assert_eq!(pool.state().endpoints[0].indexed_blocks, 20);
    // Newest first: p(3) and p(2) are held (all but the last block is
    // predicted: vLLM recomputes it), p(1) was evicted.
    let r = pool.pick(ids_req("a", p(3))).await.unwrap();
    assert_eq!(
        (r.reason.as_str(), r.endpoints[0].predicted_cached_tokens),
        ("prefix", 36)
    );
    let r = pool.pick(ids_req("b", p(2))).await.unwrap();
    assert_eq!(
        (r.reason.as_str(), r.endpoints[0].predicted_cached_tokens),
        ("prefix", 36)
    );
    let r = pool.pick(ids_req("c", p(1))).await.unwrap();
    assert_eq!(
        (r.reason.as_str(), r.endpoints[0].predicted_cached_tokens),
        ("load", 0)
    );
    // Picking p(1) recorded it again: now p(3), the least recently
    // picked, is the one gone.
    assert_eq!(pool.history_blocks(id), Some(20));
    let r = pool.pick(ids_req("d", p(3))).await.unwrap();
    assert_eq!(r.endpoints[0].predicted_cached_tokens, 0);
}

#[test]
fn set_endpoints_diffs() {
    let pool = pool_with(2, RequestTokenizer::Approx);
    let mut specs: Vec<EndpointSpec> = pool.endpoints().iter().map(|e| e.spec.clone()).collect();
    specs.remove(0);
    specs.push(EndpointSpec {
        address: "127.0.0.1:9999".into(),
        kv_events: "tcp://127.0.0.1:1".into(),
        replay: None,
        metrics_url: None,
        topic: String::new(),
    });
    let ch = pool.set_endpoints(specs, |_| None);
    assert_eq!(ch.added, vec!["127.0.0.1:9999".to_string()]);
    assert_eq!(ch.removed, vec!["127.0.0.1:8000".to_string()]);
    let st = pool.state();
    assert_eq!(st.endpoints.len(), 2);
    assert!(st.endpoints[0].healthy, "kept endpoint keeps its state");
    assert!(!st.endpoints[1].healthy, "new endpoint waits for a scrape");
}

/// A conversation's next turn, sent right after the last one finished,
/// stays on the engine holding its (short) history even though that
/// engine's last scrape, taken while the last turn ran, still counts it
/// running: the report that it is done takes it off that count.
#[tokio::test]
async fn a_request_reported_done_no_longer_counts_as_running() {
    let pool = pool_with(3, RequestTokenizer::Approx);
    let holder = "127.0.0.1:8001";
    let turn: Vec<u32> = (0..12).collect();
    store(&pool, holder, &turn);
    let r = pool.pick(ids_req("t1", turn.clone())).await.unwrap();
    assert_eq!(r.endpoints[0].address, holder);
    // Scraped while t1 ran.
    let busy = EngineLoad {
        running: 1,
        ..EngineLoad::default()
    };
    pool.load
        .record_scrape(EndpointId::from_address(holder), Some(busy), Instant::now());
    done(&pool, "t1");
    let next: Vec<u32> = (0..16).collect();
    let r = pool.pick(ids_req("t2", next)).await.unwrap();
    assert_eq!(r.endpoints[0].address, holder, "{r:?}");
    assert_eq!(r.endpoints[0].predicted_cached_tokens, 12);
}

/// The placement term is in each endpoint's score breakdown: a second new
/// conversation sees it on the endpoint the first one started on, and goes
/// elsewhere.
#[tokio::test]
async fn the_placement_term_is_in_the_score_breakdown() {
    let pool = pool_with(2, RequestTokenizer::Approx);
    let first = pool.pick(ids_req("c1", (0..40).collect())).await.unwrap();
    let taken = first.endpoints[0].address.clone();
    let second = pool
        .pick(ids_req("c2", (5000..5040).collect()))
        .await
        .unwrap();
    let placement = |address: &str| {
        second
            .endpoints
            .iter()
            .find(|e| e.address == address)
            .and_then(|e| e.score.as_ref())
            .map(|s| s.placement)
            .unwrap()
    };
    assert!(placement(&taken) > 0.0, "{second:?}");
    assert_ne!(second.endpoints[0].address, taken, "{second:?}");
    assert_eq!(placement(&second.endpoints[0].address), 0.0);
}
