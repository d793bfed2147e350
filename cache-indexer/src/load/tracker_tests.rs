//! The tracker's scrape health, in-flight accounting and pending prefixes.

use super::*;
use crate::load::prefix::{block_chain, MAX_PENDING_PREFIXES, PENDING_GRACE};

fn tracker() -> (LoadTracker, EndpointId, EndpointId, Instant) {
    super::two_endpoints(LoadConfig {
        unhealthy_after: 2,
        in_flight_timeout: Duration::from_secs(10),
        prefill_horizon: Duration::from_secs(1),
        saturation: SaturationThresholds::default(),
        ..LoadConfig::default()
    })
}

#[test]
fn health_follows_scrapes() {
    let (t, a, _, now) = tracker();
    assert!(
        !t.views([a], now)[0].healthy,
        "unhealthy before the first scrape"
    );
    t.record_scrape(
        a,
        Some(EngineLoad {
            running: 2,
            waiting: 0,
            kv_usage: 0.1,
        }),
        now,
    );
    assert!(t.views([a], now)[0].healthy);
    t.record_scrape(a, None, now);
    assert!(t.views([a], now)[0].healthy, "one failure is tolerated");
    t.record_scrape(a, None, now);
    let v = &t.views([a], now)[0];
    assert!(!v.healthy);
    assert_eq!(v.scrape_failures, 2);
    assert_eq!(v.saturation, 1.0);
    t.record_scrape(a, Some(EngineLoad::default()), now);
    assert!(t.views([a], now)[0].healthy);
}

#[test]
fn in_flight_accounting() {
    let (t, a, b, now) = tracker();
    t.record_pick("r1", a, 100, 0, None, now);
    t.record_pick("r2", a, 50, 0, None, now);
    t.record_pick("", a, 1000, 0, None, now); // not accounted
    let v = t.views([a, b], now);
    assert_eq!((v[0].in_flight, v[0].queued_prefill_tokens), (2, 150));
    let m = t.report("r1", Phase::FirstToken);
    assert_eq!((m.matched, m.endpoint), (true, Some(a)));
    assert_eq!(t.views([a], now)[0].queued_prefill_tokens, 50);
    assert_eq!(t.views([a], now)[0].in_flight, 2);
    assert!(t.report("r1", Phase::Done).matched);
    assert!(
        !t.report("r1", Phase::Done).matched,
        "second DONE is unmatched"
    );
    assert_eq!(t.views([a], now)[0].in_flight, 1);
    // A retry moves the request.
    t.record_pick("r2", b, 70, 0, None, now);
    let v = t.views([a, b], now);
    assert_eq!((v[0].in_flight, v[0].queued_prefill_tokens), (0, 0));
    assert_eq!((v[1].in_flight, v[1].queued_prefill_tokens), (1, 70));
    // Prefill horizon, then timeout.
    assert_eq!(t.sweep(now + Duration::from_millis(1500)), 0);
    assert_eq!(t.views([b], now)[0].queued_prefill_tokens, 0);
    assert_eq!(t.views([b], now)[0].in_flight, 1);
    assert_eq!(t.sweep(now + Duration::from_secs(11)), 1);
    assert_eq!(t.views([b], now)[0].in_flight, 0);
    assert_eq!(t.in_flight_total(), 0);
}

#[test]
fn removing_an_endpoint_forgets_its_picks() {
    let (t, a, b, now) = tracker();
    t.record_pick("r1", a, 10, 0, None, now);
    t.record_pick("r2", b, 10, 0, None, now);
    t.remove_endpoint(a);
    assert_eq!(t.in_flight_total(), 1);
    assert!(!t.report("r1", Phase::Done).matched);
    t.record_pick("r3", a, 10, 0, None, now); // unknown endpoint: ignored
    assert_eq!(t.in_flight_total(), 1);
}

