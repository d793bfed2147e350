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
    /// Prefill tokens queued on an engine (uncached prompt tokens of the
    /// picks placed there that have not reached their first token) that
    /// count as saturated: the engine's saturation is at least this share
    /// of it, so "room" means an engine whose prefill backlog is short,
    /// not only one with few requests waiting (with chunked prefill vLLM
    /// runs several long prefills at once and none "waits"). 0: off (the
    /// default, [`DEFAULT_SATURATED_PREFILL_TOKENS`]).
    pub saturated_prefill_tokens: u64,
    /// Room kept for tenants under their weighted fair share of the work
    /// in flight (0..1): a tenant over its share is let through or
    /// released only below `threshold x (1 - reserve)` ([`room_bound`]),
    /// so a tenant under its share finds an engine with room at once when
    /// another floods the pool. A tenant alone is never over its share. 0:
    /// off (work-conserving between tenants, as before).
    pub reserve: f64,
    /// How far above its weighted share of the work in flight a tenant
    /// must be for the reserve to apply to it (>= 0): over its share means
    /// holding more than `1 + overShareSlack` times it. At 0 every tenant
    /// momentarily above the mean is "over", equal tenants included.
    pub over_share_slack: f64,
    /// Whether a tenant's share for the reserve counts its picks waiting
    /// with its work in flight (its demand), not the work in flight alone.
    /// The fair order releases a flooding tenant's waiting picks at its
    /// share, so by the work in flight alone it is seldom over it; by its
    /// demand it is, and the others are not.
    pub reserve_counts_waiting: bool,
    /// Whether the pool's engines run vLLM with `--scheduling-policy
    /// priority`: every pick answer then carries the vLLM `priority` the
    /// filter writes into the request body ([`engine_priority`]), so that
    /// inside an engine a tenant over its share waits behind the others
    /// instead of first come first served. Off by default: at vLLM's
    /// default (`fcfs`) the priority is accepted and ignored (vLLM 0.34),
    /// so it would change nothing.
    pub engine_priority: bool,
    /// What orders requests within a band in the engines' queues, with
    /// `enginePriority` on: `share` (the default) puts the tenants over
    /// their share last ([`engine_priority`]); `prefill` puts the shortest
    /// uncached prompt on the chosen engine first ([`prefill_priority`]).
    pub engine_priority_by: EnginePriorityBy,
    /// Which of a tenant's waiting picks goes when the fair order gives
    /// that tenant its turn: `fair` (the default) its oldest;
    /// `quickestFirst` the one with the least predicted prefill on the
    /// engine that has room ([`ReleaseOrder`]). Bands and the fair share
    /// between tenants are the same either way.
    pub release_order: ReleaseOrder,
    /// With `quickestFirst`: how long a tenant's oldest waiting pick may be
    /// passed over for quicker ones, in milliseconds; from then on it goes
    /// first (its arrival order), so a long prompt is not starved by a
    /// stream of short ones. 0 is the fair order.
    pub max_quickest_skip_ms: u64,
}

/// Which of a tenant's waiting picks is released when its turn comes
/// ([`FlowControlConfig::release_order`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ReleaseOrder {
    /// The oldest: arrival order within a tenant and band.
    #[default]
    Fair,
    /// The one with the least predicted prefill on the engine that would
    /// take it (the caller's cost, [`crate::FlowQueue::pop_quickest_where`]),
    /// within the aging bound.
    QuickestFirst,
}

/// What orders the engines' waiting queues within a band
/// ([`FlowControlConfig::engine_priority_by`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum EnginePriorityBy {
    /// Tenants at or under their weighted share first.
    #[default]
    Share,
    /// Requests with less prefill left to do on their engine first.
    Prefill,
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
            // Off: see DEFAULT_SATURATED_PREFILL_TOKENS.
            saturated_prefill_tokens: DEFAULT_SATURATED_PREFILL_TOKENS,
            reserve: DEFAULT_RESERVE,
            over_share_slack: DEFAULT_OVER_SHARE_SLACK,
            reserve_counts_waiting: DEFAULT_RESERVE_COUNTS_WAITING,
            engine_priority: false,
            engine_priority_by: EnginePriorityBy::Share,
            release_order: DEFAULT_RELEASE_ORDER,
            max_quickest_skip_ms: DEFAULT_MAX_QUICKEST_SKIP_MS,
        }
    }
}

/// The default [`FlowControlConfig::release_order`].
pub const DEFAULT_RELEASE_ORDER: ReleaseOrder = ReleaseOrder::Fair;

/// The default [`FlowControlConfig::max_quickest_skip_ms`]: a pick is
/// passed over for quicker ones for at most 5 s, half the default maximum
/// wait, so the aging bound takes hold before a long prompt is shed.
pub const DEFAULT_MAX_QUICKEST_SKIP_MS: u64 = 5_000;

