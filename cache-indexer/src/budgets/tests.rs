//! The memory store through [`Budgets`]: reserve, settle, release, cancel,
//! repeated picks, expiry and the bounds.

use kvasir_budget::{Dimension, Limits, Refusal, Usage};

use super::*;

fn ask(key: &str, rid: &str, limits: Limits, prompt: u64, max_tokens: Option<u64>) -> Ask {
    Ask {
        key: key.into(),
        request_id: rid.into(),
        limits,
        default_output_tokens: 100,
        max_tokens,
        prompt_tokens: prompt,
        cached_tokens: 0,
        max_age_ms: 60_000,
    }
}

fn tpm(n: u64) -> Limits {
    Limits {
        total_tokens_per_minute: Some(n),
        ..Limits::default()
    }
}

fn usage(prompt: u64, completion: u64) -> Usage {
    Usage {
        prompt_tokens: prompt,
        cached_tokens: 0,
        completion_tokens: completion,
    }
}

fn now<F: std::future::Future>(f: F) -> F::Output {
    f.now_or_never().expect("the memory store never waits")
}

fn admitted(r: &Reserved) -> bool {
    matches!(r, Reserved::Admitted { .. })
}

#[test]
fn reserve_refuses_what_does_not_fit_and_release_gives_back() {
    let b = Budgets::memory();
    assert!(admitted(&now(b.reserve(&ask(
        "a",
        "r1",
        tpm(1000),
        100,
        Some(700)
    )))));
    let r = now(b.reserve(&ask("a", "r2", tpm(1000), 100, Some(700))));
    let Reserved::Limited { refusal, headers } = r else {
        panic!("{r:?}")
    };
    assert!(matches!(
        refusal,
        Refusal::Limited {
            dimension: Dimension::TotalTokens,
            ..
        }
    ));
    assert_eq!(headers.tokens.map(|t| t.remaining), Some(200));
    // Another key is not affected.
    assert!(admitted(&now(b.reserve(&ask(
        "b",
        "r3",
        tpm(1000),
        100,
        Some(700)
    )))));
    // r1 used 10 of its 700: the rest goes back and r2 fits.
    let done = now(b.release(Some("a"), "r1", Some(usage(100, 10)), true));
    assert_eq!(done.refunded.get(Dimension::TotalTokens), 690);
    assert_eq!(
        done.settled.map(|c| c.get(Dimension::TotalTokens)),
        Some(110)
    );
    assert!(admitted(&now(b.reserve(&ask(
        "a",
        "r2",
        tpm(1000),
        100,
        Some(700)
    )))));
    let c = b.metrics().tenant("a");
    assert_eq!((c.admitted, c.limited, c.tokens_reserved), (2, 1, 1600));
    assert_eq!((c.tokens_settled, c.tokens_refunded), (110, 690));
    assert_eq!(b.open_reservations(), 2);
}

#[test]
fn a_repeated_pick_takes_nothing_more() {
    let b = Budgets::memory();
    let lim = Limits {
        requests_per_minute: Some(1),
        ..Limits::default()
    };
    assert!(admitted(&now(b.reserve(&ask("a", "r1", lim, 10, None)))));
    let again = now(b.reserve(&ask("a", "r1", lim, 10, None)));
    assert!(
        matches!(again, Reserved::Admitted { repeated: true, .. }),
        "{again:?}"
    );
    assert_eq!(b.open_reservations(), 1);
    assert_eq!(b.metrics().tenant("a").admitted, 1);
}

#[test]
fn settle_takes_the_overrun_and_release_without_usage_keeps_the_prompt() {
    let b = Budgets::memory();
    assert!(admitted(&now(b.reserve(&ask(
        "a",
        "r1",
        tpm(10_000),
        100,
        Some(50)
    )))));
    let s = now(b.settle(Some("a"), "r1", usage(100, 80)));
    assert_eq!(s.charged.get(Dimension::TotalTokens), 30);
    // A lower, stale figure changes nothing.
    let s = now(b.settle(None, "r1", usage(100, 60)));
    assert!(s.charged.is_zero() && s.key.as_deref() == Some("a"));
    // The end carries no usage: the prompt as reserved, the completion as
    // last settled.
    let done = now(b.release(Some("a"), "r1", None, true));
    assert_eq!(
        done.settled.map(|c| c.get(Dimension::TotalTokens)),
        Some(180)
    );
    assert!(done.refunded.is_zero() && done.charged.is_zero());
    assert_eq!(b.metrics().tenant("a").tokens_overrun, 30);
}

#[test]
fn cancel_gives_back_the_request_too() {
    let b = Budgets::memory();
    let lim = Limits {
        requests_per_minute: Some(1),
        ..Limits::default()
    };
    assert!(admitted(&now(b.reserve(&ask("a", "r1", lim, 10, None)))));
    assert!(!admitted(&now(b.reserve(&ask("a", "r2", lim, 10, None)))));
    let c = now(b.cancel(Some("a"), "r1"));
    assert_eq!(c.refunded.get(Dimension::Requests), 1);
    assert!(admitted(&now(b.reserve(&ask("a", "r2", lim, 10, None)))));
}