#[test]
fn picks_in_prefill_count_as_pending_prefixes() {
    let (t, a, b, now) = tracker();
    let chain: Arc<[u64]> = block_chain(&(0..64).collect::<Vec<u32>>(), 4).into();
    t.record_pick("r1", a, 64, 0, Some(Arc::clone(&chain)), now);
    let v = t.views_matching([a, b], now, Some(&chain[..12]));
    assert_eq!(
        (v[0].pending_matched_blocks, v[1].pending_matched_blocks),
        (12, 0)
    );
    t.report("r1", Phase::FirstToken);
    let late = Instant::now() + PENDING_GRACE;
    let v = t.views_matching([a], late, Some(&chain));
    assert_eq!(
        v[0].pending_matched_blocks, 0,
        "past the grace after prefill the KV events tell"
    );
    t.sweep(late);
    for i in 0..(MAX_PENDING_PREFIXES + 5) {
        t.record_pick(&format!("x{i}"), b, 1, 0, Some(Arc::clone(&chain)), now);
    }
    let v = t.views_matching([b], now, Some(&chain));
    assert_eq!(v[0].pending_matched_blocks, 16);
    assert_eq!(t.sweep(now + Duration::from_millis(1500)), 0);
    assert_eq!(
        t.views_matching([b], now, Some(&chain))[0].pending_matched_blocks,
        0
    );
}

#[test]
fn pool_saturation_is_mean_of_healthy() {
    let mk = |healthy, saturation| LoadView {
        healthy,
        saturation,
        ..Default::default()
    };
    assert_eq!(pool_saturation(&[]), 1.0);
    assert_eq!(pool_saturation(&[mk(false, 1.0)]), 1.0);
    assert_eq!(
        pool_saturation(&[mk(true, 0.2), mk(true, 0.6), mk(false, 1.0)]),
        0.4
    );
}

#[test]
fn peer_load_adds_to_the_views_not_to_what_is_published() {
    use crate::load::PeerLoad;
    use std::collections::HashMap;
    let (t, a, b, now) = two_endpoints(LoadConfig::default());
    t.record_pick("r1", a, 100, 0, None, now);
    let peer = PeerLoad {
        in_flight: 2,
        queued_prefill_tokens: 500,
    };
    let ttl = Duration::from_secs(1);
    t.set_peer_loads(HashMap::from([(b, peer)]), 1, now, ttl);
    let v = t.views([a, b], now);
    assert_eq!((v[0].in_flight, v[0].queued_prefill_tokens), (1, 100));
    assert_eq!(
        (v[0].peer_in_flight, v[0].peer_queued_prefill_tokens),
        (0, 0)
    );
    assert_eq!((v[1].in_flight, v[1].queued_prefill_tokens), (2, 500));
    assert_eq!(
        (v[1].peer_in_flight, v[1].peer_queued_prefill_tokens),
        (2, 500)
    );
    // Only this replica's own picks are published: a peer's never echo.
    let own = PeerLoad {
        in_flight: 1,
        queued_prefill_tokens: 100,
    };
    assert_eq!(t.own_loads(), vec![(a, own)]);
    // Past the TTL with no newer read: this replica's own counts only.
    t.peer_round_failed();
    let late = now + ttl;
    assert_eq!(t.views([b], late)[0].in_flight, 0);
    let s = t.peer_stats(late);
    assert!(s.local_only && s.failures == 1 && s.peers == 0, "{s:?}");
    t.report("r1", Phase::Done);
    assert!(t.own_loads().is_empty());
}

