//! Tests of the quickest-first release ([`crate::FlowQueue::pop_quickest_where`]):
//! the fair order between tenants and bands unchanged, the cheapest of the
//! tenant's requests first, the aging bound, and release whenever the fair
//! order would release.

use std::time::{Duration, Instant};

use proptest::prelude::*;

use crate::{FlowQueue, Limits, Waiting};

fn big() -> Limits {
    Limits {
        max_queued: 100_000,
        max_queued_per_tenant: 100_000,
        max_wait: Duration::from_secs(600),
    }
}

/// A request of `tenant` whose cost (the caller's predicted prefill) is
/// `cost`, carried as its item.
fn req(tenant: &str, priority: i32, tokens: u64, cost: u64) -> Waiting<u64> {
    Waiting {
        tenant: tenant.into(),
        priority,
        weight: 1,
        tokens,
        deadline: None,
        item: cost,
    }
}

fn by_item(w: &Waiting<u64>) -> u64 {
    w.item
}

const NEVER: Duration = Duration::from_secs(3600);

#[test]
fn the_cheapest_of_a_tenants_requests_goes_first() {
    let now = Instant::now();
    let mut q = FlowQueue::new(big());
    for cost in [5_000, 100, 3_000, 50, 100] {
        q.push(req("a", 0, 1_000, cost), now).unwrap();
    }
    let out: Vec<(u64, u64)> =
        std::iter::from_fn(|| q.pop_quickest_where(|_| true, now, NEVER, by_item))
            .map(|r| (r.waiting.item, r.ticket.0))
            .collect();
    // Ties go by arrival: the first 100 (ticket 1) before the second (4).
    assert_eq!(
        out,
        vec![(50, 3), (100, 1), (100, 4), (3_000, 2), (5_000, 0)]
    );
}

#[test]
fn the_tenants_turn_and_the_bands_are_the_fair_orders() {
    let now = Instant::now();
    let mut q = FlowQueue::new(big());
    // "a" arrived first with a long request, "b" has cheap ones: the fair
    // order alternates them (equal sizes), whatever the costs.
    for cost in [9_000, 8_000, 7_000] {
        q.push(req("a", 0, 1_000, cost), now).unwrap();
    }
    for cost in [1, 2, 3] {
        q.push(req("b", 0, 1_000, cost), now).unwrap();
    }
    q.push(req("urgent", -1, 1_000, 99_999), now).unwrap();
    let out: Vec<(String, u64)> =
        std::iter::from_fn(|| q.pop_quickest_where(|_| true, now, NEVER, by_item))
            .map(|r| (r.waiting.tenant, r.waiting.item))
            .collect();
    let expected: Vec<(String, u64)> = [
        ("urgent", 99_999),
        ("a", 7_000),
        ("b", 1),
        ("a", 8_000),
        ("b", 2),
        ("a", 9_000),
        ("b", 3),
    ]
    .iter()
    .map(|(t, c)| (t.to_string(), *c))
    .collect();
    assert_eq!(out, expected);
}

#[test]
fn a_tenant_is_charged_the_tokens_of_the_request_released() {
    let now = Instant::now();
    let mut q = FlowQueue::new(big());
    // "a": a 30k-token request and a 1k one, the 1k one cheaper; "b":
    // 1k-token requests. Releasing a's 1k request charges it 1k, so b
    // gets one turn, not thirty, before a's next.
    q.push(req("a", 0, 30_000, 900), now).unwrap();
    q.push(req("a", 0, 1_000, 10), now).unwrap();
    for _ in 0..3 {
        q.push(req("b", 0, 1_000, 10), now).unwrap();
    }
    let tenants: Vec<(String, u64)> =
        std::iter::from_fn(|| q.pop_quickest_where(|_| true, now, NEVER, by_item))
            .map(|r| (r.waiting.tenant, r.waiting.tokens))
            .collect();
    assert_eq!(
        tenants,
        vec![
            ("a".to_string(), 1_000),
            ("b".to_string(), 1_000),
            ("a".to_string(), 30_000),
            ("b".to_string(), 1_000),
            ("b".to_string(), 1_000),
        ]
    );
}

#[test]
fn a_request_passed_over_for_the_aging_bound_goes_first() {
    let t0 = Instant::now();
    let skip = Duration::from_millis(500);
    let mut q = FlowQueue::new(big());
    q.push(req("a", 0, 1_000, 50_000), t0).unwrap();
    // Cheaper ones keep arriving: each goes before the long one while it
    // has waited less than the bound.
    for k in 0..5u64 {
        let now = t0 + Duration::from_millis(100 * k);
        q.push(req("a", 0, 1_000, 10 + k), now).unwrap();
        let r = q.pop_quickest_where(|_| true, now, skip, by_item).unwrap();
        assert_eq!(r.waiting.item, 10 + k, "at {k}");
    }
    // At the bound it goes, before a cheaper one waiting.
    let now = t0 + skip;
    q.push(req("a", 0, 1_000, 1), now).unwrap();
    let r = q.pop_quickest_where(|_| true, now, skip, by_item).unwrap();
    assert_eq!(r.waiting.item, 50_000);
    let r = q.pop_quickest_where(|_| true, now, skip, by_item).unwrap();
    assert_eq!(r.waiting.item, 1);
    assert!(q.is_empty());
    // A bound of zero is the fair order.
    for cost in [3, 2, 1] {
        q.push(req("a", 0, 1_000, cost), now).unwrap();
    }
    let out: Vec<u64> =
        std::iter::from_fn(|| q.pop_quickest_where(|_| true, now, Duration::ZERO, by_item))
            .map(|r| r.waiting.item)
            .collect();
    assert_eq!(out, vec![3, 2, 1]);
}