#[test]
fn unknown_reports_are_harmless_and_counted_only_with_a_key() {
    let b = Budgets::memory();
    let r = now(b.release(Some("a"), "nobody", Some(usage(1, 1)), true));
    assert_eq!(r, Reported::default());
    now(b.settle(None, "nobody", usage(1, 1)));
    assert_eq!(b.metrics().reports_unmatched[1].get(), 1);
    assert_eq!(b.metrics().reports_unmatched[0].get(), 0);
}

#[test]
fn the_output_estimate_learns_from_successes() {
    let b = Budgets::memory();
    let m = &b;
    let reserve = |rid: &str| now(m.reserve(&ask("a", rid, tpm(1_000_000), 0, None)));
    let Reserved::Admitted { held, .. } = reserve("r0") else {
        panic!()
    };
    assert_eq!(held.get(Dimension::CompletionTokens), 100, "the default");
    now(b.release(None, "r0", Some(usage(0, 10)), true));
    for i in 1..100 {
        let rid = format!("r{i}");
        reserve(&rid);
        now(b.release(None, &rid, Some(usage(0, 10)), true));
    }
    let Reserved::Admitted { held, .. } = reserve("last") else {
        panic!()
    };
    assert!(held.get(Dimension::CompletionTokens) < 20, "{held:?}");
}

#[test]
fn lost_reservations_expire_with_their_charge() {
    let s = memory::MemoryStore::new(10, 10);
    let m = BudgetMetrics::default();
    let mut a = ask("a", "r1", tpm(1000), 500, Some(0));
    a.max_age_ms = 1_000;
    assert!(admitted(&s.reserve(0, &a, &m)));
    assert_eq!(s.open(), 1);
    a.request_id = "r2".into();
    a.prompt_tokens = 1;
    assert!(admitted(&s.reserve(2_000, &a, &m)));
    assert_eq!(s.open(), 1, "r1 expired");
    assert_eq!(m.expired.get(), 1);
    // Its end, late, changes nothing.
    let rep = Report {
        key: Some("a".into()),
        request_id: "r1".into(),
        op: ReportOp::Release {
            usage: Some(usage(0, 0)),
            train: true,
            local: false,
        },
    };
    assert_eq!(s.report_swept(2_000, &rep, &m).key, None);
}

#[test]
fn a_report_sweeps_lost_reservations_too() {
    let s = memory::MemoryStore::new(10, 10);
    let m = BudgetMetrics::default();
    let mut a = ask("a", "r1", tpm(1000), 5, Some(5));
    a.max_age_ms = 1_000;
    assert!(admitted(&s.reserve(0, &a, &m)));
    let rep = Report {
        key: None,
        request_id: "other".into(),
        op: ReportOp::Cancel,
    };
    assert_eq!(s.report_swept(1_500, &rep, &m).key, None);
    assert_eq!((s.open(), m.expired.get()), (0, 1));
}

#[test]
fn bounds_evict_the_oldest_and_leave_new_keys_untracked() {
    let s = memory::MemoryStore::new(2, 2);
    let m = BudgetMetrics::default();
    let lim = tpm(1000);
    assert!(admitted(&s.reserve(
        0,
        &ask("a", "r1", lim, 1, Some(1)),
        &m
    )));
    assert!(admitted(&s.reserve(
        1,
        &ask("a", "r2", lim, 1, Some(1)),
        &m
    )));
    assert!(admitted(&s.reserve(
        2,
        &ask("b", "r3", lim, 1, Some(1)),
        &m
    )));
    assert_eq!((s.open(), m.evicted.get()), (2, 1));
    // Two keys with work in flight: a third is not tracked.
    assert_eq!(
        s.reserve(3, &ask("c", "r4", lim, 1, Some(1)), &m),
        Reserved::Untracked
    );
}

#[test]
fn limited_by_words() {
    assert_eq!(limited_by(&Refusal::Concurrency { limit: 1 }), "concurrent");
    let r = Refusal::Limited {
        dimension: Dimension::PromptTokens,
        retry_after_ms: 1,
    };
    assert_eq!(limited_by(&r), "prompt_tokens");
}

#[test]
fn a_local_admissions_end_is_charged_when_nothing_was_reserved() {
    let b = Budgets::memory();
    // The key's limits are known from an earlier pick.
    assert!(admitted(&now(b.reserve(&ask(
        "a",
        "r1",
        tpm(1000),
        10,
        Some(10)
    )))));
    now(b.release(Some("a"), "r1", Some(usage(10, 10)), false));
    let local = |rid: &str, local: bool| Report {
        key: Some("a".into()),
        request_id: rid.into(),
        op: ReportOp::Release {
            usage: Some(usage(600, 300)),
            train: false,
            local,
        },
    };
    // A plain end of an unknown request charges nothing.
    assert_eq!(now(b.report(&local("r2", false))).key, None);
    // The filter's own admission is paid for: 900 of the 1000 tokens.
    let r = now(b.report(&local("r3", true)));
    assert!(r.unreserved);
    assert_eq!(r.charged.get(Dimension::TotalTokens), 900);
    assert_eq!(b.open_reservations(), 0);
    let r = now(b.reserve(&ask("a", "r4", tpm(1000), 100, Some(100))));
    assert!(matches!(r, Reserved::Limited { .. }), "{r:?}");
    // A key never seen has no limits to charge against.
    let unknown = Report {
        key: Some("z".into()),
        ..local("r5", true)
    };
    assert_eq!(now(b.report(&unknown)).key, None);
}
