use super::*;
use crate::load::EngineLoad;

fn cfg(max_queued: usize, per_tenant: usize) -> FlowControlConfig {
    FlowControlConfig {
        enabled: true,
        threshold: 1.0,
        max_queued,
        max_queued_per_tenant: per_tenant,
        max_wait_ms: 10_000,
        // (The fair order alone; the reserve's tests set their own.)
        reserve: 0.0,
        ..FlowControlConfig::default()
    }
}

/// An endpoint scraped `age` ago with `waiting` queued, `done` reported
/// done since.
pub(super) fn ep(id: u64, waiting: u32, done: u32) -> (EndpointId, LoadView) {
    let view = LoadView {
        engine: EngineLoad {
            running: 4,
            waiting,
            kv_usage: 0.2,
        },
        healthy: true,
        done_since_scrape: done,
        last_scrape_age: Some(Duration::from_millis(5)),
        ..Default::default()
    };
    (EndpointId(id), view)
}

fn ask(tenant: &str, tokens: u64) -> Ask {
    Ask {
        request_id: format!("{tenant}-{tokens}"),
        tenant: tenant.into(),
        priority: 0,
        weight: 1,
        tokens,
        max_wait: Duration::from_secs(10),
        price: Default::default(),
    }
}

fn th() -> SaturationThresholds {
    SaturationThresholds::default()
}

#[test]
fn room_lets_picks_through_and_counts_them_until_placed() {
    let f = PoolFlow::new(cfg(8, 8));
    let now = Instant::now();
    // Room for exactly one more (4 of 5 waiting).
    let loads = [ep(1, 4, 0)];
    let Arrival::Go(first) = f.arrive(&loads, &th(), ask("a", 10), now) else {
        panic!("room for one")
    };
    assert_eq!(f.in_transit(), 1);
    // The first is not placed yet, but counts: the second waits.
    assert!(matches!(
        f.arrive(&loads, &th(), ask("a", 10), now),
        Arrival::Queued { .. }
    ));
    f.placed(first, Some(EndpointId(1)));
    assert_eq!(f.in_transit(), 0);
    // Placed after the scrape: still counted (no room).
    assert!(matches!(
        f.arrive(&loads, &th(), ask("b", 10), now),
        Arrival::Queued { .. }
    ));
    assert_eq!(f.len(), 2);
    assert_eq!(
        f.tenants(),
        vec![("a".to_string(), 1, 10), ("b".to_string(), 1, 10)]
    );
}

#[test]
fn a_freed_slot_releases_one_pick() {
    let f = PoolFlow::new(cfg(8, 8));
    let now = Instant::now();
    let full = [ep(1, 5, 0)];
    let mut rxs = Vec::new();
    for i in 0..3 {
        let Arrival::Queued { rx, .. } = f.arrive(&full, &th(), ask("a", 100 + i), now) else {
            panic!("saturated: waits")
        };
        rxs.push(rx);
    }
    f.release(&full, &th(), now);
    assert!(rxs.iter_mut().all(|rx| rx.try_recv().is_err()));
    // One request done since the scrape: one goes, then the one in
    // transit fills the slot.
    let one_done = [ep(1, 5, 1)];
    f.release(&one_done, &th(), now);
    let Ok(Wake::Go(p)) = rxs[0].try_recv() else {
        panic!("the first is released")
    };
    assert!(rxs[1].try_recv().is_err());
    assert_eq!((f.len(), f.in_transit()), (2, 1));
    f.placed(p, Some(EndpointId(1)));
    f.release(&one_done, &th(), now);
    assert!(rxs[1].try_recv().is_err(), "placed: the slot is taken");
    assert_eq!(f.metrics.released.get(), 1);
    assert_eq!(f.metrics.released_tokens.get(), 100);
    // A scrape after the placement forgets it; its done count too.
    let later = now + Duration::from_millis(50);
    let rescraped = [(
        EndpointId(1),
        LoadView {
            last_scrape_age: Some(Duration::from_millis(1)),
            ..ep(1, 3, 0).1
        },
    )];
    f.release(&rescraped, &th(), later);
    assert!(matches!(rxs[1].try_recv(), Ok(Wake::Go(_))));
    assert!(matches!(rxs[2].try_recv(), Ok(Wake::Go(_))));
    assert_eq!(f.len(), 0);
}