/// The default [`FlowControlConfig::saturated_prefill_tokens`]: off. A
/// pick's tokens leave the term at its first-token report, or at its DONE
/// when the filter sends none (its default), so the term also holds the
/// engine's work in progress and decode. Measured (short preset, one run
/// each, bench/results/governance.md): at 16384 (~0.5 s
/// of h100-8b prefill at ~0.03 ms per uncached token, FACTS.md) an engine
/// at 80% prefill use already looks saturated (98% of picks queued with no
/// burst); at 65536 (~2 s) the noisy-neighbour target is met with the
/// reserve, but the late-binding and saturation scenarios did worse with
/// the term than without it. So a pool turns it on where it helps (65536
/// is the figure measured); what would make it a safe default is an
/// estimate that drains queued prefill at the engine's prefill rate.
pub const DEFAULT_SATURATED_PREFILL_TOKENS: u64 = 0;

/// The default [`FlowControlConfig::reserve`]: half the room below the
/// threshold is kept for tenants under their share. Measured on the
/// noisy-neighbour benchmark (bench/results/governance.md, "Noisy
/// neighbour: work-based saturation and the reserve"): the other tenants' p99 TTFT 1.01-1.08x their no-burst
/// figure with it, 1.23-1.39x without, same settings otherwise. Its cost:
/// with load spread evenly, whichever tenants are above the mean for a
/// moment get the tighter bound (slower no-burst figures for some).
pub const DEFAULT_RESERVE: f64 = 0.5;

/// The default [`FlowControlConfig::over_share_slack`].
pub const DEFAULT_OVER_SHARE_SLACK: f64 = 0.0;

