//! vLLM's KV-cache events and their msgpack encoding
//! (`vllm/distributed/kv_events.py`).
//!
//! A batch is `[ts, events, data_parallel_rank]`. Each event is, since about
//! vLLM 0.23, a map tagged by `"type"` with defaulted-and-nil fields left out;
//! up to 0.22 a positional array whose element 0 is the tag.

use crate::hashing::BlockHash;
use rmpv::Value;

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Full blocks were computed and cached.
    BlockStored {
        /// Hashes of the stored blocks, in sequence order.
        block_hashes: Vec<BlockHash>,
        /// Hash of the block before the first one, if any.
        parent_block_hash: Option<BlockHash>,
        /// Every token of the listed blocks, concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The LoRA adapter's name, if any.
        lora_name: Option<String>,
    },
    /// Cached blocks were evicted.
    BlockRemoved {
        /// Hashes of the evicted blocks.
        block_hashes: Vec<BlockHash>,
    },
    /// The whole prefix cache was reset.
    AllBlocksCleared,
}

/// How events are laid out inside a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EventEncoding {
    /// Tagged maps (vLLM >= 0.23, the default).
    Map,
    /// Positional arrays with the tag first (vLLM <= 0.22).
    Array,
}

/// How block hashes are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HashFormat {
    /// uint64 (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the default).
    Int,
    /// 32-byte bin (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    Bytes,
}

/// The medium vLLM reports for blocks in GPU memory.
const MEDIUM_GPU: &str = "GPU";

fn hash_value(h: BlockHash, f: HashFormat) -> Value {
    match f {
        HashFormat::Int => Value::from(h.0),
        HashFormat::Bytes => Value::Binary(h.to_bytes32().to_vec()),
    }
}

fn hashes_value(hs: &[BlockHash], f: HashFormat) -> Value {
    Value::Array(hs.iter().map(|h| hash_value(*h, f)).collect())
}

fn str_or_nil(s: &Option<String>) -> Value {
    match s {
        Some(s) => Value::from(s.as_str()),
        None => Value::Nil,
    }
}

impl KvEvent {
    /// The event as a msgpack value in the chosen layout.
    pub fn to_value(&self, enc: EventEncoding, hf: HashFormat) -> Value {
        match (self, enc) {
            (
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_name,
                },
                _,
            ) => {
                let parent = parent_block_hash.map_or(Value::Nil, |p| hash_value(p, hf));
                let tokens = Value::Array(token_ids.iter().map(|t| Value::from(*t)).collect());
                // Required fields (no default) are written even when nil:
                // block_hashes, parent_block_hash, token_ids, block_size,
                // lora_id, medium, lora_name. Later, defaulted fields are
                // omitted while they hold their default.
                let fields = [
                    ("block_hashes", hashes_value(block_hashes, hf)),
                    ("parent_block_hash", parent),
                    ("token_ids", tokens),
                    ("block_size", Value::from(*block_size)),
                    ("lora_id", Value::Nil),
                    ("medium", Value::from(MEDIUM_GPU)),
                    ("lora_name", str_or_nil(lora_name)),
                ];
                tagged("BlockStored", fields.into_iter(), enc)
            }
            (KvEvent::BlockRemoved { block_hashes }, _) => {
                let fields = [
                    ("block_hashes", hashes_value(block_hashes, hf)),
                    ("medium", Value::from(MEDIUM_GPU)),
                ];
                tagged("BlockRemoved", fields.into_iter(), enc)
            }
            (KvEvent::AllBlocksCleared, _) => tagged("AllBlocksCleared", std::iter::empty(), enc),
        }
    }
}

fn tagged(
    tag: &str,
    fields: impl Iterator<Item = (&'static str, Value)>,
    enc: EventEncoding,
) -> Value {
    match enc {
        EventEncoding::Map => {
            let mut m = vec![(Value::from("type"), Value::from(tag))];
            m.extend(fields.map(|(k, v)| (Value::from(k), v)));
            Value::Map(m)
        }
        EventEncoding::Array => {
            let mut a = vec![Value::from(tag)];
            a.extend(fields.map(|(_, v)| v));
            Value::Array(a)
        }
    }
}

/// Encodes one batch payload: `[ts, events, data_parallel_rank]`.
pub fn encode_batch(
    ts: f64,
    events: &[KvEvent],
    dp_rank: Option<u32>,
    enc: EventEncoding,
    hf: HashFormat,
) -> Vec<u8> {
    let batch = Value::Array(vec![
        Value::F64(ts),
        Value::Array(events.iter().map(|e| e.to_value(enc, hf)).collect()),
        dp_rank.map_or(Value::Nil, Value::from),
    ]);
    let mut buf = Vec::with_capacity(256);
    // Writing into a Vec cannot fail.
    rmpv::encode::write_value(&mut buf, &batch).expect("write to Vec");
    buf
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: vec![BlockHash(1), BlockHash(u64::MAX)],
            parent_block_hash: None,
            token_ids: vec![1, 2, 3, 4, 5, 6, 7, 8],
            block_size: 4,
            lora_name: None,
        }
    }

    #[test]
    fn map_layout_has_type_first_and_required_fields() {
        let v = stored().to_value(EventEncoding::Map, HashFormat::Int);
        let m = v.as_map().unwrap();
        assert_eq!(m[0].0.as_str(), Some("type"));
        assert_eq!(m[0].1.as_str(), Some("BlockStored"));
        let keys: Vec<_> = m.iter().map(|(k, _)| k.as_str().unwrap()).collect();
        assert_eq!(
            keys,
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name"
            ]
        );
        // u64 above i64::MAX stays an unsigned int on the wire.
        assert_eq!(m[1].1.as_array().unwrap()[1].as_u64(), Some(u64::MAX));
    }

    #[test]
    fn array_layout_is_positional() {
        let v = KvEvent::BlockRemoved {
            block_hashes: vec![BlockHash(9)],
        }
        .to_value(EventEncoding::Array, HashFormat::Bytes);
        let a = v.as_array().unwrap();
        assert_eq!(a[0].as_str(), Some("BlockRemoved"));
        assert_eq!(a[1].as_array().unwrap()[0].as_slice().unwrap().len(), 32);
        assert_eq!(a[2].as_str(), Some("GPU"));
        let c = KvEvent::AllBlocksCleared.to_value(EventEncoding::Array, HashFormat::Int);
        assert_eq!(c.as_array().unwrap().len(), 1);
    }

    #[test]
    fn batch_roundtrips_through_rmpv() {
        let bytes = encode_batch(1.5, &[stored()], None, EventEncoding::Map, HashFormat::Int);
        let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
        let a = v.as_array().unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(a[0].as_f64(), Some(1.5));
        assert_eq!(a[1].as_array().unwrap().len(), 1);
        assert!(a[2].is_nil());
    }
}
