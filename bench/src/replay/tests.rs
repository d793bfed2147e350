use super::*;
use vllm_latency::LatencyProfile;
use vllm_sim::engine::SchedulingPolicy;
use vllm_sim::hashing::HashSeed;

fn model() -> EngineModel {
    EngineModel {
        profile: LatencyProfile::h100_8b(),
        max_num_batched_tokens: 8192,
    }
}

fn setup(engines: usize) -> Setup {
    Setup {
        engines,
        engine: EngineConfig {
            block_size: 16,
            num_gpu_blocks: 4096,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 32768,
            enable_prefix_caching: true,
            profile: LatencyProfile::h100_8b(),
            hash_seed: HashSeed(7),
            policy: SchedulingPolicy::Fcfs,
        },
        model: model(),
        shortest_first: false,
    }
}

fn turn(sent_s: f64, think_s: f64, new_tokens: usize, endpoint: usize) -> Turn {
    Turn {
        sent_s,
        think_s,
        new_tokens,
        completion_tokens: 20,
        endpoint,
    }
}

fn conv(tenant: usize, system_tokens: usize, turns: Vec<Turn>) -> Conversation {
    Conversation {
        tenant,
        system_tokens,
        turns,
        trace: None,
    }
}

fn rec(tenant: &str, c: usize, t: usize, sent: f64, e2e_ms: f64, p: u64, done: u64) -> Record {
    Record {
        id: 0,
        tenant: tenant.into(),
        conversation: Some(c),
        turn: t,
        sent_s: sent,
        ttft_ms: 50.0,
        itl_ms: 5.0,
        e2e_ms,
        prompt_tokens: p,
        cached_tokens: 0,
        completion_tokens: done,
        endpoint: format!("e{}", c % 2),
        status: 200,
        outcome: Outcome::Ok,
        error: String::new(),
    }
}

#[test]
fn conversations_follow_the_runs_turns_prompts_and_think_times() {
    let mut failed = rec("b", 2, 0, 0.5, f64::NAN, 900, 0);
    failed.outcome = Outcome::Error;
    let records = vec![
        rec("a", 1, 1, 3.0, 800.0, 2600, 40),
        rec("a", 1, 0, 1.0, 500.0, 2000, 100),
        failed,
    ];
    let system = HashMap::from([("a", 1500u64)]);
    let (convs, endpoints) = conversations(&records, &system);
    assert_eq!(endpoints, vec!["e1".to_string()]);
    assert_eq!(
        convs.len(),
        1,
        "the failed request's conversation has no answered turn"
    );
    let c = &convs[0];
    assert_eq!((c.tenant, c.system_tokens), (0, 1500));
    // First turn: 2000 - 1500 new tokens; the next grows by 2600 - 2100,
    // sent 3.0 - 1.0 - 0.5 s after the answer.
    assert_eq!(c.turns[0], turn(1.0, 0.0, 500, 0).with_completion(100));
    assert_eq!(c.turns[1], turn(3.0, 1.5, 500, 0).with_completion(40));
}

impl Turn {
    fn with_completion(mut self, n: u32) -> Turn {
        self.completion_tokens = n;
        self
    }
}

#[test]
fn a_lone_turn_takes_the_time_the_model_prices_it_at() {
    let convs = [conv(0, 0, vec![turn(0.0, 0.0, 3000, 0)])];
    let out = replay(&convs, &setup(2), &Placement::Own);
    assert_eq!(out.ttft_ms.len(), 1);
    let want = model().unqueued_ttft_ms(3000, 0);
    assert!(
        (out.ttft_ms[0] - want).abs() < 1e-6,
        "{} vs {want}",
        out.ttft_ms[0]
    );
    assert_eq!(out.per_engine, vec![1, 0]);
}

#[test]
fn a_later_turn_at_home_finds_its_prompt_and_answer_cached() {
    // System prompt 1600 + 400 new; then the answer (20) and 480 new.
    let convs = [conv(
        0,
        1600,
        vec![turn(0.0, 0.0, 400, 0), turn(0.0, 1.0, 480, 0)],
    )];
    let out = replay(&convs, &setup(2), &Placement::Own);
    assert_eq!(out.prompt_tokens, 2000 + 2500);
    // The second prompt's first 2016 tokens (126 full blocks of 2020) were
    // cached.
    assert_eq!(out.cached_tokens, 2016);
    // A second turn placed on the other engine finds nothing.
    let mut moved = convs.clone();
    moved[0].turns[1].endpoint = 1;
    assert_eq!(replay(&moved, &setup(2), &Placement::Own).cached_tokens, 0);
}

