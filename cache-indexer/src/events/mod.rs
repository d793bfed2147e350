//! vLLM KV-cache events: decoding the engine's exact wire format
//! ([`decode`], into the index's [`crate::index::kv_events`] types) and one
//! subscriber task per engine endpoint ([`subscriber`]) that keeps the
//! pool's [`crate::index::PoolIndex`] in step with it (sequence tracking,
//! replay, resync; the task itself is in `worker`).

pub mod decode;
pub mod state;
pub mod subscriber;
pub mod subscriber_config;
mod worker;

pub use decode::{decode_batch, DecodeError, DecodedBatch, EngineEvent, EngineHash};
pub use state::{DisconnectHook, IngestStats, IngestStatsSnapshot, SyncState};
pub use subscriber::{spawn_subscriber, SubscriberHandle};
pub use subscriber_config::SubscriberConfig;
