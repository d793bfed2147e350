use super::*;
use crate::bound::PooledBound;
use crate::compare::APPROX;
use crate::stats::{Dist, Summary};
use crate::targets::TargetCheck;

fn run(w: &str, mode: &str, load: f64, p50: f64, p99: f64, hit: f64) -> RunMeta {
    let d = Dist {
        p50,
        p90: p50 * 2.0,
        p99,
        mean: p50 * 1.5,
    };
    RunMeta {
        workload: w.into(),
        mode: mode.into(),
        load,
        rate: 2.0,
        time_scale: 0.25,
        wall_s: 1.0,
        engines: Default::default(),
        summary: Summary {
            requests: 10,
            ok: 10,
            failed: 0,
            timeouts: 0,
            ttft: d,
            itl: d,
            e2e: Dist {
                p50: p50 * 10.0,
                ..d
            },
            duration_s: 1.0,
            throughput_rps: 1.0,
            output_tokens_per_s: 1.0,
            cache_hit_rate: hit,
            goodput_rps: 1.0,
            goodput_share: 1.0,
            per_endpoint: vec![],
            fastest_ttft_ms: p50 / 4.0,
        },
        ttft_growth: 1.0,
        notes: Default::default(),
    }
}

#[test]
fn targets_compare_kvasir_with_round_robin_and_approx() {
    let inp = Inputs {
        runs: vec![
            run("trace", BASELINE, 1.0, 1000.0, 5000.0, 0.3),
            run("trace", APPROX, 1.0, 300.0, 2000.0, 0.5),
            run("trace", KVASIR, 1.0, 400.0, 1000.0, 0.6),
        ],
        bound: Some(PooledBound {
            capacity_tokens: 1,
            prompt_tokens: 1,
            cached_tokens: 1,
            hit_rate: 0.64,
            unqueued_mean_ttft_ms: None,
            per_request_cached: Vec::new(),
        }),
        ..Default::default()
    };
    let c = check_targets(&inp);
    let get = |s: &str| c.iter().find(|c| c.target.starts_with(s)).unwrap();
    assert_eq!(get("trace @1.0: median TTFT").met, Some(true)); // 40% <= 50%
    assert_eq!(get("trace @1.0: p99 TTFT").met, Some(true)); // 20% <= 30%
    assert_eq!(get("trace @1.0: cache hit").met, Some(true)); // 0.6/0.64 = 94%
    assert_eq!(get("trace @1.0: p90 TTFT below").met, Some(false)); // 800 vs 600
    assert_eq!(get("chat @1.0: median TTFT").met, None);
    assert_eq!(get("trace, round-robin saturated").met, None);
    let md = render(&inp);
    assert!(md.contains("| 1.0 | kvasir |"), "{md}");
    assert!(md.contains("| **no** |"));
    let miss = get("trace @1.0: p90 TTFT below");
    assert!(
        miss.why.starts_with(
            "33.3% above approx-prefix's; hit rate 60.0% against approx-prefix's 50.0%"
        ),
        "{}",
        miss.why
    );
    // Ten points apart: not the same prefixes.
    assert!(!miss.why.contains("little to add"), "{}", miss.why);
    assert!(md.contains("40.0%"));
}