#[test]
fn requests_done_since_the_scrape_leave_its_running_count() {
    let (t, a, _, now) = tracker();
    let busy = EngineLoad {
        running: 2,
        waiting: 0,
        kv_usage: 0.1,
    };
    // Picked before the scrape that counted them as running.
    t.record_pick("r1", a, 100, 0, None, now);
    t.record_pick("r2", a, 100, 0, None, now);
    let later = now + Duration::from_millis(10);
    t.record_scrape(a, Some(busy), later);
    // Picked after it: the scrape never counted this one.
    t.record_pick("r3", a, 100, 0, None, later + Duration::from_millis(1));
    assert!(t.report("r1", Phase::Done).matched);
    assert!(t.report("r3", Phase::Done).matched);
    let v = &t.views([a], later)[0];
    assert_eq!(
        (v.engine.running, v.done_since_scrape, v.running()),
        (2, 1, 1)
    );
    // The next scrape is the engine's word again.
    t.record_scrape(a, Some(busy), later + Duration::from_millis(100));
    let v = &t.views([a], later)[0];
    assert_eq!((v.done_since_scrape, v.running()), (0, 2));
    // Never below zero, however many reports.
    t.record_scrape(
        a,
        Some(EngineLoad::default()),
        later + Duration::from_millis(200),
    );
    assert!(t.report("r2", Phase::Done).matched);
    assert_eq!(t.views([a], later)[0].running(), 0);
}

/// The chain of `n` blocks (block size 4) shared by the grace tests.
fn chain_of(n: u32) -> Arc<[u64]> {
    block_chain(&(0..n * 4).collect::<Vec<u32>>(), 4).into()
}

#[test]
fn a_finished_chain_counts_on_its_endpoint_until_the_grace_ends() {
    // A conversation's next turn is picked right after the previous one is
    // done, before the engine's KV events have reached the index: the
    // previous prompt must still be credited to the engine that ran it.
    for phase in [Phase::FirstToken, Phase::Done] {
        let (t, a, b, now) = tracker();
        let chain = chain_of(16);
        t.record_pick("turn1", a, 64, 0, Some(Arc::clone(&chain)), now);
        t.report("turn1", phase);
        t.report("turn1", Phase::Done);
        let ended = Instant::now();
        let v = t.views_matching([a, b], ended, Some(&chain[..10]));
        assert_eq!(
            (v[0].pending_matched_blocks, v[1].pending_matched_blocks),
            (10, 0),
            "{phase:?}"
        );
        assert_eq!(v[0].in_flight, 0, "done: no load left");
        assert!(t.pending_holds(&chain[..10]));
        // Published for the other replicas too, for the same reason.
        assert_eq!(t.own_pending(), vec![(a, vec![Arc::clone(&chain)])]);
        // Past the grace the index alone tells.
        let late = ended + PENDING_GRACE;
        let v = t.views_matching([a], late, Some(&chain));
        assert_eq!(v[0].pending_matched_blocks, 0, "{phase:?}");
        t.sweep(late);
        assert!(!t.pending_holds(&chain[..10]));
        assert!(t.own_pending().is_empty());
    }
}

#[test]
fn a_moved_or_expired_pick_leaves_no_settling_chain() {
    let (t, a, b, now) = tracker();
    let chain = chain_of(8);
    // A retry elsewhere: the first engine never ran it.
    t.record_pick("r", a, 32, 0, Some(Arc::clone(&chain)), now);
    t.record_pick("r", b, 32, 0, Some(Arc::clone(&chain)), now);
    let v = t.views_matching([a, b], now, Some(&chain));
    assert_eq!(
        (v[0].pending_matched_blocks, v[1].pending_matched_blocks),
        (0, 8)
    );
    // The prefill horizon lapsing says nothing about the engine's cache.
    t.sweep(now + Duration::from_millis(1500));
    t.report("r", Phase::Done);
    let v = t.views_matching([b], Instant::now(), Some(&chain));
    assert_eq!(v[0].pending_matched_blocks, 0);
}

#[test]
fn settling_chains_are_bounded_and_dropped_when_the_endpoint_goes_down() {
    let (t, a, _, now) = tracker();
    t.record_scrape(a, Some(EngineLoad::default()), now);
    for i in 0..(MAX_PENDING_PREFIXES as u32 + 5) {
        let id = format!("r{i}");
        t.record_pick(&id, a, 4, 0, Some(chain_of(i + 1)), now);
        t.report(&id, Phase::Done);
    }
    let own = t.own_pending();
    assert_eq!(own[0].1.len(), MAX_PENDING_PREFIXES, "oldest forgotten");
    assert_eq!(own[0].1[0].len(), MAX_PENDING_PREFIXES + 5, "newest first");
    let longest = chain_of(MAX_PENDING_PREFIXES as u32 + 5);
    let v = t.views_matching([a], now, Some(&longest));
    assert_eq!(v[0].pending_matched_blocks, longest.len());
    // Nobody listens there any more: unhealthy at once, nothing credited.
    assert!(t.record_refused(a));
    let v = &t.views_matching([a], now, Some(&longest))[0];
    assert!(!v.healthy);
    assert_eq!(v.pending_matched_blocks, 0);
    assert!(t.own_pending().is_empty());
}

