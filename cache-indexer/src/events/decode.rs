//! Decoder for vLLM's KV-event payloads (`vllm/distributed/kv_events.py`,
//! see FACTS.md "vLLM KV-cache events").
//!
//! A payload is a msgpack array `[ts: f64, events: [...], data_parallel_rank: int|nil]`.
//! Each event is either a map tagged by `"type"` (vLLM >= 0.23; fields with a
//! default are left out while nil; unknown keys are ignored) or a positional
//! array whose element 0 is the tag (vLLM <= 0.22; trailing fields may be
//! missing, extra trailing fields are ignored). Block hashes are uint64,
//! negative int64 (vLLM before 0.10.2) or 32-byte bin
//! (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
//!
//! # Why a hand-written decoder
//!
//! `dynamo_kv_router::zmq_wire::decode_event_batch` goes through serde
//! (`rmp-serde`) and rejects bin hashes, so it cannot be used as is, and
//! wrapping it (re-encoding bins, or decoding twice) would cost more than it
//! saves. A generic `rmpv::Value` tree allocates one node per token id
//! (~2,000 per 125-block event), several times slower than the index itself.
//! This decoder walks the bytes once with a cursor, reads token ids straight
//! into a `Vec<u32>` and borrows strings until they are kept, so decoding stays
//! a small fraction of ingest (the target is >= 1M blocks/s decode + apply on
//! one core). It never panics: every length is checked against the bytes that
//! are left, nesting is bounded, and each failure is a [`DecodeError`] that
//! says at which byte, where in the structure, and why.

pub use crate::index::kv_events::{DecodedBatch, EngineEvent, EngineHash};

/// Deepest nesting accepted while skipping unknown values (real payloads
/// nest at most ~5 deep); bounds recursion on hostile input.
const MAX_SKIP_DEPTH: usize = 32;

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("KV-event payload invalid at byte {offset} ({path}): {reason}")]
pub struct DecodeError {
    /// Byte offset into the payload where decoding failed.
    pub offset: usize,
    /// Where in the structure, e.g. `events[3].block_hashes[7]`.
    pub path: String,
    /// What was wrong.
    pub reason: String,
}

/// A failure before its structural path is known (paths are only built on
/// the error path, so the hot path formats nothing).
struct Raw {
    offset: usize,
    reason: String,
}

impl Raw {
    fn at(self, path: impl FnOnce() -> String) -> DecodeError {
        DecodeError {
            offset: self.offset,
            path: path(),
            reason: self.reason,
        }
    }
}

type R<T> = Result<T, Raw>;

/// An integer as msgpack carries it.
#[derive(Clone, Copy)]
enum Int {
    U(u64),
    I(i64),
}

/// A byte cursor over one payload.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

