//! The picker's scoring. It lives in the `kvasir-scoring` crate so the
//! routing benchmark's cluster model can rank exactly as the picker does
//! without building the indexer's service stack; re-exported whole so
//! `crate::scoring::X` keeps naming the same items.

pub use kvasir_scoring::*;