#[test]
fn bounds_shed_with_their_cause() {
    let f = PoolFlow::new(cfg(3, 2));
    let now = Instant::now();
    let full = [ep(1, 5, 0)];
    let mut keep = Vec::new();
    for t in ["a", "a", "b"] {
        keep.push(f.arrive(&full, &th(), ask(t, 1), now));
    }
    assert!(keep.iter().all(|a| matches!(a, Arrival::Queued { .. })));
    assert!(matches!(
        f.arrive(&full, &th(), ask("c", 1), now),
        Arrival::Shed(ShedCause::PoolFull)
    ));
    let g = PoolFlow::new(cfg(3, 2));
    let _a = g.arrive(&full, &th(), ask("a", 1), now);
    let _b = g.arrive(&full, &th(), ask("a", 1), now);
    assert!(matches!(
        g.arrive(&full, &th(), ask("a", 1), now),
        Arrival::Shed(ShedCause::TenantFull)
    ));
    let no_wait = Ask {
        max_wait: Duration::ZERO,
        ..ask("d", 7)
    };
    assert!(matches!(
        g.arrive(&full, &th(), no_wait, now),
        Arrival::Shed(ShedCause::NoWait)
    ));
    assert_eq!(g.metrics.shed[slot(ShedCause::TenantFull)].get(), 1);
    assert_eq!(g.metrics.shed_tokens[slot(ShedCause::NoWait)].get(), 7);
    // A pool whose maximum wait is 0 sheds too, even a caller that waits.
    let zero = PoolFlow::new(FlowControlConfig {
        max_wait_ms: 0,
        ..cfg(3, 2)
    });
    assert!(matches!(
        zero.arrive(&full, &th(), ask("a", 1), now),
        Arrival::Shed(ShedCause::NoWait)
    ));
}

#[test]
fn deadlines_expire_and_cancels_leave_nothing_behind() {
    let f = PoolFlow::new(cfg(8, 8));
    let now = Instant::now();
    let full = [ep(1, 5, 0)];
    let short = Ask {
        max_wait: Duration::from_millis(10),
        ..ask("a", 5)
    };
    let Arrival::Queued {
        mut rx, deadline, ..
    } = f.arrive(&full, &th(), short, now)
    else {
        panic!()
    };
    assert_eq!(deadline, now + Duration::from_millis(10));
    let Arrival::Queued { ticket, .. } = f.arrive(&full, &th(), ask("b", 5), now) else {
        panic!()
    };
    f.release(&full, &th(), deadline);
    assert!(matches!(rx.try_recv(), Ok(Wake::Expired)));
    assert_eq!(f.metrics.shed[slot(ShedCause::MaxWait)].get(), 1);
    assert!(f.cancel(ticket));
    assert!(!f.cancel(ticket), "once");
    assert!(!f.expire_one(ticket));
    assert_eq!((f.len(), f.tenants().len()), (0, 0));
    assert_eq!(f.metrics.cancelled.get(), 1);
}

#[test]
fn a_released_pick_whose_caller_left_is_skipped() {
    let f = PoolFlow::new(cfg(8, 8));
    let now = Instant::now();
    let full = [ep(1, 5, 0)];
    let Arrival::Queued { rx, .. } = f.arrive(&full, &th(), ask("a", 1), now) else {
        panic!()
    };
    drop(rx);
    let Arrival::Queued { rx: mut next, .. } = f.arrive(&full, &th(), ask("b", 1), now) else {
        panic!()
    };
    // Room for one: the gone caller's pass is dropped, the next one goes.
    f.release(&[ep(1, 5, 1)], &th(), now);
    assert!(matches!(next.try_recv(), Ok(Wake::Go(_))));
    assert_eq!(f.metrics.cancelled.get(), 1);
    assert_eq!(f.in_transit(), 0, "the pass dropped with the channel");
}

#[test]
fn no_healthy_endpoint_fails_open_and_with_room_lists_the_unsaturated() {
    let f = PoolFlow::new(cfg(8, 8));
    let now = Instant::now();
    let down = [(EndpointId(1), LoadView::default())];
    assert!(matches!(
        f.arrive(&down, &th(), ask("a", 1), now),
        Arrival::Go(_)
    ));
    let loads = [
        ep(1, 5, 0),
        ep(2, 2, 0),
        (EndpointId(3), LoadView::default()),
    ];
    assert_eq!(f.with_room(&loads, &th(), now), vec![EndpointId(2)]);
}

