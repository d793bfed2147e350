//! When an engine counts as saturated, and when picks leave it out.

use serde::{Deserialize, Serialize};

use super::engine_metrics::EngineLoad;

/// When an endpoint counts as saturated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct SaturationThresholds {
    /// KV-cache usage (0..1] at which an endpoint is saturated. vLLM's usage
    /// counts blocks pinned by running requests (cached free blocks are not
    /// usage), so above ~90% admitting more work means preempting some.
    #[serde(alias = "kv_usage")]
    pub kv_usage: f64,
    /// Waiting requests at which an endpoint is saturated. vLLM queues only
    /// when it is out of batch slots or KV space; five queued prefills is
    /// already a few hundred ms of extra TTFT for everyone behind them.
    pub waiting: u32,
    /// Leave endpoints saturated by their waiting queue alone out of picks
    /// too (as KV-full ones always are), instead of ranking them at their
    /// cost. Off by default; see the scoring module docs for the A/B that
    /// keeps this a setting.
    pub leave_out_queued: bool,
}

impl Default for SaturationThresholds {
    fn default() -> Self {
        SaturationThresholds {
            kv_usage: 0.9,
            waiting: 5,
            leave_out_queued: false,
        }
    }
}

impl SaturationThresholds {
    /// Checks ranges; on error, the field name and what is wrong.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(self.kv_usage > 0.0 && self.kv_usage <= 1.0) {
            return Err((
                "kvUsage",
                format!("must be in (0, 1], got {}", self.kv_usage),
            ));
        }
        if self.waiting == 0 {
            return Err(("waiting", "must be at least 1".into()));
        }
        Ok(())
    }

    /// Saturation 0..1 of an engine state.
    pub fn saturation(&self, load: &EngineLoad) -> f64 {
        let kv = load.kv_usage / self.kv_usage;
        let q = f64::from(load.waiting) / f64::from(self.waiting);
        kv.max(q).clamp(0.0, 1.0)
    }

    /// Whether KV usage is at the threshold: admitting more work there means
    /// preempting running sequences.
    pub fn kv_full(&self, load: &EngineLoad) -> bool {
        load.kv_usage >= self.kv_usage
    }

    /// Whether picks leave the endpoint out (unless every healthy one is
    /// left out): KV-full, or saturated at all with `leave_out_queued`.
    pub fn leaves_out(&self, load: &EngineLoad) -> bool {
        self.kv_full(load) || (self.leave_out_queued && self.saturation(load) >= 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saturation_thresholds() {
        let t = SaturationThresholds::default();
        let mut l = EngineLoad::default();
        assert_eq!(t.saturation(&l), 0.0);
        l.kv_usage = 0.45;
        assert!((t.saturation(&l) - 0.5).abs() < 1e-12);
        l.waiting = 5;
        assert_eq!(t.saturation(&l), 1.0);
        // Saturated by the queue, but not KV-full: still picked.
        assert!(!t.kv_full(&l) && !t.leaves_out(&l));
        let strict = SaturationThresholds {
            leave_out_queued: true,
            ..SaturationThresholds::default()
        };
        assert!(strict.leaves_out(&l));
        l.kv_usage = 0.9;
        assert!(t.kv_full(&l) && t.leaves_out(&l));
        assert!(SaturationThresholds {
            kv_usage: 0.0,
            waiting: 1,
            leave_out_queued: false,
        }
        .validate()
        .is_err());
    }

    #[test]
    fn saturation_settings_parse_with_defaults_for_what_is_left_out() {
        let t: SaturationThresholds = serde_json::from_str(r#"{"leaveOutQueued": true}"#).unwrap();
        assert!(t.leave_out_queued);
        assert_eq!((t.kv_usage, t.waiting), (0.9, 5));
        assert!(!SaturationThresholds::default().leave_out_queued);
        assert!(
            serde_json::from_str::<SaturationThresholds>(r#"{"leaveOutQueud": true}"#).is_err()
        );
    }
}