/// Names the msgpack type of a marker byte, for error messages.
fn type_name(m: u8) -> &'static str {
    match m {
        0x00..=0x7f | 0xcc..=0xcf => "uint",
        0xe0..=0xff | 0xd0..=0xd3 => "int",
        0x80..=0x8f | 0xde | 0xdf => "map",
        0x90..=0x9f | 0xdc | 0xdd => "array",
        0xa0..=0xbf | 0xd9..=0xdb => "str",
        0xc0 => "nil",
        0xc1 => "reserved byte 0xc1",
        0xc2 | 0xc3 => "bool",
        0xc4..=0xc6 => "bin",
        0xc7..=0xc9 | 0xd4..=0xd8 => "ext",
        0xca | 0xcb => "float",
    }
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    fn err<T>(&self, reason: impl Into<String>) -> R<T> {
        Err(Raw {
            offset: self.pos,
            reason: reason.into(),
        })
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    #[inline]
    fn peek(&self) -> R<u8> {
        match self.buf.get(self.pos) {
            Some(b) => Ok(*b),
            None => self.err("unexpected end of payload"),
        }
    }

    #[inline]
    fn take(&mut self, n: usize) -> R<&'a [u8]> {
        if self.remaining() < n {
            return self.err(format!(
                "truncated: needs {n} more bytes, {} left",
                self.remaining()
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    #[inline]
    fn byte(&mut self) -> R<u8> {
        let b = self.peek()?;
        self.pos += 1;
        Ok(b)
    }

    #[inline]
    fn be<const N: usize>(&mut self) -> R<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn unexpected<T>(&self, m: u8, want: &str) -> R<T> {
        self.err(format!("expected {want}, found {}", type_name(m)))
    }

    /// A length that claims more elements than bytes remain cannot be real
    /// (each element takes at least one byte): reject before allocating.
    fn check_len(&self, len: usize, min_elem_bytes: usize) -> R<usize> {
        if len.saturating_mul(min_elem_bytes) > self.remaining() {
            return self.err(format!(
                "length {len} exceeds the {} bytes left",
                self.remaining()
            ));
        }
        Ok(len)
    }

    /// Whether the next value is nil (does not consume).
    #[inline]
    fn at_nil(&self) -> bool {
        self.buf.get(self.pos) == Some(&0xc0)
    }

    #[inline]
    fn array_len(&mut self) -> R<usize> {
        let m = self.peek()?;
        let len = match m {
            0x90..=0x9f => {
                self.pos += 1;
                (m & 0x0f) as usize
            }
            0xdc => {
                self.pos += 1;
                u16::from_be_bytes(self.be()?) as usize
            }
            0xdd => {
                self.pos += 1;
                u32::from_be_bytes(self.be()?) as usize
            }
            _ => return self.unexpected(m, "array"),
        };
        self.check_len(len, 1)
    }

    fn map_len(&mut self) -> R<usize> {
        let m = self.peek()?;
        let len = match m {
            0x80..=0x8f => {
                self.pos += 1;
                (m & 0x0f) as usize
            }
            0xde => {
                self.pos += 1;
                u16::from_be_bytes(self.be()?) as usize
            }
            0xdf => {
                self.pos += 1;
                u32::from_be_bytes(self.be()?) as usize
            }
            _ => return self.unexpected(m, "map"),
        };
        self.check_len(len, 2)
    }

    fn str(&mut self) -> R<&'a str> {
        let m = self.peek()?;
        let len = match m {
            0xa0..=0xbf => {
                self.pos += 1;
                (m & 0x1f) as usize
            }
            0xd9 => {
                self.pos += 1;
                self.byte()? as usize
            }
            0xda => {
                self.pos += 1;
                u16::from_be_bytes(self.be()?) as usize
            }
            0xdb => {
                self.pos += 1;
                u32::from_be_bytes(self.be()?) as usize
            }
            _ => return self.unexpected(m, "str"),
        };
        let start = self.pos;
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes).map_err(|e| Raw {
            offset: start + e.valid_up_to(),
            reason: "str is not valid UTF-8".into(),
        })
    }

    fn opt_str(&mut self) -> R<Option<&'a str>> {
        if self.at_nil() {
            self.pos += 1;
            return Ok(None);
        }
        self.str().map(Some)
    }

    fn bin(&mut self) -> R<&'a [u8]> {
        let m = self.peek()?;
        let len = match m {
            0xc4 => {
                self.pos += 1;
                self.byte()? as usize
            }
            0xc5 => {
                self.pos += 1;
                u16::from_be_bytes(self.be()?) as usize
            }
            0xc6 => {
                self.pos += 1;
                u32::from_be_bytes(self.be()?) as usize
            }
            _ => return self.unexpected(m, "bin"),
        };
        self.take(len)
    }

    #[inline]
    fn int(&mut self) -> R<Int> {
        let m = self.peek()?;
        let v = match m {
            0x00..=0x7f => {
                self.pos += 1;
                Int::U(m as u64)
            }
            0xe0..=0xff => {
                self.pos += 1;
                Int::I(m as i8 as i64)
            }
            0xcc => {
                self.pos += 1;
                Int::U(self.byte()? as u64)
            }
            0xcd => {
                self.pos += 1;
                Int::U(u16::from_be_bytes(self.be()?) as u64)
            }
            0xce => {
                self.pos += 1;
                Int::U(u32::from_be_bytes(self.be()?) as u64)
            }
            0xcf => {
                self.pos += 1;
                Int::U(u64::from_be_bytes(self.be()?))
            }
            0xd0 => {
                self.pos += 1;
                Int::I(self.byte()? as i8 as i64)
            }
            0xd1 => {
                self.pos += 1;
                Int::I(i16::from_be_bytes(self.be()?) as i64)
            }
            0xd2 => {
                self.pos += 1;
                Int::I(i32::from_be_bytes(self.be()?) as i64)
            }
            0xd3 => {
                self.pos += 1;
                Int::I(i64::from_be_bytes(self.be()?))
            }
            _ => return self.unexpected(m, "int"),
        };
        Ok(v)
    }

    /// A non-negative integer that fits `u32` (token ids, sizes, indices).
    #[inline]
    fn u32(&mut self) -> R<u32> {
        // Fast path: token ids below 128 are one byte.
        if let Some(&b) = self.buf.get(self.pos) {
            if b < 0x80 {
                self.pos += 1;
                return Ok(b as u32);
            }
        }
        let start = self.pos;
        let v = match self.int()? {
            Int::U(v) => u32::try_from(v).ok(),
            Int::I(v) => u32::try_from(v).ok(),
        };
        v.ok_or_else(|| Raw {
            offset: start,
            reason: "integer out of range for u32".into(),
        })
    }

    fn opt_u32(&mut self) -> R<Option<u32>> {
        if self.at_nil() {
            self.pos += 1;
            return Ok(None);
        }
        self.u32().map(Some)
    }

    fn f64(&mut self) -> R<f64> {
        let m = self.peek()?;
        match m {
            0xcb => {
                self.pos += 1;
                Ok(f64::from_be_bytes(self.be()?))
            }
            0xca => {
                self.pos += 1;
                Ok(f32::from_be_bytes(self.be()?) as f64)
            }
            // An integral timestamp is still a timestamp.
            0x00..=0x7f | 0xcc..=0xcf | 0xd0..=0xd3 | 0xe0..=0xff => Ok(match self.int()? {
                Int::U(v) => v as f64,
                Int::I(v) => v as f64,
            }),
            _ => self.unexpected(m, "float"),
        }
    }

    #[inline]
    fn hash(&mut self) -> R<EngineHash> {
        let m = self.peek()?;
        if matches!(m, 0xc4..=0xc6) {
            let start = self.pos;
            let b = self.bin()?;
            let arr: [u8; 32] = b.try_into().map_err(|_| Raw {
                offset: start,
                reason: format!("bin block hash must be 32 bytes, got {}", b.len()),
            })?;
            return Ok(EngineHash::Bytes(arr));
        }
        match self.int() {
            Ok(Int::U(v)) => Ok(EngineHash::U64(v)),
            // Old vLLM: Python's signed hash; keep the bits (dynamo does too).
            Ok(Int::I(v)) => Ok(EngineHash::U64(v as u64)),
            Err(_) => self.unexpected(m, "block hash (int or 32-byte bin)"),
        }
    }

    fn opt_hash(&mut self) -> R<Option<EngineHash>> {
        if self.at_nil() {
            self.pos += 1;
            return Ok(None);
        }
        self.hash().map(Some)
    }

    /// Skips one value of any type (unknown fields), bounded in depth.
    fn skip(&mut self, depth: usize) -> R<()> {
        if depth > MAX_SKIP_DEPTH {
            return self.err("nesting too deep");
        }
        let m = self.byte()?;
        let skip_n = |r: &mut Self, n: usize| r.take(n).map(|_| ());
        match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0 | 0xc2 | 0xc3 => Ok(()),
            0xc1 => {
                self.pos -= 1;
                self.err("reserved byte 0xc1")
            }
            0x80..=0x8f => self.skip_items((m & 0x0f) as usize * 2, depth),
            0x90..=0x9f => self.skip_items((m & 0x0f) as usize, depth),
            0xa0..=0xbf => skip_n(self, (m & 0x1f) as usize),
            0xc4 | 0xd9 => {
                let n = self.byte()? as usize;
                skip_n(self, n)
            }
            0xc5 | 0xda => {
                let n = u16::from_be_bytes(self.be()?) as usize;
                skip_n(self, n)
            }
            0xc6 | 0xdb => {
                let n = u32::from_be_bytes(self.be()?) as usize;
                skip_n(self, n)
            }
            0xc7 => {
                let n = self.byte()? as usize;
                skip_n(self, n + 1)
            }
            0xc8 => {
                let n = u16::from_be_bytes(self.be()?) as usize;
                skip_n(self, n + 1)
            }
            0xc9 => {
                let n = u32::from_be_bytes(self.be()?) as usize;
                skip_n(self, n.saturating_add(1))
            }
            0xca => skip_n(self, 4),
            0xcb => skip_n(self, 8),
            0xcc | 0xd0 => skip_n(self, 1),
            0xcd | 0xd1 => skip_n(self, 2),
            0xce | 0xd2 => skip_n(self, 4),
            0xcf | 0xd3 => skip_n(self, 8),
            0xd4 => skip_n(self, 2),
            0xd5 => skip_n(self, 3),
            0xd6 => skip_n(self, 5),
            0xd7 => skip_n(self, 9),
            0xd8 => skip_n(self, 17),
            0xdc => {
                let n = u16::from_be_bytes(self.be()?) as usize;
                self.skip_items(n, depth)
            }
            0xdd => {
                let n = u32::from_be_bytes(self.be()?) as usize;
                self.skip_items(n, depth)
            }
            0xde => {
                let n = u16::from_be_bytes(self.be()?) as usize;
                self.skip_items(n * 2, depth)
            }
            0xdf => {
                let n = u32::from_be_bytes(self.be()?) as usize;
                self.skip_items(n.saturating_mul(2), depth)
            }
        }
    }

    fn skip_items(&mut self, n: usize, depth: usize) -> R<()> {
        self.check_len(n, 1)?;
        for _ in 0..n {
            self.skip(depth + 1)?;
        }
        Ok(())
    }
}

