use super::*;
use std::time::Instant;

#[tokio::test]
async fn an_unreachable_server_fails_fast_then_is_left_alone() {
    // Port 1 on loopback: nothing listens, the connect is refused.
    let s = BudgetStore::new(
        "redis://127.0.0.1:1",
        Duration::from_millis(200),
        Duration::from_secs(30),
        "t:",
    )
    .unwrap();
    let started = Instant::now();
    let l = Limits {
        requests_per_minute: Some(1),
        ..Limits::default()
    };
    let r = s
        .reserve("k", &l, "r1", &Request::default(), None, None)
        .await;
    assert!(
        matches!(
            r,
            Err(BudgetStoreError::Failed(_) | BudgetStoreError::Timeout)
        ),
        "{r:?}"
    );
    assert!(s.resting());
    assert_eq!(
        s.cancel("k", None, "r1", None).await,
        Err(BudgetStoreError::Down)
    );
    assert!(started.elapsed() < Duration::from_secs(2));
}

const NONE3: [i64; 3] = [-1, -1, -1];

fn with_states(head: &[i64], states: [[i64; 3]; 4]) -> Vec<i64> {
    let mut v = head.to_vec();
    v.extend(states.concat());
    v
}

#[test]
fn replies_are_read_strictly() {
    let st = [[10, 9, 6000], NONE3, NONE3, NONE3];
    let ok = with_states(&[0, 0, 0, 0, 1, 5, 7, 12], st);
    let r = decode_reserve(&ok).unwrap();
    assert_eq!(r.outcome, Ok(Cost([1, 5, 7, 12])));
    assert!(!r.repeated);
    let h = r.states.headers();
    assert_eq!(
        h.requests,
        Some(LimitState {
            limit: 10,
            remaining: 9,
            reset_ms: 6000
        })
    );
    assert_eq!(h.tokens, None);
    let limited = with_states(&[1, 1, 6000, 0, 0, 0, 0, 0], st);
    assert_eq!(
        decode_reserve(&limited).unwrap().outcome,
        Err(Refusal::Limited {
            dimension: Dimension::Requests,
            retry_after_ms: 6000
        })
    );
    let too_large = with_states(&[3, 4, 700, 600, 0, 0, 0, 0], st);
    assert_eq!(
        decode_reserve(&too_large).unwrap().outcome,
        Err(Refusal::TooLarge {
            dimension: Dimension::TotalTokens,
            requested: 700,
            limit: 600
        })
    );
    // A half-unlimited state, a bad code, a short reply, a dimension
    // out of range, a bad found flag: all refused.
    let bad = with_states(
        &[0, 0, 0, 0, 1, 5, 7, 12],
        [[10, -1, -1], NONE3, NONE3, NONE3],
    );
    assert!(decode_reserve(&bad).is_err());
    let mut bad = ok.clone();
    bad[0] = 9;
    assert!(decode_reserve(&bad).is_err());
    assert!(decode_reserve(&ok[..19]).is_err());
    let mut bad = limited.clone();
    bad[1] = 5;
    assert!(decode_reserve(&bad).is_err());
    assert!(decode_cost_answer(&with_states(&[2, 0, 0, 0, 0], st)).is_err());
    assert!(decode_cost_answer(&with_states(&[1, 0, 0, 0, 0], st)).is_ok());
}

#[test]
fn headers_pick_the_least_share_left_without_a_total() {
    let s = |limit, remaining| {
        Some(LimitState {
            limit,
            remaining,
            reset_ms: 1,
        })
    };
    let st = DimensionStates([None, s(1000, 500), s(100, 40), None]);
    assert_eq!(st.headers().tokens, s(100, 40));
    assert_eq!(st.get(Dimension::PromptTokens), s(1000, 500));
    let st = DimensionStates([None, s(1000, 500), s(100, 40), s(5, 5)]);
    assert_eq!(st.headers().tokens, s(5, 5));
}

#[test]
fn arguments_are_clamped_to_exact_doubles() {
    let l = Limits {
        total_tokens_per_minute: Some(u64::MAX),
        max_concurrent: Some(3),
        ..Limits::default()
    };
    assert_eq!(
        limit_args(Some(&l)),
        ["-1", "-1", "-1", "1000000000", "3", "1000"].map(String::from)
    );
    assert_eq!(limit_args(None), std::array::from_fn(|_| String::new()));
    let req = Request {
        prompt_tokens: u64::MAX,
        cached_tokens: 1,
        output_tokens: 2,
    };
    let op = Op::Reserve {
        id: "x",
        req: &req,
        max_age_ms: None,
        token: "t",
    };
    assert_eq!(op.token(), "t");
    assert_eq!(op.tail(), ("x", [100_000_000, 1, 2], -1));
    let op = Op::Release {
        id: "y",
        usage: None,
        charge: true,
    };
    assert_eq!(op.tail(), ("y", [-1, 0, 0], -1), "nothing to charge");
    let u = Usage {
        prompt_tokens: 3,
        cached_tokens: 1,
        completion_tokens: 2,
    };
    let op = Op::Release {
        id: "y",
        usage: Some(&u),
        charge: true,
    };
    assert_eq!(op.tail(), ("y", [3, 1, 2], 1));
}
