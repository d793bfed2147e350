//! The release order in the pool's flow control: quickest first within the
//! tenants' shares, its aging bound, and release whenever there is room.

use super::tests::ep;
use super::*;

fn cfg(order: ReleaseOrder, skip_ms: u64) -> FlowControlConfig {
    FlowControlConfig {
        enabled: true,
        threshold: 1.0,
        max_queued: 64,
        max_queued_per_tenant: 64,
        max_wait_ms: 10_000,
        reserve: 0.0,
        release_order: order,
        max_quickest_skip_ms: skip_ms,
        ..FlowControlConfig::default()
    }
}

/// A pick of `tenant` with a 4,000-token prompt of which `cached` tokens
/// are held by the endpoints given.
fn ask(tenant: &str, n: u64, cached: &[(u64, u64)]) -> Ask {
    Ask {
        request_id: format!("{tenant}-{n}"),
        tenant: tenant.into(),
        priority: 0,
        weight: 1,
        tokens: 4_256,
        max_wait: Duration::from_secs(10),
        price: Price {
            prompt_tokens: 4_000,
            cached: cached.iter().map(|(e, t)| (EndpointId(*e), *t)).collect(),
        },
    }
}

fn th() -> SaturationThresholds {
    SaturationThresholds::default()
}

type Rx = oneshot::Receiver<Wake>;

fn queue(f: &PoolFlow, loads: &[(EndpointId, LoadView)], a: Ask, now: Instant) -> Rx {
    match f.arrive(loads, &th(), a, now) {
        Arrival::Queued { rx, .. } => rx,
        other => panic!("saturated: waits, got {other:?}"),
    }
}

/// Which of `rxs` were released (by position), placing each on `at`.
fn released(f: &PoolFlow, rxs: &mut [Rx], at: u64) -> Vec<usize> {
    let mut out = Vec::new();
    for (i, rx) in rxs.iter_mut().enumerate() {
        if let Ok(Wake::Go(p)) = rx.try_recv() {
            f.placed(p, Some(EndpointId(at)));
            out.push(i);
        }
    }
    out
}

#[test]
fn the_pick_with_the_least_prefill_on_the_freed_endpoint_goes_first() {
    for (order, expected) in [
        (ReleaseOrder::Fair, vec![0]),
        (ReleaseOrder::QuickestFirst, vec![2]),
    ] {
        let f = PoolFlow::new(cfg(order, 60_000));
        let now = Instant::now();
        let full = [ep(1, 5, 0), ep(2, 5, 0)];
        let mut rxs = vec![
            queue(&f, &full, ask("a", 0, &[]), now),
            queue(&f, &full, ask("a", 1, &[(1, 1_000)]), now),
            queue(&f, &full, ask("a", 2, &[(1, 3_900)]), now),
        ];
        // Endpoint 1 frees one slot: one pick goes.
        f.release(&[ep(1, 5, 1), ep(2, 5, 0)], &th(), now);
        assert_eq!(released(&f, &mut rxs, 1), expected, "{order:?}");
    }
}

#[test]
fn the_fair_turn_between_tenants_is_kept() {
    let f = PoolFlow::new(cfg(ReleaseOrder::QuickestFirst, 60_000));
    let now = Instant::now();
    let full = [ep(1, 5, 0)];
    // "a" arrived first with a long prompt; "b" has cheap ones. Equal
    // sizes: the turns alternate a, b, a, b whatever the prices.
    let mut rxs = vec![
        queue(&f, &full, ask("a", 0, &[]), now),
        queue(&f, &full, ask("a", 1, &[]), now),
        queue(&f, &full, ask("b", 0, &[(1, 3_990)]), now),
        queue(&f, &full, ask("b", 1, &[(1, 3_999)]), now),
    ];
    let mut order = Vec::new();
    // One slot at a time (each placement takes it until the next report).
    for done in 1..=4 {
        f.release(&[ep(1, 5, done)], &th(), now);
        order.extend(released(&f, &mut rxs, 1));
    }
    assert_eq!(order, vec![0, 3, 1, 2]);
}

#[test]
fn a_pick_passed_over_past_the_aging_bound_goes_first() {
    let f = PoolFlow::new(cfg(ReleaseOrder::QuickestFirst, 50));
    let t0 = Instant::now();
    let full = [ep(1, 5, 0)];
    let mut rxs = vec![
        queue(&f, &full, ask("a", 0, &[]), t0),
        queue(&f, &full, ask("a", 1, &[(1, 3_000)]), t0),
        queue(&f, &full, ask("a", 2, &[(1, 3_500)]), t0),
    ];
    // The endpoint as scraped just before t0, `done` reported since: the
    // picks placed meanwhile (each takes the slot it was released for)
    // count until a later scrape.
    let at = |ms: u64, done: u32| {
        let (id, mut v) = ep(1, 5, done);
        v.last_scrape_age = Some(Duration::from_millis(ms + 5));
        (vec![(id, v)], t0 + Duration::from_millis(ms))
    };
    // Within the bound the quickest goes.
    let (loads, now) = at(10, 1);
    f.release(&loads, &th(), now);
    assert_eq!(released(&f, &mut rxs, 1), vec![2]);
    // Past it, the oldest, though a quicker one waits.
    let (loads, now) = at(60, 2);
    f.release(&loads, &th(), now);
    assert_eq!(released(&f, &mut rxs, 1), vec![0]);
    let (loads, now) = at(60, 3);
    f.release(&loads, &th(), now);
    assert_eq!(released(&f, &mut rxs, 1), vec![1]);
}

#[test]
fn as_many_picks_go_as_there_is_room_for() {
    for order in [ReleaseOrder::Fair, ReleaseOrder::QuickestFirst] {
        let f = PoolFlow::new(cfg(order, 60_000));
        let now = Instant::now();
        let full = [ep(1, 5, 0), ep(2, 5, 0)];
        let mut rxs: Vec<Rx> = (0..6)
            .map(|n| queue(&f, &full, ask("a", n, &[(2, 3_999)]), now))
            .collect();
        // Three slots free on endpoint 1 and one on 2: four go at once,
        // none held back for a quicker one, whatever the order.
        f.release(&[ep(1, 5, 3), ep(2, 5, 1)], &th(), now);
        let mut gone = 0;
        for rx in rxs.iter_mut() {
            if let Ok(Wake::Go(p)) = rx.try_recv() {
                gone += 1;
                drop(p);
            }
        }
        assert_eq!((gone, f.len()), (4, 2), "{order:?}");
    }
}

#[test]
fn a_pick_whose_holder_would_start_it_sooner_waits_behind_the_others() {
    let f = PoolFlow::new(cfg(ReleaseOrder::QuickestFirst, 60_000));
    let now = Instant::now();
    let full = [ep(1, 5, 0), ep(2, 5, 0)];
    // Pick 0 is almost all cached on endpoint 2 (idle backlog): endpoint 1
    // may not take it while pick 1 (cached nowhere) waits.
    let mut rxs = vec![
        queue(&f, &full, ask("a", 0, &[(2, 3_900)]), now),
        queue(&f, &full, ask("a", 1, &[]), now),
    ];
    f.release(&[ep(1, 5, 1), ep(2, 5, 0)], &th(), now);
    assert_eq!(released(&f, &mut rxs, 1), vec![1]);
    // Alone, it still goes when there is room (never held for nothing).
    f.release(&[ep(1, 5, 2), ep(2, 5, 0)], &th(), now);
    assert_eq!(released(&f, &mut rxs, 1), vec![0]);
}