#[test]
fn a_p90_miss_at_equal_hit_rates_says_the_index_made_no_difference() {
    let inp = Inputs {
        runs: vec![
            run("chat", APPROX, 1.0, 100.0, 300.0, 0.891),
            run("chat", KVASIR, 1.0, 102.0, 300.0, 0.893),
        ],
        ..Default::default()
    };
    let c = check_targets(&inp);
    let miss = c
        .iter()
        .find(|c| c.target.starts_with("chat @1.0: p90 TTFT below"))
        .unwrap();
    assert_eq!(miss.met, Some(false));
    assert!(
        miss.why.starts_with("2.0% above approx-prefix's"),
        "{}",
        miss.why
    );
    assert!(
        miss.why.contains("the KV events had little to add"),
        "{}",
        miss.why
    );
    assert!(!miss.why.contains("no queueing"), "{}", miss.why);

    // With both modes priced at no queueing, the why says how much of
    // each p90 was queueing at all.
    let own = |p90: f64, mode: &str| Unqueued {
        workload: "chat".into(),
        mode: mode.into(),
        load: 1.0,
        own: Dist {
            p50: 50.0,
            p90,
            p99: 190.0,
            mean: 60.0,
        },
        best: None,
        best_hit_rate: None,
        queued_own: None,
        balanced: None,
        balanced_best: None,
    };
    let inp = Inputs {
        unqueued: vec![own(150.0, KVASIR), own(149.0, APPROX)],
        ..inp
    };
    let c = check_targets(&inp);
    let miss = c
        .iter()
        .find(|c| c.target.starts_with("chat @1.0: p90 TTFT below"))
        .unwrap();
    assert!(
        miss.why.contains(
            "the p90 is 150 ms for kvasir and 149 ms for approx-prefix, so queueing added \
             54.0 ms to kvasir's measured p90 and 51.0 ms to approx-prefix's"
        ),
        "{}",
        miss.why
    );
    // The notes price Kvasir's runs only, not the approximate mode's.
    let md = render(&inp);
    let line = md
        .lines()
        .find(|l| l.starts_with("Kvasir's requests priced with no queueing"))
        .unwrap();
    assert_eq!(line.matches("at load 1.0").count(), 1, "{line}");
}

#[test]
fn a_ttft_target_below_the_fastest_request_says_so() {
    // Round-robin's median 100 ms: 5% is 5 ms, and kvasir's fastest
    // request took 80 / 4 = 20 ms.
    let inp = Inputs {
        runs: vec![
            run("chat", BASELINE, 1.0, 100.0, 400.0, 0.6),
            run("chat", KVASIR, 1.0, 80.0, 300.0, 0.8),
        ],
        ..Default::default()
    };
    let c = check_targets(&inp);
    let median = c
        .iter()
        .find(|c| c.target.starts_with("chat @1.0: median TTFT"))
        .unwrap();
    assert_eq!(median.met, Some(false));
    assert!(
        median
            .why
            .contains("the target is 5.0 ms, below the fastest TTFT"),
        "{}",
        median.why
    );
    assert!(median.why.contains("(20.0 ms"), "{}", median.why);
    // p99: 20% of 400 ms = 80 ms is above the floor: no such claim.
    let p99 = c
        .iter()
        .find(|c| c.target.starts_with("chat @1.0: p99 TTFT"))
        .unwrap();
    assert_eq!(p99.met, Some(false));
    assert!(!p99.why.contains("fastest"), "{}", p99.why);
}

#[test]
fn chat_ttft_misses_are_set_against_the_best_reuse_floor() {
    // Round-robin p50 100 ms, p99 400 ms: targets 5 ms and 80 ms.
    let d = |p50: f64, p99: f64| Dist {
        p50,
        p90: p50,
        p99,
        mean: p50,
    };
    let with = |best_p99: f64| Inputs {
        runs: vec![
            run("chat", BASELINE, 1.0, 100.0, 400.0, 0.6),
            run("chat", KVASIR, 1.0, 80.0, 300.0, 0.8),
        ],
        unqueued: vec![Unqueued {
            workload: "chat".into(),
            mode: KVASIR.into(),
            load: 1.0,
            own: d(50.0, 110.0),
            best: Some(d(40.0, best_p99)),
            best_hit_rate: Some(0.9),
            queued_own: None,
            balanced: None,
            balanced_best: None,
        }],
        ..Default::default()
    };
    let get = |inp: &Inputs, s: &str| {
        check_targets(inp)
            .into_iter()
            .find(|c| c.target.starts_with(s))
            .unwrap()
    };
    let inp = with(70.0);
    let median = get(&inp, "chat @1.0: median TTFT");
    assert!(
        median.why.contains(
            "the median TTFT is 40.0 ms (50.0 ms at the prefixes kvasir reused), so the target (5.0 ms) is below it"
        ),
        "{}",
        median.why
    );
    // The floor says it; the fastest request need not.
    assert!(!median.why.contains("fastest"), "{}", median.why);
    let p99 = get(&inp, "chat @1.0: p99 TTFT");
    assert!(
        p99.why.contains("the p99 TTFT is 70.0 ms (110 ms at the prefixes kvasir reused), so the target leaves 10.0 ms"),
        "{}",
        p99.why
    );
    assert!(
        p99.why.contains("kvasir's p99 is 230 ms above that floor"),
        "{}",
        p99.why
    );
    assert!(get(&with(90.0), "chat @1.0: p99 TTFT")
        .why
        .contains("(80.0 ms) is below it: no routing reaches it"));
    let md = render(&inp);
    assert!(
        md.contains("mean / median / p99 TTFT 50.0 ms / 50.0 ms / 110 ms at load 1.0"),
        "{md}"
    );
    assert!(
        md.contains("a hit rate of 90.0%), the same requests at load 1.0 would see"),
        "{md}"
    );
}