/// Releases a1 (charged 10,000 tokens), settles it at `actual`, then frees
/// two more slots: whether a's next pick goes before b's second.
fn second_release_after_settling(actual: u64) -> (bool, bool, usize) {
    let f = PoolFlow::new(cfg(8, 8));
    let now = Instant::now();
    let full = [ep(1, 5, 0)];
    let mut rx = Vec::new();
    for (t, n) in [("a", 10_000), ("a", 100), ("b", 100), ("b", 101)] {
        let Arrival::Queued { rx: r, .. } = f.arrive(&full, &th(), ask(t, n), now) else {
            panic!()
        };
        rx.push(r);
    }
    f.release(&[ep(1, 5, 1)], &th(), now);
    let Ok(Wake::Go(a1)) = rx[0].try_recv() else {
        panic!("a1 first (earliest of the tied)")
    };
    f.placed(a1, Some(EndpointId(1)));
    assert_eq!(f.charges_open(), 1);
    f.settle("a-10000", actual);
    f.settle("nobody", 5);
    f.release(&[ep(1, 5, 3)], &th(), now);
    assert!(matches!(rx[2].try_recv(), Ok(Wake::Go(_))), "b1 next");
    let a2 = matches!(rx[1].try_recv(), Ok(Wake::Go(_)));
    let b2 = matches!(rx[3].try_recv(), Ok(Wake::Go(_)));
    (a2, b2, f.charges_open())
}

#[test]
fn a_done_report_settles_a_released_picks_charge() {
    // Charged its estimate, a owes 10,000 tokens: b goes twice first.
    assert_eq!(second_release_after_settling(0), (false, true, 0));
    // It used 100: a's next pick is back in turn.
    assert_eq!(second_release_after_settling(100), (true, false, 0));
}

#[test]
fn two_replicas_each_release_into_the_room_they_see() {
    // Partitioned queues: each replica releases against its own view (the
    // same scrape), so room for two seen by both at once takes four picks:
    // the overshoot is the other replicas' releases into the same room,
    // until the next scrape shows it (see the README).
    let now = Instant::now();
    let full = [ep(1, 5, 0)];
    let replicas = [PoolFlow::new(cfg(8, 8)), PoolFlow::new(cfg(8, 8))];
    let mut rx = Vec::new();
    for f in &replicas {
        for i in 0..3 {
            let Arrival::Queued { rx: r, .. } = f.arrive(&full, &th(), ask("t", i), now) else {
                panic!()
            };
            rx.push(r);
        }
    }
    let room_for_two = [ep(1, 3, 0)];
    for f in &replicas {
        f.release(&room_for_two, &th(), now);
    }
    let released = rx
        .iter_mut()
        .map(|r| r.try_recv())
        .filter(|w| matches!(w, Ok(Wake::Go(_))))
        .count();
    assert_eq!(released, 4);
    assert_eq!(replicas.iter().map(PoolFlow::len).sum::<usize>(), 2);
}

#[test]
fn room_nobody_announced_is_used_when_the_next_pick_arrives() {
    let f = PoolFlow::new(cfg(8, 8));
    let now = Instant::now();
    let full = [ep(1, 5, 0)];
    let Arrival::Queued { rx: mut first, .. } = f.arrive(&full, &th(), ask("a", 1), now) else {
        panic!()
    };
    // Room now (a slot freed without a release pass): the first takes it,
    // and the newcomer, finding none left, queues.
    let room = [ep(1, 5, 1)];
    let Arrival::Queued { rx: mut second, .. } = f.arrive(&room, &th(), ask("b", 1), now) else {
        panic!("the room is the first's")
    };
    assert_eq!((f.len(), f.in_transit()), (1, 1));
    assert!(matches!(first.try_recv(), Ok(Wake::Go(_))));
    assert!(second.try_recv().is_err(), "one slot, one release");
    assert_eq!(f.in_transit(), 0, "its pass dropped unplaced");
}

#[test]
fn a_caller_that_cannot_wait_goes_when_room_is_left_after_the_queue() {
    let f = PoolFlow::new(cfg(8, 8));
    let now = Instant::now();
    let Arrival::Queued { rx: mut first, .. } = f.arrive(&[ep(1, 5, 0)], &th(), ask("a", 1), now)
    else {
        panic!()
    };
    let no_wait = Ask {
        max_wait: Duration::ZERO,
        ..ask("b", 1)
    };
    // Two slots: the waiting pick takes one, the newcomer the other.
    let two = [ep(1, 5, 2)];
    assert!(matches!(
        f.arrive(&two, &th(), no_wait.clone(), now),
        Arrival::Go(_)
    ));
    assert!(matches!(first.try_recv(), Ok(Wake::Go(_))));
    // One slot: the waiting pick's; the newcomer, who cannot wait, is shed.
    let Arrival::Queued { rx: mut again, .. } = f.arrive(&[ep(1, 5, 0)], &th(), ask("a", 2), now)
    else {
        panic!()
    };
    assert!(matches!(
        f.arrive(&[ep(1, 5, 1)], &th(), no_wait, now),
        Arrival::Shed(ShedCause::NoWait)
    ));
    assert!(matches!(again.try_recv(), Ok(Wake::Go(_))));
}

