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

mod event;
mod msgpack;

use msgpack::{Int, Reader};

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
