//! The budget script (`budgets/budget.lua`) against the arithmetic it
//! transcribes (`kvasir_budget::TenantBudget`), on a real `redis-server`
//! (started on a free loopback port, killed at the end): seeded random
//! sequences of reserve / settle / release / cancel / expire, with limits
//! that change, clocks that jump (and once in a while go back), figures up
//! to the bounds the script is exact to, run through both with the same
//! injected time. Every answer must be the same: admissions, refusals with
//! their retry times, what was held, settled, refunded and charged, the
//! `x-ratelimit-*` figures, the exact credit in 1/60000 token units, and
//! the open reservations.
//!
//! Fails, naming the package, where `redis-server` is not installed
//! (`make setup` installs it): never skipped.

use crate::responses_support;
use std::collections::BTreeMap;
use std::time::Duration;

use kvasir_budget::{
    CachedWeight, Cost, Dimension, Limits, Refusal, Released, Request, TenantBudget, Usage,
    WINDOW_MS,
};
use kvasir_cache_indexer::budgets::redis::script::{BudgetStore, DimensionStates, MAX_TOKENS};
use responses_support::Redis;

/// Sequences run, and operations in each.
const SEQUENCES: u64 = 40;
const OPS: usize = 150;

/// SplitMix64: a seeded, dependency-free generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// True with probability `pct` percent.
    fn chance(&mut self, pct: u64) -> bool {
        self.next() % 100 < pct
    }
}

/// Limits at one of three scales: small (refusals every few ops), large
/// (10^6..10^9 per minute, the exactness bound) and mixed.
fn limits(rng: &mut Rng) -> Limits {
    let scale = rng.range(0, 2);
    let mut per = |lo: u64, hi: u64| {
        if rng.chance(35) {
            None
        } else {
            Some(rng.range(lo, hi))
        }
    };
    let (requests, tokens) = match scale {
        0 => (
            per(1, 20),
            [per(50, 3_000), per(50, 3_000), per(100, 6_000)],
        ),
        1 => (
            per(1_000, 1_000_000_000),
            [
                per(1_000_000, 1_000_000_000),
                per(1_000_000, 1_000_000_000),
                per(1_000_000, 1_000_000_000),
            ],
        ),
        _ => (
            per(1, 1_000),
            [per(10, 100_000), per(10, 10_000), per(10, 1_000_000_000)],
        ),
    };
    let weight = match rng.range(0, 3) {
        0 => 0,
        1 => 1000,
        _ => rng.range(0, 1000) as u16,
    };
    Limits {
        requests_per_minute: requests,
        prompt_tokens_per_minute: tokens[0],
        completion_tokens_per_minute: tokens[1],
        total_tokens_per_minute: tokens[2],
        max_concurrent: if rng.chance(50) {
            None
        } else {
            Some(rng.range(0, 6) as u32)
        },
        cached_token_weight: CachedWeight::from_permille(weight),
    }
}

/// A token figure: mostly small, sometimes near the largest the script
/// takes (10^8 per field).
fn tokens(rng: &mut Rng, big: bool) -> u64 {
    match rng.range(0, 9) {
        0 => 0,
        9 if big => rng.range(10_000_000, 100_000_000),
        _ => rng.range(1, if big { 2_000_000 } else { 1_500 }),
    }
}

/// What the sequences exercised: each kind must occur, or the comparison
/// proves little.
#[derive(Debug, Default)]
struct Seen {
    admitted: u64,
    limited: u64,
    concurrency: u64,
    too_large: u64,
    overrun: u64,
    released: u64,
    release_unknown: u64,
    charged_unreserved: u64,
    released_without_usage: u64,
    cancelled: u64,
    expired: u64,
    debt: u64,
    stored_limits: u64,
}

/// One sequence's state on the Rust side.
struct Reference {
    budget: TenantBudget,
    /// Script request id -> TenantBudget id and the request.
    ids: BTreeMap<String, (u64, Request)>,
    /// Every id ever reserved (released ones stay, to be reported again).
    seen: Vec<String>,
    /// Limits of the last reserve: reports may leave them to the script.
    stored: Option<Limits>,
}

/// The script's view must equal the reference's at `now`.
fn assert_states(what: &str, got: &DimensionStates, b: &TenantBudget, now: u64) {
    for (i, d) in Dimension::ALL.into_iter().enumerate() {
        let want = b.limits().per_minute(d).map(|limit| {
            let bucket = b.bucket(now, d).expect("limited");
            (limit, bucket.remaining(), bucket.reset_ms(limit))
        });
        let got = got.0[i].map(|s| (s.limit, s.remaining, s.reset_ms));
        assert_eq!(got, want, "{what}: {d} state");
    }
}

