use super::*;

fn ep(n: u8) -> EndpointId {
    EndpointId::from_address(&format!("10.0.0.{n}:8000"))
}

fn failures() -> Failures {
    Failures::new(FailureConfig::default())
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[test]
fn mostly_failing_endpoint_is_ranked_last_once_enough_outcomes_came() {
    let f = failures();
    let t0 = Instant::now();
    for i in 0..9 {
        f.record(ep(1), Verdict::Failure, t0 + ms(i));
        assert!(!f.ranked_last(ep(1), t0 + ms(i)), "judged after {i}");
    }
    f.record(ep(1), Verdict::Failure, t0 + ms(9));
    assert!(f.ranked_last(ep(1), t0 + ms(10)));
    let v = f.view(ep(1), t0 + ms(10));
    assert!(v.failing && v.error_ratio > 0.99);
    assert_eq!((v.failures, v.ejections), (10, 1));
    // Another endpoint is untouched.
    assert!(!f.ranked_last(ep(2), t0));
    assert_eq!(
        f.ranked_last_all([ep(1), ep(2)], t0 + ms(10)),
        [true, false]
    );
    assert_eq!(f.view(ep(2), t0), HealthView::default());
}

#[test]
fn errors_below_the_ratio_do_not_count_as_failing() {
    let f = failures();
    let t0 = Instant::now();
    for i in 0..100 {
        let v = if i % 3 == 0 {
            Verdict::Failure
        } else {
            Verdict::Success
        };
        f.record(ep(1), v, t0 + ms(i));
    }
    assert!(!f.ranked_last(ep(1), t0 + ms(100)));
    let r = f.view(ep(1), t0 + ms(100)).error_ratio;
    assert!((0.3..0.37).contains(&r), "{r}");
}

#[test]
fn old_successes_decay_so_a_new_fault_shows_quickly() {
    let f = failures();
    let t0 = Instant::now();
    for i in 0..1000 {
        f.record(ep(1), Verdict::Success, t0 + ms(i));
    }
    // A minute later the successes weigh ~1/64: a few errors outweigh them.
    let t1 = t0 + Duration::from_secs(61);
    for i in 0..30 {
        f.record(ep(1), Verdict::Failure, t1 + ms(i));
    }
    assert!(f.ranked_last(ep(1), t1 + ms(30)));
}

#[test]
fn after_the_cool_down_one_probe_goes_and_its_success_restores() {
    let f = failures();
    let t0 = Instant::now();
    for i in 0..10 {
        f.record(ep(1), Verdict::Failure, t0 + ms(i));
    }
    let cool = ms(f.config().cool_down_ms);
    // A straggler's success inside the cool-down changes nothing.
    f.record(ep(1), Verdict::Success, t0 + ms(20));
    assert!(f.ranked_last(ep(1), t0 + ms(30)));
    // Cooled down: ranked as usual until a pick goes there.
    let t1 = t0 + ms(9) + cool;
    assert!(!f.ranked_last(ep(1), t1));
    f.picked(ep(1), t1);
    assert!(f.ranked_last(ep(1), t1 + ms(1)), "one probe at a time");
    f.record(ep(1), Verdict::Success, t1 + ms(5));
    assert!(!f.ranked_last(ep(1), t1 + ms(6)));
    let v = f.view(ep(1), t1 + ms(6));
    assert!(!v.failing && v.error_ratio == 0.0);
}

#[test]
fn a_failed_probe_restarts_the_cool_down_and_a_lost_one_is_replaced() {
    let f = failures();
    let t0 = Instant::now();
    for i in 0..10 {
        f.record(ep(1), Verdict::Failure, t0 + ms(i));
    }
    let cool = ms(f.config().cool_down_ms);
    let t1 = t0 + ms(9) + cool;
    f.picked(ep(1), t1);
    f.record(ep(1), Verdict::Failure, t1 + ms(2));
    assert!(f.ranked_last(ep(1), t1 + cool - ms(1)));
    let t2 = t1 + ms(2) + cool;
    assert!(!f.ranked_last(ep(1), t2), "probed again");
    f.picked(ep(1), t2);
    // Its report is lost: after another cool-down, another probe.
    assert!(f.ranked_last(ep(1), t2 + cool - ms(1)));
    assert!(!f.ranked_last(ep(1), t2 + cool));
    assert_eq!(f.view(ep(1), t2).ejections, 1);
}

#[test]
fn disabled_never_ranks_last_but_still_counts() {
    let f = Failures::new(FailureConfig {
        enabled: false,
        ..FailureConfig::default()
    });
    let t0 = Instant::now();
    for i in 0..20 {
        f.record(ep(1), Verdict::Failure, t0 + ms(i));
    }
    assert!(!f.ranked_last(ep(1), t0 + ms(20)));
    assert_eq!(f.view(ep(1), t0 + ms(20)).failures, 20);
    f.remove_endpoint(ep(1));
    assert_eq!(f.view(ep(1), t0).failures, 0);
}

#[test]
fn config_validation_names_the_field() {
    assert!(FailureConfig::default().validate().is_ok());
    let bad = |c: FailureConfig| c.validate().unwrap_err().0;
    let d = FailureConfig::default;
    assert_eq!(
        bad(FailureConfig {
            half_life_ms: 0,
            ..d()
        }),
        "halfLifeMs"
    );
    assert_eq!(
        bad(FailureConfig {
            min_requests: 0.5,
            ..d()
        }),
        "minRequests"
    );
    assert_eq!(
        bad(FailureConfig {
            error_ratio: 0.0,
            ..d()
        }),
        "errorRatio"
    );
    assert_eq!(
        bad(FailureConfig {
            error_ratio: 1.5,
            ..d()
        }),
        "errorRatio"
    );
    assert_eq!(
        bad(FailureConfig {
            cool_down_ms: 0,
            ..d()
        }),
        "coolDownMs"
    );
}
