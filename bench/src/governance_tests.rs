use super::*;
use crate::governance_report::{check, Figures};
use crate::run::EngineUse;
use crate::stats;
use vllm_latency::LatencyProfile;

fn rec(tenant: &str, sent: f64, ttft: f64, status: u16) -> Record {
    let mut r = Record::unanswered(0, tenant.into(), None, 0, sent);
    r.status = status;
    if status == 200 {
        r.outcome = Outcome::Ok;
        r.ttft_ms = ttft;
        r.prompt_tokens = 1000;
        r.completion_tokens = 500;
        r.endpoint = "e:1".into();
    } else {
        r.outcome = Outcome::HttpError;
    }
    r
}

fn noisy_spec() -> NoisySpec {
    NoisySpec {
        burst_tenant: "t00".into(),
        factor: 3.0,
        from_s: 10.0,
        to_s: 20.0,
        pairs: vec![NoisyPair {
            label: "on".into(),
            burst: "b".into(),
            baseline: "a".into(),
        }],
        subject: "on".into(),
    }
}

#[test]
fn noisy_rows_compare_each_tenant_inside_the_window_only() {
    let spec = noisy_spec();
    // Outside the window: ignored, however slow.
    let base = vec![
        rec("t01", 5.0, 9_000.0, 200),
        rec("t01", 11.0, 100.0, 200),
        rec("t01", 12.0, 200.0, 200),
        rec("t00", 12.0, 100.0, 200),
    ];
    let burst = vec![
        rec("t01", 5.0, 1.0, 200),
        rec("t01", 11.0, 100.0, 200),
        rec("t01", 12.0, 300.0, 200),
        rec("t00", 12.0, 100.0, 200),
        rec("t00", 13.0, 0.0, 429),
        rec("t00", 25.0, 0.0, 429),
    ];
    let rows = noisy_rows(&spec, "on", &base, &burst);
    let t01 = rows.iter().find(|r| r.tenant == "t01").unwrap();
    assert_eq!(t01.sent, (2, 2));
    assert_eq!(t01.base.p99, stats::quantile(&[100.0, 200.0], 0.99));
    assert_eq!(t01.burst.p50, 200.0);
    assert_eq!(t01.refused, 0);
    let t00 = rows.iter().find(|r| r.tenant == "t00").unwrap();
    // The refused request in the window counts as never answered.
    assert_eq!((t00.sent, t00.refused), ((1, 2), 1));
    assert!(t00.burst.p99.is_infinite());

    // The target looks at the others only: t01's p99 went up 298 / 199 = 1.497x.
    let s = Scenarios {
        noisy: Some(spec),
        ..Scenarios::default()
    };
    let f = Figures {
        noisy: rows,
        prefill_use: [("b".to_string(), 0.9), ("a".to_string(), 0.8)].into(),
        ..Figures::default()
    };
    let t = check(&s, &f);
    assert_eq!(t.len(), 1);
    assert_eq!(t[0].met, Some(false));
    assert!(
        t[0].measured.starts_with("worst t01: 1.50x"),
        "{}",
        t[0].measured
    );
    let why = &t[0].why;
    assert!(why.contains("1 refused"), "{why}");
    // t00 got 1 of the 3 served: not past an equal share of 2 tenants.
    assert!(why.contains("t00 was served 1 of the 3 requests"), "{why}");
    assert!(
        why.contains("prefill use was 90.0% with the burst against 80.0%"),
        "{why}"
    );
    assert!(!why.contains("work-conserving"), "{why}");
}

#[test]
fn a_burst_served_past_an_equal_share_at_a_higher_use_is_called_work_conserving() {
    let spec = noisy_spec();
    let base = vec![rec("t01", 11.0, 100.0, 200), rec("t00", 12.0, 100.0, 200)];
    let mut burst = vec![rec("t01", 11.0, 300.0, 200)];
    for i in 0..3 {
        burst.push(rec("t00", 12.0 + i as f64, 100.0, 200));
    }
    let f = |with: f64| Figures {
        noisy: noisy_rows(&spec, "on", &base, &burst),
        prefill_use: [("b".to_string(), with), ("a".to_string(), 0.8)].into(),
        ..Figures::default()
    };
    let s = Scenarios {
        noisy: Some(spec.clone()),
        ..Scenarios::default()
    };
    let why = check(&s, &f(0.95))[0].why.clone();
    assert!(why.contains("t00 was served 3 of the 4 requests"), "{why}");
    assert!(why.contains("work-conserving"), "{why}");
    // The same share with the use not risen: no such reading.
    let why = check(&s, &f(0.8))[0].why.clone();
    assert!(!why.contains("work-conserving"), "{why}");
}

fn budgets_spec() -> BudgetsSpec {
    let t = |name: &str, demand: f64| BudgetTenant {
        name: name.into(),
        tokens_per_minute: 60_000,
        demand,
        max_tokens: true,
    };
    BudgetsSpec {
        run: "r".into(),
        duration_s: 180.0,
        window_s: 60.0,
        tenants: vec![t("t00", 2.0), t("t01", 0.5)],
    }
}

