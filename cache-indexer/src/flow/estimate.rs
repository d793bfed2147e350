//! How saturated an endpoint is *now*, for flow control: its last scrape
//! moved forward by what this replica knows happened since.
//!
//! The load views' saturation is the last scrape's alone, so a DONE report
//! or a pick placed a moment ago changes nothing in it until the next
//! scrape. Flow control releases one pick per freed slot, so it needs both:
//!
//! * each request reported done that the scrape counted
//!   ([`LoadView::done_since_scrape`]) leaves the engine;
//! * each pick placed on the endpoint since the scrape (counted by
//!   [`super::PoolFlow`]) joins it;
//! * with shared load, each pick another replica placed there that a
//!   sharing round read after the scrape joins it, and each of its picks
//!   that surely ended after the scrape leaves it ([`Since`]).
//!
//! Its queued prefill work ([`LoadView::queued_prefill_tokens`], exact for
//! the picks placed by this replica and, with shared load, its peers, less
//! what the engine computed since its last first-token report by its
//! learned prefill rate, [`LoadView::prefill_drained_tokens`]) saturates it
//! too, at [`Scale::saturated_prefill_tokens`] ([`engine_saturation`]).
//!
//! The engine then runs what it ran, as far as it can: a scrape with a
//! waiting queue says the engine is full at its running count (out of batch
//! slots or KV), so extra requests wait; without a queue it takes new ones
//! until its KV cache, at the scrape's KV share per running request, reaches
//! the saturation threshold. KV usage follows the running count at that
//! share. Nothing running and nothing known about a request's share: the
//! new ones run and add nothing (fail open until the next scrape says more).

use kvasir_flowcontrol::work_saturation;

use crate::load::{EngineLoad, LoadView, SaturationThresholds};

/// What saturates an engine for flow control: the load thresholds and its
/// queued prefill work.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scale<'t> {
    /// KV use and waiting requests.
    pub(crate) thresholds: &'t SaturationThresholds,
    /// Queued prefill tokens that count as saturated (0: not counted).
    pub(crate) saturated_prefill_tokens: u64,
}

/// An endpoint's saturation with `since` moved on it and `extra` prefill
/// tokens more queued on it (picks in transit): the larger of
/// [`saturation`] and its queued prefill work's.
pub(crate) fn engine_saturation(view: &LoadView, since: Since, extra: u64, scale: &Scale) -> f64 {
    let requests = saturation(view, since, scale.thresholds);
    // (What the engine computed since its last report, by its rate, is
    // not queued any more: `load::drain`.)
    let queued = backlog_tokens(view).saturating_add(extra);
    requests.max(work_saturation(queued, scale.saturated_prefill_tokens))
}

/// What moved on an endpoint since its last scrape, besides this replica's
/// DONE reports (in its view).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Since {
    /// Picks placed on it: this replica's and the other replicas'.
    pub(crate) placed: u32,
    /// The other replicas' picks that surely ended after the scrape
    /// (see [`super::PoolFlow::peer_moves`]): one the scrape counted leaves
    /// its slot; one placed after it is in `placed` too, and the two
    /// cancel out.
    pub(crate) peer_done: u32,
}

impl Since {
    /// `placed` placements, nothing else.
    #[cfg(test)]
    pub(crate) fn placed(placed: u32) -> Self {
        Since {
            placed,
            peer_done: 0,
        }
    }
}

/// The saturation (0..1) of an endpoint whose view is `view`, with `since`
/// moved on it since its last scrape. An unhealthy one is saturated.
pub(crate) fn saturation(view: &LoadView, since: Since, thresholds: &SaturationThresholds) -> f64 {
    if !view.healthy {
        return 1.0;
    }
    let done = view.done_since_scrape.saturating_add(since.peer_done);
    thresholds.saturation(&moved_on(&view.engine, done, since.placed, thresholds))
}

/// The engine's state after `done` of its requests ended and `placed` new
/// ones arrived (see the module docs).
fn moved_on(
    e: &EngineLoad,
    done: u32,
    placed: u32,
    thresholds: &SaturationThresholds,
) -> EngineLoad {
    let total = (u64::from(e.running) + u64::from(e.waiting) + u64::from(placed))
        .saturating_sub(u64::from(done));
    let share = if e.running > 0 {
        e.kv_usage / f64::from(e.running)
    } else {
        0.0
    };
    let cap = if e.waiting > 0 {
        u64::from(e.running)
    } else if share > 0.0 {
        // Requests that fit below the KV threshold at that share (at least
        // what ran: the scrape showed it could).
        // (The epsilon keeps 0.9 / 0.09 from flooring to 9.)
        ((thresholds.kv_usage / share + 1e-9).floor() as u64).max(u64::from(e.running))
    } else {
        u64::MAX
    };
    let running = total.min(cap);
    let waiting = total - running;
    EngineLoad {
        running: u32::try_from(running).unwrap_or(u32::MAX),
        waiting: u32::try_from(waiting).unwrap_or(u32::MAX),
        // (As a ratio of running counts: the same count gives the scrape's
        // figure exactly, not one rounded below the threshold.)
        kv_usage: if share > 0.0 {
            e.kv_usage * (running as f64 / f64::from(e.running))
        } else {
            e.kv_usage
        },
    }
}