/// The default [`FlowControlConfig::reserve_counts_waiting`].
pub const DEFAULT_RESERVE_COUNTS_WAITING: bool = false;

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
        if !(0.0..1.0).contains(&self.reserve) {
            return Err(ConfigError {
                field: "reserve",
                message: format!("must be in [0, 1), got {}", self.reserve),
            });
        }
        if !(self.over_share_slack.is_finite() && self.over_share_slack >= 0.0) {
            return Err(ConfigError {
                field: "overShareSlack",
                message: format!("must be a number >= 0, got {}", self.over_share_slack),
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

/// The saturation below which a pick of a tenant may go: `threshold`,
/// or for a tenant over its share (while others are active)
/// `threshold x (1 - reserve)`, keeping the room between the two for the
/// tenants under theirs.
pub fn room_bound(threshold: f64, reserve: f64, over_share: bool) -> f64 {
    if over_share {
        threshold * (1.0 - reserve.clamp(0.0, 1.0))
    } else {
        threshold
    }
}

/// The vLLM `priority` (lower is served first) of a pick of priority band
/// `band` bound now, with `over_share` saying whether its tenant holds
/// more than its weighted share of the pool's work: bands keep their order
/// (a more urgent band's picks all come first, as in the queue), and
/// within a band a tenant over its share comes after those at or under
/// theirs. So `2 x band`, plus 1 when over its share (saturating).
pub fn engine_priority(band: i32, over_share: bool) -> i32 {
    band.saturating_mul(2).saturating_add(i32::from(over_share))
}

/// Uncached prompt tokens per step of [`prefill_priority`].
pub const PREFILL_PRIORITY_STEP_TOKENS: u64 = 256;

/// Steps of [`prefill_priority`] within a band; longer prompts share the
/// last.
pub const PREFILL_PRIORITY_STEPS: i32 = 64;

/// The vLLM `priority` (lower is served first) of a pick of priority band
/// `band` placed where `uncached_tokens` of its prompt are not cached:
/// bands keep their order, and within a band the request with the least
/// prefill left goes first, in steps of [`PREFILL_PRIORITY_STEP_TOKENS`]
/// (the last step holds everything from 16,128 tokens on). An engine whose
/// waiting queue never empties then serves a long prompt only after every
/// shorter one (vLLM's priority policy has no aging): the mean and the
/// median fall, the longest prompts' tail grows (measured with
/// `kvasir-bench replay --shortest-first`, bench/results/replay.md).
pub fn prefill_priority(band: i32, uncached_tokens: u64) -> i32 {
    let step = (uncached_tokens / PREFILL_PRIORITY_STEP_TOKENS)
        .min(PREFILL_PRIORITY_STEPS as u64 - 1) as i32;
    band.saturating_mul(PREFILL_PRIORITY_STEPS)
        .saturating_add(step)
}

/// An engine's saturation from its queued prefill work: `tokens` queued
/// over `saturated` (0: the term is off, 0.0).
pub fn work_saturation(tokens: u64, saturated: u64) -> f64 {
    if saturated == 0 {
        return 0.0;
    }
    (tokens as f64 / saturated as f64).min(1.0)
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
    fn reserve_and_work_settings() {
        let c: FlowControlConfig =
            serde_json::from_str(r#"{"reserve": 0.25, "saturatedPrefillTokens": 8192}"#).unwrap();
        assert_eq!((c.reserve, c.saturated_prefill_tokens), (0.25, 8192));
        assert!(c.validate().is_ok());
        for bad in [1.0, -0.1, f64::NAN] {
            let c = FlowControlConfig {
                reserve: bad,
                ..FlowControlConfig::default()
            };
            assert_eq!(c.validate().unwrap_err().field, "reserve");
        }
        for bad in [-0.5, f64::INFINITY, f64::NAN] {
            let c = FlowControlConfig {
                over_share_slack: bad,
                ..FlowControlConfig::default()
            };
            let e = c.validate().unwrap_err();
            assert_eq!(e.field, "overShareSlack");
            assert!(e
                .to_string()
                .starts_with("flowControl.overShareSlack: must be"));
        }
        let c: FlowControlConfig = serde_json::from_str(r#"{"overShareSlack": 0.5}"#).unwrap();
        assert_eq!(c.over_share_slack, 0.5);
        assert!(c.validate().is_ok());
        assert_eq!(room_bound(0.8, 0.25, false), 0.8);
        assert!((room_bound(0.8, 0.25, true) - 0.6).abs() < 1e-12);
        assert_eq!(room_bound(0.8, 0.0, true), 0.8);
        assert_eq!(work_saturation(4096, 16_384), 0.25);
        assert_eq!(work_saturation(1 << 40, 16_384), 1.0);
        assert_eq!(work_saturation(1 << 40, 0), 0.0, "off");
    }

    #[test]
    fn engine_priority_keeps_bands_then_puts_over_share_last() {
        let c: FlowControlConfig = serde_json::from_str(r#"{"enginePriority": true}"#).unwrap();
        assert!(c.engine_priority);
        assert!(
            !FlowControlConfig::default().engine_priority,
            "off by default"
        );
        assert_eq!(engine_priority(0, false), 0);
        assert_eq!(engine_priority(0, true), 1);
        // Over its share in band 0 still comes before anyone in band 1.
        assert!(engine_priority(0, true) < engine_priority(1, false));
        assert!(engine_priority(-1, true) < engine_priority(0, false));
        assert_eq!(engine_priority(i32::MAX, true), i32::MAX, "saturates");
        assert_eq!(engine_priority(i32::MIN, false), i32::MIN);
    }

    #[test]
    fn prefill_priority_keeps_bands_then_puts_the_shortest_prefill_first() {
        let c: FlowControlConfig =
            serde_json::from_str(r#"{"enginePriority": true, "enginePriorityBy": "prefill"}"#)
                .unwrap();
        assert_eq!(c.engine_priority_by, EnginePriorityBy::Prefill);
        assert_eq!(
            FlowControlConfig::default().engine_priority_by,
            EnginePriorityBy::Share
        );
        let e = serde_json::from_str::<FlowControlConfig>(r#"{"enginePriorityBy": "size"}"#)
            .unwrap_err();
        assert!(e.to_string().contains("unknown variant `size`"), "{e}");
        assert_eq!(prefill_priority(0, 0), 0);
        assert_eq!(prefill_priority(0, 255), 0);
        assert_eq!(prefill_priority(0, 256), 1);
        assert_eq!(prefill_priority(0, 1 << 40), 63, "the last step");
        // The longest prompt in band 0 still comes before anyone in band 1.
        assert!(prefill_priority(0, 1 << 40) < prefill_priority(1, 0));
        assert!(prefill_priority(-1, 1 << 40) < prefill_priority(0, 0));
        assert_eq!(prefill_priority(i32::MAX, 1 << 20), i32::MAX, "saturates");
    }

    #[test]
    fn release_order_parses_and_is_fair_by_default() {
        let d = FlowControlConfig::default();
        assert_eq!(d.release_order, ReleaseOrder::Fair);
        assert_eq!(d.max_quickest_skip_ms, DEFAULT_MAX_QUICKEST_SKIP_MS);
        let c: FlowControlConfig =
            serde_json::from_str(r#"{"releaseOrder": "quickestFirst", "maxQuickestSkipMs": 750}"#)
                .unwrap();
        assert_eq!(c.release_order, ReleaseOrder::QuickestFirst);
        assert_eq!(c.max_quickest_skip_ms, 750);
        let e = serde_json::from_str::<FlowControlConfig>(r#"{"releaseOrder": "shortest"}"#)
            .unwrap_err();
        assert!(e.to_string().contains("unknown variant `shortest`"), "{e}");
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
