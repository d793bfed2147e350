//! The latency model lives in the `vllm-latency` crate (the bench uses it
//! too); re-exported here so `vllm_sim::latency` keeps its paths.

pub use vllm_latency::*;
