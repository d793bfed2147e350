//! One token bucket, in exact integer arithmetic.
//!
//! Credit is kept in units of 1/60000 of a token (one per millisecond of
//! the window), so a rate of `limit` per minute refills exactly `limit`
//! units per millisecond: no fractions, no float drift, and the same
//! figures in a Redis script as here. The bucket holds at most one window
//! of credit (`limit` tokens) and starts full. Credit may go below zero
//! only through usage beyond a reservation (a settle or release that
//! charges more than was held): that debt is repaid by refill before the
//! next admission.

use crate::limits::WINDOW_MS;

/// A bucket's state. The limit is not stored: it comes with every call,
/// so a changed limit applies at once (a lower cap clips the credit at the
/// next refill).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Bucket {
    /// Credit in 1/60000 token units.
    pub(crate) credit: i128,
    /// The time of the last refill (ms, the caller's clock).
    pub(crate) last_ms: u64,
    /// False until first use: a new bucket starts full at its first call.
    pub(crate) primed: bool,
}

fn scaled(tokens: u64) -> i128 {
    i128::from(tokens) * i128::from(WINDOW_MS)
}

/// `a / b` rounded up, for `a > 0`, `b > 0` (signed `div_ceil` is not
/// stable).
fn ceil_div(a: i128, b: i128) -> i128 {
    (a + b - 1) / b
}

impl Bucket {
    fn cap(limit: u64) -> i128 {
        scaled(limit)
    }

    /// Brings the credit up to `now_ms`. A clock that goes back is read as
    /// no time passing (never a panic, never a refund of time).
    pub fn refill(&mut self, now_ms: u64, limit: u64) {
        let cap = Self::cap(limit);
        if !self.primed {
            self.primed = true;
            self.credit = cap;
            self.last_ms = now_ms;
            return;
        }
        let elapsed = now_ms.saturating_sub(self.last_ms);
        // Past one window a bucket in credit is full; debt may take longer.
        let gained = i128::from(elapsed) * i128::from(limit);
        self.credit = self.credit.saturating_add(gained).min(cap);
        self.last_ms = self.last_ms.max(now_ms);
    }

    /// Milliseconds from the last refill until `tokens` fit, 0 when they
    /// fit now, `None` when they never will (more than the cap, or a zero
    /// rate with not enough credit).
    pub fn wait_ms(&self, tokens: u64, limit: u64) -> Option<u64> {
        let need = scaled(tokens);
        if need > Self::cap(limit) {
            return None;
        }
        let short = need - self.credit;
        if short <= 0 {
            return Some(0);
        }
        if limit == 0 {
            return None;
        }
        let ms = ceil_div(short, i128::from(limit));
        Some(u64::try_from(ms).unwrap_or(u64::MAX))
    }

    /// Takes `tokens` (may leave the bucket in debt).
    pub fn take(&mut self, tokens: u64) {
        self.credit = self.credit.saturating_sub(scaled(tokens));
    }

    /// Gives back `tokens`, never above the cap: credit unused within a
    /// window is not banked beyond it.
    pub fn give(&mut self, tokens: u64, limit: u64) {
        self.credit = self
            .credit
            .saturating_add(scaled(tokens))
            .min(Self::cap(limit));
    }

    /// Whole tokens of credit (0 in debt).
    pub fn remaining(&self) -> u64 {
        let t = self.credit.max(0) / i128::from(WINDOW_MS);
        u64::try_from(t).unwrap_or(u64::MAX)
    }

    /// Credit in 1/60000 token units (negative in debt).
    pub fn credit_units(&self) -> i128 {
        self.credit
    }

    /// Milliseconds from the last refill until the bucket is full again.
    pub fn reset_ms(&self, limit: u64) -> u64 {
        let short = Self::cap(limit) - self.credit;
        if short <= 0 || limit == 0 {
            return 0;
        }
        u64::try_from(ceil_div(short, i128::from(limit))).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_full_and_refills_at_the_rate() {
        let mut b = Bucket::default();
        b.refill(1_000, 600);
        assert_eq!(b.remaining(), 600);
        b.take(600);
        assert_eq!(b.remaining(), 0);
        // 600 per minute = 1 token per 100 ms.
        b.refill(1_100, 600);
        assert_eq!(b.remaining(), 1);
        b.refill(1_000_000, 600);
        assert_eq!(b.remaining(), 600);
    }

    #[test]
    fn wait_is_exact() {
        let mut b = Bucket::default();
        b.refill(0, 600);
        b.take(600);
        assert_eq!(b.wait_ms(3, 600), Some(300));
        assert_eq!(b.wait_ms(0, 600), Some(0));
        assert_eq!(b.wait_ms(601, 600), None);
        b.refill(299, 600);
        assert_eq!(b.wait_ms(3, 600), Some(1));
    }

    #[test]
    fn clock_going_back_changes_nothing() {
        let mut b = Bucket::default();
        b.refill(5_000, 60);
        b.take(60);
        b.refill(1_000, 60);
        assert_eq!(b.remaining(), 0);
        b.refill(6_000, 60);
        assert_eq!(b.remaining(), 1);
    }

    #[test]
    fn give_never_exceeds_the_cap_and_debt_is_repaid_first() {
        let mut b = Bucket::default();
        b.refill(0, 100);
        b.give(50, 100);
        assert_eq!(b.remaining(), 100);
        b.take(150);
        assert_eq!(b.remaining(), 0);
        assert_eq!(b.wait_ms(1, 100), Some(30_600));
        assert_eq!(b.reset_ms(100), 90_000);
    }

    #[test]
    fn a_lower_limit_clips_the_credit() {
        let mut b = Bucket::default();
        b.refill(0, 1000);
        b.refill(1, 10);
        assert_eq!(b.remaining(), 10);
    }

    #[test]
    fn zero_rate_never_waits_forever() {
        let mut b = Bucket::default();
        b.refill(0, 0);
        assert_eq!(b.wait_ms(0, 0), Some(0));
        assert_eq!(b.wait_ms(1, 0), None);
        assert_eq!(b.reset_ms(0), 0);
    }
}