/// Which event a tag names.
#[derive(Clone, Copy)]
enum Kind {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn kind_of(tag: &str) -> Kind {
    match tag {
        "BlockStored" => Kind::Stored,
        "BlockRemoved" => Kind::Removed,
        "AllBlocksCleared" => Kind::Cleared,
        _ => Kind::Unknown,
    }
}

/// Fields of a `BlockStored` / `BlockRemoved` while they are being read.
#[derive(Default)]
struct Fields<'a> {
    block_hashes: Option<Vec<EngineHash>>,
    parent: Option<EngineHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_name: Option<&'a str>,
    medium: Option<&'a str>,
    group_idx: Option<u32>,
    kv_cache_spec_kind: Option<&'a str>,
}

/// Positional field order after the tag (vLLM's struct field order).
const STORED_FIELDS: [&str; 11] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
];
const REMOVED_FIELDS: [&str; 3] = ["block_hashes", "medium", "group_idx"];
/// Fields every positional event of a kind must carry.
const STORED_REQUIRED: usize = 4;
const REMOVED_REQUIRED: usize = 1;

impl<'a> Reader<'a> {
    fn hashes(&mut self) -> R<Vec<EngineHash>> {
        let n = self.array_len()?;
        let mut v = Vec::with_capacity(n);
        for i in 0..n {
            let h = self.hash().map_err(|mut e| {
                e.reason = format!("[{i}]: {}", e.reason);
                e
            })?;
            v.push(h);
        }
        Ok(v)
    }

