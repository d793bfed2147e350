//! The pool index over dynamo-kv-router: stores, prefixes, removals, clears,
//! endpoints, parent links, LoRA, filters, concurrency.

use dynamo_kv_router::protocols::{compute_block_hash_for_seq, BlockHashOptions};
use kvasir_cache_indexer::index::kv_events::{DecodedBatch, EngineEvent, EngineHash};
use kvasir_cache_indexer::index::PoolIndex;
use kvasir_cache_indexer::types::EndpointId;
use std::sync::Arc;

const BS: u32 = 4;

fn ep(n: u64) -> EndpointId {
    EndpointId(1000 + n)
}

/// Deterministic token ids of `n` blocks for sequence `seed`.
fn toks(seed: u32, blocks: usize) -> Vec<u32> {
    (0..blocks as u32 * BS)
        .map(|i| seed * 100_000 + i)
        .collect()
}

fn h(v: u64) -> EngineHash {
    EngineHash::U64(v)
}

fn stored(hashes: &[u64], parent: Option<u64>, token_ids: &[u32]) -> EngineEvent {
    EngineEvent::BlockStored {
        block_hashes: hashes.iter().map(|x| h(*x)).collect(),
        parent: parent.map(h),
        token_ids: token_ids.to_vec(),
        block_size: BS,
        lora_name: None,
        medium: Some("GPU".into()),
        group_idx: None,
        kv_cache_spec_kind: None,
    }
}

fn removed(hashes: &[u64]) -> EngineEvent {
    EngineEvent::BlockRemoved {
        block_hashes: hashes.iter().map(|x| h(*x)).collect(),
        medium: None,
        group_idx: None,
    }
}

fn batch(events: Vec<EngineEvent>) -> DecodedBatch {
    DecodedBatch {
        ts: 0.0,
        events,
        dp_rank: None,
        ignored_events: 0,
    }
}

/// Engine hashes for a sequence: distinct per (seed, block).
fn hashes(seed: u32, blocks: usize) -> Vec<u64> {
    (0..blocks as u64)
        .map(|i| seed as u64 * 1_000 + i + 1)
        .collect()
}

fn store_seq(idx: &PoolIndex, e: EndpointId, seed: u32, blocks: usize) {
    let o = idx.apply(
        e,
        &batch(vec![stored(
            &hashes(seed, blocks),
            None,
            &toks(seed, blocks),
        )]),
    );
    assert_eq!(o.skipped_events, 0);
}

#[test]
fn dynamo_hash_contract_is_pinned() {
    // FACTS.md: tokens [100,101,102,103], block size 4, no LoRA.
    let h = compute_block_hash_for_seq(&[100, 101, 102, 103], 4, BlockHashOptions::default());
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].0, 6_320_977_984_009_303_047);
}

#[test]
fn stored_blocks_match_on_their_endpoint_only() {
    let idx = PoolIndex::new(BS);
    store_seq(&idx, ep(1), 1, 5);
    idx.flush_blocking();
    let o = idx.overlap(&toks(1, 5));
    assert_eq!(o.request_blocks, 5);
    assert_eq!(o.blocks_for(ep(1)), 5);
    assert_eq!(o.matched.len(), 1);
    assert_eq!(idx.blocks(ep(1)), 5);
    assert_eq!(idx.blocks(ep(2)), 0);
    assert_eq!(idx.endpoints(), vec![ep(1)]);
    assert_eq!(idx.total_blocks(), 5);
}

#[test]
fn partial_prefix_and_partial_last_block() {
    let idx = PoolIndex::new(BS);
    store_seq(&idx, ep(1), 1, 6);
    idx.flush_blocking();
    // The first 3 blocks, then different tokens.
    let mut req = toks(1, 3);
    req.extend(toks(9, 3));
    let o = idx.overlap(&req);
    assert_eq!((o.request_blocks, o.blocks_for(ep(1))), (6, 3));
    // A longer request than what is cached; and a trailing partial block.
    let mut req = toks(1, 6);
    req.extend(toks(7, 2));
    req.extend([1, 2]);
    let o = idx.overlap(&req);
    assert_eq!((o.request_blocks, o.blocks_for(ep(1))), (8, 6));
    // Shorter than one block: nothing to match.
    let o = idx.overlap(&[1, 2, 3]);
    assert_eq!(o.request_blocks, 0);
    assert!(o.matched.is_empty());
    // A different first block: no match at all.
    assert!(idx.overlap(&toks(2, 6)).matched.is_empty());
}

