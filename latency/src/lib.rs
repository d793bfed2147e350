//! The latency model: how long one engine step takes on the modelled GPU.
//!
//! A continuous-batching step runs every scheduled sequence once. Its time
//! is the decode part (one read of the weights, a little per sequence, and a
//! read of every scheduled sequence's KV cache) plus, when the step carries
//! prefill, a fixed overhead, a per-token cost for the linear layers, and the
//! attention cost of each new token over the context before it.
//! Constants are per profile and every one can be overridden by a flag.
//!
//! Its own crate (std only) because two users need it: `vllm-sim` prices
//! its steps with it, and `kvasir-bench`'s cluster model and bounds use
//! the same numbers without building a simulator.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// vLLM's `--max-num-batched-tokens` default in the simulator and the bench.
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: usize = 8192;
/// The profile used when none is given.
pub const DEFAULT_PROFILE: &str = "h100-8b";

use std::time::Duration;

/// Constants of the model, in microseconds (attention in nanoseconds).
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyProfile {
    /// Profile name, reported in logs and `/metrics`.
    pub name: String,
    /// Extra fixed cost of a step that carries any prefill tokens.
    pub prefill_overhead_us: f64,
    /// Linear-layer cost per prefilled (uncached) token.
    pub prefill_per_token_us: f64,
    /// Attention cost per (new token x context token before it) pair.
    pub prefill_attn_per_pair_ns: f64,
    /// Fixed cost of any step: reading the weights once.
    pub step_base_us: f64,
    /// Cost per sequence in the batch (sampling, scheduling).
    pub per_seq_us: f64,
    /// Cost per context token of each decoding sequence (KV-cache reads).
    pub decode_per_ctx_token_us: f64,
}

impl LatencyProfile {
    /// An 8B model in bf16 on one H100 (see FACTS.md): ~30 ms + 0.03 ms per
    /// token for a lone prefill; 6 ms decode steps at batch 1, growing with
    /// summed context (128 KiB of KV per token at 3.35 TB/s = 0.039 us).
    pub fn h100_8b() -> Self {
        LatencyProfile {
            name: "h100-8b".into(),
            prefill_overhead_us: 24_000.0,
            prefill_per_token_us: 0.03 * 1000.0,
            // 4 * 32 layers * 4096 dims FLOP per pair at ~445 TFLOP/s.
            prefill_attn_per_pair_ns: 1.2,
            step_base_us: 6_000.0,
            per_seq_us: 20.0,
            decode_per_ctx_token_us: 0.039,
        }
    }

    /// llm-d-inference-sim's "8b-h100" numbers (30 ms + 0.25 ms per token),
    /// about 8x slower than the hardware, for comparisons with its results.
    pub fn llmd_8b_h100() -> Self {
        LatencyProfile {
            name: "llmd-8b-h100".into(),
            prefill_overhead_us: 24_000.0,
            prefill_per_token_us: 250.0,
            prefill_attn_per_pair_ns: 0.0,
            ..Self::h100_8b()
        }
    }

    /// Every step takes no time at all: for throughput tests of the
    /// simulator and the router's own overhead.
    pub fn zero() -> Self {
        LatencyProfile {
            name: "zero".into(),
            prefill_overhead_us: 0.0,
            prefill_per_token_us: 0.0,
            prefill_attn_per_pair_ns: 0.0,
            step_base_us: 0.0,
            per_seq_us: 0.0,
            decode_per_ctx_token_us: 0.0,
        }
    }

    /// A profile by name.
    pub fn by_name(name: &str) -> Option<Self> {
        match name {
            "h100-8b" => Some(Self::h100_8b()),
            "llmd-8b-h100" => Some(Self::llmd_8b_h100()),
            "zero" => Some(Self::zero()),
            _ => None,
        }
    }

    /// Names accepted by [`LatencyProfile::by_name`].
    pub const NAMES: &'static [&'static str] = &["h100-8b", "llmd-8b-h100", "zero"];

    /// Time of one step doing `work`.
    pub fn step_time(&self, work: &StepWork) -> Duration {
        if work.prefill_tokens == 0 && work.decode_seqs == 0 {
            return Duration::ZERO;
        }
        let seqs = (work.decode_seqs + work.prefill_seqs) as f64;
        let mut us = self.step_base_us
            + self.per_seq_us * seqs
            + self.decode_per_ctx_token_us * work.decode_context_tokens as f64;
        us += self.prefill_us(work);
        Duration::from_secs_f64(us.max(0.0) / 1e6)
    }

    /// The prefill terms of a step's cost (fixed overhead, per token,
    /// attention), the part a benchmark calls prefill utilisation.
    pub fn prefill_time(&self, work: &StepWork) -> Duration {
        Duration::from_secs_f64(self.prefill_us(work).max(0.0) / 1e6)
    }

    fn prefill_us(&self, work: &StepWork) -> f64 {
        if work.prefill_tokens == 0 {
            return 0.0;
        }
        self.prefill_overhead_us
            + self.prefill_per_token_us * work.prefill_tokens as f64
            + self.prefill_attn_per_pair_ns * work.prefill_attn_pairs as f64 / 1000.0
    }
}