#[test]
fn held_tenants_are_passed_over_as_in_the_fair_order() {
    let now = Instant::now();
    let mut q = FlowQueue::new(big());
    q.push(req("flood", 0, 1_000, 1), now).unwrap();
    q.push(req("light", 0, 1_000, 500), now).unwrap();
    q.push(req("light", 0, 1_000, 5), now).unwrap();
    let r = q
        .pop_quickest_where(|t| t != "flood", now, NEVER, by_item)
        .unwrap();
    assert_eq!((r.waiting.tenant.as_str(), r.waiting.item), ("light", 5));
    assert!(q
        .pop_quickest_where(|t| t == "nobody", now, NEVER, by_item)
        .is_none());
    assert_eq!(q.len(), 2);
}

/// What a run of pushes and pops released: (tenant, ticket).
type Out = Vec<(String, u64)>;

/// Pushes requests of three tenants, each of one size per tenant (so the
/// fair order's tags do not depend on which of its requests goes), with
/// costs unrelated to anything, interleaved with pops; returns what
/// `quickest` and the fair order released.
fn run(
    pushes: &[(usize, i32, u64)],
    sizes: [u64; 3],
    pops_every: usize,
    skip_ms: u64,
    quickest: bool,
) -> Result<Out, TestCaseError> {
    let tenants = ["a", "b", "c"];
    let t0 = Instant::now();
    let skip = Duration::from_millis(skip_ms);
    let mut q = FlowQueue::new(big());
    let mut out = Out::new();
    let pop = |q: &mut FlowQueue<u64>, now: Instant, out: &mut Out| -> Result<(), TestCaseError> {
        let had = !q.is_empty();
        let r = if quickest {
            q.pop_quickest_where(|_| true, now, skip, by_item)
        } else {
            q.pop_next_where(|_| true)
        };
        // Released whenever something waits: never held for a quicker one.
        prop_assert_eq!(r.is_some(), had);
        if let Some(r) = r {
            out.push((r.waiting.tenant, r.ticket.0));
        }
        Ok(())
    };
    for (k, &(tenant, priority, cost)) in pushes.iter().enumerate() {
        let now = t0 + Duration::from_millis(k as u64 * 10);
        q.push(req(tenants[tenant], priority, sizes[tenant], cost), now)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        if k % pops_every == 0 {
            pop(&mut q, now, &mut out)?;
        }
    }
    let end = t0 + Duration::from_millis(pushes.len() as u64 * 10);
    while !q.is_empty() {
        pop(&mut q, end, &mut out)?;
    }
    Ok(out)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Quickest first releases the same tenants in the same order as the
    /// fair order (bands and shares unchanged), as many times, and within a
    /// tenant its cheapest request unless its oldest is past the bound.
    #[test]
    fn fairness_between_tenants_is_unchanged(
        pushes in proptest::collection::vec((0..3usize, 0..2i32, 0..10_000u64), 1..120),
        sizes in proptest::array::uniform3(1..20_000u64),
        pops_every in 1..4usize,
        skip_ms in 0..400u64,
    ) {
        let fair = run(&pushes, sizes, pops_every, skip_ms, false)?;
        let quick = run(&pushes, sizes, pops_every, skip_ms, true)?;
        prop_assert_eq!(fair.len(), pushes.len());
        let tenants = |o: &Out| o.iter().map(|(t, _)| t.clone()).collect::<Vec<_>>();
        prop_assert_eq!(tenants(&fair), tenants(&quick));
    }

    /// Within one tenant and band, each release is the cheapest waiting
    /// (ties by arrival) or the oldest once it has waited the bound.
    #[test]
    fn quickest_within_the_aging_bound(
        costs in proptest::collection::vec(0..1_000u64, 1..60),
        arrive_ms in proptest::collection::vec(0..50u64, 1..60),
        skip_ms in 0..300u64,
    ) {
        let t0 = Instant::now();
        let skip = Duration::from_millis(skip_ms);
        let mut q = FlowQueue::new(big());
        let mut waiting: Vec<(u64, u64, Instant)> = Vec::new(); // (ticket, cost, at)
        let mut now = t0;
        for (k, &cost) in costs.iter().enumerate() {
            now += Duration::from_millis(arrive_ms[k % arrive_ms.len()]);
            let t = q.push(req("a", 0, 100, cost), now).unwrap();
            waiting.push((t.0, cost, now));
            if k % 2 == 1 {
                let r = q.pop_quickest_where(|_| true, now, skip, by_item).unwrap();
                let oldest = waiting[0];
                let expected = if now.duration_since(oldest.2) >= skip {
                    oldest.0
                } else {
                    waiting.iter().min_by_key(|(t, c, _)| (*c, *t)).unwrap().0
                };
                prop_assert_eq!(r.ticket.0, expected);
                waiting.retain(|(t, _, _)| *t != expected);
            }
        }
    }
}
