//! How far an engine has got through its queued prefill since the last
//! report said where it was: its prefill rate, learned from first-token
//! reports, times the time its current prefill has run.
//!
//! An engine's queued prefill work (the uncached prompt tokens of the picks
//! placed there and not at their first token yet) otherwise falls only at a
//! FIRST_TOKEN report: a pick in the middle of a 20k-token prefill leaves
//! the engine looking just as busy until the report, seconds later, and
//! flow control holds picks that long (bench/results/governance.md, "Late
//! binding that keeps prefixes").
//!
//! The engine prefills its picks about in arrival order (vLLM's chunked
//! prefill gives the running requests their chunks first, in arrival
//! order), so the oldest pick in prefill is the one in progress. Its
//! prefill could start when it was picked, or when the previous prefill on
//! the engine ended, whichever is later ([`started`]); a FIRST_TOKEN
//! report then gives one sample of the rate: its tokens over that time
//! ([`PrefillRate::observe`]). Between reports the work done is the rate
//! times the time since the current prefill started, **at most the oldest
//! pick's tokens** ([`drained`]): the engine cannot be past that pick
//! without its report saying so, so a wrong rate shows room early by at
//! most one pick's prefill, and only until that report.
//!
//! It errs on the slow side by construction: a sample's time includes the
//! report's way back, the decode steps sharing the engine's token budget
//! and other replicas' work on the engine, all of which lower the rate.
//! Until the first sample nothing drains.

use std::time::{Duration, Instant};

/// Samples smaller than this are not learned from: their time is mostly
/// fixed costs (a step, the report's way), not prefill.
pub const MIN_SAMPLE_TOKENS: u64 = 256;

/// Weight of a new sample in the running averages.
const ALPHA: f64 = 0.2;

/// Highest rate believed (tokens per second): a bound on what a sample
/// timed at a few microseconds could claim.
pub const MAX_RATE: f64 = 10_000_000.0;

/// An engine's prefill rate: running averages of a sample's tokens and of
/// its time, whose ratio is the rate (a ratio of sums, so one short sample
/// with a tiny time cannot swing it).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillRate {
    tokens: f64,
    secs: f64,
}

impl PrefillRate {
    /// Learns from one prefill of `tokens` that took `took` (see
    /// [`started`]); small or untimed samples are ignored.
    pub fn observe(&mut self, tokens: u64, took: Duration) {
        let secs = took.as_secs_f64();
        if tokens < MIN_SAMPLE_TOKENS || secs <= 0.0 {
            return;
        }
        let tokens = tokens as f64;
        if self.secs == 0.0 {
            (self.tokens, self.secs) = (tokens, secs);
        } else {
            self.tokens += ALPHA * (tokens - self.tokens);
            self.secs += ALPHA * (secs - self.secs);
        }
    }

    /// Tokens per second; `None` before the first sample.
    pub fn per_sec(&self) -> Option<f64> {
        (self.secs > 0.0).then(|| (self.tokens / self.secs).min(MAX_RATE))
    }
}

/// When the prefill of a pick picked at `picked_at` could start on an
/// engine whose previous prefill ended at `previous_end` (none known:
/// at its pick).
pub fn started(picked_at: Instant, previous_end: Option<Instant>) -> Instant {
    previous_end.map_or(picked_at, |e| e.max(picked_at))
}

/// Tokens of queued prefill done by `now` on an engine prefilling at
/// `rate` since `since`, at most `cap` (the oldest pick's tokens, see the
/// module docs). No rate or no prefill in progress: none.
pub fn drained(rate: Option<f64>, since: Option<Instant>, now: Instant, cap: u64) -> u64 {
    let (Some(rate), Some(since)) = (rate, since) else {
        return 0;
    };
    let done = rate * now.saturating_duration_since(since).as_secs_f64();
    // (`as` saturates; the cap bounds it anyway.)
    (done as u64).min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_rate_is_tokens_over_time_and_follows_new_samples() {
        let mut r = PrefillRate::default();
        assert_eq!(r.per_sec(), None, "nothing learned: no rate");
        r.observe(10_000, ms(500));
        assert_eq!(r.per_sec(), Some(20_000.0));
        // A slower sample moves it down, not all the way.
        r.observe(10_000, ms(1000));
        let slower = r.per_sec().unwrap();
        assert!(slower < 20_000.0 && slower > 10_000.0, "{slower}");
        // Many of them: it converges on the new rate.
        for _ in 0..100 {
            r.observe(10_000, ms(1000));
        }
        assert!((r.per_sec().unwrap() - 10_000.0).abs() < 1.0);
    }

    #[test]
    fn small_and_untimed_samples_teach_nothing() {
        let mut r = PrefillRate::default();
        r.observe(MIN_SAMPLE_TOKENS - 1, ms(1));
        r.observe(100_000, Duration::ZERO);
        assert_eq!(r.per_sec(), None);
        r.observe(4096, ms(100));
        let before = r.per_sec();
        r.observe(10, Duration::from_nanos(1));
        assert_eq!(r.per_sec(), before, "one tiny sample cannot swing it");
        r = PrefillRate::default();
        r.observe(1 << 40, Duration::from_nanos(1));
        assert_eq!(r.per_sec(), Some(MAX_RATE), "bounded");
    }

    #[test]
    fn a_prefill_starts_at_its_pick_or_when_the_one_before_ended() {
        let t0 = Instant::now();
        assert_eq!(started(t0 + ms(5), None), t0 + ms(5));
        assert_eq!(started(t0 + ms(5), Some(t0)), t0 + ms(5), "engine idle");
        assert_eq!(started(t0, Some(t0 + ms(5))), t0 + ms(5), "queued");
    }

    #[test]
    fn work_drains_with_time_up_to_the_oldest_picks_tokens() {
        let t0 = Instant::now();
        let rate = Some(10_000.0);
        assert_eq!(drained(rate, Some(t0), t0, 8192), 0);
        assert_eq!(drained(rate, Some(t0), t0 + ms(100), 8192), 1000);
        assert_eq!(drained(rate, Some(t0), t0 + ms(500), 8192), 5000);
        assert_eq!(
            drained(rate, Some(t0), t0 + Duration::from_secs(60), 8192),
            8192,
            "never past the oldest pick without its report"
        );
        assert_eq!(drained(None, Some(t0), t0 + ms(500), 8192), 0, "no rate");
        assert_eq!(drained(rate, None, t0 + ms(500), 8192), 0, "no prefill");
        assert_eq!(drained(rate, Some(t0 + ms(5)), t0, 8192), 0, "clock order");
        assert_eq!(
            drained(
                Some(MAX_RATE),
                Some(t0),
                t0 + Duration::from_secs(1 << 42),
                u64::MAX
            ),
            u64::MAX,
            "saturates"
        );
    }
}