/// `ep` scraped `age_ms` ago.
fn ep_scraped(id: u64, waiting: u32, age_ms: u64) -> (EndpointId, LoadView) {
    let (id, mut v) = ep(id, waiting, 0);
    v.last_scrape_age = Some(Duration::from_millis(age_ms));
    (id, v)
}

#[test]
fn other_replicas_moves_fill_and_free_room_until_the_next_scrape() {
    let f = PoolFlow::new(cfg(8, 8));
    let t0 = Instant::now();
    let at = |ms| t0 + Duration::from_millis(ms);
    let lag = Duration::from_millis(10);
    let e1 = EndpointId(1);
    // Room for exactly one (4 of 5 waiting), scraped at t0; `loads(s, n)`:
    // scraped at `s` ms, looked at at `n` ms.
    let loads = |s: u64, n: u64| [ep_scraped(1, 4, n - s)];
    // Another replica placed one there, read at 10 ms: no room here.
    assert!(!f.peer_moves([(e1, 1, 0)], at(10), lag));
    let Arrival::Queued { mut rx, .. } = f.arrive(&loads(0, 20), &th(), ask("b", 10), at(20))
    else {
        panic!("the other replica's placement took the room")
    };
    assert!(f.with_room(&loads(0, 20), &th(), at(20)).is_empty());
    // It ended, read at 30 ms (so surely after the scrape): room again,
    // the waiting pick goes.
    assert!(f.peer_moves([(e1, 0, 1)], at(30), lag));
    f.release(&loads(0, 40), &th(), at(40));
    let Ok(Wake::Go(pass)) = rx.try_recv() else {
        panic!("released")
    };
    f.placed(pass, Some(e1));
    // One more from the other replica, read at 45 ms: full again.
    f.peer_moves([(e1, 1, 0)], at(45), lag);
    assert!(f.with_room(&loads(0, 46), &th(), at(46)).is_empty());
    // A scrape at 50 ms shows the engine as it is: the moves before it
    // are forgotten (this replica's placement too).
    assert_eq!(f.with_room(&loads(50, 50), &th(), at(50)), vec![e1]);
    // Read at 55 ms: a placement that may be newer than that scrape
    // counts; an end that may be older (within the lag) is not credited.
    f.peer_moves([(e1, 1, 1)], at(55), lag);
    assert!(f.with_room(&loads(50, 56), &th(), at(56)).is_empty());
    // An end read at 65 ms is surely newer: credited.
    f.peer_moves([(e1, 0, 1)], at(65), lag);
    assert_eq!(f.with_room(&loads(50, 66), &th(), at(66)), vec![e1]);
    // Moves with nothing in them change nothing and free nothing.
    assert!(!f.peer_moves([(e1, 0, 0)], at(70), lag));
    assert_eq!(f.with_room(&loads(50, 70), &th(), at(70)), vec![e1]);
}

fn reserved(reserve: f64) -> FlowControlConfig {
    FlowControlConfig {
        reserve,
        ..cfg(64, 64)
    }
}

/// Lets `ask` through at `loads` and places it on endpoint 1.
fn go_and_place(f: &PoolFlow, loads: &[(EndpointId, LoadView)], ask: Ask) {
    let Arrival::Go(p) = f.arrive(loads, &th(), ask, Instant::now()) else {
        panic!("room: it goes")
    };
    f.placed(p, Some(EndpointId(1)));
}

