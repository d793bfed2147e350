use super::*;

fn cfg(shape: Shape, rate: f64, duration_s: f64) -> WorkloadConfig {
    WorkloadConfig::new(shape, rate, duration_s, 7)
}

fn planned(c: &WorkloadConfig) -> (ChatPlan, PlanStats) {
    let p = plan(c).unwrap();
    let s = stats(c, &p);
    (p, s)
}

#[test]
fn plans_are_deterministic_for_a_seed_and_differ_between_seeds() {
    for shape in Shape::ALL {
        let c = cfg(shape, 2.0, 60.0);
        let a = plan(&c).unwrap();
        assert_eq!(a, plan(&c).unwrap(), "{shape:?}");
        assert!(!a.conversations.is_empty(), "{shape:?}");
        let b = plan(&WorkloadConfig { seed: 8, ..c }).unwrap();
        assert_ne!(a.system_prompts, b.system_prompts, "{shape:?}");
        assert_ne!(
            a.conversations[0].turns, b.conversations[0].turns,
            "{shape:?}"
        );
        assert_eq!(Shape::parse(shape.name()), Some(shape));
    }
    assert_eq!(Shape::parse("chat"), None);
}

#[test]
fn twice_the_rate_sends_the_same_sessions_twice_as_densely() {
    for shape in [Shape::LongChat, Shape::Agents] {
        let (slow, s1) = planned(&cfg(shape, 1.0, 200.0));
        let (fast, s2) = planned(&cfg(shape, 2.0, 200.0));
        // Poisson arrivals: exactly half the times, the same sessions.
        for (a, b) in slow.conversations.iter().zip(&fast.conversations) {
            assert_eq!(a.turns, b.turns, "{shape:?}");
            assert_eq!(a.tenant, b.tenant);
            assert!((a.arrival_s / 2.0 - b.arrival_s).abs() < 1e-9);
        }
        let n = |t: f64, p: &ChatPlan| p.conversations.iter().filter(|c| c.arrival_s < t).count();
        assert_eq!(n(100.0, &fast), n(200.0, &slow), "{shape:?}");
        assert!(
            (1.7..2.3).contains(&(s2.sessions as f64 / s1.sessions as f64)),
            "{shape:?}"
        );
        assert_eq!(slow.system_prompts, fast.system_prompts);
    }
    // On/off arrivals: the bursts stay where they are (seconds), the same
    // requests come twice as densely within them.
    let slow = plan(&cfg(Shape::Bursty, 10.0, 60.0)).unwrap();
    let fast = plan(&cfg(Shape::Bursty, 20.0, 60.0)).unwrap();
    for (a, b) in slow.conversations.iter().zip(&fast.conversations) {
        assert_eq!(a.turns, b.turns);
        assert!(b.arrival_s <= a.arrival_s);
    }
    let n = |rate| arrivals(&cfg(Shape::Bursty, rate, 20_000.0)).len() as f64;
    let ratio = n(20.0) / n(10.0);
    assert!((1.95..2.05).contains(&ratio), "{ratio}");
}

#[test]
fn the_mean_rate_is_the_rate_asked_for() {
    for shape in Shape::ALL {
        let got = arrivals(&cfg(shape, 5.0, 20_000.0)).len() as f64 / 20_000.0;
        assert!((got / 5.0 - 1.0).abs() < 0.05, "{shape:?}: {got} per s");
    }
}

#[test]
fn longchat_grows_long_contexts_under_a_few_large_shared_system_prompts() {
    let c = cfg(Shape::LongChat, 2.0, 300.0);
    let (p, s) = planned(&c);
    assert_eq!(p.system_prompts.len(), 4);
    for sp in &p.system_prompts {
        let n = words_in(sp);
        assert!((4000..=8010).contains(&n), "{n}");
    }
    // Popularity 1/(i+1): the first prompt about 4x as often as the last.
    let mut by = [0usize; 4];
    for cv in &p.conversations {
        by[cv.tenant] += 1;
        assert!((1..=10).contains(&cv.turns.len()));
        for t in &cv.turns {
            assert!((150..=600).contains(&t.output_tokens));
            assert!(t.think_s >= 0.0);
        }
    }
    assert!(by[0] > 3 * by[3] && by[3] > 0, "{by:?}");
    // Few conversations are cut below 3 turns by the 30k cap.
    assert!(s.turns.mean > 5.0 && s.turns.mean < 7.0, "{:?}", s.turns);
    assert!(s.session_tokens.max <= 30_000.0, "{:?}", s.session_tokens);
    assert!(s.session_tokens.p50 > 15_000.0, "{:?}", s.session_tokens);
    assert!(s.prompt_tokens.p50 > 10_000.0, "{:?}", s.prompt_tokens);
    // About 30% of turns paste a document.
    let docs = p
        .conversations
        .iter()
        .flat_map(|cv| &cv.turns)
        .filter(|t| t.user.contains("a document to read"))
        .count() as f64
        / s.requests as f64;
    assert!((0.25..0.35).contains(&docs), "{docs}");
    // Most of every prompt is something an earlier request sent.
    assert!(
        s.shared_prefix_fraction > 0.85,
        "{}",
        s.shared_prefix_fraction
    );
    assert!(
        (0.2..0.6).contains(&s.system_fraction),
        "{}",
        s.system_fraction
    );
    assert!(
        (0.7..1.3).contains(&s.arrivals_per_s_dispersion),
        "{}",
        s.arrivals_per_s_dispersion
    );
}

