//! The decoded KV events: the index's input, and what the decoder
//! ([`crate::events::decode`]) produces. They sit with the index, below the
//! events module, because the subscribers there feed the index: the decoder
//! imports them going down, and the index never imports from the decoder.

use std::fmt;

/// One engine block hash, exactly as the engine sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineHash {
    /// An integer hash: uint64, or a negative int64 from old vLLM kept bit
    /// for bit (`i as u64`), as dynamo does.
    U64(u64),
    /// A 32-byte binary hash (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    Bytes([u8; 32]),
}

impl EngineHash {
    /// The 64-bit id the index keys this hash by (dynamo's
    /// `ExternalSequenceBlockHash` is a `u64`): integers as they are,
    /// 32-byte hashes folded with xxh3-64. The engine hash is an opaque id
    /// inside one endpoint, so a 64-bit fold only needs to keep distinct
    /// blocks of one engine distinct (collision odds ~n²/2⁶⁵).
    #[inline]
    pub fn key(&self) -> u64 {
        match self {
            EngineHash::U64(v) => *v,
            EngineHash::Bytes(b) => xxhash_rust::xxh3::xxh3_64(b),
        }
    }
}

impl fmt::Display for EngineHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineHash::U64(v) => write!(f, "{v}"),
            EngineHash::Bytes(b) => {
                for x in b {
                    write!(f, "{x:02x}")?;
                }
                Ok(())
            }
        }
    }
}

/// One decoded payload: `[ts, events, data_parallel_rank]`.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    /// Engine wall-clock timestamp (seconds since the epoch).
    pub ts: f64,
    /// The events, in the order the engine emitted them.
    pub events: Vec<EngineEvent>,
    /// The engine's data-parallel rank (`None` when nil or absent).
    pub dp_rank: Option<i64>,
    /// Well-formed events with a tag this decoder does not know (a newer
    /// vLLM): left out of `events` rather than failing the whole batch.
    pub ignored_events: usize,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Full blocks were computed and cached.
    BlockStored {
        /// Engine hashes of the stored blocks, in sequence order.
        block_hashes: Vec<EngineHash>,
        /// Engine hash of the block before the first one (`None`: the chain
        /// starts at the beginning of the sequence).
        parent: Option<EngineHash>,
        /// Token ids of all listed blocks, concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// LoRA adapter name, if any (mixed into the block hash).
        lora_name: Option<String>,
        /// Storage medium ("GPU", "CPU", ...), if sent.
        medium: Option<String>,
        /// KV-cache group of hybrid models, if sent.
        group_idx: Option<u32>,
        /// The group's attention kind (`"full_attention"`, `"sliding_window"`,
        /// ...), if sent.
        kv_cache_spec_kind: Option<String>,
    },
    /// Cached blocks were evicted.
    BlockRemoved {
        /// Engine hashes of the removed blocks.
        block_hashes: Vec<EngineHash>,
        /// Storage medium, if sent.
        medium: Option<String>,
        /// KV-cache group of hybrid models, if sent.
        group_idx: Option<u32>,
    },
    /// The engine dropped its whole prefix cache.
    AllBlocksCleared,
}
