//! Block chains: a prompt hashed per full block, each hash chained to the
//! one before, so equal entries mean equal prefixes. The tracker matches
//! in-prefill picks by them and the pick path builds them; the engines'
//! own block hashes are never reproduced here.

/// Prompts in prefill remembered per endpoint (this replica's, and each
/// other replica's) for `LoadView::pending_matched_blocks`; older ones are
/// forgotten first.
pub const MAX_PENDING_PREFIXES: usize = 64;

/// How long a pick's chain still counts on its endpoint once its prefill
/// ended (FIRST_TOKEN, or DONE without one): the engine holds those blocks
/// from then on, but its KV events (published after the engine's step,
/// then carried over ZMQ and applied by the subscriber) reach the index a
/// little later, and a conversation's next turn sent at once must not find
/// its prefix nowhere. Events normally trail by milliseconds; 1 s also
/// covers a busy engine and a subscriber filling a gap from replay, while
/// an eviction or a restart right after is credited for at most that long
/// (an endpoint turned unhealthy drops its chains at once). Past the grace
/// the index alone tells, and crediting a covered chain changes nothing:
/// a pick takes the larger of the indexed and the pending match.
pub const PENDING_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// The chained hashes of a prompt's full blocks: entry `i` identifies the
/// whole prefix up to block `i`, so two chains agree exactly on their
/// common prefix. (Private to the indexer; the engines' hashes are never
/// reproduced.)
pub fn block_chain(tokens: &[u32], block_size: u32) -> Vec<u64> {
    let mut chain = Vec::with_capacity(tokens.len() / block_size.max(1) as usize);
    extend_block_chain(&mut chain, tokens, block_size);
    chain
}

/// Extends `chain`, the [`block_chain`] of a prefix of `tokens`, to the
/// full blocks of `tokens`: only the new blocks are hashed.
pub fn extend_block_chain(chain: &mut Vec<u64>, tokens: &[u32], block_size: u32) {
    let bs = block_size.max(1) as usize;
    let mut h = chain.last().copied().unwrap_or(0);
    // One-shot over the block's little-endian bytes: the same value as
    // feeding the tokens to a streaming hasher one by one, at a fraction of
    // the per-call cost.
    let mut bytes = Vec::with_capacity(bs * 4);
    let done = chain.len() * bs;
    let Some(rest) = tokens.get(done..) else {
        return;
    };
    chain.extend(rest.chunks_exact(bs).map(|block| {
        bytes.clear();
        bytes.extend(block.iter().flat_map(|t| t.to_le_bytes()));
        h = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, h);
        h
    }));
}

/// Length of the common prefix of two block chains. Chains agree on a
/// prefix and differ after it, so a binary search finds the end.
pub fn common_prefix(a: &[u64], b: &[u64]) -> usize {
    let (mut lo, mut hi) = (0usize, a.len().min(b.len()));
    // Invariant: a[..lo] == b[..lo]; a[..hi+1] != b[..hi+1] past hi.
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if a[mid - 1] == b[mid - 1] {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_chain_values_are_the_streaming_hash_of_each_block() {
        // The values are part of nothing persisted, but replicas of
        // different versions compare nothing either; this pins the
        // one-shot form to the definition (a seeded xxh3 over the tokens'
        // little-endian bytes, seeded with the previous block's hash).
        let tokens: Vec<u32> = (0..40).map(|i| i * 7919).collect();
        let mut h = 0u64;
        let want: Vec<u64> = tokens
            .chunks_exact(16)
            .map(|b| {
                let mut x = xxhash_rust::xxh3::Xxh3::with_seed(h);
                for t in b {
                    x.update(&t.to_le_bytes());
                }
                h = x.digest();
                h
            })
            .collect();
        assert_eq!(block_chain(&tokens, 16), want);
        // Extending a prefix's chain gives the whole chain.
        let mut c = block_chain(&tokens[..20], 16);
        extend_block_chain(&mut c, &tokens, 16);
        assert_eq!(c, want);
        extend_block_chain(&mut c, &tokens[..8], 16);
        assert_eq!(c, want, "a shorter prompt changes nothing");
    }

    #[test]
    fn block_chains_and_common_prefix() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[40] = 999; // block 10 (size 4) differs
        let (ca, cb) = (block_chain(&a, 4), block_chain(&b, 4));
        assert_eq!(ca.len(), 16);
        assert_eq!(common_prefix(&ca, &cb), 10);
        assert_eq!(common_prefix(&ca, &ca), 16);
        assert_eq!(common_prefix(&ca, &ca[..3]), 3);
        assert_eq!(common_prefix(&ca, &[]), 0);
        assert_eq!(common_prefix(&ca, &block_chain(&[7; 64], 4)), 0);
        assert_eq!(
            block_chain(&a[..7], 4).len(),
            1,
            "partial blocks are not hashed"
        );
    }
}