/// The least saturated endpoint, by its position in `loads`, and its
/// saturation once `in_transit` picks (let through or released, not placed
/// yet: their count and tokens) are placed, each where it finds the most
/// room, each with an even part of the tokens as its queued prefill;
/// `None` without endpoints. That endpoint is the one a pick released now
/// would find the most room on. `loads` are each endpoint's view and what
/// moved on it since its scrape. Stops adding once every endpoint is at
/// `threshold` (the answer is then known).
pub(crate) fn freest(
    loads: &[(&LoadView, Since)],
    in_transit: (usize, u64),
    scale: &Scale,
    threshold: f64,
) -> Option<(usize, f64)> {
    let (picks, tokens) = in_transit;
    let each = if picks > 0 {
        tokens.div_ceil(picks as u64)
    } else {
        0
    };
    let mut since: Vec<(Since, u64)> = loads.iter().map(|(_, s)| (*s, 0)).collect();
    let sat = |i: usize, (s, extra): (Since, u64)| engine_saturation(loads[i].0, s, extra, scale);
    let mut sats: Vec<f64> = (0..loads.len()).map(|i| sat(i, since[i])).collect();
    for _ in 0..picks {
        let (i, s) = argmin(&sats)?;
        if s >= threshold {
            return Some((i, s));
        }
        since[i].0.placed = since[i].0.placed.saturating_add(1);
        since[i].1 = since[i].1.saturating_add(each);
        sats[i] = sat(i, since[i]);
    }
    argmin(&sats)
}

/// An endpoint's prefill backlog now: the uncached prompt tokens of the
/// picks placed there not at their first token yet, less what the engine
/// computed since its last report by its learned rate.
pub(crate) fn backlog_tokens(view: &LoadView) -> u64 {
    view.queued_prefill_tokens
        .saturating_sub(view.prefill_drained_tokens)
}

