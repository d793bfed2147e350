use super::*;

fn cand(address: &str) -> Candidate<'_> {
    Candidate {
        address,
        matched_blocks: 0,
        running: 0,
        waiting: 0,
        kv_usage: 0.0,
        in_flight: 0,
        queued_prefill_tokens: 0,
        healthy: true,
        saturated: false,
        left_out: false,
        failing: false,
        recent_placements: 0.0,
    }
}

fn req(prompt_tokens: u32, seed: u64) -> Request {
    Request {
        prompt_tokens,
        block_size: 16,
        seed,
        max_endpoints: 0,
        indexed: true,
        starts_conversation: false,
    }
}

fn addrs<'a>(r: &Ranking, c: &[Candidate<'a>]) -> Vec<&'a str> {
    r.order.iter().map(|x| c[x.candidate].address).collect()
}

#[test]
fn predicted_cached_never_covers_the_last_token() {
    assert_eq!(predicted_cached_tokens(100, 6, 16), 96);
    assert_eq!(
        predicted_cached_tokens(96, 6, 16),
        80,
        "full prompt: last block recomputed"
    );
    assert_eq!(predicted_cached_tokens(97, 6, 16), 96);
    assert_eq!(predicted_cached_tokens(100, 2, 16), 32);
    assert_eq!(predicted_cached_tokens(0, 2, 16), 0);
    assert_eq!(predicted_cached_tokens(1, 0, 16), 0);
}

#[test]
fn longest_prefix_wins_when_idle() {
    let mut c = vec![cand("a:1"), cand("b:1"), cand("c:1")];
    c[1].matched_blocks = 50;
    c[2].matched_blocks = 10;
    let r = rank(&req(1000, 7), &c, &Weights::default());
    assert_eq!(addrs(&r, &c), ["b:1", "c:1", "a:1"]);
    assert_eq!(r.decision, Decision::Prefix);
    assert_eq!(r.order[0].predicted_cached_tokens, 800);
    assert_eq!(r.order[0].cost.uncached_tokens, 200);
}

#[test]
fn load_outweighs_a_prefix_eventually() {
    let w = Weights::default();
    let mut c = vec![cand("a:1"), cand("b:1")];
    // A 1000-token system prompt: caching it saves ~1010 prefill tokens
    // (992 + attention).
    c[0].matched_blocks = 62;
    c[0].running = 15; // 15 x 64 = 960 < 1010
    let r = rank(&req(1200, 1), &c, &w);
    assert_eq!(c[r.order[0].candidate].address, "a:1");
    c[0].running = 16; // 16 x 64 = 1024 > 1010
    let r = rank(&req(1200, 1), &c, &w);
    assert_eq!(c[r.order[0].candidate].address, "b:1");
    assert_eq!(r.decision, Decision::Load);
}

#[test]
fn shared_system_prompt_burst_spreads() {
    // Simulates a burst: every pick adds in-flight and queued prefill to
    // its endpoint, and the picked endpoint then holds the system prompt.
    let w = Weights::default();
    let names = ["a:1", "b:1", "c:1", "d:1"];
    let mut c: Vec<Candidate> = names.iter().map(|n| cand(n)).collect();
    c[0].matched_blocks = 62;
    let mut counts = [0usize; 4];
    for i in 0..40u64 {
        let r = rank(&req(1200, i), &c, &w);
        let e = r.order[0];
        counts[e.candidate] += 1;
        let cc = &mut c[e.candidate];
        cc.in_flight += 1;
        cc.queued_prefill_tokens += u64::from(e.cost.uncached_tokens);
        cc.matched_blocks = 62;
    }
    assert!(counts.iter().all(|&n| n >= 5), "{counts:?}");
}

#[test]
fn unhealthy_excluded_kv_full_excluded_unless_all() {
    let mut c = vec![cand("a:1"), cand("b:1"), cand("c:1")];
    c[0].healthy = false;
    c[1].saturated = true;
    c[1].left_out = true;
    let r = rank(&req(10, 0), &c, &Weights::default());
    assert_eq!(addrs(&r, &c), ["c:1"]);
    c[2].saturated = true;
    c[2].left_out = true;
    let r = rank(&req(10, 0), &c, &Weights::default());
    assert_eq!(r.decision, Decision::AllSaturated);
    assert_eq!(r.order.len(), 2);
    assert!(r.order.iter().all(|x| x.saturated));
    c[1].healthy = false;
    c[2].healthy = false;
    let r = rank(&req(10, 0), &c, &Weights::default());
    assert_eq!(r.decision, Decision::NoEndpoints);
    assert!(r.order.is_empty());
}