#[test]
fn the_saturation_target_is_checked_at_every_load_round_robin_cannot_keep_up_with() {
    // Round-robin at 70% prefill use at load 1.0: 1.2 offers 84% (not
    // saturated), 1.5 offers 105% and 2.0 140%.
    let mut runs = Vec::new();
    for (load, mean_rr, mean_k) in [
        (1.0, 2000.0, 500.0),
        (1.2, 4000.0, 600.0),
        (1.5, 20_000.0, 800.0),
        (2.0, 40_000.0, 10_000.0),
    ] {
        let mut b = run("trace", BASELINE, load, 1.0, 1.0, 0.05);
        b.engines.prefill_utilisation = 0.7;
        b.summary.ttft.mean = mean_rr;
        let mut k = run("trace", KVASIR, load, 1.0, 1.0, 0.3);
        k.summary.ttft.mean = mean_k;
        runs.extend([b, k]);
    }
    let c = check_targets(&Inputs {
        runs,
        ..Default::default()
    });
    let sat: Vec<&TargetCheck> = c
        .iter()
        .filter(|c| c.target.contains("round-robin saturated"))
        .collect();
    assert_eq!(sat.len(), 2, "{sat:?}");
    assert!(
        sat[0]
            .target
            .starts_with("trace @1.5 (round-robin saturated: offered 105.0%"),
        "{}",
        sat[0].target
    );
    assert_eq!(sat[0].met, Some(true)); // 800 / 20000 = 4%
    assert!(sat[1].target.starts_with("trace @2.0"), "{}", sat[1].target);
    assert_eq!(sat[1].met, Some(false)); // 25%
}

#[test]
fn a_mean_ttft_miss_is_set_against_the_unqueued_floor() {
    // Round-robin saturated at 1.5 (mean 20 s, 5% = 1 s); the floor
    // decides whether the miss leaves room or is out of reach.
    let runs_with = |mean_k: f64| {
        let mut b = run("trace", BASELINE, 1.0, 1.0, 1.0, 0.05);
        b.engines.prefill_utilisation = 0.7;
        let mut b15 = run("trace", BASELINE, 1.5, 1.0, 1.0, 0.05);
        b15.summary.ttft.mean = 20_000.0;
        let mut k = run("trace", KVASIR, 1.5, 1.0, 1.0, 0.3);
        k.summary.ttft.mean = mean_k;
        vec![b, b15, k]
    };
    let bound = |floor: f64| PooledBound {
        capacity_tokens: 1,
        prompt_tokens: 1,
        cached_tokens: 1,
        hit_rate: 0.3,
        unqueued_mean_ttft_ms: Some(floor),
        per_request_cached: Vec::new(),
    };
    let check = |mean_k: f64, floor: f64| {
        check_targets(&Inputs {
            runs: runs_with(mean_k),
            bound: Some(bound(floor)),
            ..Default::default()
        })
        .into_iter()
        .find(|c| c.target.starts_with("trace @1.5"))
        .unwrap()
    };
    let room = check(1500.0, 600.0);
    assert_eq!(room.met, Some(false));
    assert!(
        room.why
            .contains("the mean TTFT is 600 ms, so the target leaves 400 ms"),
        "{}",
        room.why
    );
    assert!(
        room.why
            .contains("kvasir's mean is 900 ms above that floor"),
        "{}",
        room.why
    );
    let out_of_reach = check(1500.0, 1200.0);
    assert!(
        out_of_reach
            .why
            .contains("(1000 ms) is below it: out of reach short of out-reusing that cache"),
        "{}",
        out_of_reach.why
    );
    // Other TTFT targets are not judged against a mean.
    let c = check_targets(&Inputs {
        runs: vec![
            run("trace", BASELINE, 1.0, 1000.0, 5000.0, 0.05),
            run("trace", KVASIR, 1.0, 900.0, 4000.0, 0.3),
        ],
        bound: Some(bound(600.0)),
        ..Default::default()
    });
    assert!(c.iter().all(|c| !c.why.contains("no queueing")), "{c:?}");
}

