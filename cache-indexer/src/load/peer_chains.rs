//! Other replicas' picks still in prefill, as block chains thinned to a few
//! sampled hashes so that publishing them stays small: a chain of a
//! long prompt has thousands of blocks, and replicas rewrite their entries
//! every round.
//!
//! A chain of `len` blocks is kept as its last hash and the hashes at
//! blocks `0, k, 2k, ...` below the last, with `k` at least
//! [`SAMPLE_EVERY`] and large enough that at most [`MAX_SAMPLES`] are kept.
//! Chained hashes make a match at block `i` a match of the whole prefix up
//! to `i`, so matching a request against such a chain is exact where it
//! reaches the last block and otherwise conservative: it credits the
//! prefix up to the last sampled block that matches, never more, and loses
//! at most `k - 1` blocks of a longer true match.

use std::fmt::Write as _;

/// Least distance between sampled blocks.
pub const SAMPLE_EVERY: u32 = 16;
/// Most sampled hashes kept per chain (besides the last block's).
pub const MAX_SAMPLES: u32 = 64;
/// Longest chain read back, in blocks: far past any context length, so a
/// bad entry cannot claim an absurd match.
pub const MAX_CHAIN_BLOCKS: u32 = 1 << 24;

/// A block chain thinned to sampled hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampledChain {
    len: u32,
    every: u32,
    last: u64,
    /// Hashes of blocks `0, every, 2 * every, ...` below `len - 1`.
    samples: Vec<u64>,
}

/// Samples of a chain of `len` blocks taken every `every` blocks.
fn sample_count(len: u32, every: u32) -> u32 {
    len.saturating_sub(1).div_ceil(every.max(1))
}

impl SampledChain {
    /// Thins `chain`; `None` for an empty chain (nothing to match) or one
    /// past [`MAX_CHAIN_BLOCKS`].
    pub fn of(chain: &[u64]) -> Option<SampledChain> {
        let len = u32::try_from(chain.len()).ok()?;
        if len == 0 || len > MAX_CHAIN_BLOCKS {
            return None;
        }
        let every = SAMPLE_EVERY.max((len - 1).div_ceil(MAX_SAMPLES));
        let samples = (0..sample_count(len, every))
            .map(|j| chain[(j * every) as usize])
            .collect();
        Some(SampledChain {
            len,
            every,
            last: chain[len as usize - 1],
            samples,
        })
    }

    /// Blocks in the chain.
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Always false: empty chains are never made (for clippy).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Leading blocks of `chain` this one is known to share: all of it when
    /// `chain` reaches this one's last block and agrees there, else up to
    /// and including the last sampled block that agrees. A binary search:
    /// chains agree on a prefix and differ after it.
    pub fn matched(&self, chain: &[u64]) -> usize {
        let len = self.len as usize;
        if chain.get(len - 1) == Some(&self.last) {
            return len;
        }
        let every = self.every as usize;
        // Samples whose block `chain` reaches.
        let reach = self.samples.len().min(chain.len().div_ceil(every));
        // Invariant: samples[..lo] agree; samples[hi..] (up to reach) do not.
        let (mut lo, mut hi) = (0usize, reach);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if chain[mid * every] == self.samples[mid] {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        if lo == 0 {
            0
        } else {
            (lo - 1) * every + 1
        }
    }

    /// Whether this chain may hold the whole of `chain`: it is at least as
    /// long and agrees at the last sampled block within `chain` (or at its
    /// last block). Optimistic by up to `k - 1` blocks: it only tells the
    /// tokenizer to go on, never credits a match.
    pub fn may_hold(&self, chain: &[u64]) -> bool {
        let Some(n) = chain.len().checked_sub(1) else {
            return true;
        };
        let len = self.len as usize;
        if n + 1 > len {
            return false;
        }
        if n + 1 == len {
            return chain[n] == self.last;
        }
        let j = n / self.every as usize;
        self.samples.get(j) == Some(&chain[j * self.every as usize])
    }

    /// Appends `<len>.<every>.<last>.<sample>...` (hashes in hex).
    pub fn encode_into(&self, out: &mut String) {
        // Writing into a String does not fail.
        let _ = write!(out, "{}.{}.{:x}", self.len, self.every, self.last);
        for s in &self.samples {
            let _ = write!(out, ".{s:x}");
        }
    }

    /// What [`SampledChain::encode_into`] wrote; `None` for anything else,
    /// a sample count that does not fit the length included.
    pub fn decode(text: &str) -> Option<SampledChain> {
        let mut f = text.split('.');
        let len = decimal(f.next()?)?;
        let every = decimal(f.next()?)?;
        let last = hex(f.next()?)?;
        if len == 0 || len > MAX_CHAIN_BLOCKS || every == 0 {
            return None;
        }
        let want = sample_count(len, every);
        if want > MAX_SAMPLES {
            return None;
        }
        let mut samples = Vec::with_capacity(want as usize);
        for s in f {
            if samples.len() == want as usize {
                return None;
            }
            samples.push(hex(s)?);
        }
        (samples.len() == want as usize).then_some(SampledChain {
            len,
            every,
            last,
            samples,
        })
    }
}

/// A decimal `u32`, digits only (no sign, no blanks).
fn decimal(s: &str) -> Option<u32> {
    if s.is_empty() || s.len() > 10 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// A hex `u64`, hex digits only.
fn hex(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 16 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(s, 16).ok()
}

#[cfg(test)]
#[path = "peer_chains_tests.rs"]
mod tests;