#[test]
fn queue_saturated_holder_stays_ranked_at_its_cost() {
    // The holder has 5 waiting (saturated by queue, KV not full): its
    // 6,400 cached tokens outweigh the queue terms, so it still wins.
    let mut c = vec![cand("a:1"), cand("b:1")];
    c[0].matched_blocks = 400;
    c[0].waiting = 5;
    c[0].saturated = true;
    let r = rank(&req(8000, 0), &c, &Weights::default());
    assert_eq!(addrs(&r, &c), ["a:1", "b:1"]);
    assert_eq!(r.decision, Decision::Prefix);
    assert!(r.order[0].saturated && !r.order[1].saturated);
    // With a long enough queue the idle endpoint is cheaper.
    c[0].waiting = 8;
    let r = rank(&req(8000, 0), &c, &Weights::default());
    assert_eq!(addrs(&r, &c), ["b:1", "a:1"]);
    assert_eq!(r.decision, Decision::Load);
}

#[test]
fn saturated_load_scales_the_load_terms_only_when_every_endpoint_is_saturated() {
    // Both saturated: the holder (6,400 cached tokens) has 20 waiting,
    // the other 8. At full load weights the 12 extra waiting requests
    // (12 x (1024 + 256)) outweigh the hit; at a quarter they do not.
    let mut c = vec![cand("a:1"), cand("b:1")];
    c[0].matched_blocks = 400;
    (c[0].waiting, c[1].waiting) = (20, 8);
    (c[0].saturated, c[1].saturated) = (true, true);
    let full = Weights {
        saturated_load: 1.0,
        ..Weights::default()
    };
    let quarter = Weights::default();
    let r = rank(&req(8000, 0), &c, &full);
    assert_eq!(
        (addrs(&r, &c)[0], r.decision),
        ("b:1", Decision::AllSaturated)
    );
    let r = rank(&req(8000, 0), &c, &quarter);
    assert_eq!(addrs(&r, &c)[0], "a:1");
    let scaled = r.order[0].cost;
    assert!(
        (scaled.queue - 0.25 * 1024.0 * 20.0).abs() < 1e-9,
        "{scaled:?}"
    );
    assert!(
        (scaled.decode - 0.25 * 64.0 * 20.0).abs() < 1e-9,
        "{scaled:?}"
    );
    // One endpoint below saturation: the weights apply unscaled.
    c[1].saturated = false;
    assert_eq!(
        rank(&req(8000, 0), &c, &quarter),
        rank(&req(8000, 0), &c, &full)
    );
}

#[test]
fn queue_skew_cap_ranks_a_runaway_holder_last() {
    // Both saturated; the holder has every block of a 100k-token prompt
    // but 300k prefill tokens queued, the other none. At the saturated
    // weights its queue costs ~19k against ~300k of prefill elsewhere,
    // so only the cap moves the request.
    let mut c = vec![cand("a:1"), cand("b:1")];
    c[0].matched_blocks = 100_000 / 16;
    c[0].queued_prefill_tokens = 300_000;
    (c[0].saturated, c[1].saturated) = (true, true);
    let capped = Weights {
        max_queue_skew: Some(262_144.0),
        ..Weights::default()
    };
    let r = rank(&req(100_000, 0), &c, &Weights::default());
    assert_eq!(addrs(&r, &c), ["a:1", "b:1"]);
    let r = rank(&req(100_000, 0), &c, &capped);
    assert_eq!(addrs(&r, &c), ["b:1", "a:1"]);
    assert_eq!(r.decision, Decision::AllSaturated);
    // Within the margin the cost decides again.
    c[1].queued_prefill_tokens = 300_000 - 262_144;
    let r = rank(&req(100_000, 0), &c, &capped);
    assert_eq!(addrs(&r, &c), ["a:1", "b:1"]);
}

#[test]
fn ties_are_deterministic_and_spread_by_seed() {
    let c = vec![
        cand("10.0.0.1:8000"),
        cand("10.0.0.2:8000"),
        cand("10.0.0.3:8000"),
    ];
    let w = Weights::default();
    let mut firsts = std::collections::BTreeSet::new();
    for seed in 0..64 {
        let a = rank(&req(100, seed), &c, &w);
        let b = rank(&req(100, seed), &c.clone(), &w);
        assert_eq!(a, b);
        firsts.insert(a.order[0].candidate);
    }
    assert_eq!(firsts.len(), 3, "ties spread over all endpoints");
    assert_eq!(seed_of("r1", &[]), seed_of("r1", &[1, 2]));
    assert_ne!(seed_of("", &[1]), seed_of("", &[2]));
}

