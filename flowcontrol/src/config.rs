//! A pool's flow-control settings, as the indexer's pool config carries them.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// One pool's flow control: when picks start waiting and how long the
/// queue may grow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct FlowControlConfig {
    /// Off by default: picks are placed at once, as before flow control.
    pub enabled: bool,
    /// Pool saturation (0..1, the indexer's saturation of the least
    /// saturated ready endpoint) at or above which a pick waits, and below
    /// which a waiting pick is released ([`has_room`]). 1.0 waits only when
    /// every endpoint is saturated; lower values hold picks back earlier,
    /// which is late binding below saturation. Above 0: at 0 no endpoint
    /// would ever have room.
    pub threshold: f64,
    /// Picks waiting in the pool at most; one more is shed.
    pub max_queued: usize,
    /// Picks one tenant may have waiting in the pool at most, so one
    /// tenant's flood cannot fill the pool's queue for everyone.
    pub max_queued_per_tenant: usize,
    /// How long a pick may wait, in milliseconds; past it, it is shed. 0
    /// sheds instead of queueing. The filter's pick deadline must be longer,
    /// so a queued pick is answered (released or shed), never timed out.
    pub max_wait_ms: u64,
}

impl Default for FlowControlConfig {
    fn default() -> Self {
        FlowControlConfig {
            enabled: false,
            threshold: 1.0,
            max_queued: 1024,
            // A quarter of the pool: at least four tenants can each fill
            // their part before anyone is refused for the pool being full.
            max_queued_per_tenant: 256,
            // A client waiting longer than this is usually better served by
            // a 429 it can retry elsewhere than by a first token later still.
            max_wait_ms: 10_000,
        }
    }
}

/// A setting out of range.
#[derive(Debug, Clone, PartialEq, Error)]
#[error("flowControl.{field}: {message}")]
pub struct ConfigError {
    /// The setting's name as written in the config.
    pub field: &'static str,
    /// What is wrong with it.
    pub message: String,
}

impl FlowControlConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.threshold.is_finite() && self.threshold > 0.0) {
            return Err(ConfigError {
                field: "threshold",
                message: format!("must be a number > 0, got {}", self.threshold),
            });
        }
        if self.max_queued_per_tenant > self.max_queued {
            return Err(ConfigError {
                field: "maxQueuedPerTenant",
                message: format!(
                    "must be at most maxQueued ({}), got {}",
                    self.max_queued, self.max_queued_per_tenant
                ),
            });
        }
        Ok(())
    }

    /// The queue's bounds.
    pub fn limits(&self) -> Limits {
        Limits {
            max_queued: self.max_queued,
            max_queued_per_tenant: self.max_queued_per_tenant,
            max_wait: Duration::from_millis(self.max_wait_ms),
        }
    }
}

/// The bounds a [`crate::FlowQueue`] enforces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Requests waiting at most.
    pub max_queued: usize,
    /// Requests one tenant may have waiting at most (all bands together).
    pub max_queued_per_tenant: usize,
    /// How long a request may wait.
    pub max_wait: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        FlowControlConfig::default().limits()
    }
}

/// Whether a new pick waits instead of being placed now: when the pool is
/// at or above `threshold`, or when picks already wait (a newcomer placed
/// at once would overtake them, and the fair order would only hold among
/// picks that happened to arrive during saturation).
///
/// A saturation that is not a number (no load known) does not make a pick
/// wait: without a load view the indexer fails open, as it does elsewhere.
pub fn should_queue(saturation: f64, threshold: f64, queue_nonempty: bool) -> bool {
    queue_nonempty || !has_room(saturation, threshold)
}

/// Whether the pool has room for one more placement: its saturation is
/// below `threshold`. The release side's test, the mirror of
/// [`should_queue`]'s, so a pick held at a saturation is released at the
/// saturation just below it. The saturation must count this replica's own
/// placements that have not reached their first token, so one freed slot
/// releases one pick rather than the whole queue. Unknown load (not a
/// number) has room: fail open.
pub fn has_room(saturation: f64, threshold: f64) -> bool {
    saturation.is_nan() || saturation < threshold
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_with_defaults_and_refuses_unknown_fields() {
        let c: FlowControlConfig =
            serde_json::from_str(r#"{"enabled": true, "threshold": 0.8}"#).unwrap();
        assert!(c.enabled);
        assert_eq!(c.threshold, 0.8);
        assert_eq!(c.max_queued, FlowControlConfig::default().max_queued);
        assert!(c.validate().is_ok());
        assert!(serde_json::from_str::<FlowControlConfig>(r#"{"treshold": 1}"#).is_err());
        assert_eq!(c.limits().max_wait, Duration::from_millis(10_000));
    }

    #[test]
    fn config_ranges() {
        let bad = FlowControlConfig {
            threshold: 0.0,
            ..FlowControlConfig::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "threshold");
        let nan = FlowControlConfig {
            threshold: f64::NAN,
            ..FlowControlConfig::default()
        };
        assert!(nan.validate().is_err());
        let per = FlowControlConfig {
            max_queued: 10,
            max_queued_per_tenant: 11,
            ..FlowControlConfig::default()
        };
        let e = per.validate().unwrap_err();
        assert_eq!(e.field, "maxQueuedPerTenant");
        assert!(e.to_string().starts_with("flowControl.maxQueuedPerTenant:"));
    }

    #[test]
    fn admission_rule() {
        assert!(!should_queue(0.5, 1.0, false));
        assert!(should_queue(1.0, 1.0, false), "at the threshold waits");
        assert!(should_queue(0.2, 1.0, true), "no overtaking the queue");
        assert!(
            should_queue(0.0, 0.0, false),
            "threshold 0: every pick waits"
        );
        assert!(
            !should_queue(f64::NAN, 1.0, false),
            "unknown load fails open"
        );
        assert!(should_queue(f64::NAN, 1.0, true));
    }
}