/// The exact credit of every limited bucket, as Redis holds it.
async fn assert_credit(
    what: &str,
    conn: &mut redis::aio::MultiplexedConnection,
    hash: &str,
    b: &TenantBudget,
    now: u64,
) {
    for (i, d) in Dimension::ALL.into_iter().enumerate() {
        let Some(bucket) = b.bucket(now, d) else {
            continue;
        };
        let v: Option<String> = redis::cmd("HGET")
            .arg(hash)
            .arg(format!("c{}", i + 1))
            .query_async(conn)
            .await
            .expect("HGET");
        let v: i128 = v.expect("credit stored").parse().expect("an integer");
        assert_eq!(v, bucket.credit_units(), "{what}: {d} credit units");
    }
    let open: usize = redis::cmd("HLEN")
        .arg(format!("{hash}:open"))
        .query_async(conn)
        .await
        .expect("HLEN");
    assert_eq!(open, b.in_flight(), "{what}: open reservations");
}

/// Usage around what `req` reserved: below, equal, above (overrun), with
/// cached tokens sometimes above the prompt (clamped).
fn usage_for(rng: &mut Rng, req: &Request, big: bool) -> Usage {
    let around = |rng: &mut Rng, x: u64| match rng.range(0, 3) {
        0 => x,
        1 => x / 2,
        2 => x + tokens(rng, big) / 4,
        _ => tokens(rng, big),
    };
    // The script takes at most 10^8 per field (the caller's clamp).
    let prompt = around(rng, req.prompt_tokens).min(MAX_TOKENS);
    Usage {
        prompt_tokens: prompt,
        cached_tokens: if rng.chance(10) {
            prompt + 5
        } else {
            around(rng, req.cached_tokens).min(prompt)
        },
        completion_tokens: around(rng, req.output_tokens).min(MAX_TOKENS),
    }
}