#[test]
fn a_refused_connection_is_unhealthy_at_once_a_timeout_is_counted() {
    let (t, a, b, now) = tracker();
    for id in [a, b] {
        t.record_scrape(id, Some(EngineLoad::default()), now);
    }
    // A failed scrape that may be a busy engine: one is tolerated.
    t.record_scrape(b, None, now);
    assert!(t.views([b], now)[0].healthy);
    // Connection refused: nobody listens.
    assert!(t.record_refused(a));
    let v = &t.views([a], now)[0];
    assert!(!v.healthy);
    assert_eq!(
        (v.failures_in_row, v.scrape_failures, v.refused_marks),
        (1, 1, 1)
    );
    assert!(!t.record_refused(a), "already down");
    // The next good scrape brings it back.
    t.record_scrape(a, Some(EngineLoad::default()), now);
    assert!(t.views([a], now)[0].healthy);
    assert!(!t.record_refused(EndpointId(99)), "unknown endpoint");
}

#[test]
fn a_chain_completed_after_the_prefill_ended_still_settles() {
    // A pick tokenized only as far as its cached prefix gets its whole
    // chain off the pick's path; a fast engine may be done before that.
    let (t, a, _, now) = tracker();
    let whole = chain_of(16);
    t.record_pick("r", a, 64, 0, Some(Arc::from(&whole[..1])), now);
    t.report("r", Phase::Done);
    assert!(t.pending_chains().complete("r", Arc::clone(&whole)));
    let v = t.views_matching([a], now, Some(&whole));
    assert_eq!(v[0].pending_matched_blocks, 16);
    assert!(!t.pending_chains().complete("unknown", Arc::clone(&whole)));
}

#[test]
fn queued_prefill_drains_at_the_rate_first_tokens_showed() {
    let (t, a, _, _) = tracker();
    let ms = Duration::from_millis;
    let Some(t0) = Instant::now().checked_sub(ms(100)) else {
        return; // (a clock too young to go back: nothing to test)
    };
    t.record_scrape(a, Some(EngineLoad::default()), t0);
    t.record_pick("r1", a, 10_000, 0, None, t0);
    assert_eq!(
        t.views([a], t0 + ms(1000))[0].prefill_drained_tokens,
        0,
        "no rate learned yet: nothing drains"
    );
    // Its first token at least 100 ms after its pick: at most 100k tokens/s.
    t.report("r1", Phase::FirstToken);
    let now = Instant::now();
    t.record_pick("r2", a, 8000, 0, None, now);
    t.record_pick("r3", a, 8000, 0, None, now);
    let drained = |at: Instant| t.views([a], at)[0].prefill_drained_tokens;
    assert_eq!(drained(now), 0);
    let d = drained(now + ms(40));
    assert!(d > 0 && d <= 4000, "40 ms at <= 100k tokens/s: {d}");
    assert_eq!(
        drained(now + ms(10_000)),
        8000,
        "never past the oldest pick without its report"
    );
    // r2's first token: its tokens leave the queue, r3's drain from then.
    t.report("r2", Phase::FirstToken);
    let later = Instant::now();
    assert_eq!(t.views([a], later)[0].queued_prefill_tokens, 8000);
    assert_eq!(drained(later + ms(10_000)), 8000);
    t.report("r3", Phase::Done);
    assert_eq!(drained(later + ms(10_000)), 0, "nothing left to drain");
}
