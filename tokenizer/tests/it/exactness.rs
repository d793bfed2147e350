//! The fast encoder must give exactly the ids of Hugging Face `tokenizers`
//! (what vLLM uses) on any text. The reference is slow in debug builds:
//! run these with `cargo test -p kvasir-tokenizer --release`.

use crate::common;
use common::{assert_same_ids, document, FAST, REFERENCE};
use kvasir_tokenizer::ChatTokenizer;

#[test]
fn varied_corpus_matches_reference() {
    let mut bytes = 0;
    let mut tokens = 0;
    for seed in 1..=120u64 {
        let doc = document(seed, 4096);
        let fast = FAST.encode(&doc);
        let reference = REFERENCE.encode(&doc).expect("reference encode");
        assert_same_ids(&format!("document seed {seed}"), &doc, &fast, &reference);
        bytes += doc.len();
        tokens += fast.len();
    }
    assert!(bytes > 400_000, "corpus too small: {bytes} bytes");
    eprintln!("{bytes} bytes, {tokens} tokens identical");
}

#[test]
fn one_large_text_matches_reference() {
    let doc: String = (1000..1040u64).map(|s| document(s, 8192)).collect();
    let fast = FAST.encode(&doc);
    let reference = REFERENCE.encode(&doc).expect("reference encode");
    assert_same_ids("concatenated corpus", &doc, &fast, &reference);
}

/// Every character class decision and NFC table entry, in the contexts the
/// regex distinguishes (after and before letters, doubled, after a space,
/// before a digit, after an apostrophe, before a newline) and between
/// combining marks, where canonical reordering and composition depend on
/// the Unicode version of the NFC tables (188 code points normalize
/// differently with current tables than with the Unicode 9 ones `tokenizers`
/// uses). Planes 4-13 hold no assigned characters and are sampled.
#[test]
fn every_code_point_in_context_matches_reference() {
    let chars: Vec<char> = (0u32..=0x10FFFF)
        .filter(|&cp| !(0x40000..0xE0000).contains(&cp) || cp % 251 == 0)
        .filter_map(char::from_u32)
        .collect();
    for chunk in chars.chunks(2048) {
        let mut text = String::new();
        for &c in chunk {
            for part in [
                c.to_string(),
                "a".into(),
                c.to_string(),
                c.to_string(),
                " ".into(),
                c.to_string(),
                "1'".into(),
                c.to_string(),
                "\n".into(),
                format!("a{c}\u{301}{c}\u{323}\u{F900} "),
            ] {
                text.push_str(&part);
            }
        }
        let fast = FAST.encode(&text);
        let reference = REFERENCE.encode(&text).expect("reference encode");
        assert_same_ids(
            &format!("code points from U+{:04X}", chunk[0] as u32),
            &text,
            &fast,
            &reference,
        );
    }
}

#[test]
fn pieces_long_enough_for_the_heap_path_match_reference() {
    let cases = [
        " ".repeat(10_000),
        "a".repeat(5_000),
        "ab".repeat(3_000),
        "=".repeat(4_000) + "\n",
        "-_".repeat(700),
        "🙂".repeat(600),
        "ÿ".repeat(900),
        format!("x{}y", "\t ".repeat(500)),
        "\n".repeat(1_000),
        "\r\n".repeat(300) + "z",
        "bcdefghijklmnopqrstuvwxyzBCDEFGHIJKLMNOPQRSTUVWXYZ".repeat(40),
    ];
    for text in &cases {
        let fast = FAST.encode(text);
        let reference = REFERENCE.encode(text).expect("reference encode");
        assert_same_ids(&format!("{:?}...", &text[..8]), text, &fast, &reference);
    }
}

#[test]
fn contractions_and_case_folding_match_reference() {
    let text = "I'LL we'Re THEY'VE it'S don'T I'M she'D 'll 'LL 'Ll 'ſ 'ſt 'x 'RE 're 'rex \
                'VE've 'M'm 'D'd ''s ' s '\u{17F}up 'K 'k";
    let fast = FAST.encode(text);
    let reference = REFERENCE.encode(text).expect("reference encode");
    assert_same_ids("contractions", text, &fast, &reference);
}

#[test]
fn cached_and_uncached_encoding_agree() {
    let uncached = ChatTokenizer::from_dir(common::tokenizer_dir())
        .expect("load")
        .with_cache_bytes(0);
    let system = "You are a helpful assistant. ".repeat(50);
    for round in 0..3 {
        for seed in 0..10u64 {
            let text = format!(
                "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n",
                document(seed, 1024)
            );
            assert_eq!(
                FAST.encode(&text),
                uncached.encode(&text),
                "round {round} seed {seed}"
            );
        }
    }
}

#[test]
fn special_tokens_are_single_ids() {
    assert_eq!(FAST.token_to_id("<|im_start|>"), Some(151644));
    assert_eq!(FAST.token_to_id("<|im_end|>"), Some(151645));
    assert_eq!(FAST.token_to_id("<|endoftext|>"), Some(151643));
    assert_eq!(FAST.token_to_id("<think>"), Some(151667));
    assert_eq!(FAST.eos_token_id(), 151645);
    assert_eq!(FAST.vocab_size(), 151_669);
    assert!(FAST.is_special(151645));
    assert!(!FAST.is_special(151667), "<think> is added but not special");
    assert!(!FAST.is_special(100));

    let ids = FAST.encode("<|im_start|>user\nhi<|im_end|>\n<think></think>");
    assert_eq!(ids[0], 151644);
    assert_eq!(ids.iter().filter(|&&id| id == 151645).count(), 1);
    assert_eq!(&ids[ids.len() - 2..], &[151667, 151668]);
    assert_eq!(FAST.encode("<|im_end|>"), vec![151645]);
    assert_eq!(FAST.decode(&[151644]), "<|im_start|>");
    assert_eq!(FAST.id_to_token(151645).as_deref(), Some("<|im_end|>"));
}

#[test]
fn vocabulary_helpers() {
    let the = FAST.token_to_id("Ġthe").expect("Ġthe");
    assert_eq!(FAST.encode(" the"), vec![the]);
    assert_eq!(FAST.id_to_token(the).as_deref(), Some("Ġthe"));
    assert_eq!(FAST.token_to_id("no such token, surely"), None);
    assert_eq!(FAST.id_to_token(u32::MAX), None);
    assert_eq!(FAST.encode(""), Vec::<u32>::new());
}

fn the_id() -> u32 {
    FAST.token_to_id("Ġthe").expect("Ġthe")
}

#[test]
fn decode_inverts_encode() {
    let ascii: String = (0..20u64)
        .map(|s| document(s, 2048))
        .filter(|d| d.is_ascii())
        .collect::<String>()
        + "plain ascii <|im_start|>with specials<|im_end|>\r\n\tand  spaces  ";
    assert_eq!(FAST.decode(&FAST.encode(&ascii)), ascii);
    // Non-ASCII text comes back NFC-normalized, so re-encoding is stable.
    for seed in 0..20u64 {
        let doc = document(seed, 2048);
        let ids = FAST.encode(&doc);
        assert_eq!(FAST.encode(&FAST.decode(&ids)), ids, "seed {seed}");
    }
    // Unknown ids are skipped; split UTF-8 becomes U+FFFD, no panic.
    // (Byte 0xE2 alone, written `â` in byte-level form, starts a 3-byte char.)
    let lone = FAST.token_to_id("â").expect("byte token");
    assert_eq!(FAST.decode(&[lone, u32::MAX, the_id()]), "\u{FFFD} the");
}