fn argmin(sats: &[f64]) -> Option<(usize, f64)> {
    sats.iter()
        .copied()
        .enumerate()
        .min_by(|a, b| a.1.total_cmp(&b.1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The saturation [`freest`] finds.
    fn least_saturation(
        loads: &[(&LoadView, Since)],
        in_transit: (usize, u64),
        scale: &Scale,
        threshold: f64,
    ) -> Option<f64> {
        freest(loads, in_transit, scale, threshold).map(|(_, s)| s)
    }

    fn view(running: u32, waiting: u32, kv_usage: f64, done: u32) -> LoadView {
        LoadView {
            engine: EngineLoad {
                running,
                waiting,
                kv_usage,
            },
            healthy: true,
            done_since_scrape: done,
            ..Default::default()
        }
    }

    fn th() -> SaturationThresholds {
        SaturationThresholds::default() // kv 0.9, waiting 5
    }

    fn scale(thresholds: &SaturationThresholds, tokens: u64) -> Scale<'_> {
        Scale {
            thresholds,
            saturated_prefill_tokens: tokens,
        }
    }

    #[test]
    fn queued_prefill_work_saturates_an_engine_with_nothing_waiting() {
        // Two long prefills running (chunked), none waiting: by requests
        // the engine has room, by its work it is half full.
        let mut v = view(2, 0, 0.1, 0);
        v.queued_prefill_tokens = 8192;
        let t = th();
        let by_requests = saturation(&v, Since::placed(0), &t);
        assert!(by_requests < 0.2);
        assert_eq!(
            engine_saturation(&v, Since::placed(0), 0, &scale(&t, 16_384)),
            0.5
        );
        assert_eq!(
            engine_saturation(&v, Since::placed(0), 8192, &scale(&t, 16_384)),
            1.0,
            "a pick in transit adds its tokens"
        );
        assert_eq!(
            engine_saturation(&v, Since::placed(0), 0, &scale(&t, 0)),
            by_requests,
            "off"
        );
        // What the engine computed since its last report is not queued.
        let mut drained = v.clone();
        drained.prefill_drained_tokens = 4096;
        assert_eq!(
            engine_saturation(&drained, Since::placed(0), 0, &scale(&t, 16_384)),
            0.25
        );
        drained.prefill_drained_tokens = u64::MAX;
        assert!(engine_saturation(&drained, Since::placed(0), 0, &scale(&t, 16_384)) < 0.2);
        // Picks in transit go where the backlog is shortest.
        let mut w = view(2, 0, 0.1, 0);
        w.queued_prefill_tokens = 0;
        let loads = [(&v, Since::placed(0)), (&w, Since::placed(0))];
        let s = scale(&t, 16_384);
        let least = |picks, tokens| least_saturation(&loads, (picks, tokens), &s, 1.0).unwrap();
        assert!(least(0, 0) < 0.2);
        // One 8192-token pick lands on the idle engine: both at half.
        assert!((least(1, 8192) - 0.5).abs() < 1e-9);
        assert_eq!(least(3, 3 * 16_384), 1.0);
    }

    #[test]
    fn a_queue_shrinks_by_the_requests_done_and_grows_by_the_picks_placed() {
        let v = view(10, 5, 0.5, 0);
        assert_eq!(saturation(&v, Since::placed(0), &th()), 1.0);
        let freed = view(10, 5, 0.5, 1);
        assert!((saturation(&freed, Since::placed(0), &th()) - 0.8).abs() < 1e-9);
        assert_eq!(
            saturation(&freed, Since::placed(1), &th()),
            1.0,
            "one freed slot, one pick"
        );
        assert_eq!(
            saturation(&view(0, 5, 0.0, 0), Since::placed(0), &th()),
            1.0
        );
        assert!((saturation(&view(0, 5, 0.0, 2), Since::placed(0), &th()) - 0.6).abs() < 1e-9);
    }

    #[test]
    fn without_a_queue_kv_follows_the_running_count() {
        // 10 running at 0.9: KV-full; one done frees its share.
        let full = view(10, 0, 0.9, 0);
        assert_eq!(saturation(&full, Since::placed(0), &th()), 1.0);
        let one_done = view(10, 0, 0.9, 1);
        assert!((saturation(&one_done, Since::placed(0), &th()) - 0.9).abs() < 1e-9);
        assert_eq!(saturation(&one_done, Since::placed(1), &th()), 1.0);
        // Half full: room for five more before KV reaches the threshold,
        // the sixth waits.
        let half = view(5, 0, 0.45, 0);
        assert!((saturation(&half, Since::placed(5), &th()) - 1.0).abs() < 1e-9);
        assert!(saturation(&half, Since::placed(4), &th()) < 1.0);
        assert!((saturation(&half, Since::placed(6), &th()) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn an_idle_engine_takes_new_picks_until_a_scrape_says_more() {
        let idle = view(0, 0, 0.0, 0);
        assert_eq!(saturation(&idle, Since::placed(1000), &th()), 0.0);
        let unhealthy = LoadView::default();
        assert_eq!(saturation(&unhealthy, Since::placed(0), &th()), 1.0);
        assert_eq!(
            saturation(&view(3, 0, 0.3, 10), Since::placed(0), &th()),
            0.0
        );
    }

    #[test]
    fn picks_in_transit_take_the_most_room_first() {
        let a = view(0, 4, 0.0, 0); // room for one
        let b = view(0, 3, 0.0, 0); // room for two
        let loads = [(&a, Since::placed(0)), (&b, Since::placed(0))];
        assert!(
            (least_saturation(&loads, (0, 0), &scale(&th(), 0), 1.0).unwrap() - 0.6).abs() < 1e-9
        );
        assert!(
            (least_saturation(&loads, (2, 0), &scale(&th(), 0), 1.0).unwrap() - 0.8).abs() < 1e-9
        );
        assert_eq!(
            least_saturation(&loads, (3, 0), &scale(&th(), 0), 1.0),
            Some(1.0)
        );
        assert_eq!(
            least_saturation(&loads, (1000, 0), &scale(&th(), 0), 1.0),
            Some(1.0)
        );
        assert_eq!(least_saturation(&[], (0, 0), &scale(&th(), 0), 1.0), None);
        // Placements since the scrape count like picks in transit.
        let loads = [(&a, Since::placed(1)), (&b, Since::placed(2))];
        assert_eq!(
            least_saturation(&loads, (0, 0), &scale(&th(), 0), 1.0),
            Some(1.0)
        );
    }

    #[test]
    fn other_replicas_placements_and_ends_move_it_as_this_ones_do() {
        // Room for one (4 of 5 waiting): another replica's placement fills
        // it, and its end frees it again, as this replica's would.
        let v = view(10, 4, 0.2, 0);
        assert!(saturation(&v, Since::default(), &th()) < 1.0);
        assert_eq!(saturation(&v, Since::placed(1), &th()), 1.0);
        let came_and_went = Since {
            placed: 1,
            peer_done: 1,
        };
        assert!((saturation(&v, came_and_went, &th()) - 0.8).abs() < 1e-9);
        // An end of a request the scrape counted frees a slot, with this
        // replica's own DONE reports.
        let ended = Since {
            placed: 0,
            peer_done: 1,
        };
        let own_done = view(10, 4, 0.2, 1);
        assert!((saturation(&own_done, ended, &th()) - 0.4).abs() < 1e-9);
    }
}
