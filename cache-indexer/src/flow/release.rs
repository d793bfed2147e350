//! Where a released pick may be placed (late binding): the endpoints with
//! room now, and the holders of more of its prefix than any of those,
//! unless they are saturated.
//!
//! Flow control holds a pick while no engine has room and releases it when
//! one has; placing it only on the engines with room then made it leave
//! the engine holding its prefix whenever that one was busy (measured:
//! bench/results/governance.md, "Below saturation": hit rate 25% -> 9%).
//! Whether waiting a little on the holder is cheaper than prefilling the
//! prefix elsewhere is what the ranking's cost already weighs for every
//! pick (the holder's queue in `queue`, `decode` and `queuedPrefill`
//! against the uncached prompt, all in prefill tokens): so the holder
//! joins the endpoints the released pick is ranked among, and the ranking
//! decides. Only a holder offering blocks the endpoints with room do not
//! hold joins (a prefix every engine holds changes nothing), and only while
//! it is not saturated by the scrape's figures (requests waiting, KV use:
//! past them the engine is full by the pool's own measure). Its queued
//! prefill work is not a bound here: under load nearly every holder has
//! more than flow control's `saturatedPrefillTokens` queued, and bounding
//! by it gave the prefixes up again (measured: bench/results/governance.md,
//! "Late binding that keeps prefixes"); the ranking prices that work.

use super::PoolFlow;
use crate::load::{LoadView, SaturationThresholds};
use crate::types::EndpointId;

impl PoolFlow {
    /// The endpoints of `loads` a released pick may be placed on (see the
    /// module docs): those with room ([`PoolFlow::with_room`]) and the
    /// unsaturated healthy ones holding more of its prefix (`held`: blocks
    /// held per endpoint) than the best of those. Empty when no endpoint
    /// has room (the caller then ranks them all, as before).
    pub(crate) fn placeable(
        &self,
        loads: &[(EndpointId, LoadView)],
        thresholds: &SaturationThresholds,
        now: std::time::Instant,
        held: impl Fn(EndpointId) -> usize,
    ) -> Vec<EndpointId> {
        let room = self.with_room(loads, thresholds, now);
        let Some(best_with_room) = room.iter().map(|id| held(*id)).max() else {
            return room;
        };
        let holders = loads
            .iter()
            .filter(|(id, v)| !room.contains(id) && may_wait_on(v) && held(*id) > best_with_room);
        let mut out = room.clone();
        out.extend(holders.map(|(id, _)| *id));
        out
    }
}

/// Whether a prefix holder without room may still take a released pick:
/// healthy, and neither saturated nor left out by the scrape's figures.
/// Its queued prefill work is left to the ranking (see the module docs).
fn may_wait_on(v: &LoadView) -> bool {
    v.healthy && !v.saturated && !v.left_out
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use kvasir_flowcontrol::FlowControlConfig;

    use super::*;
    use crate::load::EngineLoad;

    fn flow(threshold: f64) -> PoolFlow {
        PoolFlow::new(FlowControlConfig {
            enabled: true,
            threshold,
            max_queued: 64,
            max_queued_per_tenant: 64,
            max_wait_ms: 1000,
            ..FlowControlConfig::default()
        })
    }

    /// A scraped endpoint (just now) with `waiting` requests queued.
    fn view(waiting: u32) -> LoadView {
        let th = SaturationThresholds::default();
        let engine = EngineLoad {
            running: 4,
            waiting,
            kv_usage: 0.1,
        };
        let saturation = th.saturation(&engine);
        LoadView {
            engine,
            healthy: true,
            saturation,
            saturated: saturation >= 1.0,
            last_scrape_age: Some(Duration::ZERO),
            ..Default::default()
        }
    }

    /// Endpoint 1 with room, endpoint 2 holding 8 blocks with `waiting`
    /// requests queued, endpoint 3 without room or prefix.
    fn placeable(waiting: u32, held_by_2: usize) -> Vec<EndpointId> {
        let loads = vec![
            (EndpointId(1), view(0)),
            (EndpointId(2), view(waiting)),
            (EndpointId(3), view(waiting)),
        ];
        let held = |id: EndpointId| if id == EndpointId(2) { held_by_2 } else { 0 };
        let th = SaturationThresholds::default();
        flow(0.2).placeable(&loads, &th, Instant::now(), held)
    }

    #[test]
    fn a_holder_just_over_the_threshold_joins_the_endpoints_with_room() {
        // One request waiting: saturation 0.2, no room at threshold 0.2.
        assert_eq!(placeable(1, 8), vec![EndpointId(1), EndpointId(2)]);
        assert_eq!(placeable(4, 8), vec![EndpointId(1), EndpointId(2)]);
    }

    #[test]
    fn a_saturated_holder_does_not() {
        assert_eq!(placeable(5, 8), vec![EndpointId(1)]);
        assert_eq!(placeable(50, 8), vec![EndpointId(1)]);
    }

    #[test]
    fn a_holder_with_a_long_prefill_backlog_is_left_to_the_ranking() {
        let mut busy = view(1);
        busy.queued_prefill_tokens = 1 << 20;
        let loads = vec![(EndpointId(1), view(0)), (EndpointId(2), busy)];
        let th = SaturationThresholds::default();
        let more = |id: EndpointId| if id == EndpointId(2) { 8 } else { 0 };
        assert_eq!(
            flow(0.2).placeable(&loads, &th, Instant::now(), more),
            vec![EndpointId(1), EndpointId(2)]
        );
    }

    #[test]
    fn without_a_prefix_only_the_endpoints_with_room_as_before() {
        assert_eq!(placeable(1, 0), vec![EndpointId(1)]);
    }

    #[test]
    fn a_prefix_an_endpoint_with_room_holds_as_well_changes_nothing() {
        let loads = vec![(EndpointId(1), view(0)), (EndpointId(2), view(1))];
        let th = SaturationThresholds::default();
        let now = Instant::now();
        let f = flow(0.2);
        assert_eq!(f.placeable(&loads, &th, now, |_| 8), vec![EndpointId(1)]);
        // The holder holds more of it than the endpoint with room.
        let more = |id: EndpointId| if id == EndpointId(2) { 12 } else { 8 };
        assert_eq!(
            f.placeable(&loads, &th, now, more),
            vec![EndpointId(1), EndpointId(2)]
        );
    }

    #[test]
    fn no_room_anywhere_leaves_the_choice_to_the_caller() {
        let loads = vec![(EndpointId(1), view(1)), (EndpointId(2), view(1))];
        let th = SaturationThresholds::default();
        assert!(flow(0.2)
            .placeable(&loads, &th, Instant::now(), |_| 8)
            .is_empty());
        let mut sick = view(0);
        sick.healthy = false;
        let loads = vec![(EndpointId(1), view(0)), (EndpointId(2), sick)];
        let more = |id: EndpointId| if id == EndpointId(2) { 12 } else { 0 };
        assert_eq!(
            flow(0.2).placeable(&loads, &th, Instant::now(), more),
            vec![EndpointId(1)]
        );
    }
}