#[test]
fn a_mean_ttft_miss_is_split_by_the_queue_model_when_it_fits() {
    // Kvasir measured 1500 ms at 1.5 against a 1000 ms target and a
    // 600 ms unqueued floor; the queues say where balance would put it.
    let mut b = run("trace", BASELINE, 1.0, 1.0, 1.0, 0.05);
    b.engines.prefill_utilisation = 0.7;
    let mut b15 = run("trace", BASELINE, 1.5, 1.0, 1.0, 0.05);
    b15.summary.ttft.mean = 20_000.0;
    let mut k = run("trace", KVASIR, 1.5, 1.0, 1.0, 0.3);
    k.summary.ttft.mean = 1500.0;
    let mean = |m: f64| Dist {
        p50: m,
        p90: m,
        p99: m,
        mean: m,
    };
    let with = |own_engines: f64, balanced: f64, best: f64| Inputs {
        runs: vec![b.clone(), b15.clone(), k.clone()],
        bound: Some(PooledBound {
            capacity_tokens: 1,
            prompt_tokens: 1,
            cached_tokens: 1,
            hit_rate: 0.3,
            unqueued_mean_ttft_ms: Some(600.0),
            per_request_cached: Vec::new(),
        }),
        unqueued: vec![Unqueued {
            workload: "trace".into(),
            mode: KVASIR.into(),
            load: 1.5,
            own: mean(650.0),
            best: None,
            best_hit_rate: None,
            queued_own: Some(mean(own_engines)),
            balanced: Some(mean(balanced)),
            balanced_best: Some(mean(best)),
        }],
        ..Default::default()
    };
    let why = |inp: &Inputs| {
        check_targets(inp)
            .into_iter()
            .find(|c| c.target.starts_with("trace @1.5"))
            .unwrap()
            .why
    };
    // The model within 15% of the measured mean: the split is given.
    let fits = why(&with(1450.0, 1100.0, 1050.0));
    assert!(
        fits.contains("would give a mean of 1100 ms at kvasir's reuse and 1050 ms at the pooled cache's reuse, so the target (1000 ms) is below what balancing alone reaches"),
        "{fits}"
    );
    assert!(
        fits.contains("give 1450 ms (measured 1500 ms), so about 400 ms of kvasir's mean is balance it gave up"),
        "{fits}"
    );
    // Balance at the pooled reuse would meet it, at kvasir's not.
    let more_reuse = why(&with(1450.0, 1100.0, 900.0));
    assert!(
        more_reuse.contains("even perfect balance misses the target; it takes more reuse as well"),
        "{more_reuse}"
    );
    let balance = why(&with(1450.0, 950.0, 900.0));
    assert!(
        balance.contains("perfect balance at kvasir's reuse would meet the target"),
        "{balance}"
    );
    // A model 40% off says so instead of splitting the figure.
    let off = why(&with(900.0, 700.0, 650.0));
    assert!(
        off.contains("the model is 40.0% off here, so it splits this figure only roughly"),
        "{off}"
    );
    assert!(!off.contains("balance it gave up"), "{off}");
}

#[test]
fn milliseconds_format_compactly() {
    assert_eq!(ms(f64::INFINITY), "∞");
    assert_eq!(ms(f64::NAN), "-");
    assert_eq!(ms(12.345), "12.3 ms");
    assert_eq!(ms(1234.4), "1234 ms");
    assert_eq!(ms(12_345.0), "12.3 s");
}
