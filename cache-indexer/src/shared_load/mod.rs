//! Shared load: indexer replicas that act as one. Each replica counts the
//! picks it placed (in flight, queued prefill) in its own tracker; behind a
//! load balancer that spreads picks over several replicas, each would see
//! only its share of what the engines are about to receive. With shared
//! load every replica writes its own per-endpoint counts into a Redis hash
//! per pool and reads the others' back, and its views add them to the load
//! terms (see [`crate::load::peers`]).

pub mod merge;

pub use merge::{decode, encode, Entry, Merged, PeerTable};
