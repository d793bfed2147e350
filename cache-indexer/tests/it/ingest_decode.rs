//! Decoding vLLM KV-event payloads laid out byte for byte as vLLM's msgspec
//! encoder lays them out (FACTS.md "vLLM KV-cache events"): both event
//! layouts, every hash encoding, optional and unknown fields, and garbage.

use crate::testkit;
use kvasir_cache_indexer::events::decode::{decode_batch, DecodedBatch, EngineEvent, EngineHash};
use testkit::Rng;

/// A minimal msgpack writer that emits the smallest encoding of each value,
/// as msgspec does. Written out by hand (not via a msgpack library) so the
/// bytes under test are the wire format itself.
#[derive(Default)]
struct W(Vec<u8>);

impl W {
    fn arr(&mut self, n: usize) -> &mut Self {
        if n < 16 {
            self.0.push(0x90 | n as u8);
        } else if n < 65536 {
            self.0.push(0xdc);
            self.0.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            self.0.push(0xdd);
            self.0.extend_from_slice(&(n as u32).to_be_bytes());
        }
        self
    }
    fn map(&mut self, n: usize) -> &mut Self {
        assert!(n < 16);
        self.0.push(0x80 | n as u8);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        let n = s.len();
        if n < 32 {
            self.0.push(0xa0 | n as u8);
        } else {
            self.0.push(0xd9);
            self.0.push(n as u8);
        }
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    fn uint(&mut self, v: u64) -> &mut Self {
        if v < 128 {
            self.0.push(v as u8);
        } else if v <= 0xff {
            self.0.extend_from_slice(&[0xcc, v as u8]);
        } else if v <= 0xffff {
            self.0.push(0xcd);
            self.0.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= 0xffff_ffff {
            self.0.push(0xce);
            self.0.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.0.push(0xcf);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
        self
    }
    fn int(&mut self, v: i64) -> &mut Self {
        if v >= 0 {
            return self.uint(v as u64);
        }
        if v >= -32 {
            self.0.push(v as i8 as u8);
        } else if v >= i8::MIN as i64 {
            self.0.extend_from_slice(&[0xd0, v as i8 as u8]);
        } else if v >= i16::MIN as i64 {
            self.0.push(0xd1);
            self.0.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i32::MIN as i64 {
            self.0.push(0xd2);
            self.0.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.0.push(0xd3);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
        self
    }
    fn f64(&mut self, v: f64) -> &mut Self {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }
    fn nil(&mut self) -> &mut Self {
        self.0.push(0xc0);
        self
    }
    fn bool(&mut self, b: bool) -> &mut Self {
        self.0.push(if b { 0xc3 } else { 0xc2 });
        self
    }
    fn bin(&mut self, b: &[u8]) -> &mut Self {
        assert!(b.len() < 256);
        self.0.extend_from_slice(&[0xc4, b.len() as u8]);
        self.0.extend_from_slice(b);
        self
    }
    fn uints(&mut self, v: &[u64]) -> &mut Self {
        self.arr(v.len());
        for x in v {
            self.uint(*x);
        }
        self
    }
    fn done(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.0)
    }
}

fn tokens(n: usize, base: u64) -> Vec<u64> {
    // A mix of 1-, 2-, 3- and 5-byte encodings, as real token ids are.
    (0..n as u64).map(|i| (base + i * 977) % 151_936).collect()
}

fn as_u32(v: &[u64]) -> Vec<u32> {
    v.iter().map(|x| *x as u32).collect()
}

/// `BlockStored` as vLLM >= 0.23 writes it: a map, tag first, required
/// fields always present, defaulted fields only when set.
fn map_stored(w: &mut W, hashes: &[u64], parent: Option<u64>, toks: &[u64]) {
    w.map(8).str("type").str("BlockStored");
    w.str("block_hashes").uints(hashes);
    w.str("parent_block_hash");
    match parent {
        Some(p) => w.uint(p),
        None => w.nil(),
    };
    w.str("token_ids").uints(toks);
    w.str("block_size").uint(16);
    w.str("lora_id").nil();
    w.str("medium").str("GPU");
    w.str("lora_name").nil();
}

fn batch(events: impl FnOnce(&mut W), n_events: usize, dp_rank: Option<i64>) -> Vec<u8> {
    let mut w = W::default();
    w.arr(3).f64(1_700_000_000.25).arr(n_events);
    events(&mut w);
    match dp_rank {
        Some(r) => w.int(r),
        None => w.nil(),
    };
    w.done()
}

fn stored(e: &EngineEvent) -> (&[EngineHash], Option<EngineHash>, &[u32], u32) {
    match e {
        EngineEvent::BlockStored {
            block_hashes,
            parent,
            token_ids,
            block_size,
            ..
        } => (block_hashes, *parent, token_ids, *block_size),
        other => panic!("expected BlockStored, got {other:?}"),
    }
}

#[test]
fn literal_bytes_all_blocks_cleared_array_layout() {
    // [1.5, [["AllBlocksCleared"]], nil], written out byte for byte.
    let mut p = vec![0x93, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xb0];
    p.extend_from_slice(b"AllBlocksCleared");
    p.push(0xc0);
    let b = decode_batch(&p).unwrap();
    assert_eq!(
        b,
        DecodedBatch {
            ts: 1.5,
            events: vec![EngineEvent::AllBlocksCleared],
            dp_rank: None,
            ignored_events: 0
        }
    );
}

#[test]
fn literal_bytes_block_removed_map_layout() {
    // [0.0, [{"type": "BlockRemoved", "block_hashes": [7, 2^64-1], "medium": "GPU"}], 0]
    let mut p = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x83, 0xa4];
    p.extend_from_slice(b"type");
    p.push(0xac);
    p.extend_from_slice(b"BlockRemoved");
    p.push(0xac);
    p.extend_from_slice(b"block_hashes");
    p.extend_from_slice(&[
        0x92, 0x07, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    ]);
    p.push(0xa6);
    p.extend_from_slice(b"medium");
    p.push(0xa3);
    p.extend_from_slice(b"GPU");
    p.push(0x00);
    let b = decode_batch(&p).unwrap();
    assert_eq!(b.dp_rank, Some(0));
    assert_eq!(
        b.events,
        vec![EngineEvent::BlockRemoved {
            block_hashes: vec![EngineHash::U64(7), EngineHash::U64(u64::MAX)],
            medium: Some("GPU".into()),
            group_idx: None,
        }]
    );
}

#[test]
fn map_block_stored_u64_above_i64_max() {
    let big = [u64::MAX, i64::MAX as u64 + 1, 0x8000_0000_0000_0001];
    let toks = tokens(48, 5);
    let p = batch(
        |w| map_stored(w, &big, Some(u64::MAX - 7), &toks),
        1,
        Some(3),
    );
    let b = decode_batch(&p).unwrap();
    assert_eq!(b.ts, 1_700_000_000.25);
    assert_eq!(b.dp_rank, Some(3));
    let (h, parent, t, bs) = stored(&b.events[0]);
    assert_eq!(h, big.map(EngineHash::U64));
    assert_eq!(parent, Some(EngineHash::U64(u64::MAX - 7)));
    assert_eq!(t, as_u32(&toks));
    assert_eq!(bs, 16);
    match &b.events[0] {
        EngineEvent::BlockStored {
            medium, lora_name, ..
        } => {
            assert_eq!(medium.as_deref(), Some("GPU"));
            assert_eq!(lora_name, &None);
        }
        _ => unreachable!(),
    }
}

#[test]
fn map_missing_optional_fields_and_any_key_order() {
    // Only what has no default; parent absent; "type" last.
    let toks = tokens(16, 1);
    let p = batch(
        |w| {
            w.map(4);
            w.str("token_ids").uints(&toks);
            w.str("block_size").uint(16);
            w.str("block_hashes").uints(&[42]);
            w.str("type").str("BlockStored");
        },
        1,
        None,
    );
    let b = decode_batch(&p).unwrap();
    let (h, parent, t, _) = stored(&b.events[0]);
    assert_eq!(h, [EngineHash::U64(42)]);
    assert_eq!(parent, None);
    assert_eq!(t, as_u32(&toks));
}

#[test]
fn map_extra_and_unknown_fields_are_ignored() {
    let toks = tokens(32, 9);
    let p = batch(
        |w| {
            w.map(15).str("type").str("BlockStored");
            w.str("block_hashes").uints(&[1, 2]);
            w.str("parent_block_hash").nil();
            w.str("token_ids").uints(&toks);
            w.str("block_size").uint(16);
            w.str("lora_id").nil();
            w.str("medium").str("GPU");
            w.str("lora_name").str("sql-adapter");
            // extra_keys: per block, a list of extra keys (mm hashes...)
            w.str("extra_keys")
                .arr(2)
                .nil()
                .arr(1)
                .arr(2)
                .str("abc")
                .int(-5);
            w.str("group_idx").uint(0);
            w.str("kv_cache_spec_kind").str("full_attention");
            w.str("kv_cache_spec_sliding_window").nil();
            w.str("locality").str("LOCAL");
            w.str("session_id").str("s-1");
            // Something a future vLLM might add.
            w.str("future_field")
                .map(2)
                .str("a")
                .f64(1.0)
                .str("b")
                .arr(3)
                .bool(true)
                .bin(&[1, 2, 3])
                .nil();
        },
        1,
        Some(0),
    );
    let b = decode_batch(&p).unwrap();
    match &b.events[0] {
        EngineEvent::BlockStored {
            block_hashes,
            lora_name,
            group_idx,
            kv_cache_spec_kind,
            token_ids,
            ..
        } => {
            assert_eq!(block_hashes.len(), 2);
            assert_eq!(token_ids.len(), 32);
            assert_eq!(lora_name.as_deref(), Some("sql-adapter"));
            assert_eq!(*group_idx, Some(0));
            assert_eq!(kv_cache_spec_kind.as_deref(), Some("full_attention"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn array_layout_minimal_full_and_longer() {
    let toks = tokens(32, 3);
    let p = batch(
        |w| {
            // vLLM <= 0.22 at its oldest: tag + 4 fields.
            w.arr(5)
                .str("BlockStored")
                .uints(&[10, 11])
                .nil()
                .uints(&toks)
                .uint(16);
            // All 11 positional fields.
            w.arr(12).str("BlockStored").uints(&[12]).uint(11);
            w.uints(&toks[..16]).uint(16).nil().str("CPU").str("lora-x");
            w.nil().uint(1).str("sliding_window").uint(4096);
            // More fields than this decoder knows.
            w.arr(14).str("BlockStored").uints(&[13]).uint(12);
            w.uints(&toks[..16]).uint(16).nil().str("GPU").nil();
            w.nil().nil().nil().nil().str("x").map(1).str("y").uint(1);
            w.arr(2).str("BlockRemoved").uints(&[10]);
            w.arr(4).str("BlockRemoved").uints(&[11]).str("GPU").uint(2);
            w.arr(1).str("AllBlocksCleared");
        },
        6,
        Some(1),
    );
    let b = decode_batch(&p).unwrap();
    assert_eq!(b.events.len(), 6);
    let (h, parent, t, _) = stored(&b.events[0]);
    assert_eq!(h, [EngineHash::U64(10), EngineHash::U64(11)]);
    assert_eq!(parent, None);
    assert_eq!(t, as_u32(&toks));
    match &b.events[1] {
        EngineEvent::BlockStored {
            parent,
            medium,
            lora_name,
            group_idx,
            kv_cache_spec_kind,
            ..
        } => {
            assert_eq!(*parent, Some(EngineHash::U64(11)));
            assert_eq!(medium.as_deref(), Some("CPU"));
            assert_eq!(lora_name.as_deref(), Some("lora-x"));
            assert_eq!(*group_idx, Some(1));
            assert_eq!(kv_cache_spec_kind.as_deref(), Some("sliding_window"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(stored(&b.events[2]).0, [EngineHash::U64(13)]);
    assert_eq!(
        b.events[4],
        EngineEvent::BlockRemoved {
            block_hashes: vec![EngineHash::U64(11)],
            medium: Some("GPU".into()),
            group_idx: Some(2)
        }
    );
    assert_eq!(b.events[5], EngineEvent::AllBlocksCleared);
}

#[test]
fn negative_i64_hashes_keep_their_bits() {
    let toks = tokens(32, 0);
    let p = batch(
        |w| {
            w.arr(5).str("BlockStored");
            w.arr(3).int(-1).int(-100).int(i64::MIN);
            w.int(-4_611_686_018_427_387_904).uints(&toks).uint(16);
        },
        1,
        None,
    );
    let b = decode_batch(&p).unwrap();
    let (h, parent, _, _) = stored(&b.events[0]);
    assert_eq!(
        h,
        [
            EngineHash::U64(-1i64 as u64),
            EngineHash::U64(-100i64 as u64),
            EngineHash::U64(i64::MIN as u64)
        ]
    );
    assert_eq!(
        parent,
        Some(EngineHash::U64(-4_611_686_018_427_387_904i64 as u64))
    );
}

#[test]
fn bin32_hashes() {
    let h1 = [0xabu8; 32];
    let mut h2 = [0u8; 32];
    for (i, b) in h2.iter_mut().enumerate() {
        *b = i as u8;
    }
    let toks = tokens(16, 0);
    let p = batch(
        |w| {
            w.map(5).str("type").str("BlockStored");
            w.str("block_hashes").arr(1).bin(&h2);
            w.str("parent_block_hash").bin(&h1);
            w.str("token_ids").uints(&toks);
            w.str("block_size").uint(16);
            w.map(2).str("type").str("BlockRemoved");
            w.str("block_hashes").arr(2).bin(&h1).bin(&h2);
        },
        2,
        None,
    );
    let b = decode_batch(&p).unwrap();
    let (h, parent, _, _) = stored(&b.events[0]);
    assert_eq!(h, [EngineHash::Bytes(h2)]);
    assert_eq!(parent, Some(EngineHash::Bytes(h1)));
    // The index key of a bin hash is a stable 64-bit fold.
    assert_eq!(EngineHash::Bytes(h1).key(), EngineHash::Bytes(h1).key());
    assert_ne!(EngineHash::Bytes(h1).key(), EngineHash::Bytes(h2).key());
    assert_eq!(EngineHash::U64(77).key(), 77);
    match &b.events[1] {
        EngineEvent::BlockRemoved { block_hashes, .. } => {
            assert_eq!(
                block_hashes,
                &[EngineHash::Bytes(h1), EngineHash::Bytes(h2)]
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn batch_shapes_dp_rank_and_unknown_events() {
    // Two elements (no rank), an unknown event kind, extra batch elements.
    let mut w = W::default();
    w.arr(2).f64(2.0).arr(0);
    let b = decode_batch(&w.done()).unwrap();
    assert_eq!((b.events.len(), b.dp_rank), (0, None));

    let mut w = W::default();
    w.arr(5).f64(2.0).arr(3);
    w.map(2).str("type").str("BlockPinned").str("x").uint(1);
    w.arr(3).str("SomethingNew").uint(1).uint(2);
    w.arr(1).str("AllBlocksCleared");
    w.uint(7).str("extra").nil();
    let b = decode_batch(&w.done()).unwrap();
    assert_eq!(b.events, vec![EngineEvent::AllBlocksCleared]);
    assert_eq!(b.ignored_events, 2);
    assert_eq!(b.dp_rank, Some(7));

    // An integral timestamp and a float32 one are accepted.
    let mut w = W::default();
    w.arr(3).uint(1_700_000_000).arr(0).nil();
    assert_eq!(decode_batch(&w.done()).unwrap().ts, 1_700_000_000.0);
    let mut p = vec![0x93, 0xca];
    p.extend_from_slice(&2.5f32.to_be_bytes());
    p.extend_from_slice(&[0x90, 0xc0]);
    assert_eq!(decode_batch(&p).unwrap().ts, 2.5);
}

fn err(p: &[u8]) -> String {
    match decode_batch(p) {
        Ok(b) => panic!("expected an error, decoded {b:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn malformed_payloads_are_errors_that_say_where() {
    assert!(err(&[]).contains("end of payload"));
    assert!(err(&[0xc0]).contains("expected array"));
    assert!(err(&[0x91, 0xcb]).contains("batch"));

    let toks = tokens(16, 0);
    // block_hashes is a string
    let p = batch(
        |w| {
            w.map(4).str("type").str("BlockStored");
            w.str("block_hashes").str("nope");
            w.str("token_ids").uints(&toks);
            w.str("block_size").uint(16);
        },
        1,
        None,
    );
    let e = err(&p);
    assert!(e.contains("events[0].block_hashes"), "{e}");
    // a negative token id
    let p = batch(
        |w| {
            w.arr(5).str("BlockStored").uints(&[1]).nil();
            w.arr(2).uint(5).int(-3).uint(16);
        },
        1,
        None,
    );
    let e = err(&p);
    assert!(
        e.contains("events[0].token_ids") && e.contains("[1]"),
        "{e}"
    );
    // a token id beyond u32
    let p = batch(
        |w| {
            w.arr(5).str("BlockStored").uints(&[1]).nil();
            w.uints(&[1 << 33]).uint(16);
        },
        1,
        None,
    );
    assert!(err(&p).contains("u32"));
    // a 16-byte bin hash
    let p = batch(
        |w| {
            w.arr(2).str("BlockRemoved").arr(1).bin(&[0; 16]);
        },
        1,
        None,
    );
    assert!(err(&p).contains("32 bytes"));
    // a map without "type"
    let p = batch(
        |w| {
            w.map(1).str("block_hashes").uints(&[1]);
        },
        1,
        None,
    );
    assert!(err(&p).contains("no \"type\""));
    // a non-string map key
    let p = batch(
        |w| {
            w.map(1).uint(1).uint(2);
        },
        1,
        None,
    );
    assert!(err(&p).contains("map key"));
    // missing required fields
    let p = batch(
        |w| {
            w.arr(3).str("BlockStored").uints(&[1]).nil();
        },
        1,
        None,
    );
    assert!(err(&p).contains("needs 4 fields"));
    let p = batch(
        |w| {
            w.map(2)
                .str("type")
                .str("BlockStored")
                .str("block_hashes")
                .uints(&[1]);
        },
        1,
        None,
    );
    assert!(err(&p).contains("missing required field"));
    // an empty event array, an event that is a number
    let p = batch(
        |w| {
            w.arr(0);
        },
        1,
        None,
    );
    assert!(err(&p).contains("no tag"));
    let p = batch(
        |w| {
            w.uint(3);
        },
        1,
        None,
    );
    assert!(err(&p).contains("expected event map or array"));
    // a length claim far beyond the payload (must not allocate it)
    let mut p = vec![
        0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff,
    ];
    p.push(0xc0);
    assert!(err(&p).contains("exceeds"));
    // invalid UTF-8 in a tag
    let mut p = vec![
        0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xa2, 0xff, 0xfe, 0xc0,
    ];
    assert!(err(&p).contains("UTF-8"));
    p.truncate(12);
    assert!(decode_batch(&p).is_err());
    // trailing bytes after the batch
    let mut p = batch(|_| {}, 0, None);
    p.push(0x00);
    assert!(err(&p).contains("trailing"));
    // deeply nested unknown field: bounded, an error not a stack overflow
    let mut w = W::default();
    w.arr(3)
        .f64(0.0)
        .arr(1)
        .map(2)
        .str("type")
        .str("AllBlocksCleared")
        .str("deep");
    for _ in 0..100_000 {
        w.arr(1);
    }
    w.nil();
    w.nil();
    assert!(err(&w.done()).contains("too deep"));
    // the reserved byte
    let p = batch(
        |w| {
            w.map(2).str("type").str("AllBlocksCleared").str("x");
            w.0.push(0xc1);
        },
        1,
        None,
    );
    assert!(err(&p).contains("0xc1"));
}

fn sample_payloads() -> Vec<Vec<u8>> {
    let toks = tokens(64, 11);
    vec![
        batch(
            |w| {
                map_stored(w, &[1, u64::MAX, 3, 4], Some(9), &toks);
                w.map(3).str("type").str("BlockRemoved");
                w.str("block_hashes")
                    .uints(&[1, 2])
                    .str("medium")
                    .str("GPU");
                w.map(1).str("type").str("AllBlocksCleared");
            },
            3,
            Some(0),
        ),
        batch(
            |w| {
                w.arr(8)
                    .str("BlockStored")
                    .arr(2)
                    .bin(&[7; 32])
                    .bin(&[8; 32]);
                w.int(-77)
                    .uints(&toks[..32])
                    .uint(16)
                    .nil()
                    .str("GPU")
                    .nil();
                w.arr(3).str("BlockRemoved").arr(1).int(-5).nil();
            },
            2,
            None,
        ),
    ]
}

/// A payload this decoder accepts must be one well-formed msgpack value
/// (cross-checked with `rmpv`).
fn check_consistent(p: &[u8]) {
    if decode_batch(p).is_ok() {
        let mut rd = p;
        assert!(
            rmpv::decode::read_value(&mut rd).is_ok(),
            "accepted non-msgpack {p:02x?}"
        );
        assert!(rd.is_empty(), "accepted trailing bytes");
    }
}

#[test]
fn every_truncation_is_an_error() {
    for p in sample_payloads() {
        assert!(decode_batch(&p).is_ok());
        for n in 0..p.len() {
            assert!(
                decode_batch(&p[..n]).is_err(),
                "prefix of {n} bytes decoded"
            );
        }
    }
}

#[test]
fn fuzz_random_bytes_and_mutations_never_panic() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut ok = 0usize;
    // Random bytes, often starting like a batch so the decoder gets deep.
    for i in 0..20_000 {
        let n = rng.below(200);
        let mut p: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
        if i % 2 == 0 && !p.is_empty() {
            p[0] = 0x93;
        }
        if decode_batch(&p).is_ok() {
            ok += 1;
        }
        check_consistent(&p);
    }
    // Mutations of valid payloads: flips, inserts, deletes, splices.
    let samples = sample_payloads();
    for _ in 0..30_000 {
        let mut p = samples[rng.below(samples.len())].clone();
        for _ in 0..1 + rng.below(4) {
            let at = rng.below(p.len());
            match rng.below(4) {
                0 => p[at] ^= 1 << rng.below(8),
                1 => p.insert(at, rng.next() as u8),
                2 => {
                    p.remove(at);
                }
                _ => p[at] = [0xc0, 0xc1, 0xdd, 0xdf, 0xcf, 0xd3, 0xc4, 0xff][rng.below(8)],
            }
            if p.is_empty() {
                break;
            }
        }
        let _ = decode_batch(&p);
        check_consistent(&p);
    }
    // Random payloads are almost never valid batches.
    assert!(ok < 200, "{ok} random payloads decoded");
}