#[test]
fn an_over_share_tenant_waits_while_one_under_its_share_goes() {
    let f = PoolFlow::new(reserved(0.5));
    let idle = [ep(1, 0, 0)];
    go_and_place(&f, &idle, ask("b", 100));
    go_and_place(&f, &idle, ask("a", 1000));
    assert!(f.over_share("a") && !f.over_share("b"));
    assert_eq!(f.held("a"), (1000, 1100));
    // 2 waiting and the 2 placed since the scrape: saturation 0.8, room
    // by the threshold (1.0) but not by a's bound (0.5).
    let busy = [ep(1, 2, 0)];
    let now = Instant::now();
    let Arrival::Queued { rx: mut a_rx, .. } = f.arrive(&busy, &th(), ask("a", 1001), now) else {
        panic!("a is over its share: it waits")
    };
    assert!(
        matches!(f.arrive(&busy, &th(), ask("b", 101), now), Arrival::Go(_)),
        "b, under its share, overtakes a's held pick"
    );
    f.release(&busy, &th(), now);
    assert!(a_rx.try_recv().is_err(), "still held");
    // Three done: 2 waiting of 5 after the placements, below a's bound.
    f.release(&[ep(1, 2, 3)], &th(), now);
    let Ok(Wake::Go(a2)) = a_rx.try_recv() else {
        panic!("released")
    };
    // Done reports take the work out of the shares (b's second pass was
    // dropped unplaced: out already).
    f.settle("b-100", 100);
    f.settle("a-1000", 1000);
    assert_eq!(f.held("a"), (1001, 1001), "a's released pick (in transit)");
    f.placed(a2, Some(EndpointId(1)));
    f.settle("a-1001", 0);
    assert_eq!(f.held("a"), (0, 0));
}

#[test]
fn a_tenant_alone_uses_the_whole_pool_whatever_the_reserve() {
    let through = |reserve: f64| {
        let f = PoolFlow::new(reserved(reserve));
        let idle = [ep(1, 0, 0)];
        let mut n = 0;
        while n < 100 {
            match f.arrive(&idle, &th(), ask("a", 1000 + n), Instant::now()) {
                Arrival::Go(p) => f.placed(p, Some(EndpointId(1))),
                _ => break,
            }
            n += 1;
        }
        n
    };
    let all = through(0.0);
    assert!(all > 5 && all < 100, "{all}");
    assert_eq!(through(0.5), all);
    assert_eq!(through(0.9), all);
}

#[test]
fn a_pass_dropped_unplaced_leaves_the_share() {
    let f = PoolFlow::new(reserved(0.5));
    let idle = [ep(1, 0, 0)];
    let Arrival::Go(p) = f.arrive(&idle, &th(), ask("a", 500), Instant::now()) else {
        panic!()
    };
    assert_eq!(f.held("a"), (500, 500));
    drop(p);
    assert_eq!(f.held("a"), (0, 0));
    let Arrival::Go(p) = f.arrive(&idle, &th(), ask("a", 500), Instant::now()) else {
        panic!()
    };
    f.placed(p, None);
    assert_eq!(f.held("a"), (0, 0), "nothing placed");
}

#[test]
fn queued_prefill_work_leaves_an_engine_without_room() {
    let f = PoolFlow::new(FlowControlConfig {
        saturated_prefill_tokens: 65_536,
        ..cfg(8, 8)
    });
    let mut long = ep(1, 0, 0);
    long.1.queued_prefill_tokens = 65_536;
    let short = ep(2, 0, 0);
    let now = Instant::now();
    assert_eq!(
        f.with_room(&[long.clone(), short], &th(), now),
        vec![EndpointId(2)]
    );
    // Nothing waits by request count, but the backlog is long: it waits.
    assert!(matches!(
        f.arrive(&[long], &th(), ask("a", 10), now),
        Arrival::Queued { .. }
    ));
}

#[test]
fn the_reserves_holds_and_passes_are_counted_per_tenant() {
    let f = PoolFlow::new(reserved(0.5));
    let idle = [ep(1, 0, 0)];
    go_and_place(&f, &idle, ask("b", 100));
    go_and_place(&f, &idle, ask("a", 1000));
    let busy = [ep(1, 2, 0)];
    let now = Instant::now();
    let Arrival::Queued { rx: mut a_rx, .. } = f.arrive(&busy, &th(), ask("a", 1001), now) else {
        panic!("held for the reserve")
    };
    let later = now + Duration::from_millis(40);
    f.release(&[ep(1, 2, 3)], &th(), later);
    assert!(matches!(a_rx.try_recv(), Ok(Wake::Go(_))));
    let counts = f.metrics.tenant_counts();
    assert_eq!(counts.len(), 1, "b was never over its share: {counts:?}");
    let (t, a) = &counts[0];
    assert_eq!(t, "a");
    assert_eq!((a.reserve_held, a.reserve_passed, a.released), (1, 1, 1));
    assert_eq!(a.wait_ns, 40_000_000);
}

