//! Loading: bad or unsupported files are errors (never panics, never a
//! tokenizer that silently differs from Hugging Face's), and the small
//! synthetic tokenizer used here agrees with the reference too.

use std::path::PathBuf;

use kvasir_tokenizer::reference::ReferenceTokenizer;
use kvasir_tokenizer::{ChatMessage, ChatTokenizer, TokenizerError};
use serde_json::{json, Value};

const QWEN_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-2's byte-to-character map, to write a byte-level vocabulary.
fn byte_char(b: u8) -> char {
    let mut extra = 0u32;
    for x in 0..=255u8 {
        let printable = matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if !printable {
            extra += 1;
        }
        if x == b {
            let cp = if printable { u32::from(b) } else { 255 + extra };
            return char::from_u32(cp).expect("valid");
        }
    }
    unreachable!()
}

/// A complete, small Qwen-shaped tokenizer.json: 256 byte tokens, a few
/// merges (the last one out of id order), NFC, Qwen's pre-tokenizer.
fn small_tokenizer() -> Value {
    let mut vocab = serde_json::Map::new();
    for b in 0..=255u8 {
        vocab.insert(byte_char(b).to_string(), json!(b));
    }
    let merges: [(&[u8], &[u8]); 8] = [
        (b" ", b"t"),
        (b"h", b"e"),
        (b" t", b"he"),
        (b"i", b"n"),
        (b"in", b"g"),
        (&[0xC3], &[0xA9]), // é
        (&[0xC3, 0xA9], b"t"),
        (b" ", b" "),
    ];
    let bl = |b: &[u8]| -> String { b.iter().copied().map(byte_char).collect() };
    let mut merge_list = Vec::new();
    for (id, (a, b)) in (256..).zip(merges) {
        vocab.insert(bl(&[a, b].concat()), json!(id));
        merge_list.push(json!([bl(a), bl(b)]));
    }
    merge_list.swap(0, 1); // ranks need not follow ids
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [
            {"id": 300, "content": "<|im_start|>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true},
            {"id": 301, "content": "<|im_end|>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true},
            {"id": 302, "content": "caf\u{e9}", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": true, "special": false}
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_PATTERN}, "behavior": "Isolated",
             "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
             "use_regex": false}
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false,
                    "use_regex": false},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merge_list}
    })
}

fn small_config() -> Value {
    json!({
        "eos_token": "<|im_end|>",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    })
}

fn load(tokenizer: &Value, config: &Value) -> Result<ChatTokenizer, TokenizerError> {
    ChatTokenizer::from_json(&tokenizer.to_string(), &config.to_string())
}

#[test]
fn small_tokenizer_matches_reference() {
    let tokenizer = small_tokenizer();
    let fast = load(&tokenizer, &small_config()).expect("load");
    let reference = ReferenceTokenizer::from_json(&tokenizer.to_string()).expect("reference");
    for text in [
        "the thing  in the ring",
        "<|im_start|>the<|im_end|>",
        // `café` is a normalized added token: found after NFC, so the
        // decomposed spelling matches too.
        "a café, a cafe\u{301}, caf\u{e9}s",
        "été  \t\n\nété",
    ] {
        assert_eq!(
            fast.encode(text),
            reference.encode(text).expect("reference"),
            "{text:?}"
        );
    }
    // The file lists ids 300-302, but HF numbers added tokens from the
    // vocabulary's size (264 here) and only warns; so must we.
    assert_eq!(fast.token_to_id("<|im_start|>"), Some(264));
    assert_eq!(fast.eos_token_id(), 265);
    assert_eq!(fast.vocab_size(), 256 + 8 + 3);
    let ids = fast
        .encode_chat(&[ChatMessage::new("user", "the")], true)
        .expect("chat");
    assert_eq!(ids[0], 264);
}

#[test]
fn missing_files_are_io_errors() {
    let err = ChatTokenizer::from_dir("/nonexistent/kvasir").expect_err("no dir");
    assert!(matches!(err, TokenizerError::Io { .. }), "{err}");
    assert!(err
        .to_string()
        .contains("/nonexistent/kvasir/tokenizer.json"));
}