#[test]
fn removal_shortens_the_matched_prefix() {
    let idx = PoolIndex::new(BS);
    store_seq(&idx, ep(1), 1, 6);
    let hs = hashes(1, 6);
    // Evict the last two blocks (vLLM evicts tails first).
    let o = idx.apply(ep(1), &batch(vec![removed(&[hs[5], hs[4]])]));
    assert_eq!(o.removed, 2);
    idx.flush_blocking();
    assert_eq!(idx.overlap(&toks(1, 6)).blocks_for(ep(1)), 4);
    assert_eq!(idx.blocks(ep(1)), 4);
    // A hole in the middle ends the usable prefix there.
    idx.apply(ep(1), &batch(vec![removed(&[hs[1]])]));
    idx.flush_blocking();
    assert_eq!(idx.overlap(&toks(1, 6)).blocks_for(ep(1)), 1);
    // Removing unknown or already removed blocks is a no-op.
    let o = idx.apply(ep(1), &batch(vec![removed(&[hs[1], 987_654])]));
    assert_eq!(o.removed, 0);
    assert_eq!(idx.blocks(ep(1)), 3);
}

#[test]
fn all_blocks_cleared_and_clear_endpoint() {
    let idx = PoolIndex::new(BS);
    store_seq(&idx, ep(1), 1, 4);
    store_seq(&idx, ep(2), 1, 4);
    let o = idx.apply(ep(1), &batch(vec![EngineEvent::AllBlocksCleared]));
    assert_eq!(o.cleared, 1);
    idx.flush_blocking();
    let ov = idx.overlap(&toks(1, 4));
    assert_eq!(ov.blocks_for(ep(1)), 0);
    assert_eq!(ov.blocks_for(ep(2)), 4);
    assert_eq!(idx.blocks(ep(1)), 0);

    idx.clear_endpoint(ep(2));
    idx.flush_blocking();
    assert!(idx.overlap(&toks(1, 4)).matched.is_empty());
    assert_eq!(idx.blocks(ep(2)), 0);
    // Cleared endpoints stay known and can be filled again.
    assert_eq!(idx.endpoints(), vec![ep(1), ep(2)]);
    store_seq(&idx, ep(2), 1, 2);
    idx.flush_blocking();
    assert_eq!(idx.overlap(&toks(1, 4)).blocks_for(ep(2)), 2);
}

#[test]
fn remove_endpoint_forgets_it() {
    let idx = PoolIndex::new(BS);
    store_seq(&idx, ep(1), 1, 4);
    store_seq(&idx, ep(2), 1, 3);
    idx.remove_endpoint(ep(1));
    idx.flush_blocking();
    assert_eq!(idx.endpoints(), vec![ep(2)]);
    let o = idx.overlap(&toks(1, 4));
    assert_eq!(o.blocks_for(ep(1)), 0);
    assert_eq!(o.blocks_for(ep(2)), 3);
    assert_eq!(idx.blocks(ep(1)), 0);
    assert_eq!(idx.total_blocks(), 3);
    // Removing twice, or an unknown endpoint, is fine.
    idx.remove_endpoint(ep(1));
    idx.remove_endpoint(ep(9));
    // It can come back from empty.
    store_seq(&idx, ep(1), 5, 2);
    idx.flush_blocking();
    assert_eq!(idx.overlap(&toks(5, 2)).blocks_for(ep(1)), 2);
    assert_eq!(idx.overlap(&toks(1, 4)).blocks_for(ep(1)), 0);
}

