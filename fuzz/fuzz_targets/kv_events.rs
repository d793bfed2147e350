//! The indexer's KV-event decoder: both event encodings (tagged maps and
//! positional arrays) and every hash form (uint64, negative int64, 32-byte
//! bin). It never reports more than the payload can hold: each hash takes
//! at least one byte (a bin hash 34), each token id at least one.
#![no_main]

use kvasir_cache_indexer::events::{decode_batch, EngineEvent, EngineHash};
use libfuzzer_sys::fuzz_target;

fn cost(h: &EngineHash) -> usize {
    match h {
        EngineHash::U64(_) => 1,
        EngineHash::Bytes(_) => 34,
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(batch) = decode_batch(data) else {
        return;
    };
    let mut bytes = batch.events.len() + batch.ignored_events;
    for e in &batch.events {
        match e {
            EngineEvent::BlockStored {
                block_hashes,
                parent,
                token_ids,
                ..
            } => {
                bytes += block_hashes.iter().map(cost).sum::<usize>();
                bytes += parent.as_ref().map_or(0, cost);
                bytes += token_ids.len();
            }
            EngineEvent::BlockRemoved { block_hashes, .. } => {
                bytes += block_hashes.iter().map(cost).sum::<usize>();
            }
            EngineEvent::AllBlocksCleared => {}
        }
    }
    assert!(
        bytes <= data.len(),
        "decoded {bytes} bytes' worth from {}",
        data.len()
    );
});
