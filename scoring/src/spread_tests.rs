//! The `placement` term: cold and shared-only prefixes spread over idle
//! endpoints, later turns stay where their history is.

use std::collections::HashSet;

use super::placements::Placements;
use super::*;

fn idle(address: &str, matched_blocks: u32, recent_placements: f64) -> Candidate<'_> {
    Candidate {
        address,
        matched_blocks,
        running: 0,
        waiting: 0,
        kv_usage: 0.0,
        in_flight: 0,
        queued_prefill_tokens: 0,
        healthy: true,
        saturated: false,
        left_out: false,
        failing: false,
        recent_placements,
    }
}

fn starting(prompt_tokens: u32, seed: u64) -> Request {
    Request {
        prompt_tokens,
        block_size: 16,
        seed,
        max_endpoints: 0,
        indexed: true,
        starts_conversation: true,
    }
}

#[test]
fn a_new_conversation_leaves_a_shared_prompt_for_the_least_placed() {
    // A 1,500-token system prompt cached on `a`, which just took a
    // conversation; `b` and `c` took none.
    let c = [idle("a", 94, 1.0), idle("b", 0, 0.0), idle("c", 0, 0.0)];
    let w = Weights::default();
    let r = rank(&starting(1520, 3), &c, &w);
    assert_ne!(c[r.order[0].candidate].address, "a", "{r:?}");
    assert_eq!(r.decision, Decision::Load);
    let a = r.order.iter().find(|x| x.candidate == 0).expect("a ranked");
    assert_eq!(a.cost.placement, w.placement);
    assert!(r.order[..2].iter().all(|x| x.cost.placement == 0.0));
    // The same request as a later turn pays no placement: the prefix wins.
    let later = Request {
        starts_conversation: false,
        ..starting(1520, 3)
    };
    let r = rank(&later, &c, &w);
    assert_eq!(r.order[0].candidate, 0);
    assert!(r.order.iter().all(|x| x.cost.placement == 0.0));
    // Off: the prefix wins too.
    let off = Weights {
        placement: 0.0,
        ..Weights::default()
    };
    assert_eq!(rank(&starting(1520, 3), &c, &off).order[0].candidate, 0);
}

#[test]
fn only_the_excess_over_the_least_placed_counts_relative_to_it() {
    let w = Weights::default();
    // Few conversations each: one more is a whole placement.
    let c = [idle("a", 0, 2.0), idle("b", 0, 0.0), idle("c", 0, 0.5)];
    let r = rank(&starting(100, 1), &c, &w);
    let by = |i: usize| r.order.iter().find(|x| x.candidate == i).expect("ranked");
    assert_eq!(by(1).cost.placement, 0.0);
    assert_eq!(by(0).cost.placement, w.placement, "capped at one placement");
    assert_eq!(by(2).cost.placement, 0.5 * w.placement);
    assert_eq!(r.order[0].candidate, 1);
    // Many each: the same difference is a small share of an endpoint's
    // conversations, and weighs that share.
    let c = [idle("a", 0, 7.0), idle("b", 0, 5.0), idle("c", 0, 5.5)];
    let r = rank(&starting(100, 1), &c, &w);
    let by = |i: usize| r.order.iter().find(|x| x.candidate == i).expect("ranked");
    assert_eq!(by(1).cost.placement, 0.0);
    assert_eq!(by(0).cost.placement, 0.4 * w.placement);
    assert_eq!(by(2).cost.placement, 0.1 * w.placement);
    assert_eq!(r.order[0].candidate, 1);
    // An unhealthy endpoint's count is no baseline.
    let mut c = c;
    c[1].healthy = false;
    let r = rank(&starting(100, 1), &c, &w);
    assert_eq!(r.order[0].candidate, 2);
    assert_eq!(r.order[0].cost.placement, 0.0);
    // Nonsense counts read as none.
    let c = [idle("a", 0, f64::NAN), idle("b", 0, -3.0)];
    let r = rank(&starting(100, 1), &c, &w);
    assert!(r.order.iter().all(|x| x.cost.placement == 0.0));
}

#[test]
fn a_shared_prefix_longer_than_a_placement_stays_with_its_holder() {
    // A 4k-token shared document, however many conversations its holder
    // started: spreading it is worth at most one placement.
    let w = Weights::default();
    for placed in [1.0, 2.0, 8.0, 100.0] {
        let c = [idle("a", 256, placed), idle("b", 0, 0.0)];
        assert_eq!(rank(&starting(4_600, 9), &c, &w).order[0].candidate, 0);
    }
}

#[test]
fn saturation_scales_placement_like_the_other_load_terms() {
    let w = Weights::default();
    let mut c = [idle("a", 0, 1.0), idle("b", 0, 0.0)];
    for x in &mut c {
        x.saturated = true;
    }
    let r = rank(&starting(100, 1), &c, &w);
    assert_eq!(r.decision, Decision::AllSaturated);
    let a = r.order.iter().find(|x| x.candidate == 0).expect("ranked");
    assert_eq!(a.cost.placement, w.placement * w.saturated_load);
}