#[test]
fn two_endpoints_with_different_and_shared_prefixes() {
    let idx = PoolIndex::new(BS);
    store_seq(&idx, ep(1), 1, 4);
    store_seq(&idx, ep(2), 2, 4);
    // ep(3) shares seq 1's first two blocks (same tokens, its own engine
    // hashes) and then diverges.
    let mut t3 = toks(1, 2);
    t3.extend(toks(3, 2));
    idx.apply(ep(3), &batch(vec![stored(&[71, 72, 73, 74], None, &t3)]));
    idx.flush_blocking();
    let o1 = idx.overlap(&toks(1, 4));
    assert_eq!(o1.blocks_for(ep(1)), 4);
    assert_eq!(o1.blocks_for(ep(2)), 0);
    assert_eq!(o1.blocks_for(ep(3)), 2);
    let o2 = idx.overlap(&toks(2, 4));
    assert_eq!((o2.blocks_for(ep(1)), o2.blocks_for(ep(2))), (0, 4));
    assert_eq!(idx.overlap(&t3).blocks_for(ep(3)), 4);
    assert_eq!(idx.overlap(&t3).blocks_for(ep(1)), 2);
}

#[test]
fn parent_links_across_events_and_orphans() {
    let idx = PoolIndex::new(BS);
    let t = toks(1, 6);
    let hs = hashes(1, 6);
    // Blocks 0-1, then 2-3 linked to block 1, then 4-5 linked to block 3,
    // in separate batches as a long prefill's chunks arrive.
    idx.apply(ep(1), &batch(vec![stored(&hs[0..2], None, &t[0..8])]));
    idx.apply(
        ep(1),
        &batch(vec![stored(&hs[2..4], Some(hs[1]), &t[8..16])]),
    );
    idx.apply(
        ep(1),
        &batch(vec![stored(&hs[4..6], Some(hs[3]), &t[16..24])]),
    );
    idx.flush_blocking();
    assert_eq!(idx.overlap(&t).blocks_for(ep(1)), 6);
    assert_eq!(idx.blocks(ep(1)), 6);
    // A store whose parent was never seen (lost events) is skipped.
    let o = idx.apply(ep(1), &batch(vec![stored(&[555], Some(444), &toks(8, 1))]));
    assert_eq!((o.stored, o.skipped_events), (0, 1));
    // A branch off block 2 of the same sequence.
    let mut branch = t[0..12].to_vec();
    branch.extend(toks(4, 1));
    idx.apply(
        ep(1),
        &batch(vec![stored(&[901], Some(hs[2]), &branch[12..16])]),
    );
    idx.flush_blocking();
    assert_eq!(idx.overlap(&branch).blocks_for(ep(1)), 4);
    assert_eq!(idx.overlap(&t).blocks_for(ep(1)), 6);
    assert_eq!(idx.blocks(ep(1)), 7);
}

#[test]
fn duplicate_stores_are_counted_once() {
    let idx = PoolIndex::new(BS);
    store_seq(&idx, ep(1), 1, 3);
    let o = idx.apply(
        ep(1),
        &batch(vec![stored(&hashes(1, 3), None, &toks(1, 3))]),
    );
    assert_eq!(o.stored, 0);
    // A chain that repeats the known head and adds a tail.
    let o = idx.apply(
        ep(1),
        &batch(vec![stored(&hashes(1, 5), None, &toks(1, 5))]),
    );
    assert_eq!(o.stored, 2);
    idx.flush_blocking();
    assert_eq!(idx.blocks(ep(1)), 5);
    assert_eq!(idx.overlap(&toks(1, 5)).blocks_for(ep(1)), 5);
}

#[test]
fn lora_blocks_match_only_under_the_adapter() {
    let idx = PoolIndex::new(BS);
    let t = toks(1, 3);
    idx.apply(
        ep(1),
        &batch(vec![EngineEvent::BlockStored {
            block_hashes: hashes(1, 3).into_iter().map(h).collect(),
            parent: None,
            token_ids: t.clone(),
            block_size: BS,
            lora_name: Some("sql".into()),
            medium: None,
            group_idx: None,
            kv_cache_spec_kind: None,
        }]),
    );
    idx.flush_blocking();
    assert_eq!(idx.overlap(&t).blocks_for(ep(1)), 0);
    assert_eq!(idx.overlap_for(&t, Some("sql")).blocks_for(ep(1)), 3);
    assert_eq!(idx.overlap_for(&t, Some("other")).blocks_for(ep(1)), 0);
}

