//! `encode_prefix`: the ids are always a prefix of `encode`'s, whole when
//! the caller never says stop, and the caller is asked at block boundaries
//! inside uncached text only.

use crate::common;
use common::{document, tokenizer_dir};
use kvasir_tokenizer::ChatTokenizer;

fn fresh() -> ChatTokenizer {
    ChatTokenizer::from_dir(tokenizer_dir()).expect("load")
}

fn chat(system: &str, user: &str) -> String {
    format!(
        "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )
}

/// Plain words: short pieces, one kind of text.
fn prose(seed: usize, n: usize) -> String {
    let words = [
        "cache", "prefix", "token", "router", "engine", "latency", "batch",
    ];
    (0..n)
        .map(|i| words[(i * 7 + seed * 13 + i / 5) % words.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn never_stopping_gives_all_ids() {
    let tok = fresh();
    for seed in 0..20u64 {
        let text = chat(&document(seed, 3000), &document(seed + 100, 2000));
        let mut asked = 0;
        let p = tok.encode_prefix(&text, 16, &mut |_| {
            asked += 1;
            true
        });
        assert!(p.complete(), "seed {seed}");
        assert_eq!(p.ids, tok.encode(&text), "seed {seed}");
        assert_eq!(p.estimated_len(), p.ids.len());
        // Doubling distances: a handful of checks, not one per block.
        assert!(
            (1..=12).contains(&asked),
            "seed {seed}: asked {asked} times"
        );
    }
}

#[test]
fn stopping_anywhere_gives_a_prefix_at_a_block_boundary_or_past_it() {
    // No segment cache: every run asks the same questions.
    let t = fresh().with_cache_bytes(0);
    for seed in 0..30u64 {
        let text = chat(&document(seed, 2000), &document(seed + 7, 3000));
        let whole = t.encode(&text);
        // Stop at the k-th question.
        for k in 1..4 {
            let mut seen = Vec::new();
            let p = t.encode_prefix(&text, 16, &mut |ids| {
                seen.push(ids.len());
                seen.len() < k
            });
            assert!(seen.iter().all(|n| n % 16 == 0), "seed {seed}: {seen:?}");
            assert!(
                seen.windows(2).all(|w| w[1] > w[0]),
                "seed {seed}: {seen:?}"
            );
            assert!(!p.complete());
            let stop = *seen.last().unwrap();
            // Encoding stops on the piece that reached the checkpoint.
            assert!(
                p.ids.len() >= stop && p.ids.len() < stop + 64,
                "seed {seed}"
            );
            assert_eq!(&p.ids[..], &whole[..p.ids.len()], "seed {seed} k {k}");
            let at = p.stopped_at.unwrap();
            assert!(at > 0 && at < text.len());
            assert!(p.estimated_len() >= p.ids.len());
        }
    }
}

#[test]
fn the_estimate_is_close_on_text_of_one_kind() {
    let tok = fresh();
    let tok = tok.with_cache_bytes(0);
    for seed in 0..5 {
        let text = chat(&prose(seed, 3000), &prose(seed + 1, 2000));
        let whole = tok.encode(&text).len() as f64;
        let p = tok.encode_prefix(&text, 16, &mut |ids| ids.len() < 1000);
        let est = p.estimated_len() as f64;
        assert!(
            (est / whole - 1.0).abs() < 0.1,
            "seed {seed}: {est} vs {whole}"
        );
    }
}

#[test]
fn cached_text_is_not_asked_about_and_the_first_question_is_the_block_of_the_first_new_text() {
    let tok = fresh();
    let system = prose(1, 800);
    let first = chat(&system, &prose(2, 200));
    // Warm the cache with the system prompt (and that user turn).
    let _ = tok.encode(&first);
    let second = chat(&system, &prose(3, 200));
    // (Not `tok.encode`: that would cache the new turn.)
    let whole = fresh().with_cache_bytes(0).encode(&second);
    // The first uncached text is the glue after the system prompt's
    // `<|im_end|>` (short texts are never cached).
    let glue = tok
        .encode(&format!("<|im_start|>system\n{system}<|im_end|>"))
        .len();
    let mut seen = Vec::new();
    let p = tok.encode_prefix(&second, 16, &mut |ids| {
        seen.push(ids.len());
        false
    });
    assert_eq!(seen, vec![(glue / 16 + 1) * 16]);
    assert_eq!(&p.ids[..], &whole[..p.ids.len()]);
    // Stopped on the piece (a word here) that reached the checkpoint.
    assert!(
        p.ids.len() <= seen[0] + 2,
        "glue {glue}, seen {seen:?}, ids {}",
        p.ids.len()
    );
}

#[test]
fn a_stopped_segment_is_not_cached_and_a_finished_one_is() {
    let tok = fresh();
    let text = chat(&document(5, 3000), &document(6, 3000));
    let p = tok.encode_prefix(&text, 16, &mut |_| false);
    assert!(!p.complete());
    // Asked again: the stopped part was not cached as if it were whole.
    let mut asked = 0;
    let again = tok.encode_prefix(&text, 16, &mut |_| {
        asked += 1;
        true
    });
    assert!(asked > 0);
    assert_eq!(again.ids, tok.encode(&text));
    // Now the long segments are cached: only the short template glue
    // (never cached) is asked about, at most a few times.
    let mut asked = 0;
    let third = tok.encode_prefix(&text, 16, &mut |_| {
        asked += 1;
        true
    });
    assert!(asked < 8, "{asked}");
    assert_eq!(third.ids, again.ids);
}

#[test]
fn chat_prefix_matches_encode_chat() {
    let tok = fresh();
    let msgs = vec![
        kvasir_tokenizer::ChatMessage::new("system", document(8, 2000)),
        kvasir_tokenizer::ChatMessage::new("user", document(9, 2000)),
    ];
    let p = tok
        .encode_chat_prefix(&msgs, true, 16, &mut |_| true)
        .unwrap();
    assert_eq!(p.ids, tok.encode_chat(&msgs, true).unwrap());
    assert!(tok
        .encode_chat_prefix(&[], true, 16, &mut |_| true)
        .is_err());
}
