//! Bounds on picks nobody reports: the unconfirmed timeout, the
//! per-endpoint cap on unconfirmed picks, and the pool's tracking cap.

use super::*;

fn bounded(cap: u32, tracked: usize) -> (LoadTracker, EndpointId, EndpointId, Instant) {
    two_endpoints(LoadConfig {
        in_flight_timeout: Duration::from_secs(300),
        unconfirmed_timeout: Duration::from_secs(5),
        max_unconfirmed_per_endpoint: cap,
        max_tracked: tracked,
        ..LoadConfig::default()
    })
}

#[test]
fn unreported_picks_expire_after_the_unconfirmed_timeout() {
    let (t, a, _, now) = bounded(100, 1000);
    t.record_pick("fake", a, 10, 0, None, now);
    t.record_pick("real", a, 10, 0, None, now);
    assert!(t.report("real", Phase::FirstToken).matched);
    assert_eq!(t.bound_stats().unconfirmed, 1);
    assert_eq!(t.sweep(now + Duration::from_secs(4)), 0);
    assert_eq!(t.sweep(now + Duration::from_secs(5)), 1, "only the fake");
    assert_eq!(t.views([a], now)[0].in_flight, 1, "the reported one stays");
    let s = t.bound_stats();
    assert_eq!((s.unconfirmed_expired, s.unconfirmed), (1, 0));
    // The confirmed one lives to the ordinary timeout.
    assert_eq!(t.sweep(now + Duration::from_secs(299)), 0);
    assert_eq!(t.sweep(now + Duration::from_secs(300)), 1);
    assert_eq!(t.bound_stats().unconfirmed_expired, 1);
}

#[test]
fn the_endpoint_cap_stops_phantom_load_and_reports_free_places() {
    let (t, a, b, now) = bounded(3, 1000);
    for i in 0..10 {
        let want = if i < 3 {
            Accounting::Accounted
        } else {
            Accounting::EndpointCap
        };
        assert_eq!(t.record_pick(&format!("f{i}"), a, 100, 0, None, now), want);
    }
    let v = t.views([a, b], now);
    assert_eq!((v[0].in_flight, v[0].queued_prefill_tokens), (3, 300));
    assert_eq!(t.bound_stats().capped_endpoint, 7);
    // Another endpoint is not held back.
    assert_eq!(
        t.record_pick("g", b, 1, 0, None, now),
        Accounting::Accounted
    );
    // A FIRST_TOKEN confirms (frees a place) but keeps the pick in flight.
    t.report("f0", Phase::FirstToken);
    assert_eq!(
        t.record_pick("h", a, 1, 0, None, now),
        Accounting::Accounted
    );
    assert_eq!(t.views([a], now)[0].in_flight, 4);
    // A DONE of an unconfirmed pick frees its place too; of a confirmed
    // one, none (it was freed already).
    t.report("f1", Phase::Done);
    t.report("f0", Phase::Done);
    assert_eq!(t.bound_stats().unconfirmed, 3, "f2, h on a; g on b");
    // A retry moves the pick: it does not count twice.
    assert_eq!(
        t.record_pick("h", a, 1, 0, None, now),
        Accounting::Accounted
    );
    assert_eq!(t.bound_stats().unconfirmed, 3);
}

#[test]
fn the_pool_cap_bounds_the_table() {
    let (t, a, b, now) = bounded(100, 4);
    for i in 0..4 {
        t.record_pick(
            &format!("r{i}"),
            if i % 2 == 0 { a } else { b },
            1,
            0,
            None,
            now,
        );
    }
    assert_eq!(t.record_pick("x", a, 1, 0, None, now), Accounting::PoolCap);
    assert_eq!(t.in_flight_total(), 4);
    assert_eq!(t.bound_stats().capped_pool, 1);
    t.report("r0", Phase::Done);
    assert_eq!(
        t.record_pick("x", a, 1, 0, None, now),
        Accounting::Accounted
    );
    assert_eq!(t.record_pick("", a, 1, 0, None, now), Accounting::Ignored);
}