#[test]
fn non_gpu_wrong_block_size_and_sliding_window_are_skipped() {
    let idx = PoolIndex::new(BS);
    let t = toks(1, 2);
    let mk = |medium: Option<&str>, bs: u32, kind: Option<&str>| EngineEvent::BlockStored {
        block_hashes: vec![h(1), h(2)],
        parent: None,
        token_ids: t.clone(),
        block_size: bs,
        lora_name: None,
        medium: medium.map(str::to_owned),
        group_idx: None,
        kv_cache_spec_kind: kind.map(str::to_owned),
    };
    let o = idx.apply(
        ep(1),
        &batch(vec![
            mk(Some("CPU"), BS, None),
            mk(None, 8, None),
            mk(None, BS, Some("sliding_window")),
        ]),
    );
    assert_eq!((o.stored, o.skipped_events), (0, 3));
    let o = idx.apply(
        ep(1),
        &batch(vec![mk(Some("GPU"), BS, Some("full_attention"))]),
    );
    assert_eq!(o.stored, 2);
    // A CPU-tier removal does not remove the GPU copy.
    let o = idx.apply(
        ep(1),
        &batch(vec![EngineEvent::BlockRemoved {
            block_hashes: vec![h(1)],
            medium: Some("CPU".into()),
            group_idx: None,
        }]),
    );
    assert_eq!((o.removed, o.skipped_events), (0, 1));
    idx.flush_blocking();
    assert_eq!(idx.overlap(&t).blocks_for(ep(1)), 2);
}

#[test]
fn short_token_ids_index_what_they_cover() {
    let idx = PoolIndex::new(BS);
    // Three hashes but tokens for two blocks and a half.
    let t = toks(1, 3);
    let o = idx.apply(ep(1), &batch(vec![stored(&[1, 2, 3], None, &t[..10])]));
    assert_eq!(o.stored, 2);
    idx.flush_blocking();
    assert_eq!(idx.overlap(&t).blocks_for(ep(1)), 2);
}

#[test]
fn bin_hashes_store_and_remove() {
    let idx = PoolIndex::new(BS);
    let t = toks(1, 2);
    let (a, b) = (EngineHash::Bytes([1; 32]), EngineHash::Bytes([2; 32]));
    idx.apply(
        ep(1),
        &batch(vec![EngineEvent::BlockStored {
            block_hashes: vec![a],
            parent: None,
            token_ids: t[..4].to_vec(),
            block_size: BS,
            lora_name: None,
            medium: None,
            group_idx: None,
            kv_cache_spec_kind: None,
        }]),
    );
    idx.apply(
        ep(1),
        &batch(vec![EngineEvent::BlockStored {
            block_hashes: vec![b],
            parent: Some(a),
            token_ids: t[4..].to_vec(),
            block_size: BS,
            lora_name: None,
            medium: None,
            group_idx: None,
            kv_cache_spec_kind: None,
        }]),
    );
    idx.flush_blocking();
    assert_eq!(idx.overlap(&t).blocks_for(ep(1)), 2);
    idx.apply(
        ep(1),
        &batch(vec![EngineEvent::BlockRemoved {
            block_hashes: vec![b],
            medium: None,
            group_idx: None,
        }]),
    );
    idx.flush_blocking();
    assert_eq!(idx.overlap(&t).blocks_for(ep(1)), 1);
}

