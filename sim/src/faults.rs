//! Faults on demand: set at start by flags, changed at run time through the
//! admin endpoint, read by the engine, the publisher and the HTTP layer.

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Shared fault switches.
#[derive(Debug, Default)]
pub struct Faults {
    fail_rate_bits: AtomicU64,
    drop_event_rate_bits: AtomicU64,
    drop_next_batches: AtomicU64,
    duplicate_next_batches: AtomicU64,
    reorder_next_batches: AtomicU64,
    unhealthy: AtomicBool,
    stall_until: Mutex<Option<Instant>>,
}

/// The admin API's view of the faults (also the body of `POST /sim/faults`,
/// where every field is optional and only given fields change).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FaultSettings {
    /// Fraction of requests answered with a 500, in [0, 1]: generation
    /// requests on every API, and the reads and cancels of stored
    /// responses.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fail_rate: Option<f64>,
    /// Fraction of KV-event batches not sent (their sequence numbers are
    /// still used, so subscribers see gaps), in [0, 1].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drop_event_rate: Option<f64>,
    /// Drop exactly the next N event batches.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drop_next_event_batches: Option<u64>,
    /// Send each of the next N event batches twice in a row (same
    /// sequence number and payload), as a redelivering transport would.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duplicate_next_event_batches: Option<u64>,
    /// Hold back each of the next N event batches and send it right after
    /// the batch that follows it, so subscribers see seq n+1 before n.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reorder_next_event_batches: Option<u64>,
    /// Stall the engine (no steps) for this many wall milliseconds from now;
    /// 0 ends a stall.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stall_ms: Option<u64>,
    /// Make `/health` answer 503.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unhealthy: Option<bool>,
}

fn check_rate(name: &str, v: Option<f64>) -> Result<(), String> {
    match v {
        Some(r) if !(0.0..=1.0).contains(&r) => {
            Err(format!("{name} must be within [0, 1], got {r}"))
        }
        _ => Ok(()),
    }
}

impl Faults {
    /// Applies the given fields; errors name the bad field.
    pub fn apply(&self, s: &FaultSettings) -> Result<(), String> {
        check_rate("fail_rate", s.fail_rate)?;
        check_rate("drop_event_rate", s.drop_event_rate)?;
        if let Some(r) = s.fail_rate {
            self.fail_rate_bits.store(r.to_bits(), Ordering::Relaxed);
        }
        if let Some(r) = s.drop_event_rate {
            self.drop_event_rate_bits
                .store(r.to_bits(), Ordering::Relaxed);
        }
        if let Some(n) = s.drop_next_event_batches {
            self.drop_next_batches.store(n, Ordering::Relaxed);
        }
        if let Some(n) = s.duplicate_next_event_batches {
            self.duplicate_next_batches.store(n, Ordering::Relaxed);
        }
        if let Some(n) = s.reorder_next_event_batches {
            self.reorder_next_batches.store(n, Ordering::Relaxed);
        }
        if let Some(ms) = s.stall_ms {
            *self.stall_until.lock() = (ms > 0).then(|| Instant::now() + Duration::from_millis(ms));
        }
        if let Some(u) = s.unhealthy {
            self.unhealthy.store(u, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Current settings (stall as remaining milliseconds).
    pub fn current(&self) -> FaultSettings {
        FaultSettings {
            fail_rate: Some(self.fail_rate()),
            drop_event_rate: Some(f64::from_bits(
                self.drop_event_rate_bits.load(Ordering::Relaxed),
            )),
            drop_next_event_batches: Some(self.drop_next_batches.load(Ordering::Relaxed)),
            duplicate_next_event_batches: Some(self.duplicate_next_batches.load(Ordering::Relaxed)),
            reorder_next_event_batches: Some(self.reorder_next_batches.load(Ordering::Relaxed)),
            stall_ms: Some(self.stall_until().map_or(0, |t| {
                t.saturating_duration_since(Instant::now()).as_millis() as u64
            })),
            unhealthy: Some(self.unhealthy()),
        }
    }

    /// Fraction of requests to fail.
    pub fn fail_rate(&self) -> f64 {
        f64::from_bits(self.fail_rate_bits.load(Ordering::Relaxed))
    }

    /// Whether `/health` should fail.
    pub fn unhealthy(&self) -> bool {
        self.unhealthy.load(Ordering::Relaxed)
    }

    /// When the current stall ends, if one is in force.
    pub fn stall_until(&self) -> Option<Instant> {
        let g = self.stall_until.lock();
        g.filter(|t| *t > Instant::now())
    }

    /// Decides whether to drop the next event batch (consumes one of the
    /// "drop next N" budget). `roll` is a uniform sample in [0, 1).
    pub fn drop_event_batch(&self, roll: f64) -> bool {
        let took = self
            .drop_next_batches
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok();
        took || roll < f64::from_bits(self.drop_event_rate_bits.load(Ordering::Relaxed))
    }

    /// Whether to send the next event batch twice (consumes one of the
    /// "duplicate next N" budget).
    pub fn duplicate_event_batch(&self) -> bool {
        take_one(&self.duplicate_next_batches)
    }

    /// Whether to hold the next event batch back until the one after it
    /// was sent (consumes one of the "reorder next N" budget).
    pub fn reorder_event_batch(&self) -> bool {
        take_one(&self.reorder_next_batches)
    }
}

fn take_one(n: &AtomicU64) -> bool {
    n.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_validated_and_drop_budget_counts_down() {
        let f = Faults::default();
        assert!(f
            .apply(&FaultSettings {
                fail_rate: Some(1.5),
                ..Default::default()
            })
            .is_err());
        f.apply(&FaultSettings {
            drop_next_event_batches: Some(2),
            ..Default::default()
        })
        .unwrap();
        assert!(f.drop_event_batch(0.99));
        assert!(f.drop_event_batch(0.99));
        assert!(!f.drop_event_batch(0.99));
        f.apply(&FaultSettings {
            duplicate_next_event_batches: Some(1),
            reorder_next_event_batches: Some(2),
            ..Default::default()
        })
        .unwrap();
        assert!(f.duplicate_event_batch());
        assert!(!f.duplicate_event_batch());
        assert!(f.reorder_event_batch());
        assert!(f.reorder_event_batch());
        assert!(!f.reorder_event_batch());
        f.apply(&FaultSettings {
            stall_ms: Some(10_000),
            ..Default::default()
        })
        .unwrap();
        assert!(f.stall_until().is_some());
        f.apply(&FaultSettings {
            stall_ms: Some(0),
            ..Default::default()
        })
        .unwrap();
        assert!(f.stall_until().is_none());
    }
}