#[test]
fn malformed_json_names_the_file() {
    let config = small_config().to_string();
    for bad in ["", "{", "[1, 2]", "{\"model\": 3}", "not json"] {
        match ChatTokenizer::from_json(bad, &config) {
            Err(TokenizerError::Json {
                what: "tokenizer.json",
                ..
            }) => {}
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    let tokenizer = small_tokenizer().to_string();
    match ChatTokenizer::from_json(&tokenizer, "{\"chat_template\": 5") {
        Err(TokenizerError::Json {
            what: "tokenizer_config.json",
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
}

fn expect_err(tokenizer: Value, config: Value, want: fn(&TokenizerError) -> bool) {
    match load(&tokenizer, &config) {
        Err(e) if want(&e) => {}
        Err(e) => panic!("wrong error: {e:?}"),
        Ok(_) => panic!("loaded, but should not have"),
    }
}

fn unsupported(e: &TokenizerError) -> bool {
    matches!(e, TokenizerError::Unsupported(_))
}

fn invalid(e: &TokenizerError) -> bool {
    matches!(e, TokenizerError::Invalid(_))
}

#[test]
fn inconsistent_files_are_invalid() {
    let mut t = small_tokenizer();
    t["model"]["merges"]
        .as_array_mut()
        .expect("merges")
        .push(json!(["nope", "x"]));
    expect_err(t, small_config(), invalid);

    let mut t = small_tokenizer();
    t["model"]["merges"] = json!(["nospace"]);
    expect_err(t, small_config(), invalid);

    let mut t = small_tokenizer();
    t["model"]["vocab"]["\u{120}the"] = json!(4_000_000_000u32);
    expect_err(t, small_config(), invalid);

    let mut c = small_config();
    c["eos_token"] = json!("<|not_a_token|>");
    expect_err(small_tokenizer(), c, invalid);

    let mut c = small_config();
    c.as_object_mut().expect("object").remove("chat_template");
    expect_err(small_tokenizer(), c, invalid);
}

#[test]
fn features_not_reproduced_exactly_are_refused() {
    let cases: Vec<(&str, Value)> = vec![
        ("/normalizer", json!({"type": "NFKC"})),
        ("/normalizer", json!({"type": "Lowercase"})),
        (
            "/pre_tokenizer",
            json!({"type": "Metaspace", "replacement": "▁"}),
        ),
        ("/pre_tokenizer", Value::Null),
        (
            "/pre_tokenizer/pretokenizers/0/pattern/Regex",
            json!(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"),
        ),
        (
            "/pre_tokenizer/pretokenizers/1/add_prefix_space",
            json!(true),
        ),
        (
            "/truncation",
            json!({"max_length": 8, "strategy": "LongestFirst", "stride": 0}),
        ),
        ("/padding", json!({"strategy": "BatchLongest"})),
        ("/model/type", json!("WordPiece")),
        ("/model/byte_fallback", json!(true)),
        ("/model/dropout", json!(0.1)),
        ("/added_tokens/0/lstrip", json!(true)),
    ];
    for (pointer, value) in cases {
        let mut t = small_tokenizer();
        *t.pointer_mut(pointer)
            .unwrap_or_else(|| panic!("{pointer} exists")) = value;
        match load(&t, &small_config()) {
            Err(TokenizerError::Unsupported(_)) => {}
            other => panic!("{pointer}: {other:?}"),
        }
    }
    // A byte with no token: BPE could not even start.
    let mut t = small_tokenizer();
    t["model"]["vocab"]
        .as_object_mut()
        .expect("vocab")
        .remove("a");
    expect_err(t, small_config(), unsupported);
    // A non-byte-level vocabulary entry.
    let mut t = small_tokenizer();
    t["model"]["vocab"]["\u{4e2d}"] = json!(500);
    expect_err(t, small_config(), unsupported);
}

#[test]
fn template_syntax_errors_are_template_errors() {
    let mut c = small_config();
    c["chat_template"] = json!("{% for m in messages %}{{ m.content }");
    expect_err(small_tokenizer(), c, |e| {
        matches!(e, TokenizerError::Template(_))
    });
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn from_dir_falls_back_to_chat_template_jinja() {
    let dir =
        TempDir(std::env::temp_dir().join(format!("kvasir-tokenizer-test-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).expect("mkdir");
    std::fs::write(dir.0.join("tokenizer.json"), small_tokenizer().to_string()).expect("write");
    std::fs::write(
        dir.0.join("tokenizer_config.json"),
        json!({"eos_token": {"content": "<|im_end|>"}}).to_string(),
    )
    .expect("write");
    std::fs::write(
        dir.0.join("chat_template.jinja"),
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}",
    )
    .expect("write");
    let tok = ChatTokenizer::from_dir(&dir.0).expect("load");
    assert_eq!(
        tok.render_chat(&[ChatMessage::new("user", "hi")], false)
            .expect("render"),
        "[user] hi\n"
    );
    let tok = ChatTokenizer::from_files(
        dir.0.join("tokenizer.json"),
        dir.0.join("tokenizer_config.json"),
    );
    assert!(
        matches!(tok, Err(TokenizerError::Invalid(_))),
        "no template in config"
    );
}
