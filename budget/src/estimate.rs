//! The output estimate of a request without `max_tokens`: a per-tenant
//! learned figure.
//!
//! A moving mean of the tenant's completion lengths plus twice their mean
//! deviation (the shape of TCP's retransmission timer): the mean alone
//! would be short for half the requests, and every short estimate is usage
//! taken beyond the reservation while the response streams. Exponential
//! weights with gain 1/8 follow a tenant whose answers change length
//! within tens of requests, and need no history. Integer fixed point (1/16
//! token), so the figure is the same on every platform.

/// Fixed-point scale of the moving figures.
const SCALE: i64 = 16;
/// Gain of each new sample: 1 / 2^GAIN_SHIFT.
const GAIN_SHIFT: u32 = 3;

/// A tenant's learned completion length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputEstimate {
    initial: u64,
    mean: i64,
    dev: i64,
    samples: u64,
}

impl OutputEstimate {
    /// An estimate that answers `initial` until it has seen a completion.
    pub fn new(initial: u64) -> OutputEstimate {
        OutputEstimate {
            initial,
            mean: 0,
            dev: 0,
            samples: 0,
        }
    }

    /// Learns one finished request's completion tokens.
    pub fn observe(&mut self, completion_tokens: u64) {
        // Far beyond any context length; keeps the fixed point in range.
        let x = i64::try_from(completion_tokens.min(1 << 40)).unwrap_or(0) * SCALE;
        if self.samples == 0 {
            self.mean = x;
            self.dev = x / 2;
        } else {
            let err = x - self.mean;
            self.mean += err >> GAIN_SHIFT;
            self.dev += (err.abs() - self.dev) >> GAIN_SHIFT;
        }
        self.samples = self.samples.saturating_add(1);
    }

    /// Completions learned so far.
    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// The learned figure (the initial one before any sample), at least 1.
    pub fn learned(&self) -> u64 {
        if self.samples == 0 {
            return self.initial.max(1);
        }
        let v = (self.mean + 2 * self.dev.max(0)).max(0);
        u64::try_from((v + SCALE - 1) / SCALE).unwrap_or(0).max(1)
    }

    /// The completion tokens to reserve: the request's `max_tokens` when it
    /// sets one (the engine never exceeds it, so the reservation is never
    /// short), else the learned figure.
    pub fn estimate(&self, max_tokens: Option<u64>) -> u64 {
        max_tokens.unwrap_or_else(|| self.learned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn initial_until_the_first_sample() {
        let e = OutputEstimate::new(256);
        assert_eq!(e.learned(), 256);
        assert_eq!(e.estimate(Some(10)), 10);
        assert_eq!(OutputEstimate::new(0).learned(), 1);
    }

    #[test]
    fn constant_lengths_converge_to_the_length() {
        let mut e = OutputEstimate::new(1000);
        for _ in 0..200 {
            e.observe(100);
        }
        assert_eq!(e.learned(), 100);
    }

    #[test]
    fn spread_lengths_are_covered_above_the_mean() {
        let mut e = OutputEstimate::new(1);
        for i in 0..400 {
            e.observe(if i % 2 == 0 { 50 } else { 150 });
        }
        let l = e.learned();
        assert!(l > 150 && l < 300, "{l}");
    }

    #[test]
    fn huge_samples_do_not_overflow() {
        let mut e = OutputEstimate::new(1);
        for _ in 0..100 {
            e.observe(u64::MAX);
        }
        assert!(e.learned() > 0);
    }
}