#[test]
fn agents_take_many_small_steps_on_one_growing_context() {
    let c = cfg(Shape::Agents, 1.0, 300.0);
    let (p, s) = planned(&c);
    assert_eq!(p.system_prompts.len(), 3);
    let mut outputs = 0u64;
    let mut results = Vec::new();
    for a in &p.conversations {
        assert!((1..=50).contains(&a.turns.len()));
        assert!(a.turns[0].user.contains(", task: "));
        for (k, t) in a.turns.iter().enumerate().skip(1) {
            assert!(t
                .user
                .starts_with(&format!("Agent {}, result of call {}: ", a.id, k - 1)));
            results.push(words_in(&t.user) - 6);
        }
        for t in &a.turns {
            assert!((30..=150).contains(&t.output_tokens));
            outputs += u64::from(t.output_tokens);
        }
    }
    // 10-50 steps, a few cut by the 32k cap.
    assert!((27.0..33.0).contains(&s.turns.mean), "{:?}", s.turns);
    assert!(s.session_tokens.max <= 32_000.0, "{:?}", s.session_tokens);
    // Tool results log-uniform on 50..1500: median near sqrt(50 * 1500).
    results.sort_unstable();
    let median = results[results.len() / 2] as f64;
    assert!((230.0..330.0).contains(&median), "{median}");
    // Input to output around 100:1, nearly everything re-sent.
    let ratio = s.prompt_tokens.mean * s.requests as f64 / outputs as f64;
    assert!(ratio > 80.0, "{ratio}");
    assert!(
        s.shared_prefix_fraction > 0.9,
        "{}",
        s.shared_prefix_fraction
    );
    // Short tool pauses.
    let pauses: Vec<f64> = p
        .conversations
        .iter()
        .flat_map(|a| a.turns.iter().map(|t| t.think_s))
        .collect();
    let mean = pauses.iter().sum::<f64>() / pauses.len() as f64;
    assert!((1.3..1.7).contains(&mean), "{mean}");
}

#[test]
fn bursty_mixes_short_prompts_with_rare_long_documents_in_bursts() {
    let c = cfg(Shape::Bursty, 20.0, 300.0);
    let (p, s) = planned(&c);
    assert!(p.conversations.iter().all(|r| r.turns.len() == 1));
    let mut short = Vec::new();
    for r in &p.conversations {
        let t = &r.turns[0];
        let n = words_in(&t.user);
        if t.user.contains("summarise this document") {
            assert!((20_000..=60_010).contains(&n), "{n}");
            assert!((200..=600).contains(&t.output_tokens));
        } else {
            assert!((200..=1002).contains(&n), "{n}");
            assert!((50..=300).contains(&t.output_tokens));
            short.push(n);
        }
    }
    assert!(
        (0.03..0.05).contains(&s.long_request_fraction),
        "{}",
        s.long_request_fraction
    );
    // The documents carry most of the tokens.
    assert!(
        (0.5..0.8).contains(&s.long_token_fraction),
        "{}",
        s.long_token_fraction
    );
    // Short prompts log-uniform on 200..1000: median near 447.
    short.sort_unstable();
    let median = short[short.len() / 2] as f64;
    assert!((400.0..500.0).contains(&median), "{median}");
    // Little sharing: only the short client preambles repeat.
    assert!(
        s.shared_prefix_fraction < 0.05,
        "{}",
        s.shared_prefix_fraction
    );
    assert!(s.shared_prefix_fraction > 0.0);
    // Bursts: counts per second far more variable than Poisson's, and
    // the same parameters with a flat rate are Poisson.
    assert!(
        s.arrivals_per_s_dispersion > 5.0,
        "{}",
        s.arrivals_per_s_dispersion
    );
    assert!(s.arrival_gap_cv > 1.3, "{}", s.arrival_gap_cv);
    let flat = WorkloadConfig {
        shape: ShapeConfig::Bursty(BurstyConfig {
            peak_over_quiet: 1.0,
            ..BurstyConfig::default()
        }),
        ..c
    };
    let f = planned(&flat).1;
    assert!(
        (0.8..1.2).contains(&f.arrivals_per_s_dispersion),
        "{}",
        f.arrivals_per_s_dispersion
    );
    assert!(
        (0.9..1.1).contains(&f.arrival_gap_cv),
        "{}",
        f.arrival_gap_cv
    );
}