#[test]
fn the_oracle_follows_the_system_prompt_unless_a_move_is_sooner() {
    // Tenant 0's system prompt goes to engine 0 with the first turn; a
    // second conversation of the tenant arrives when engine 0 is idle
    // again, and finds it there.
    let convs = [
        conv(0, 4000, vec![turn(0.0, 0.0, 100, 0)]),
        conv(0, 4000, vec![turn(1.0, 0.0, 100, 1)]),
    ];
    let at = Placement::AtArrival { move_penalty: 0.5 };
    let out = replay(&convs, &setup(2), &at);
    assert_eq!(out.per_engine, vec![2, 0]);
    assert_eq!(out.cached_tokens, 4000);
    // Arriving while engine 0 is still prefilling a long first turn (its
    // backlog is that whole prefill, more than the second's cold prefill
    // on an idle engine, even with half the extra counted against it):
    // it goes to engine 1. (The system prompt's blocks count as held from
    // the step that computes them, as the indexer matches picks still in
    // prefill.)
    let busy = [
        conv(0, 4000, vec![turn(0.0, 0.0, 8000, 0)]),
        conv(0, 4000, vec![turn(0.0, 0.0, 100, 0)]),
    ];
    let out = replay(&busy, &setup(2), &at);
    assert_eq!(out.per_engine, vec![1, 1]);
    assert_eq!(out.cached_tokens, 0);
}

#[test]
fn a_central_queue_places_only_on_free_engines() {
    // Three cold 6000-token prompts at once on two engines: the third
    // waits for an engine to free, so its first token comes after the
    // first two's; placed at arrival it shares a step with one of them.
    let convs: Vec<Conversation> = (0..3)
        .map(|i| conv(i, 0, vec![turn(0.0, 0.0, 6000, 0)]))
        .collect();
    let central = Placement::Central {
        quickest: false,
        move_penalty: 0.0,
        free_tokens: 0,
    };
    let mut held = replay(&convs, &setup(2), &central).ttft_ms;
    held.sort_by(f64::total_cmp);
    let alone = model().unqueued_ttft_ms(6000, 0);
    assert!((held[0] - alone).abs() < 1e-6 && (held[1] - alone).abs() < 1e-6);
    assert!(held[2] > 2.0 * alone - 1e-6, "{held:?}");
    let mut at = replay(
        &convs,
        &setup(2),
        &Placement::AtArrival { move_penalty: 0.0 },
    )
    .ttft_ms;
    at.sort_by(f64::total_cmp);
    assert!(at[2] < held[2], "{at:?} against {held:?}");
}

#[test]
fn placements_parse_and_bad_ones_say_why() {
    assert_eq!(Placement::parse("own"), Ok(Placement::Own));
    assert_eq!(
        Placement::parse("at-arrival:0.5"),
        Ok(Placement::AtArrival { move_penalty: 0.5 })
    );
    assert_eq!(
        Placement::parse("central:quickest:1:2048"),
        Ok(Placement::Central {
            quickest: true,
            move_penalty: 1.0,
            free_tokens: 2048
        })
    );
    assert_eq!(
        Placement::parse("central:oldest:0"),
        Ok(Placement::Central {
            quickest: false,
            move_penalty: 0.0,
            free_tokens: 0
        })
    );
    for bad in [
        "",
        "central",
        "central:soonest:1",
        "at-arrival:-1",
        "at-arrival:x",
        "central:oldest:1:many",
    ] {
        let e = Placement::parse(bad).unwrap_err();
        assert!(e.contains(&format!("{bad:?}")), "{e}");
    }
}

