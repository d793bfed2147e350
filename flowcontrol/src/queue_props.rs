//! Property tests: the queue against a plain model of what it must do, and
//! the fair-share bound of backlogged tenants.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use proptest::prelude::*;

use crate::{FlowQueue, Limits, Refusal, Released, Ticket, Waiting};

const TENANTS: [&str; 4] = ["a", "b", "c", "d"];

#[derive(Debug, Clone)]
enum Op {
    Push {
        tenant: usize,
        priority: i32,
        weight: u32,
        tokens: u64,
        own_wait_ms: Option<u64>,
    },
    Pop {
        capacity: bool,
    },
    Advance {
        ms: u64,
    },
    Remove {
        nth: usize,
    },
    Settle {
        tenant: usize,
        priority: i32,
        charged: u64,
        actual: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..TENANTS.len(), -1..3i32, 1..5u32, 0..40_000u64, proptest::option::of(0..300u64))
            .prop_map(|(tenant, priority, weight, tokens, own_wait_ms)| Op::Push {
                tenant, priority, weight, tokens, own_wait_ms
            }),
        3 => any::<bool>().prop_map(|capacity| Op::Pop { capacity }),
        1 => (0..150u64).prop_map(|ms| Op::Advance { ms }),
        1 => (0..64usize).prop_map(|nth| Op::Remove { nth }),
        1 => (0..TENANTS.len(), -1..3i32, 0..40_000u64, 0..40_000u64)
            .prop_map(|(tenant, priority, charged, actual)| Op::Settle {
                tenant, priority, charged, actual
            }),
    ]
}

/// What the model keeps of a waiting request.
#[derive(Debug, Clone)]
struct Model {
    tenant: String,
    priority: i32,
    deadline: Instant,
}

/// Everything observable a run produced, to compare two runs.
type Trace = Vec<(char, u64)>;

/// Runs `ops` on a queue, checking each step against the model; returns
/// the trace of tickets out.
fn run(ops: &[Op], limits: Limits) -> Result<Trace, TestCaseError> {
    let t0 = Instant::now();
    let mut now = t0;
    let mut q: FlowQueue<u64> = FlowQueue::new(limits);
    let mut model: BTreeMap<u64, Model> = BTreeMap::new();
    let mut trace = Trace::new();
    for op in ops {
        match *op {
            Op::Push {
                tenant,
                priority,
                weight,
                tokens,
                own_wait_ms,
            } => {
                let tenant = TENANTS[tenant].to_string();
                let own = own_wait_ms.map(|ms| now + Duration::from_millis(ms));
                let held = model.values().filter(|m| m.tenant == tenant).count();
                let expected = if model.len() >= limits.max_queued {
                    Some(Refusal::PoolFull {
                        max: limits.max_queued,
                    })
                } else if held >= limits.max_queued_per_tenant {
                    Some(Refusal::TenantFull {
                        max: limits.max_queued_per_tenant,
                    })
                } else if own.is_some_and(|d| d <= now) {
                    Some(Refusal::NoTime)
                } else {
                    None
                };
                let w = Waiting {
                    tenant: tenant.clone(),
                    priority,
                    weight,
                    tokens,
                    deadline: own,
                    item: 0,
                };
                match q.push(w, now) {
                    Ok(Ticket(t)) => {
                        prop_assert_eq!(expected, None);
                        let deadline =
                            (now + limits.max_wait).min(own.unwrap_or(now + limits.max_wait));
                        model.insert(
                            t,
                            Model {
                                tenant,
                                priority,
                                deadline,
                            },
                        );
                        trace.push(('+', t));
                    }
                    Err(e) => prop_assert_eq!(Some(e.reason), expected),
                }
            }
            Op::Pop { capacity } => {
                // Release only what has not expired, as the caller does.
                check_expired(&mut q, &mut model, now, &mut trace)?;
                let before = model.clone();
                match q.pop_next(capacity) {
                    None => prop_assert!(!capacity || before.is_empty()),
                    Some(r) => {
                        prop_assert!(capacity);
                        check_release(&r, &before)?;
                        model.remove(&r.ticket.0);
                        trace.push(('>', r.ticket.0));
                    }
                }
            }
            Op::Advance { ms } => {
                now += Duration::from_millis(ms);
                check_expired(&mut q, &mut model, now, &mut trace)?;
            }
            Op::Remove { nth } => {
                let t = model.keys().nth(nth).copied().unwrap_or(u64::MAX);
                let r = q.remove(Ticket(t));
                prop_assert_eq!(r.is_some(), model.remove(&t).is_some());
            }
            Op::Settle {
                tenant,
                priority,
                charged,
                actual,
            } => q.settle(TENANTS[tenant], priority, 1, charged, actual),
        }
        prop_assert_eq!(q.len(), model.len());
        prop_assert!(q.len() <= limits.max_queued);
        for t in TENANTS {
            let n = model.values().filter(|m| m.tenant == t).count();
            prop_assert_eq!(q.tenant_len(t), n);
            prop_assert!(n <= limits.max_queued_per_tenant);
        }
        prop_assert_eq!(q.next_deadline(), model.values().map(|m| m.deadline).min());
    }
    // Draining releases everything, and the bands keep no tenant state.
    while let Some(r) = q.pop_next(true) {
        trace.push(('>', r.ticket.0));
    }
    prop_assert_eq!(q.tenant_states(), 0);
    Ok(trace)
}

