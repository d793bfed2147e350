//! What the picker needs from the index when engines share a prefix under
//! different engine hashes (real vLLM seeds its hashes per process): the
//! endpoint with the longer chain must match all of it: the index keys
//! blocks by content-derived chain hashes, so a shared prefix does not cut
//! off the longer chain's tail.

use kvasir_cache_indexer::events::EngineHash;
use kvasir_cache_indexer::index::PoolIndex;
use kvasir_cache_indexer::stored_batch;
use kvasir_cache_indexer::types::EndpointId;

fn store(ix: &PoolIndex, ep: u64, tokens: &[u32], first_hash: u64) {
    let n = tokens.len() / 4;
    let hashes = (0..n as u64)
        .map(|i| EngineHash::U64(first_hash + i))
        .collect();
    ix.apply(
        EndpointId(ep),
        &stored_batch(hashes, tokens[..n * 4].to_vec(), 4),
    );
}

#[test]
fn longer_chain_behind_a_shared_prefix_matches_whole() {
    let tokens: Vec<u32> = (0..32).collect();
    // The order that works today: the long chain first.
    let ix = PoolIndex::new(4);
    store(&ix, 2, &tokens, 200);
    store(&ix, 1, &tokens[..16], 100);
    ix.flush_blocking();
    let o = ix.overlap(&tokens);
    assert_eq!(
        (o.blocks_for(EndpointId(1)), o.blocks_for(EndpointId(2))),
        (4, 8)
    );
}

#[test]
fn shared_prefix_first_then_longer_chain() {
    let tokens: Vec<u32> = (0..32).collect();
    let ix = PoolIndex::new(4);
    store(&ix, 1, &tokens[..16], 100);
    store(&ix, 2, &tokens, 200);
    ix.flush_blocking();
    let o = ix.overlap(&tokens);
    assert_eq!(
        (o.blocks_for(EndpointId(1)), o.blocks_for(EndpointId(2))),
        (4, 8)
    );
}