#[test]
fn placement_weights_are_validated() {
    for (w, field) in [
        (
            Weights {
                placement: -1.0,
                ..Weights::default()
            },
            "placement",
        ),
        (
            Weights {
                placement_half_life_ms: 0.0,
                ..Weights::default()
            },
            "placementHalfLifeMs",
        ),
        (
            Weights {
                placement_half_life_ms: f64::NAN,
                ..Weights::default()
            },
            "placementHalfLifeMs",
        ),
    ] {
        assert_eq!(w.validate().unwrap_err().0, field);
    }
    let w = Weights {
        placement: 0.0,
        placement_half_life_ms: 5000.0,
        ..Weights::default()
    };
    assert!(w.validate().is_ok());
}

/// The demo, modelled: a chat template's head block every prompt shares,
/// two tenants with a ~1,500-token system prompt each, three
/// conversations per tenant, turns sent one at a time to idle engines that
/// cache every prompt and answer they serve.
struct Demo {
    placements: Placements<usize>,
    caches: Vec<HashSet<u64>>,
    prompts: Vec<Vec<u32>>,
    now_ms: f64,
}

const BLOCK: usize = 16;
const ADDRS: [&str; 3] = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];

fn chain(tokens: &[u32]) -> Vec<u64> {
    let mut prev = 0u64;
    tokens
        .chunks_exact(BLOCK)
        .map(|b| {
            let bytes: Vec<u8> = b.iter().flat_map(|t| t.to_le_bytes()).collect();
            prev = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, prev);
            prev
        })
        .collect()
}

impl Demo {
    fn new(w: &Weights) -> Demo {
        let head: Vec<u32> = (0..BLOCK as u32).collect();
        let prompts = (0..6u32)
            .map(|conv| {
                let tenant = conv / 3;
                let mut p = head.clone();
                p.extend((0..1500).map(|i| 100_000 * (tenant + 1) + i));
                p.extend((0..20).map(|i| 1_000_000 * (conv + 1) + i));
                p
            })
            .collect();
        Demo {
            placements: Placements::new(w.placement_half_life_ms, 1024),
            caches: vec![HashSet::new(); ADDRS.len()],
            prompts,
            now_ms: 0.0,
        }
    }

    /// Sends conversation `conv`'s next turn; returns where it went.
    fn turn(&mut self, conv: usize, turn: u32, w: &Weights) -> usize {
        let prompt = &self.prompts[conv];
        let ch = chain(prompt);
        let held = |cache: &HashSet<u64>| ch.iter().take_while(|h| cache.contains(h)).count();
        let c: Vec<Candidate<'_>> = ADDRS
            .iter()
            .zip(&self.caches)
            .enumerate()
            .map(|(i, (a, cache))| {
                let n = u32::try_from(held(cache)).expect("small");
                idle(a, n, self.placements.recent(i, self.now_ms))
            })
            .collect();
        let starts = self.placements.starts_conversation(&ch);
        let req = Request {
            starts_conversation: starts,
            ..starting(
                u32::try_from(prompt.len()).expect("small"),
                seed_of(&format!("conv-{conv}-turn-{turn}"), &[]),
            )
        };
        let first = rank(&req, &c, w).order[0].candidate;
        self.placements.record(first, &ch, starts, self.now_ms);
        // The answer and the next question extend the prompt; the engine
        // caches the prompt and the answer.
        let p = &mut self.prompts[conv];
        p.extend((0..24).map(|i| 10_000_000 * (conv as u32 + 1) + 100 * turn + i));
        self.caches[first].extend(chain(p));
        p.extend((0..20).map(|i| 20_000_000 * (conv as u32 + 1) + 100 * turn + i));
        self.now_ms += 300.0;
        first
    }
}

#[test]
fn the_demo_spreads_two_per_engine_and_stays_put() {
    let w = Weights::default();
    let mut demo = Demo::new(&w);
    let homes: Vec<usize> = (0..6).map(|conv| demo.turn(conv, 1, &w)).collect();
    let mut per = [0; 3];
    for &h in &homes {
        per[h] += 1;
    }
    assert_eq!(per, [2, 2, 2], "homes {homes:?}");
    for turn in 2..=4 {
        for (conv, &home) in homes.iter().enumerate() {
            assert_eq!(demo.turn(conv, turn, &w), home, "conv {conv} turn {turn}");
        }
    }
}

#[test]
fn without_placement_the_demo_piles_onto_one_engine() {
    // The root cause, kept as a test: the shared template head is a real
    // (one-block) prefix hit, and so is a tenant's system prompt, and every
    // load term is zero when turns come one at a time.
    let w = Weights {
        placement: 0.0,
        ..Weights::default()
    };
    let mut demo = Demo::new(&w);
    let homes: HashSet<usize> = (0..6).map(|conv| demo.turn(conv, 1, &w)).collect();
    assert_eq!(homes.len(), 1, "{homes:?}");
}
