//! Prefix-chained block hashes, as vLLM computes them for its prefix cache.
//!
//! vLLM hashes each *full* block from its parent's hash, the block's token ids
//! and extra keys (LoRA, cache salt). The exact function is vLLM-private and
//! routers must not depend on it (they re-hash `token_ids` from the events),
//! so the simulator uses SHA-256 over the same inputs and keeps 64 bits, the
//! shape vLLM publishes with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`.
//!
//! Like vLLM, the chain starts from a per-process seed (vLLM's `NONE_HASH`,
//! random unless `PYTHONHASHSEED` is set), so two engines holding the same
//! prefix publish different hashes for it. Routers must cope with that.

use sha2::{Digest, Sha256};

/// An engine block hash: opaque id of one full block and its whole prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

impl BlockHash {
    /// The 32-byte form, for engines configured to publish raw digests
    /// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`). Deterministic from the u64
    /// so removals and parents stay consistent in both forms.
    pub fn to_bytes32(self) -> [u8; 32] {
        let digest = Sha256::digest(self.0.to_be_bytes());
        digest.into()
    }
}

/// The root of every hash chain of one engine process (vLLM's `NONE_HASH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HashSeed(pub u64);

/// Hash of one full block given its parent (None for the first block, which
/// hangs off the process seed).
///
/// `salt` is mixed into the first block only, as vLLM does with `cache_salt`,
/// so salted requests never share cache with unsalted ones.
pub fn hash_block(
    seed: HashSeed,
    parent: Option<BlockHash>,
    tokens: &[u32],
    salt: Option<&str>,
) -> BlockHash {
    let mut h = Sha256::new();
    match parent {
        Some(p) => {
            h.update([1u8]);
            h.update(p.0.to_le_bytes());
        }
        None => {
            h.update([0u8]);
            h.update(seed.0.to_le_bytes());
            if let Some(s) = salt {
                h.update((s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
        }
    }
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    let d = h.finalize();
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[..8]);
    BlockHash(u64::from_be_bytes(b))
}

/// Extends `hashes` (the chain of the first `hashes.len()` full blocks of
/// `tokens`) with every further full block, and returns how many were added.
pub fn extend_chain(
    seed: HashSeed,
    hashes: &mut Vec<BlockHash>,
    tokens: &[u32],
    block_size: usize,
    salt: Option<&str>,
) -> usize {
    let before = hashes.len();
    let full = tokens.len() / block_size;
    for i in before..full {
        let parent = if i == 0 { None } else { Some(hashes[i - 1]) };
        hashes.push(hash_block(
            seed,
            parent,
            &tokens[i * block_size..(i + 1) * block_size],
            salt,
        ));
    }
    hashes.len() - before
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: HashSeed = HashSeed(7);

    #[test]
    fn chain_depends_on_whole_prefix() {
        let a: Vec<u32> = (0..48).collect();
        let mut b = a.clone();
        b[3] = 999; // change inside the first block only
        let (mut ha, mut hb) = (Vec::new(), Vec::new());
        extend_chain(S, &mut ha, &a, 16, None);
        extend_chain(S, &mut hb, &b, 16, None);
        assert_eq!(ha.len(), 3);
        // Later blocks have identical tokens but a different prefix.
        assert_ne!(ha[1], hb[1]);
        assert_ne!(ha[2], hb[2]);
    }

    #[test]
    fn same_tokens_same_hashes_and_partial_block_ignored() {
        let a: Vec<u32> = (0..40).collect();
        let mut h1 = Vec::new();
        let mut h2 = Vec::new();
        assert_eq!(extend_chain(S, &mut h1, &a, 16, None), 2);
        extend_chain(S, &mut h2, &a[..32], 16, None);
        assert_eq!(h1, h2);
    }

    #[test]
    fn incremental_extension_equals_full() {
        let a: Vec<u32> = (0..100).map(|x| x * 7).collect();
        let mut full = Vec::new();
        extend_chain(S, &mut full, &a, 16, None);
        let mut inc = Vec::new();
        extend_chain(S, &mut inc, &a[..20], 16, None);
        extend_chain(S, &mut inc, &a[..70], 16, None);
        extend_chain(S, &mut inc, &a, 16, None);
        assert_eq!(full, inc);
    }

    #[test]
    fn seed_separates_processes() {
        let a: Vec<u32> = (0..32).collect();
        let (mut h1, mut h2) = (Vec::new(), Vec::new());
        extend_chain(HashSeed(1), &mut h1, &a, 16, None);
        extend_chain(HashSeed(2), &mut h2, &a, 16, None);
        assert!(h1.iter().zip(&h2).all(|(x, y)| x != y));
    }

    #[test]
    fn salt_separates_caches() {
        let a: Vec<u32> = (0..16).collect();
        assert_ne!(
            hash_block(S, None, &a, None),
            hash_block(S, None, &a, Some("t1"))
        );
        assert_ne!(
            hash_block(S, None, &a, Some("t1")),
            hash_block(S, None, &a, Some("t2"))
        );
    }
}