#[test]
fn kv_penalty_and_queue_terms() {
    let w = Weights::default();
    let mut c = cand("a:1");
    let r = req(0, 0);
    assert_eq!(cost(&r, &c, &w).0.kv, 0.0);
    c.kv_usage = 0.7;
    assert_eq!(cost(&r, &c, &w).0.kv, 0.0);
    c.kv_usage = 1.0;
    assert!((cost(&r, &c, &w).0.kv - 8192.0).abs() < 1e-9);
    c.kv_usage = 0.0;
    c.waiting = 2;
    c.running = 1;
    let k = cost(&r, &c, &w).0;
    assert_eq!(k.queue, 2048.0);
    assert_eq!(k.decode, 3.0 * 64.0);
    c.in_flight = 5;
    assert_eq!(cost(&r, &c, &w).0.decode, 5.0 * 64.0);
}

#[test]
fn no_index_ignores_matches_and_max_endpoints_truncates() {
    let mut c = vec![cand("a:1"), cand("b:1"), cand("c:1")];
    c[0].matched_blocks = 10;
    c[0].running = 1;
    let mut r = req(200, 3);
    r.indexed = false;
    r.max_endpoints = 2;
    let out = rank(&r, &c, &Weights::default());
    assert_eq!(out.decision, Decision::NoIndex);
    assert_eq!(out.order.len(), 2);
    assert!(out.order.iter().all(|x| x.predicted_cached_tokens == 0));
    assert_ne!(c[out.order[0].candidate].address, "a:1");
}

#[test]
fn long_prompts_cost_more_than_their_length() {
    let w = Weights::default();
    assert_eq!(prefill_work(1000, 1000, w.attention), 0.0);
    // 15k tokens: +30%; 134k tokens: ~3.7x their length (the sim's
    // 1.2 ns per pair against 30 us per token).
    let x = prefill_work(15_000, 0, w.attention);
    assert!((x - 19_500.0).abs() < 1.0, "{x}");
    assert!(prefill_work(134_000, 0, w.attention) > 3.5 * 134_000.0);
    // A cached prefix removes its own pairs only.
    let tail = prefill_work(20_000, 16_000, w.attention);
    assert!((tail - (4_000.0 + 4e-5 * (4e8 - 2.56e8) / 2.0)).abs() < 1.0);

    // A short request avoids the endpoint with a huge prefill queued,
    // even when the other one has a few more requests running.
    let mut a = cand("a:1");
    a.queued_prefill_tokens = prefill_work(134_000, 0, w.attention) as u64;
    let mut b = cand("b:1");
    b.running = 40;
    let out = rank(&req(30, 1), &[a, b], &w);
    assert_eq!(out.order[0].candidate, 1);
    assert_eq!(out.order[0].cost.prefill_work, 30);
}

#[test]
fn weights_validate() {
    assert!(Weights::default().validate().is_ok());
    let w = Weights {
        kv_knee: 1.0,
        ..Default::default()
    };
    assert_eq!(w.validate().unwrap_err().0, "kvKnee");
    let w = Weights {
        queue: f64::NAN,
        ..Default::default()
    };
    assert_eq!(w.validate().unwrap_err().0, "queue");
    let w = Weights {
        saturated_load: -0.5,
        ..Default::default()
    };
    assert_eq!(w.validate().unwrap_err().0, "saturatedLoad");
    let w = Weights {
        max_queue_skew: Some(f64::INFINITY),
        ..Default::default()
    };
    assert_eq!(w.validate().unwrap_err().0, "maxQueueSkew");
    let w = Weights {
        max_queue_skew: Some(0.0),
        ..Default::default()
    };
    assert!(w.validate().is_ok());
}

#[test]
fn failing_endpoints_go_after_the_others_but_are_used_alone() {
    // The failing one looks idle (errors finish at once) and holds the
    // prefix: it would win on cost.
    let mut c = vec![cand("a"), cand("b"), cand("c")];
    c[0].matched_blocks = 10;
    c[1].running = 8;
    c[2].running = 4;
    let r = rank(&req(320, 1), &c, &Weights::default());
    assert_eq!(addrs(&r, &c), ["a", "c", "b"]);
    c[0].failing = true;
    let r = rank(&req(320, 1), &c, &Weights::default());
    assert_eq!(addrs(&r, &c), ["c", "b", "a"]);
    assert_eq!(r.decision, Decision::Load);
    // Every endpoint failing: the cost order again.
    for x in &mut c {
        x.failing = true;
    }
    let r = rank(&req(320, 1), &c, &Weights::default());
    assert_eq!(addrs(&r, &c), ["a", "c", "b"]);
    // Only a failing one: still answered.
    let r = rank(&req(320, 1), &c[..1], &Weights::default());
    assert_eq!(addrs(&r, &c[..1]), ["a"]);
}
