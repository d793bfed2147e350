//! vLLM KV-cache events: decoding the engine's exact wire format
//! ([`decode`]) and one subscriber task per engine endpoint ([`subscriber`])
//! that keeps the pool's [`crate::index::PoolIndex`] in step with it
//! (sequence tracking, replay, resync).

pub mod decode;
pub mod subscriber;

pub use decode::{decode_batch, DecodeError, DecodedBatch, EngineEvent, EngineHash};
pub use subscriber::{
    spawn_subscriber, IngestStats, IngestStatsSnapshot, SubscriberConfig, SubscriberHandle,
    SyncState,
};
