//! What the crate's tests and its benchmark examples (which include this
//! file by path) both build: a reproducible filler generator and vLLM
//! KV-event payloads.

// Each includer uses only part of it.
#![allow(dead_code)]

use rmpv::Value as V;

/// vLLM's default block size, in tokens: the block size of every payload
/// built here.
pub const BLOCK_SIZE: u32 = 16;

/// xorshift64*: reproducible filler without a dependency, so a benchmark's
/// workload and a property test's cases stay the same from run to run.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// A batch payload exactly as vLLM >= 0.23 writes it (map layout, integer
/// hashes): an optional `BlockStored` of `(hashes, parent, tokens)`, then
/// an optional `BlockRemoved`.
pub fn vllm_payload(
    stored: Option<(&[u64], Option<u64>, &[u32])>,
    removed: Option<&[u64]>,
) -> Vec<u8> {
    let mut events = Vec::new();
    if let Some((hashes, parent, tokens)) = stored {
        events.push(V::Map(vec![
            (V::from("type"), V::from("BlockStored")),
            (
                V::from("block_hashes"),
                V::Array(hashes.iter().map(|h| V::from(*h)).collect()),
            ),
            (V::from("parent_block_hash"), parent.map_or(V::Nil, V::from)),
            (
                V::from("token_ids"),
                V::Array(tokens.iter().map(|t| V::from(*t)).collect()),
            ),
            (V::from("block_size"), V::from(BLOCK_SIZE)),
            (V::from("lora_id"), V::Nil),
            (V::from("medium"), V::from("GPU")),
            (V::from("lora_name"), V::Nil),
        ]));
    }
    if let Some(hashes) = removed {
        events.push(V::Map(vec![
            (V::from("type"), V::from("BlockRemoved")),
            (
                V::from("block_hashes"),
                V::Array(hashes.iter().map(|h| V::from(*h)).collect()),
            ),
            (V::from("medium"), V::from("GPU")),
        ]));
    }
    let b = V::Array(vec![V::F64(1.7e9), V::Array(events), V::from(0)]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &b).expect("encode to Vec");
    out
}