async fn run_sequence(
    store: &BudgetStore,
    conn: &mut redis::aio::MultiplexedConnection,
    seed: u64,
    seen: &mut Seen,
) {
    let mut rng = Rng(seed);
    let key = format!("seq{seed}");
    let hash = store.state_key(&key);
    let mut lim = limits(&mut rng);
    let big = lim.total_tokens_per_minute.is_some_and(|t| t >= 1_000_000);
    let mut r = Reference {
        budget: TenantBudget::new(lim),
        ids: BTreeMap::new(),
        seen: Vec::new(),
        stored: None,
    };
    // Epoch milliseconds: the script must keep 13-digit times exact.
    let mut now: u64 = 1_760_000_000_000 + rng.range(0, 1_000_000);
    for step in 0..OPS {
        now = match rng.range(0, 19) {
            0 => now.saturating_sub(rng.range(1, 5_000)),
            1..=4 => now,
            5 => now + rng.range(60_000, 200_000),
            _ => now + rng.range(1, 8_000),
        };
        if rng.chance(3) {
            lim = limits(&mut rng);
            r.budget.set_limits(lim);
        }
        let what = format!("seed {seed} step {step} at {now}");
        // Reports leave the limits to the script when they are the stored
        // ones, as the indexer's reports do.
        let report_limits = if r.stored == Some(lim) && rng.chance(50) {
            None
        } else {
            Some(lim)
        };
        let pick = |rng: &mut Rng, r: &Reference| -> String {
            if r.seen.is_empty() || rng.chance(8) {
                format!("nobody-{}", rng.next() % 4)
            } else {
                r.seen[(rng.next() % r.seen.len() as u64) as usize].clone()
            }
        };
        match rng.range(0, 9) {
            0..=3 => {
                let id = format!("req-{step}");
                let req = Request {
                    prompt_tokens: tokens(&mut rng, big),
                    cached_tokens: tokens(&mut rng, big),
                    output_tokens: tokens(&mut rng, big),
                };
                let want = r.budget.reserve(now, &req);
                let got = store
                    .reserve(&key, &lim, &id, &req, None, Some(now))
                    .await
                    .expect("reserve");
                r.stored = Some(lim);
                assert!(!got.repeated, "{what}");
                match &want {
                    Ok(_) => seen.admitted += 1,
                    Err(Refusal::Limited { .. }) => seen.limited += 1,
                    Err(Refusal::Concurrency { .. }) => seen.concurrency += 1,
                    Err(Refusal::TooLarge { .. }) => seen.too_large += 1,
                }
                assert_eq!(got.outcome, want.map(|x| x.held), "{what}: reserve {req:?}");
                if let Ok(res) = want {
                    r.ids.insert(id.clone(), (res.id, req));
                    r.seen.push(id);
                }
                assert_states(&what, &got.states, &r.budget, now);
            }
            4 | 5 => {
                let id = pick(&mut rng, &r);
                let (rid, req) = r
                    .ids
                    .get(&id)
                    .copied()
                    .unwrap_or((u64::MAX, Request::default()));
                let u = usage_for(&mut rng, &req, big);
                let want = r.budget.settle(now, rid, &u);
                let got = store
                    .settle(&key, report_limits.as_ref(), &id, &u, Some(now))
                    .await
                    .expect("settle");
                assert_eq!(got.value, want, "{what}: settle {id} {u:?}");
                if want.is_some_and(|c| !c.is_zero()) {
                    seen.overrun += 1;
                }
                if report_limits.is_none() {
                    seen.stored_limits += 1;
                }
                assert_states(&what, &got.states, &r.budget, now);
            }
            6 | 7 => {
                let id = pick(&mut rng, &r);
                let (rid, req) = r
                    .ids
                    .get(&id)
                    .copied()
                    .unwrap_or((u64::MAX, Request::default()));
                // Without usage the script takes the prompt as reserved
                // and the completion as last settled.
                let given = rng.chance(75).then(|| usage_for(&mut rng, &req, big));
                let u = given.unwrap_or(Usage {
                    prompt_tokens: req.prompt_tokens,
                    cached_tokens: req.cached_tokens,
                    completion_tokens: 0,
                });
                // A local admission's end charges its usage when nothing
                // is open under its id.
                let charge = rng.chance(30);
                let want = r.budget.release(now, rid, &u).or_else(|| {
                    (charge && given.is_some()).then(|| Released {
                        refunded: Cost::default(),
                        charged: r.budget.charge(now, &u),
                    })
                });
                let got = store
                    .release(
                        &key,
                        report_limits.as_ref(),
                        &id,
                        given.as_ref(),
                        charge,
                        Some(now),
                    )
                    .await
                    .expect("release");
                assert_eq!(
                    got.value.map(|e| e.released),
                    want,
                    "{what}: release {id} {given:?} charge {charge}"
                );
                if let Some(e) = got.value.filter(|e| !e.reserved) {
                    assert!(!r.ids.contains_key(&id), "{what}");
                    assert_eq!(e.settled, e.released.charged, "{what}");
                    seen.charged_unreserved += 1;
                } else if let Some(e) = got.value {
                    assert!(r.ids.remove(&id).is_some(), "{what}");
                    assert_eq!(e.settled.get(Dimension::Requests), 1, "{what}");
                    seen.released += 1;
                    seen.released_without_usage += u64::from(given.is_none());
                } else {
                    seen.release_unknown += 1;
                }
                assert_states(&what, &got.states, &r.budget, now);
            }
            8 => {
                let id = pick(&mut rng, &r);
                let rid = r.ids.get(&id).map_or(u64::MAX, |x| x.0);
                let want = r.budget.cancel(now, rid);
                let got = store
                    .cancel(&key, report_limits.as_ref(), &id, Some(now))
                    .await
                    .expect("cancel");
                assert_eq!(got.value, want, "{what}: cancel {id}");
                seen.cancelled += u64::from(want.is_some());
                r.ids.remove(&id);
                assert_states(&what, &got.states, &r.budget, now);
            }
            _ => {
                let max_age = rng.range(0, 120_000);
                let want = r.budget.expire(now, max_age);
                let got = store
                    .expire(&key, max_age, Some(now))
                    .await
                    .expect("expire");
                assert_eq!(got, want, "{what}: expire {max_age}");
                seen.expired += want as u64;
                // Expired ids are gone on both sides.
                let open: Vec<String> = redis::cmd("HKEYS")
                    .arg(format!("{hash}:open"))
                    .query_async(conn)
                    .await
                    .expect("HKEYS");
                r.ids.retain(|id, _| open.contains(id));
                continue;
            }
        }
        assert_credit(&what, conn, &hash, &r.budget, now).await;
        let in_debt = Dimension::ALL
            .into_iter()
            .filter_map(|d| r.budget.bucket(now, d))
            .any(|b| b.credit_units() < 0);
        seen.debt += u64::from(in_debt);
    }
}