/// A release is from the most urgent band waiting, and its tenant's oldest
/// request in that band.
fn check_release(r: &Released<u64>, before: &BTreeMap<u64, Model>) -> Result<(), TestCaseError> {
    let top = before.values().map(|m| m.priority).min();
    prop_assert_eq!(Some(r.waiting.priority), top);
    let oldest = before
        .iter()
        .find(|(_, m)| m.tenant == r.waiting.tenant && m.priority == r.waiting.priority)
        .map(|(t, _)| *t);
    prop_assert_eq!(Some(r.ticket.0), oldest);
    Ok(())
}

/// `expire(now)` returns exactly the requests due, earliest first.
fn check_expired(
    q: &mut FlowQueue<u64>,
    model: &mut BTreeMap<u64, Model>,
    now: Instant,
    trace: &mut Trace,
) -> Result<(), TestCaseError> {
    let mut due: Vec<(Instant, u64)> = model
        .iter()
        .filter(|(_, m)| m.deadline <= now)
        .map(|(t, m)| (m.deadline, *t))
        .collect();
    due.sort();
    let got: Vec<(Instant, u64)> = q
        .expire(now)
        .into_iter()
        .map(|r| (r.deadline.unwrap_or(now), r.ticket.0))
        .collect();
    prop_assert_eq!(&got, &due);
    for (_, t) in got {
        model.remove(&t);
        trace.push(('x', t));
    }
    Ok(())
}

/// Two or more tenants backlogged from the start: at every release, the
/// tokens per weight any tenant got exceed another's by at most its own
/// largest request (per weight), whatever the sizes. With `quickest`, each
/// tenant's requests are released quickest first by a cost unrelated to
/// their size (the ticket's hash), and the bound is the same.
fn check_fair_share(
    tenants: &[(u32, Vec<u64>)],
    pops: usize,
    quickest: bool,
) -> Result<(), TestCaseError> {
    let now = Instant::now();
    let limits = Limits {
        max_queued: usize::MAX,
        max_queued_per_tenant: usize::MAX,
        max_wait: Duration::from_secs(3600),
    };
    let mut q: FlowQueue<usize> = FlowQueue::new(limits);
    let mut left = vec![0usize; tenants.len()];
    // Interleaved pushes, as concurrent arrivals would be.
    let longest = tenants.iter().map(|(_, s)| s.len()).max().unwrap_or(0);
    for k in 0..longest {
        for (i, (weight, sizes)) in tenants.iter().enumerate() {
            if let Some(&tokens) = sizes.get(k) {
                let w = Waiting {
                    tenant: TENANTS[i].into(),
                    priority: 0,
                    weight: *weight,
                    tokens,
                    deadline: None,
                    item: i,
                };
                q.push(w, now)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                left[i] += 1;
            }
        }
    }
    let mut got = vec![0u128; tenants.len()];
    for _ in 0..pops {
        let popped = if quickest {
            let cost = |w: &Waiting<usize>| w.tokens.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
            q.pop_quickest_where(|_| true, now, Duration::from_secs(3600), cost)
        } else {
            q.pop_next(true)
        };
        let Some(r) = popped else { break };
        let i = r.waiting.item;
        got[i] += u128::from(r.waiting.tokens);
        left[i] -= 1;
        if left.contains(&0) {
            // A tenant ran out: the bound is for backlogged tenants only.
            break;
        }
        for (i, (wi, si)) in tenants.iter().enumerate() {
            for (j, (wj, _)) in tenants.iter().enumerate() {
                let (wi, wj) = (u128::from(*wi), u128::from(*wj));
                let li = u128::from(si.iter().copied().max().unwrap_or(0));
                // got_i / w_i - got_j / w_j <= l_i / w_i, plus one token per
                // weight for fixed-point rounding.
                prop_assert!(
                    got[i] * wj <= (got[j] + 1) * wi + li * wj,
                    "tenant {} got {} (w {}), tenant {} got {} (w {})",
                    i,
                    got[i],
                    wi,
                    j,
                    got[j],
                    wj
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn queue_matches_its_model(
        ops in proptest::collection::vec(op(), 1..200),
        max_queued in 1..40usize,
        per_tenant in 1..20usize,
        wait_ms in 1..400u64,
    ) {
        let limits = Limits {
            max_queued,
            max_queued_per_tenant: per_tenant,
            max_wait: Duration::from_millis(wait_ms),
        };
        let first = run(&ops, limits)?;
        // Same input, same order: nothing depends on hashing or clocks.
        let second = run(&ops, limits)?;
        prop_assert_eq!(first, second);
    }

    #[test]
    fn backlogged_tenants_share_tokens_by_weight(
        tenants in proptest::collection::vec(
            (1..6u32, proptest::collection::vec(1..30_000u64, 20..80)),
            2..5,
        ),
        pops in 1..300usize,
    ) {
        check_fair_share(&tenants, pops, false)?;
        check_fair_share(&tenants, pops, true)?;
    }

    #[test]
    fn equal_weights_share_tokens_whatever_the_sizes(
        small in proptest::collection::vec(1..2_000u64, 200..400),
        large in proptest::collection::vec(10_000..40_000u64, 20..40),
    ) {
        check_fair_share(&[(1, small.clone()), (1, large.clone())], 10_000, false)?;
        check_fair_share(&[(1, small), (1, large)], 10_000, true)?;
    }
}