#[test]
fn about_half_of_the_bursty_requests_come_in_bursts() {
    let c = BurstyConfig::default();
    let spells = on_off(&c, 5000.0, 7);
    let times = arrivals(&cfg(Shape::Bursty, 10.0, 5000.0));
    let peak = spells.iter().map(|s| s.1).fold(0.0, f64::max);
    let in_burst = |t: f64| {
        let i = spells.partition_point(|s| s.0 <= t) - 1;
        spells[i].1 == peak
    };
    let on_time: f64 = spells
        .windows(2)
        .filter(|w| w[0].1 == peak)
        .map(|w| w[1].0.min(5000.0) - w[0].0)
        .sum::<f64>()
        / 5000.0;
    let share = times.iter().filter(|&&t| in_burst(t)).count() as f64 / times.len() as f64;
    // Bursts a quarter of the time (3 s of every 12 on average) carry
    // 8 * 3 / (8 * 3 + 9) = 73% of the requests.
    assert!((0.2..0.3).contains(&on_time), "{on_time}");
    assert!((0.65..0.8).contains(&share), "{share}");
}

#[test]
fn texts_repeat_whole_messages_so_prefixes_are_token_identical() {
    // Every session of a tenant sends the very same system message, and a
    // session's turns differ from other sessions' from their label on.
    let (p, _) = planned(&cfg(Shape::LongChat, 2.0, 60.0));
    let firsts: Vec<&str> = p
        .conversations
        .iter()
        .map(|c| c.turns[0].user.as_str())
        .collect();
    for (i, a) in firsts.iter().enumerate() {
        for b in &firsts[i + 1..] {
            // Labels end within the first 40 bytes; what follows differs.
            let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
            assert!(common < 40, "{a:.60} / {b:.60}");
        }
    }
    // Apart from the labels, texts are words of the single-token list.
    let vocab: std::collections::HashSet<&str> = crate::chat::WORDS.iter().copied().collect();
    for shape in Shape::ALL {
        let (p, _) = planned(&cfg(shape, 1.0, 30.0));
        for s in &p.system_prompts {
            let body = s.split_once(". ").unwrap().1;
            let tail = body.rsplit_once(". ").map_or(body, |x| x.1);
            assert!(tail.split(' ').all(|w| vocab.contains(w)), "{shape:?}");
        }
        for c in &p.conversations {
            for t in &c.turns {
                let body = t.user.split_once(": ").unwrap().1;
                assert!(body.split(' ').all(|w| vocab.contains(w)), "{shape:?}");
                // No doubled or trailing spaces: a word is a token.
                assert!(!t.user.contains("  ") && !t.user.ends_with(' '));
            }
        }
    }
}

#[test]
fn reused_content_and_the_longest_sequence_bound_what_the_caches_need() {
    let (p, s) = planned(&cfg(Shape::LongChat, 1.0, 60.0));
    let sys: u64 = p.system_prompts.iter().map(|x| words_in(x) as u64).sum();
    assert!(s.reused_tokens > sys);
    assert!(s.longest_sequence_tokens <= 30_000);
    let b = planned(&cfg(Shape::Bursty, 30.0, 60.0)).1;
    // Nothing but the preambles is reused; a document fits its sequence.
    assert!(b.reused_tokens < 4 * 80, "{}", b.reused_tokens);
    assert!(b.longest_sequence_tokens <= 60_000 + 600 + 100);
}

#[test]
fn bad_settings_name_the_field() {
    let e = plan(&cfg(Shape::Agents, 0.0, 10.0)).unwrap_err();
    assert_eq!(e.to_string(), "rate: must be > 0, got 0");
    let mut c = cfg(Shape::LongChat, 1.0, 10.0);
    c.shape = ShapeConfig::LongChat(LongChatConfig {
        turns: (5, 2),
        ..LongChatConfig::default()
    });
    assert_eq!(plan(&c).unwrap_err().field, "turns");
    c.shape = ShapeConfig::LongChat(LongChatConfig {
        max_context_tokens: 5000,
        ..LongChatConfig::default()
    });
    assert_eq!(plan(&c).unwrap_err().field, "max_context_tokens");
    c.shape = ShapeConfig::Bursty(BurstyConfig {
        peak_over_quiet: 0.5,
        ..BurstyConfig::default()
    });
    assert_eq!(plan(&c).unwrap_err().field, "peak_over_quiet");
    c.shape = ShapeConfig::Agents(AgentsConfig {
        kinds: 17,
        ..AgentsConfig::default()
    });
    assert_eq!(plan(&c).unwrap_err().field, "kinds");
}