async fn connect(redis: &Redis) -> redis::aio::MultiplexedConnection {
    redis::Client::open(redis.url())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect")
}

fn store(redis: &Redis) -> BudgetStore {
    BudgetStore::new(
        &redis.url(),
        Duration::from_secs(5),
        Duration::from_millis(100),
        "diff:",
    )
    .expect("store")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_script_computes_what_kvasir_budget_computes() {
    let redis = Redis::start().await;
    let store = store(&redis);
    let mut conn = connect(&redis).await;
    let mut seen = Seen::default();
    for seed in 1..=SEQUENCES {
        run_sequence(&store, &mut conn, seed, &mut seen).await;
        if seed == SEQUENCES / 2 {
            // A flushed script cache (a restarted Redis): EVALSHA answers
            // NOSCRIPT and the next call loads it again.
            let _: () = redis::cmd("SCRIPT")
                .arg("FLUSH")
                .query_async(&mut conn)
                .await
                .expect("SCRIPT FLUSH");
        }
    }
    println!("{seen:?}");
    for (what, n) in [
        ("admissions", seen.admitted),
        ("per-minute refusals", seen.limited),
        ("concurrency refusals", seen.concurrency),
        ("too-large refusals", seen.too_large),
        ("settles beyond the hold", seen.overrun),
        ("releases", seen.released),
        ("releases of ids not open", seen.release_unknown),
        (
            "local ends charged with nothing open",
            seen.charged_unreserved,
        ),
        ("releases without usage", seen.released_without_usage),
        ("cancels", seen.cancelled),
        ("expired reservations", seen.expired),
        ("steps in debt", seen.debt),
        ("reports on stored limits", seen.stored_limits),
    ] {
        assert!(
            n >= 20,
            "only {n} {what}: the sequences no longer exercise them"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_time_repeated_picks_and_idle_expiry() {
    let redis = Redis::start().await;
    let store = store(&redis).with_idle(Duration::from_millis(2_000));
    let mut conn = connect(&redis).await;
    let lim = Limits {
        requests_per_minute: Some(2),
        ..Limits::default()
    };
    let req = Request {
        prompt_tokens: 10,
        cached_tokens: 0,
        output_tokens: 5,
    };
    // Redis's clock: 2 per minute admits two, then a retry ~30 s away.
    let a = store
        .reserve("t", &lim, "a", &req, None, None)
        .await
        .unwrap();
    assert_eq!(a.outcome.map(|c| c.0), Ok([1, 10, 5, 15]));
    // The same request picked again is admitted without another charge.
    let again = store
        .reserve("t", &lim, "a", &req, None, None)
        .await
        .unwrap();
    assert!(again.repeated);
    assert_eq!(again.states.get(Dimension::Requests).unwrap().remaining, 1);
    store
        .reserve("t", &lim, "b", &req, None, None)
        .await
        .unwrap()
        .outcome
        .unwrap();
    let c = store
        .reserve("t", &lim, "c", &req, None, None)
        .await
        .unwrap();
    match c.outcome {
        Err(Refusal::Limited {
            dimension: Dimension::Requests,
            retry_after_ms,
        }) => assert!(
            (25_000..=30_000).contains(&retry_after_ms),
            "{retry_after_ms}"
        ),
        other => panic!("{other:?}"),
    }
    // Keys expire `idle` after the budget is whole again: 60 s of refill
    // plus 2 s here (checked on the TTL, not by waiting).
    let ttl: i64 = redis::cmd("PTTL")
        .arg(store.state_key("t"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(
        (WINDOW_MS as i64..=WINDOW_MS as i64 + 2_000).contains(&ttl),
        "{ttl}"
    );
    // A report carries no limits: the stored ones apply.
    let done = store
        .release("t", None, "a", Some(&Usage::default()), false, None)
        .await
        .unwrap();
    assert_eq!(
        done.value.map(|e| e.released.refunded.0),
        Some([0, 10, 5, 15])
    );
    assert_eq!(
        done.states.get(Dimension::Requests).map(|s| s.limit),
        Some(2)
    );
    // An unknown op is the script's error, not a store failure.
    let e = redis::cmd("EVAL")
        .arg(kvasir_cache_indexer::budgets::redis::script::SCRIPT)
        .arg(2)
        .arg("x")
        .arg("x:open")
        .arg("nope")
        .query_async::<redis::Value>(&mut conn)
        .await;
    assert!(e.is_err(), "{e:?}");
    assert!(!store.resting());
}