    /// Token ids: the hot loop of decoding (16 per block). Ids below 2^32
    /// come as fixint / uint8 / uint16 / uint32; those are read inline
    /// with one bounds check each, anything else goes the general way
    /// (which also produces the error).
    fn tokens(&mut self) -> R<Vec<u32>> {
        let n = self.array_len()?;
        let mut v = Vec::with_capacity(n);
        let buf = self.buf;
        for i in 0..n {
            let p = self.pos;
            let fast = match buf.get(p) {
                Some(&b) if b < 0x80 => Some((b as u32, 1)),
                Some(0xcd) => buf
                    .get(p + 1..p + 3)
                    .map(|s| (u16::from_be_bytes([s[0], s[1]]) as u32, 3)),
                Some(0xce) => buf
                    .get(p + 1..p + 5)
                    .map(|s| (u32::from_be_bytes([s[0], s[1], s[2], s[3]]), 5)),
                Some(0xcc) => buf.get(p + 1).map(|b| (*b as u32, 2)),
                _ => None,
            };
            let t = match fast {
                Some((t, len)) => {
                    self.pos = p + len;
                    t
                }
                None => self.u32().map_err(|mut e| {
                    e.reason = format!("[{i}]: {}", e.reason);
                    e
                })?,
            };
            v.push(t);
        }
        Ok(v)
    }