/// Lets `ask` through at `loads`, places it on endpoint 1, and returns its
/// engine priority.
fn engine_priority_of(f: &PoolFlow, loads: &[(EndpointId, LoadView)], ask: Ask) -> Option<i32> {
    let Arrival::Go(p) = f.arrive(loads, &th(), ask, Instant::now()) else {
        panic!("room: it goes")
    };
    let priority = p.engine_priority(0);
    f.placed(p, Some(EndpointId(1)));
    priority
}

#[test]
fn engine_priority_is_set_only_when_on_and_puts_the_tenant_over_its_share_last() {
    let idle = [ep(1, 0, 0)];
    let off = PoolFlow::new(cfg(64, 64));
    assert_eq!(engine_priority_of(&off, &idle, ask("a", 1000)), None);
    assert_eq!(engine_priority_of(&off, &idle, ask("a", 1001)), None);

    let f = PoolFlow::new(FlowControlConfig {
        engine_priority: true,
        ..cfg(64, 64)
    });
    // Alone, and then with b active but holding nothing: never over.
    assert_eq!(engine_priority_of(&f, &idle, ask("b", 100)), Some(0));
    assert_eq!(engine_priority_of(&f, &idle, ask("a", 1000)), Some(0));
    // a holds 1000 of 1100 (its own new pick not counted): over its half.
    assert_eq!(engine_priority_of(&f, &idle, ask("a", 1001)), Some(1));
    assert_eq!(engine_priority_of(&f, &idle, ask("b", 101)), Some(0));
    // A less urgent band comes after band 0, over its share or not.
    let batch = Ask {
        priority: 1,
        ..ask("b", 102)
    };
    assert_eq!(engine_priority_of(&f, &idle, batch), Some(2));
    // The reports take a's work out: equal again.
    f.settle("a-1000", 0);
    f.settle("a-1001", 0);
    assert_eq!(engine_priority_of(&f, &idle, ask("a", 1002)), Some(0));
}

#[test]
fn a_released_pick_gets_its_engine_priority_when_it_leaves_the_queue() {
    let f = PoolFlow::new(FlowControlConfig {
        engine_priority: true,
        ..cfg(64, 64)
    });
    let idle = [ep(1, 0, 0)];
    assert_eq!(engine_priority_of(&f, &idle, ask("b", 100)), Some(0));
    assert_eq!(engine_priority_of(&f, &idle, ask("a", 100)), Some(0));
    let full = [ep(1, 5, 0)];
    let now = Instant::now();
    let mut rxs = Vec::new();
    for tokens in [5000, 5001] {
        let Arrival::Queued { rx, .. } = f.arrive(&full, &th(), ask("a", tokens), now) else {
            panic!("no room: it waits")
        };
        rxs.push(rx);
    }
    // Room for one: the first leaves while a's second still waits, so a
    // demands 100 + 5001 of 5201, over its half: it was not over when its
    // pick arrived (100 of 200), it is when the pick is bound.
    f.release(&[ep(1, 4, 2)], &th(), now);
    let Ok(Wake::Go(p)) = rxs[0].try_recv() else {
        panic!("released")
    };
    assert!(rxs[1].try_recv().is_err(), "one slot, one release");
    assert_eq!(p.engine_priority(0), Some(1));
}

#[test]
fn by_prefill_the_engine_priority_is_the_band_then_the_prefill_left_where_it_goes() {
    let f = PoolFlow::new(FlowControlConfig {
        engine_priority: true,
        engine_priority_by: kvasir_flowcontrol::EnginePriorityBy::Prefill,
        ..cfg(64, 64)
    });
    let idle = [ep(1, 0, 0)];
    let Arrival::Go(p) = f.arrive(&idle, &th(), ask("a", 1000), Instant::now()) else {
        panic!("room: it goes")
    };
    // Not its tenant's share (a is alone): the prefill on its engine.
    assert_eq!(p.engine_priority(0), Some(0));
    assert_eq!(p.engine_priority(1000), Some(3));
    let batch = Ask {
        priority: 1,
        ..ask("b", 1001)
    };
    let Arrival::Go(q) = f.arrive(&idle, &th(), batch, Instant::now()) else {
        panic!("room: it goes")
    };
    assert_eq!(q.engine_priority(0), Some(64), "after every band-0 prefill");
}

/// A cause's counter slot.
fn slot(c: ShedCause) -> usize {
    c.position().expect("a known cause")
}