/// What one step computes, as the latency model needs it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepWork {
    /// Uncached prompt tokens computed in this step (all chunks together).
    pub prefill_tokens: u64,
    /// Sequences with a prefill chunk in this step.
    pub prefill_seqs: u32,
    /// Sum over prefilled tokens of the context length before each one.
    pub prefill_attn_pairs: u64,
    /// Sequences generating one token in this step.
    pub decode_seqs: u32,
    /// Summed context length of the decoding sequences.
    pub decode_context_tokens: u64,
}

impl StepWork {
    /// Adds a prefill chunk of `tokens` new tokens after `context` tokens
    /// already computed (cached or from earlier chunks).
    pub fn add_prefill(&mut self, context: u64, tokens: u64) {
        self.prefill_tokens += tokens;
        self.prefill_seqs += 1;
        // sum_{i=0}^{tokens-1} (context + i)
        self.prefill_attn_pairs += tokens * context + tokens * tokens.saturating_sub(1) / 2;
    }

    /// Adds one decoding sequence with `context` tokens of KV cache.
    pub fn add_decode(&mut self, context: u64) {
        self.decode_seqs += 1;
        self.decode_context_tokens += context;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(d: Duration) -> f64 {
        d.as_secs_f64() * 1e3
    }

    #[test]
    fn prefill_time_is_the_prefill_share_of_a_step() {
        let p = LatencyProfile::h100_8b();
        let mut w = StepWork::default();
        w.add_decode(1000);
        assert_eq!(p.prefill_time(&w), Duration::ZERO);
        let decode_only = p.step_time(&w);
        w.add_prefill(0, 2000);
        let extra = p.step_time(&w) - decode_only;
        // The per-sequence cost of the new sequence is not prefill work.
        let diff = ms(extra) - ms(p.prefill_time(&w));
        assert!((diff - p.per_seq_us / 1e3).abs() < 1e-6, "diff {diff}");
        assert!(ms(p.prefill_time(&w)) > 80.0);
    }

    #[test]
    fn lone_short_prefill_is_about_30ms_plus_per_token() {
        let p = LatencyProfile::h100_8b();
        let mut w = StepWork::default();
        w.add_prefill(0, 100);
        // 30 ms + 100 x 0.03 ms (+ a little attention and per-sequence cost).
        let t = ms(p.step_time(&w));
        assert!((33.0..33.2).contains(&t), "{t}");
    }

    #[test]
    fn prefill_cost_grows_with_uncached_tokens_and_context() {
        let p = LatencyProfile::h100_8b();
        let mut a = StepWork::default();
        a.add_prefill(0, 2000);
        let mut b = StepWork::default();
        b.add_prefill(0, 8000);
        let mut c = StepWork::default();
        c.add_prefill(8000, 2000); // same new tokens, after a cached prefix
        let (ta, tb, tc) = (
            ms(p.step_time(&a)),
            ms(p.step_time(&b)),
            ms(p.step_time(&c)),
        );
        // 8000 tokens: 30 + 240 ms linear + 38 ms attention.
        assert!((300.0..320.0).contains(&tb), "{tb}");
        assert!(tb > ta * 3.0);
        assert!(tc > ta && tc < tb, "attention over a cached prefix costs, but far less than recomputing it: {ta} {tc} {tb}");
    }

    #[test]
    fn decode_step_batch_one_and_long_batches() {
        let p = LatencyProfile::h100_8b();
        let mut w = StepWork::default();
        w.add_decode(1000);
        let t1 = ms(p.step_time(&w));
        assert!((6.0..7.0).contains(&t1), "{t1}");
        let mut big = StepWork::default();
        for _ in 0..32 {
            big.add_decode(8192);
        }
        // 32 x 8k tokens of KV = 32 GB: ~10 ms more than the base step.
        let t32 = ms(p.step_time(&big));
        assert!((16.0..18.0).contains(&t32), "{t32}");
    }

    #[test]
    fn empty_step_is_free_and_zero_profile_is_zero() {
        let p = LatencyProfile::h100_8b();
        assert_eq!(p.step_time(&StepWork::default()), Duration::ZERO);
        let mut w = StepWork::default();
        w.add_prefill(0, 5000);
        w.add_decode(100);
        assert_eq!(LatencyProfile::zero().step_time(&w), Duration::ZERO);
    }

    #[test]
    fn attention_pairs_sum_is_exact() {
        let mut w = StepWork::default();
        w.add_prefill(10, 4); // 10 + 11 + 12 + 13
        assert_eq!(w.prefill_attn_pairs, 46);
    }
}