#[test]
fn budget_rows_count_the_first_window_and_the_steady_state() {
    let spec = budgets_spec();
    // t00: 1500 tokens per request; 60 served in the first 75 s, then one
    // every 1.5 s (1000 tokens/s: the refill exactly) and refusals.
    let mut recs = Vec::new();
    for i in 0..60 {
        recs.push(rec("t00", i as f64, 100.0, 200));
    }
    let mut at = 75.0;
    while at < 180.0 {
        recs.push(rec("t00", at, 100.0, 200));
        recs.push(rec("t00", at + 0.5, 0.0, 429));
        at += 1.5;
    }
    recs.push(rec("t01", 30.0, 100.0, 200));
    let rows = budget_rows(&spec, &recs);
    let a = &rows[0];
    assert_eq!((a.sent, a.ok, a.limited), (60 + 2 * 70, 130, 70));
    assert_eq!(a.allowed_tokens, 60_000.0 + 1000.0 * 180.0);
    // Dry at the first 429 (75.5 s): the 69 served after it, over the
    // refill of 104.5 s.
    assert_eq!(a.dry_at_s, 75.5);
    assert_eq!(a.steady_allowed, 1000.0 * 104.5);
    assert_eq!(a.steady_tokens, 69 * 1500);
    assert!((a.steady_ratio() - 103_500.0 / 104_500.0).abs() < 1e-12);
    // Never limited: no steady span.
    assert!(rows[1].dry_at_s.is_nan() && rows[1].steady_ratio().is_nan());
    assert!((a.whole_ratio() - 130.0 * 1500.0 / 240_000.0).abs() < 1e-12);

    let s = Scenarios {
        budgets: Some(spec.clone()),
        ..Scenarios::default()
    };
    let f = Figures {
        budgets: rows,
        ..Figures::default()
    };
    let t = check(&s, &f);
    assert_eq!(t.len(), 2);
    assert_eq!(t[0].met, Some(true), "{t:?}");
    assert_eq!(t[1].met, Some(true), "{t:?}");

    // Ten extra requests after the first 429 are 14% over.
    let mut more = recs.clone();
    for k in 0..10 {
        more.push(rec("t00", 100.1 + k as f64, 100.0, 200));
    }
    more.push(rec("t01", 40.0, 0.0, 429));
    let f = Figures {
        budgets: budget_rows(&spec, &more),
        ..Figures::default()
    };
    let t = check(&s, &f);
    assert_eq!((t[0].met, t[1].met), (Some(false), Some(false)), "{t:?}");
    assert!(
        t[1].measured.contains("t01: 1 of 2 answered 429"),
        "{}",
        t[1].measured
    );
}

#[test]
fn goodput_counts_served_requests_within_the_slo_over_the_arrival_window() {
    let recs = vec![
        rec("trace", 0.0, 500.0, 200),
        rec("trace", 1.0, 2_500.0, 200),
        rec("trace", 2.0, 0.0, 429),
        rec("trace", 4.0, 1_999.0, 200),
    ];
    let g = goodput("x", &recs, 2_000.0);
    assert_eq!((g.sent, g.ok, g.good, g.refused), (4, 3, 2, 1));
    assert_eq!(g.good_per_s, 0.5);
    assert!(g.ttft.p99.is_infinite());
}

#[test]
fn balance_sets_the_mean_against_one_central_queue() {
    let model = EngineModel {
        profile: LatencyProfile::h100_8b(),
        max_num_batched_tokens: 8192,
    };
    // Two engines, three requests at once on one engine: the measured
    // mean is what its FCFS queue gives; balance spreads them.
    let mut recs: Vec<Record> = (0..3).map(|_| rec("trace", 0.0, 0.0, 200)).collect();
    let one = model.unqueued_ttft_ms(1000, 0);
    for (i, r) in recs.iter_mut().enumerate() {
        r.ttft_ms = one * (i + 1) as f64;
    }
    recs.push(rec("trace", 0.0, 0.0, 503));
    let meta = RunMeta {
        workload: "trace".into(),
        mode: "kvasir-lb".into(),
        load: 1.0,
        rate: 1.0,
        time_scale: 1.0,
        wall_s: 1.0,
        engines: EngineUse {
            engines: 2,
            ..EngineUse::default()
        },
        summary: stats::summarize(&recs),
        ttft_growth: f64::NAN,
        notes: Default::default(),
    };
    let b = balance("late", &meta, &recs, &model);
    assert_eq!((b.sent, b.unanswered), (4, 1));
    assert!((b.mean_ms - 2.0 * one).abs() < 1e-9);
    // Balanced over 2 engines: one, one, two services.
    assert!((b.balanced_ms - 4.0 * one / 3.0).abs() < 1e-9, "{b:?}");
    assert!((b.ratio() - 1.5).abs() < 1e-9);
    assert_eq!(b.hit_rate, 0.0);
}
