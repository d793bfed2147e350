//! vLLM's schema on top of the msgpack cursor: block hashes in their three
//! forms (uint64, negative int64 of vLLM before 0.10.2, 32-byte bin), token
//! ids, and one event in either layout (a map tagged by `"type"`, or a
//! positional array whose element 0 is the tag).

use super::msgpack::{type_name, Int, Raw, Reader, R};
use super::{DecodeError, EngineEvent, EngineHash};

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
    pub(super) fn event(&mut self, i: usize) -> Result<Option<EngineEvent>, DecodeError> {
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