    /// Reads the value of field `name` into `f`; unknown names are skipped.
    fn field(&mut self, kind: Kind, name: &str, f: &mut Fields<'a>) -> R<()> {
        match (kind, name) {
            (Kind::Stored | Kind::Removed, "block_hashes") => f.block_hashes = Some(self.hashes()?),
            (Kind::Stored, "parent_block_hash") => f.parent = self.opt_hash()?,
            (Kind::Stored, "token_ids") => f.token_ids = Some(self.tokens()?),
            (Kind::Stored, "block_size") => f.block_size = Some(self.u32()?),
            (Kind::Stored, "lora_name") => f.lora_name = self.opt_str()?,
            (Kind::Stored | Kind::Removed, "medium") => f.medium = self.opt_str()?,
            (Kind::Stored | Kind::Removed, "group_idx") => f.group_idx = self.opt_u32()?,
            (Kind::Stored, "kv_cache_spec_kind") => f.kv_cache_spec_kind = self.opt_str()?,
            _ => self.skip(0)?,
        }
        Ok(())
    }

    /// One event (map or array layout). `Ok(None)`: a well-formed event of
    /// an unknown kind.
    fn event(&mut self, i: usize) -> Result<Option<EngineEvent>, DecodeError> {
        let start = self.pos;
        let m = self.peek().map_err(|e| e.at(|| format!("events[{i}]")))?;
        let mut f = Fields::default();
        let kind;
        if matches!(m, 0x80..=0x8f | 0xde | 0xdf) {
            let n = self
                .map_len()
                .map_err(|e| e.at(|| format!("events[{i}]")))?;
            // "type" is first in what msgspec writes, but any order is valid
            // msgpack: remember fields until the tag is known.
            let mut tag: Option<&str> = None;
            let mut pending: Vec<(&'a str, usize)> = Vec::new();
            for _ in 0..n {
                let key = self
                    .str()
                    .map_err(|e| e.at(|| format!("events[{i}] (map key)")))?;
                if key == "type" {
                    tag = Some(
                        self.str()
                            .map_err(|e| e.at(|| format!("events[{i}].type")))?,
                    );
                    continue;
                }
                match tag {
                    Some(t) => self
                        .field(kind_of(t), key, &mut f)
                        .map_err(|e| e.at(|| format!("events[{i}].{key}")))?,
                    None => {
                        pending.push((key, self.pos));
                        self.skip(0)
                            .map_err(|e| e.at(|| format!("events[{i}].{key}")))?;
                    }
                }
            }
            let Some(t) = tag else {
                return Err(DecodeError {
                    offset: start,
                    path: format!("events[{i}]"),
                    reason: "event map has no \"type\"".into(),
                });
            };
            kind = kind_of(t);
            if !pending.is_empty() {
                let end = self.pos;
                for (key, pos) in pending {
                    self.pos = pos;
                    self.field(kind, key, &mut f)
                        .map_err(|e| e.at(|| format!("events[{i}].{key}")))?;
                }
                self.pos = end;
            }
        } else if matches!(m, 0x90..=0x9f | 0xdc | 0xdd) {
            let n = self
                .array_len()
                .map_err(|e| e.at(|| format!("events[{i}]")))?;
            if n == 0 {
                return Err(DecodeError {
                    offset: start,
                    path: format!("events[{i}]"),
                    reason: "empty event array (no tag)".into(),
                });
            }
            let t = self
                .str()
                .map_err(|e| e.at(|| format!("events[{i}][0] (tag)")))?;
            kind = kind_of(t);
            let (names, required): (&[&str], usize) = match kind {
                Kind::Stored => (&STORED_FIELDS, STORED_REQUIRED),
                Kind::Removed => (&REMOVED_FIELDS, REMOVED_REQUIRED),
                Kind::Cleared | Kind::Unknown => (&[], 0),
            };
            if n - 1 < required {
                return Err(DecodeError {
                    offset: start,
                    path: format!("events[{i}]"),
                    reason: format!("{t} needs {required} fields, has {}", n - 1),
                });
            }
            for k in 1..n {
                match names.get(k - 1) {
                    Some(name) => self
                        .field(kind, name, &mut f)
                        .map_err(|e| e.at(|| format!("events[{i}].{name}")))?,
                    // Fields a newer vLLM appended.
                    None => self
                        .skip(0)
                        .map_err(|e| e.at(|| format!("events[{i}][{k}]")))?,
                }
            }
        } else {
            return Err(Raw {
                offset: start,
                reason: format!("expected event map or array, found {}", type_name(m)),
            }
            .at(|| format!("events[{i}]")));
        }
        let missing = |what: &str| DecodeError {
            offset: start,
            path: format!("events[{i}]"),
            reason: format!("missing required field {what}"),
        };
        Ok(match kind {
            Kind::Stored => Some(EngineEvent::BlockStored {
                block_hashes: f.block_hashes.ok_or_else(|| missing("block_hashes"))?,
                parent: f.parent,
                token_ids: f.token_ids.ok_or_else(|| missing("token_ids"))?,
                block_size: f.block_size.ok_or_else(|| missing("block_size"))?,
                lora_name: f.lora_name.map(str::to_owned),
                medium: f.medium.map(str::to_owned),
                group_idx: f.group_idx,
                kv_cache_spec_kind: f.kv_cache_spec_kind.map(str::to_owned),
            }),
            Kind::Removed => Some(EngineEvent::BlockRemoved {
                block_hashes: f.block_hashes.ok_or_else(|| missing("block_hashes"))?,
                medium: f.medium.map(str::to_owned),
                group_idx: f.group_idx,
            }),
            Kind::Cleared => Some(EngineEvent::AllBlocksCleared),
            Kind::Unknown => None,
        })
    }
}

/// Decodes one msgpack payload (the last frame of a KV-event message or a
/// replay reply) into a [`DecodedBatch`].
///
/// Accepts both event layouts and all hash encodings; ignores unknown map
/// keys, extra trailing positional fields and extra trailing batch elements;
/// skips events with an unknown tag (counted in `ignored_events`). Anything
/// else malformed is a [`DecodeError`]; it never panics.
pub fn decode_batch(payload: &[u8]) -> Result<DecodedBatch, DecodeError> {
    let mut r = Reader::new(payload);
    let n = r.array_len().map_err(|e| e.at(|| "batch".into()))?;
    if n < 2 {
        return Err(DecodeError {
            offset: 0,
            path: "batch".into(),
            reason: format!("batch array needs [ts, events, dp_rank], has {n} elements"),
        });
    }
    let ts = r.f64().map_err(|e| e.at(|| "ts".into()))?;
    let ne = r.array_len().map_err(|e| e.at(|| "events".into()))?;
    let mut events = Vec::with_capacity(ne);
    let mut ignored_events = 0;
    for i in 0..ne {
        match r.event(i)? {
            Some(e) => events.push(e),
            None => ignored_events += 1,
        }
    }
    let mut dp_rank = None;
    if n >= 3 {
        if r.at_nil() {
            r.pos += 1;
        } else {
            dp_rank = Some(
                match r.int().map_err(|e| e.at(|| "data_parallel_rank".into()))? {
                    Int::I(v) => v,
                    Int::U(v) => i64::try_from(v).map_err(|_| DecodeError {
                        offset: r.pos,
                        path: "data_parallel_rank".into(),
                        reason: "out of range".into(),
                    })?,
                },
            );
        }
        for k in 3..n {
            r.skip(0).map_err(|e| e.at(|| format!("batch[{k}]")))?;
        }
    }
    if r.remaining() != 0 {
        return Err(DecodeError {
            offset: r.pos,
            path: "batch".into(),
            reason: format!("{} trailing bytes after the batch", r.remaining()),
        });
    }
    Ok(DecodedBatch {
        ts,
        events,
        dp_rank,
        ignored_events,
    })
}
