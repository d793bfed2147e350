//! In-process tokenization stops where no engine holds the prompt: the
//! ids it keeps route exactly as the whole prompt's would, the rest is
//! estimated, and a stopped pick's chain is completed for later requests.
//! Needs the Qwen3 tokenizer (`make setup`).

use crate::service_support;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvasir_cache_indexer::events::EngineHash;
use kvasir_cache_indexer::load::{LoadConfig, LoadTracker};
use kvasir_cache_indexer::scoring::Weights;
use kvasir_cache_indexer::tokenize::RequestTokenizer;
use kvasir_cache_indexer::types::EndpointId;
use kvasir_cache_indexer::{stored_batch, Pool};
use kvasir_proto::v1 as pb;
use kvasir_tokenizer::{ChatMessage, ChatTokenizer};
use service_support::{chat_pick, filler, tokenizer_dir, POOL};

const BLOCK: u32 = 16;

/// The tokenizer without a segment cache, for expected values: computing
/// them with the pool's own tokenizer would cache the text under test.
fn reference() -> ChatTokenizer {
    ChatTokenizer::from_dir(tokenizer_dir())
        .expect("Qwen3 tokenizer")
        .with_cache_bytes(0)
}

fn pool(n: usize) -> (Pool, Arc<ChatTokenizer>) {
    let tok = Arc::new(ChatTokenizer::from_dir(tokenizer_dir()).expect("Qwen3 tokenizer"));
    let pool = Pool::new(
        POOL,
        "m",
        BLOCK,
        RequestTokenizer::Local(Arc::clone(&tok)),
        LoadTracker::new(LoadConfig::default()),
        Weights::default(),
    );
    pool.set_idle_loopback_endpoints(n);
    (pool, tok)
}

/// Stores the full blocks of `ids` on `address`, as its engine's events would.
fn store(pool: &Pool, address: &str, ids: &[u32], hash_base: u64) {
    let blocks = ids.len() / BLOCK as usize;
    let hashes = (0..blocks as u64)
        .map(|i| EngineHash::U64(hash_base + i))
        .collect();
    let batch = stored_batch(hashes, ids[..blocks * BLOCK as usize].to_vec(), BLOCK);
    pool.index.apply(EndpointId::from_address(address), &batch);
    pool.index.flush_blocking();
}

fn msgs(pairs: &[(&str, &String)]) -> Vec<ChatMessage> {
    pairs
        .iter()
        .map(|(r, c)| ChatMessage::new(*r, c.as_str()))
        .collect()
}

fn req(id: &str, pairs: &[(&str, &String)]) -> pb::PickRequest {
    let owned: Vec<(&str, String)> = pairs.iter().map(|(r, c)| (*r, (*c).clone())).collect();
    chat_pick(id, &owned)
}

#[tokio::test]
async fn a_fresh_turn_after_a_cached_history_stops_early_and_routes_to_the_history() {
    let (pool, _) = pool(3);
    let tok = reference();
    let system = filler(1, 3000);
    let earlier = filler(2, 500);
    let answer = filler(3, 300);
    // The conversation so far is cached on endpoint 2.
    let history = tok
        .encode_chat(
            &msgs(&[
                ("system", &system),
                ("user", &earlier),
                ("assistant", &answer),
            ]),
            false,
        )
        .unwrap();
    store(&pool, "127.0.0.1:8002", &history, 10_000);
    // Endpoint 0 holds the system prompt only.
    let sys_ids = tok
        .encode_chat(&msgs(&[("system", &system)]), false)
        .unwrap();
    store(&pool, "127.0.0.1:8000", &sys_ids, 50_000);

    let fresh = filler(4, 2000);
    let turn = [
        ("system", &system),
        ("user", &earlier),
        ("assistant", &answer),
        ("user", &fresh),
    ];
    let whole = tok.encode_chat(&msgs(&turn), true).unwrap();
    let r = pool.pick(req("r1", &turn)).await.unwrap();
    assert_eq!(r.endpoints[0].address, "127.0.0.1:8002");
    // Exactly the cached blocks are predicted (the history as rendered
    // last time and as rendered now agree up to the last assistant turn).
    let common = history
        .iter()
        .zip(&whole)
        .take_while(|(a, b)| a == b)
        .count();
    let cached = (common / BLOCK as usize * BLOCK as usize) as u32;
    assert_eq!(r.endpoints[0].predicted_cached_tokens, cached);
    assert_eq!(pool.metrics.tokenize_stopped.get(), 1);
    // The fresh turn was not tokenized; its length is estimated closely.
    let skipped = pool.metrics.tokens_not_tokenized.get() as f64;
    let fresh_len = (whole.len() - common) as f64;
    assert!(
        skipped > 0.8 * fresh_len && skipped < 1.2 * fresh_len,
        "{skipped} vs {fresh_len}"
    );
    let est = f64::from(r.prompt_tokens);
    assert!(
        (est / whole.len() as f64 - 1.0).abs() < 0.05,
        "{est} vs {}",
        whole.len()
    );
}

#[tokio::test]
async fn a_prompt_held_to_its_end_is_tokenized_whole() {
    let (pool, _) = pool(2);
    let tok = reference();
    let system = filler(5, 2000);
    let user = filler(6, 400);
    let turn = [("system", &system), ("user", &user)];
    let whole = tok.encode_chat(&msgs(&turn), true).unwrap();
    store(&pool, "127.0.0.1:8001", &whole, 10_000);
    // The pool's tokenizer has seen none of it: all new text, all held.
    let r = pool.pick(req("r1", &turn)).await.unwrap();
    assert_eq!(r.endpoints[0].address, "127.0.0.1:8001");
    assert_eq!(r.prompt_tokens as usize, whole.len());
    assert_eq!(pool.metrics.tokenize_stopped.get(), 0);
}

#[tokio::test]
async fn a_burst_sharing_a_fresh_document_follows_the_first_pick() {
    let (pool, _tok) = pool(4);
    let doc = filler(7, 6000);
    let q1 = filler(8, 50);
    let q2 = filler(9, 50);
    // Nothing is cached anywhere: the first pick stops at once.
    let first = pool
        .pick(req("a", &[("user", &format!("{doc}\n{q1}"))]))
        .await
        .unwrap();
    assert_eq!(pool.metrics.tokenize_stopped.get(), 1);
    let home = first.endpoints[0].address.clone();
    // Its chain is completed off the pick's path (blocking pool). Probes
    // carry no request id, so they are not accounted as picks themselves.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = pool
            .pick(req("", &[("user", &format!("{doc}\n{q2}"))]))
            .await
            .unwrap();
        if r.endpoints[0].address == home && r.endpoints[0].predicted_cached_tokens > 4000 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the first pick's chain was never completed: first {first:?}, last {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_salted_request_is_not_tokenized_past_the_first_new_text() {
    let (pool, _) = pool(2);
    let tok = reference();
    let system = filler(10, 2000);
    let turn = [("system", &system)];
    let whole = tok.encode_chat(&msgs(&turn), true).unwrap();
    store(&pool, "127.0.0.1:8001", &whole, 10_000);
    let mut r = req("s", &turn);
    r.hints = Some(pb::Hints {
        cache_salt: "tenant-a".into(),
        ..Default::default()
    });
    let a = pool.pick(r).await.unwrap();
    assert_eq!(pool.metrics.tokenize_stopped.get(), 1);
    assert_eq!(a.endpoints[0].predicted_cached_tokens, 0);
    let est = f64::from(a.prompt_tokens);
    assert!(
        (est / whole.len() as f64 - 1.0).abs() < 0.1,
        "{est} vs {}",
        whole.len()
    );
}