#[test]
fn data_parallel_ranks_are_separate_and_best_rank_wins() {
    let idx = PoolIndex::new(BS);
    let t = toks(1, 4);
    let hs = hashes(1, 4);
    let mut b0 = batch(vec![stored(&hs[..2], None, &t[..8])]);
    b0.dp_rank = Some(0);
    let mut b1 = batch(vec![stored(&hs, None, &t)]);
    b1.dp_rank = Some(1);
    idx.apply(ep(1), &b0);
    idx.apply(ep(1), &b1);
    idx.flush_blocking();
    assert_eq!(idx.overlap(&t).blocks_for(ep(1)), 4);
    // The same engine hashes on two ranks are two copies.
    assert_eq!(idx.blocks(ep(1)), 6);
    // Rank 1 clears its cache: rank 0's copy still serves.
    let mut c = batch(vec![EngineEvent::AllBlocksCleared]);
    c.dp_rank = Some(1);
    idx.apply(ep(1), &c);
    idx.flush_blocking();
    assert_eq!(idx.overlap(&t).blocks_for(ep(1)), 2);
    idx.clear_endpoint(ep(1));
    idx.flush_blocking();
    assert_eq!(idx.overlap(&t).blocks_for(ep(1)), 0);
}

#[test]
fn concurrent_readers_and_writers() {
    let idx = Arc::new(PoolIndex::new(BS));
    let writers: Vec<_> = (0..3u64)
        .map(|w| {
            let idx = idx.clone();
            std::thread::spawn(move || {
                for s in 0..200u32 {
                    let seed = w as u32 * 1000 + s;
                    store_seq(&idx, ep(w), seed, 8);
                    if s % 3 == 0 {
                        idx.apply(ep(w), &batch(vec![removed(&hashes(seed, 8)[4..])]));
                    }
                }
            })
        })
        .collect();
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let idx = idx.clone();
            std::thread::spawn(move || {
                let mut seen = 0;
                for s in 0..2000u32 {
                    let o = idx.overlap(&toks(s % 200, 8));
                    seen += o.matched.len();
                    assert!(o.matched.values().all(|m| *m <= 8));
                }
                seen
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    for r in readers {
        r.join().unwrap();
    }
    idx.flush_blocking();
    for w in 0..3u64 {
        // 200 sequences of 8 blocks, every third cut to 4.
        assert_eq!(idx.blocks(ep(w)), 200 * 8 - 67 * 4);
        assert_eq!(
            idx.overlap(&toks(w as u32 * 1000 + 1, 8)).blocks_for(ep(w)),
            8
        );
        assert_eq!(
            idx.overlap(&toks(w as u32 * 1000 + 3, 8)).blocks_for(ep(w)),
            4
        );
    }
}

/// vLLM seeds its block hashes per process, so two engines publish different
/// hashes for the same prefix. The endpoint holding the longer chain must
/// still match all of it, whichever stored first and whether its tail came
/// as a separate second-turn event (parent set) or in one event.
#[test]
fn shared_prefix_under_different_engine_hashes_keeps_the_longer_tail() {
    let tokens = toks(7, 8);
    for order in 0..2 {
        for split in [false, true] {
            let idx = PoolIndex::new(BS);
            let short = || {
                idx.apply(
                    ep(1),
                    &batch(vec![stored(&[101, 102, 103, 104], None, &tokens[..16])]),
                );
            };
            let long = || {
                let hs = [201, 202, 203, 204, 205, 206, 207, 208];
                if split {
                    // Turn 1 then turn 2, as an engine reports a growing chat.
                    idx.apply(ep(2), &batch(vec![stored(&hs[..4], None, &tokens[..16])]));
                    idx.apply(
                        ep(2),
                        &batch(vec![stored(&hs[4..], Some(204), &tokens[16..32])]),
                    );
                } else {
                    idx.apply(ep(2), &batch(vec![stored(&hs, None, &tokens)]));
                }
            };
            if order == 0 {
                short();
                long();
            } else {
                long();
                short();
            }
            idx.flush_blocking();
            let o = idx.overlap(&tokens);
            assert_eq!(o.blocks_for(ep(1)), 4, "order {order} split {split}");
            assert_eq!(o.blocks_for(ep(2)), 8, "order {order} split {split}");
            // Removing the short endpoint's copy leaves the long one whole.
            idx.apply(ep(1), &batch(vec![removed(&[104])]));
            idx.flush_blocking();
            let o = idx.overlap(&tokens);
            assert_eq!(o.blocks_for(ep(1)), 3);
            assert_eq!(o.blocks_for(ep(2)), 8);
        }
    }
}
