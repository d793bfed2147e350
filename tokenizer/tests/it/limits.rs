//! `encode_prefix_limited`: bounded work per call, ids still exact. Below
//! the limits nothing changes (ids equal Hugging Face `tokenizers`'); past
//! them the ids are a prefix of the whole text's, stopped before the first
//! piece that would exceed a limit.

use crate::common;
use common::{assert_same_ids, document, tokenizer_dir, FAST, REFERENCE};
use kvasir_tokenizer::{ChatMessage, ChatTokenizer, EncodeLimits};

/// The indexer's defaults (`tokenizeBudget` in its config).
const DEFAULTS: EncodeLimits = EncodeLimits {
    max_bytes: 128 * 1024,
    max_piece_bytes: 4096,
};

fn limited(tok: &ChatTokenizer, text: &str, limits: EncodeLimits) -> kvasir_tokenizer::PrefixIds {
    tok.encode_prefix_limited(text, 16, &mut |_| true, limits)
}

#[test]
fn below_the_limits_ids_equal_the_reference() {
    let tok = ChatTokenizer::from_dir(tokenizer_dir())
        .expect("load")
        .with_cache_bytes(0);
    for seed in 1..=60u64 {
        let doc = document(seed, 8192);
        let p = limited(&tok, &doc, DEFAULTS);
        assert!(p.complete() && !p.limited, "seed {seed}");
        let reference = REFERENCE.encode(&doc).expect("reference encode");
        assert_same_ids(&format!("seed {seed}"), &doc, &p.ids, &reference);
    }
    // The heap path's long pieces, up to the piece limit.
    for text in [" ".repeat(4096), "a".repeat(4000), "=".repeat(4095) + "\n"] {
        let p = limited(&tok, &text, DEFAULTS);
        assert!(!p.limited);
        let reference = REFERENCE.encode(&text).expect("reference encode");
        assert_same_ids("long piece", &text, &p.ids, &reference);
    }
}

#[test]
fn a_piece_over_the_limit_stops_the_encoding_before_it() {
    let head = "Here is the file:\n";
    let text = format!("{head}{} and more words after it", "a".repeat(10_000));
    let p = limited(&FAST, &text, DEFAULTS);
    assert!(p.limited && !p.complete());
    // Stopped at the piece's start: the head's ids, exactly.
    assert_eq!(p.stopped_at, Some(head.len()));
    assert_eq!(p.ids, FAST.encode(head));
    assert_eq!(&FAST.encode(&text)[..p.ids.len()], &p.ids[..]);
    // The rest is estimated, not dropped.
    assert!(
        p.estimated_len() > p.ids.len() + 1000,
        "{}",
        p.estimated_len()
    );
}

#[test]
fn the_byte_budget_bounds_the_encoded_text() {
    let tok = ChatTokenizer::from_dir(tokenizer_dir())
        .expect("load")
        .with_cache_bytes(0);
    let text = document(77, 200_000);
    let whole = tok.encode(&text);
    for budget in [1, 1000, 50_000] {
        let limits = EncodeLimits {
            max_bytes: budget,
            max_piece_bytes: 4096,
        };
        let p = limited(&tok, &text, limits);
        assert!(p.limited, "budget {budget}");
        let at = p.stopped_at.expect("stopped");
        // Added tokens (the corpus has some) cost nothing: a little slack.
        assert!(
            at <= budget + budget / 25 + 100,
            "budget {budget}: stopped at {at}"
        );
        assert!(at + 4096 > budget, "budget {budget}: stopped early at {at}");
        assert_eq!(&whole[..p.ids.len()], &p.ids[..], "budget {budget}");
        if budget >= 50_000 {
            let est = p.estimated_len() as f64;
            let real = whole.len() as f64;
            assert!(
                (est - real).abs() < 0.2 * real,
                "estimated {est} for {real}"
            );
        }
    }
}

#[test]
fn cached_segments_cost_no_budget_and_limited_ones_are_not_cached() {
    let tok = ChatTokenizer::from_dir(tokenizer_dir()).expect("load");
    // Plain words: one segment (the corpus's added tokens would split it).
    let words = ["cache", "prefix", "token", "router", "engine", "latency"];
    let body: Vec<&str> = (0..4000).map(|i| words[(i * 7 + i / 5) % 6]).collect();
    let msgs = [ChatMessage::new("user", body.join(" "))];
    let tiny = EncodeLimits {
        max_bytes: 2000,
        max_piece_bytes: 4096,
    };
    let first = tok
        .encode_chat_prefix_limited(&msgs, true, 16, &mut |_| true, tiny)
        .expect("template");
    assert!(first.limited);
    // Not cached as if whole: still limited the second time.
    let again = tok
        .encode_chat_prefix_limited(&msgs, true, 16, &mut |_| true, tiny)
        .expect("template");
    assert!(again.limited);
    assert_eq!(again.ids, first.ids);
    // Encoded whole once (cached), the message body costs nothing.
    let whole = tok.encode_chat(&msgs, true).expect("template");
    let warm = tok
        .encode_chat_prefix_limited(&msgs, true, 16, &mut |_| true, tiny)
        .expect("template");
    assert!(warm.complete() && !warm.limited);
    assert_eq!(warm.ids, whole);
}

#[test]
fn pathological_texts_stop_within_the_limits() {
    let mb = 1 << 20;
    let cases = [
        "a".repeat(mb),
        " ".repeat(mb),
        "{[\"".repeat(mb / 3),
        "缓".repeat(mb / 3),
        "ab ".repeat(mb / 3),
    ];
    for text in &cases {
        let p = limited(&FAST, text, DEFAULTS);
        assert!(p.limited, "{:?}...", &text[..6]);
        assert!(p.stopped_at.is_some_and(|at| at <= DEFAULTS.max_bytes));
        assert_eq!(&FAST.encode(&text[..p.stopped_at.unwrap_or(0)]), &p.ids);
    }
}

#[test]
fn long_text_to_normalize_is_normalized_only_as_far_as_the_budget_reaches() {
    let tok = ChatTokenizer::from_dir(tokenizer_dir())
        .expect("load")
        .with_cache_bytes(0);
    let small = EncodeLimits {
        max_bytes: 1000,
        max_piece_bytes: 4096,
    };
    // Decomposed accents (NFC composes them), words of them, 1 MB.
    let words = "cafe\u{301} ou\u{300} na\u{308}ive ".repeat(1 << 15);
    // The head is cut inside a whitespace run with one early newline: the
    // whole text's piece is `\n` + the run + `\n` (too long, refused); the
    // head's would have been a lone `\n`.
    let run = format!("{}\n{}\nafter", "e\u{301}".repeat(300), " ".repeat(9000));
    for (label, text, limits) in [
        ("words", &words, small),
        ("words, defaults", &words, DEFAULTS),
        ("run", &run, small),
    ] {
        let p = limited(&tok, text, limits);
        assert!(p.limited, "{label}");
        let whole = tok.encode(text);
        assert!(p.ids.len() < whole.len(), "{label}");
        assert_eq!(&whole[..p.ids.len()], &p.ids[..], "{label}");
    }
    let p = limited(&tok, &run, small);
    assert_eq!(p.ids, tok.encode(&"e\u{301}".repeat(300)));
}