#[test]
fn the_indexers_ranking_keeps_a_conversation_home_and_spreads_new_ones() {
    // Two tenants' first turns at once, then tenant 0's second turn.
    let convs = [
        conv(
            0,
            1600,
            vec![turn(0.0, 0.0, 400, 0), turn(0.0, 1.0, 480, 0)],
        ),
        conv(1, 1600, vec![turn(0.0, 0.0, 400, 0)]),
    ];
    let out = replay(&convs, &setup(2), &Placement::Scored(Box::default()));
    assert_eq!(out.per_engine.iter().sum::<usize>(), 3);
    assert!(
        out.per_engine.iter().all(|&n| n >= 1),
        "{:?}",
        out.per_engine
    );
    // The second turn found its first turn's prompt and answer.
    assert_eq!(out.cached_tokens, 2016);
}

#[test]
fn dealt_conversations_go_round_the_engines_and_stay() {
    let convs: Vec<Conversation> = (0..3)
        .map(|i| {
            conv(
                0,
                1600,
                vec![turn(i as f64, 0.0, 400, 1), turn(0.0, 1.0, 480, 1)],
            )
        })
        .collect();
    let out = replay(&convs, &setup(2), &Placement::Dealt);
    assert_eq!(out.per_engine, vec![4, 2]);
    assert_eq!(Placement::parse("dealt"), Ok(Placement::Dealt));
}

#[test]
fn a_trace_run_replays_its_requests_with_their_prompts_and_refuses_another_trace() {
    let req = |ids: Vec<u64>, n: usize| TraceRequest {
        timestamp: 0.0,
        input_length: n,
        output_length: 4,
        hash_ids: ids,
    };
    let trace = vec![req(vec![1, 2], 40), req(vec![1, 3], 40)];
    let mut a = rec("trace", 0, 0, 0.0, 100.0, 40, 4);
    a.conversation = None;
    let mut b = a.clone();
    b.id = 1;
    b.sent_s = 1.0;
    let (convs, endpoints) = trace_requests(&[a.clone(), b], &trace, 16).unwrap();
    assert_eq!((convs.len(), endpoints.len()), (2, 1));
    // The second shares the first's first 16-token hash id: one block cached.
    let out = replay(&convs, &setup(1), &Placement::Own);
    assert_eq!((out.prompt_tokens, out.cached_tokens), (80, 16));
    a.prompt_tokens = 41;
    let e = trace_requests(&[a], &trace, 16).unwrap_err();
    assert!(
        e.contains("record 0 has 41 prompt tokens, the trace's request 0 has 40"),
        "{e}"
    );
    let empty = vec![req(vec![1], 0)];
    let mut none = rec("trace", 0, 0, 0.0, 100.0, 0, 4);
    none.conversation = None;
    assert!(trace_requests(&[none], &empty, 16)
        .unwrap_err()
        .contains("has no prompt tokens"));
    let mut far = rec("trace", 0, 0, 0.0, 100.0, 40, 4);
    far.id = 2;
    assert!(trace_requests(&[far], &trace, 16)
        .unwrap_err()
        .contains("past the trace's 2 requests"));
}

#[test]
fn shortest_first_lets_a_short_prompt_past_a_long_one_in_the_waiting_queue() {
    // A long prefill runs; a long and then a short prompt wait behind it.
    // In the step where the first one's last chunk leaves budget over, the
    // waiting queue's front gets it: the long one first come first served,
    // the short one under shortest first.
    let convs = [
        conv(0, 0, vec![turn(0.0, 0.0, 20_000, 0)]),
        conv(1, 0, vec![turn(0.001, 0.0, 16_000, 0)]),
        conv(2, 0, vec![turn(0.002, 0.0, 100, 0)]),
    ];
    let short_ttft = |shortest_first: bool| {
        let s = Setup {
            shortest_first,
            engine: EngineConfig {
                policy: if shortest_first {
                    SchedulingPolicy::Priority
                } else {
                    SchedulingPolicy::Fcfs
                },
                ..setup(1).engine
            },
            ..setup(1)
        };
        // First tokens come in time order: the short one's is the one
        // closest to its own prefill alone.
        let out = replay(&convs, &s, &Placement::Own);
        out.ttft_ms.iter().copied().fold(f64::INFINITY, f64::min)
    };
    let (fcfs, sjf) = (short_ttft(false), short_ttft(true));
    assert!(sjf < fcfs, "shortest first {sjf} ms against {fcfs} ms");
}
