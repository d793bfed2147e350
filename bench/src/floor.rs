//! Unqueued TTFT: what a run's requests would take with no queueing at
//! all, each alone on an idle engine ([`EngineModel::unqueued_ttft_ms`]).
//!
//! Priced at the prefixes the run actually reused, it splits a router's
//! TTFT into what its cache hits leave to compute and what queueing adds.
//! Priced at the best reuse any router could get, it is the floor a TTFT
//! target is judged against: no routing goes below it. For the chat
//! workload that best reuse is [`chat_best_reuse`]; for the trace, one
//! pooled cache's ([`crate::bound`]) stands in, a yardstick rather than a
//! strict best.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::bound::EngineModel;
use crate::queue::{self, Job};
use crate::record::{Outcome, Record};
use crate::stats::Dist;

/// The unqueued TTFT of one run's requests.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Unqueued {
    /// `trace` or `chat`.
    pub workload: String,
    /// Routing mode of the run.
    pub mode: String,
    /// Load factor of the run.
    pub load: f64,
    /// At the prefixes the run reused.
    pub own: Dist,
    /// At the best reuse any router could get, where computed (chat).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best: Option<Dist>,
    /// Prompt tokens the best reuse would find cached, over all prompt
    /// tokens, where computed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_hit_rate: Option<f64>,
    /// TTFT with queueing priced too: the run's requests in FCFS prefill
    /// queues on the engines that served them, at their own reuse
    /// ([`crate::queue::on_own_engines`]); set against the measured TTFT
    /// it checks the queue model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued_own: Option<Dist>,
    /// The same arrivals perfectly balanced over the engines (least work
    /// left, [`crate::queue::balanced`]) at the run's own reuse.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balanced: Option<Dist>,
    /// Perfectly balanced at the best reuse, where that is computed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub balanced_best: Option<Dist>,
}

fn answered(r: &Record) -> bool {
    r.outcome == Outcome::Ok && r.ttft_ms.is_finite()
}

/// The distribution of unqueued TTFTs of the answered `records`, each with
/// `reuse(record)` prompt tokens cached.
pub fn unqueued_dist(
    records: &[Record],
    reuse: &dyn Fn(&Record) -> u64,
    model: &EngineModel,
) -> Dist {
    dist_of(records.iter().map(|r| (r, reuse(r))), model)
}

/// [`unqueued_dist`] of (record, cached tokens) pairs.
fn dist_of<'a>(pairs: impl Iterator<Item = (&'a Record, u64)>, model: &EngineModel) -> Dist {
    Dist::of(
        pairs
            .filter(|(r, _)| answered(r))
            .map(|(r, c)| model.unqueued_ttft_ms(r.prompt_tokens as usize, c as usize))
            .collect(),
    )
}

/// For each of `records` (one chat run), the most prompt tokens any router
/// could have found cached, with every earlier request's KV kept forever:
/// a later turn reuses its whole previous turn (prompt and answer, which
/// the engine caches too), a first turn its tenant's system prompt unless
/// no request of that tenant came before it. The system prompt's length is
/// not in the records, so it is taken as the most any first turn of that
/// tenant reused in any of `runs` (all replaying the same conversations);
/// every figure is cut to whole `block_tokens` blocks and below the last
/// prompt token, as vLLM reuses. An over-estimate only lowers the floor, so
/// the floor stays one.
pub fn chat_best_reuse(records: &[Record], runs: &[&[Record]], block_tokens: u64) -> Vec<u64> {
    best_reuse(records, runs, block_tokens, &system_prompts(records, runs))
}

/// [`chat_best_reuse`] with the tenants' system prompts given
/// ([`system_prompts`]).
fn best_reuse(
    records: &[Record],
    runs: &[&[Record]],
    block_tokens: u64,
    system: &HashMap<&str, u64>,
) -> Vec<u64> {
    let block = block_tokens.max(1);
    let mut turns: HashMap<(usize, usize), (u64, u64)> = HashMap::new();
    for r in runs.iter().flat_map(|rs| rs.iter()).chain(records) {
        let Some(c) = r.conversation else { continue };
        if r.outcome == Outcome::Ok {
            turns.insert((c, r.turn), (r.prompt_tokens, r.completion_tokens));
        }
    }
    // A tenant's first request by send time has nothing to reuse.
    let mut first: HashMap<&str, (f64, usize)> = HashMap::new();
    for r in records {
        let e = first.entry(r.tenant.as_str()).or_insert((r.sent_s, r.id));
        if r.sent_s < e.0 {
            *e = (r.sent_s, r.id);
        }
    }
    records
        .iter()
        .map(|r| {
            let best = match r.conversation {
                Some(c) if r.turn > 0 => {
                    turns.get(&(c, r.turn - 1)).map_or(0, |&(p, done)| p + done)
                }
                Some(_) if first.get(r.tenant.as_str()).map(|f| f.1) != Some(r.id) => {
                    system.get(r.tenant.as_str()).copied().unwrap_or(0)
                }
                _ => 0,
            };
            let best = best.min(r.prompt_tokens.saturating_sub(1)) / block * block;
            best.max(r.cached_tokens)
        })
        .collect()
}

/// Each tenant's system prompt in tokens, as far as the records show it:
/// the most any answered first turn of that tenant found cached, in
/// `records` or any of `runs` (replaying the same conversations).
pub fn system_prompts<'a>(records: &'a [Record], runs: &[&'a [Record]]) -> HashMap<&'a str, u64> {
    let mut system: HashMap<&str, u64> = HashMap::new();
    for r in runs.iter().flat_map(|rs| rs.iter()).chain(records) {
        if r.conversation.is_some() && r.turn == 0 && r.outcome == Outcome::Ok {
            let s = system.entry(r.tenant.as_str()).or_default();
            *s = (*s).max(r.cached_tokens);
        }
    }
    system
}

/// The answered `records` as queue jobs (arrival at their send time), each
/// with `cached` prompt tokens reused, paired with the record.
fn jobs<'a>(
    records: &'a [Record],
    cached: &'a [u64],
    model: &'a EngineModel,
) -> impl Iterator<Item = (Job, &'a Record)> + 'a {
    records
        .iter()
        .zip(cached)
        .filter(|(r, _)| answered(r))
        .map(|(r, &c)| {
            let job = Job {
                arrival_ms: r.sent_s * 1e3,
                service_ms: model.unqueued_ttft_ms(r.prompt_tokens as usize, c as usize),
            };
            (job, r)
        })
}

/// A run's unqueued TTFT at its own reuse, and its queueing yardsticks
/// ([`crate::queue`]) over `engines` engines: on its own engine choices, and
/// balanced at its own reuse and, given one figure per record, at `best`
/// (`meta`: workload, mode, load).
pub fn at_own_reuse(
    meta: (&str, &str, f64),
    records: &[Record],
    engines: usize,
    best: Option<&[u64]>,
    model: &EngineModel,
) -> Unqueued {
    let own: Vec<u64> = records.iter().map(|r| r.cached_tokens).collect();
    let on_own: Vec<(Job, &str)> = jobs(records, &own, model)
        .map(|(j, r)| (j, r.endpoint.as_str()))
        .collect();
    let plain: Vec<Job> = on_own.iter().map(|(j, _)| *j).collect();
    let balanced_best = best.filter(|b| b.len() == records.len()).map(|b| {
        let at_best: Vec<Job> = jobs(records, b, model).map(|(j, _)| j).collect();
        Dist::of(queue::balanced(&at_best, engines))
    });
    Unqueued {
        workload: meta.0.into(),
        mode: meta.1.into(),
        load: meta.2,
        own: unqueued_dist(records, &|r| r.cached_tokens, model),
        best: None,
        best_hit_rate: None,
        queued_own: (!on_own.is_empty()).then(|| Dist::of(queue::on_own_engines(&on_own))),
        balanced: (!plain.is_empty()).then(|| Dist::of(queue::balanced(&plain, engines))),
        balanced_best,
    }
}

/// The chat run's unqueued TTFT at its own reuse and at the best
/// ([`chat_best_reuse`], with `runs` all runs of the same workload).
pub fn chat(
    meta: (&str, f64),
    records: &[Record],
    runs: &[&[Record]],
    block_tokens: u64,
    engines: usize,
    model: &EngineModel,
) -> Unqueued {
    let system = system_prompts(records, runs);
    // One best figure per record, in the records' order.
    let best = best_reuse(records, runs, block_tokens, &system);
    let pairs = || records.iter().zip(best.iter().copied());
    let (mut hit, mut all) = (0u64, 0u64);
    for (r, c) in pairs().filter(|(r, _)| answered(r)) {
        hit += c;
        all += r.prompt_tokens;
    }
    Unqueued {
        best: Some(dist_of(pairs(), model)),
        best_hit_rate: (all > 0).then(|| hit as f64 / all as f64),
        ..at_own_reuse(
            ("chat", meta.0, meta.1),
            records,
            engines,
            Some(&best),
            model,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vllm_latency::LatencyProfile;

    fn rec(id: usize, tenant: &str, conv: usize, turn: usize, sent: f64, p: u64, c: u64) -> Record {
        Record {
            id,
            tenant: tenant.into(),
            conversation: Some(conv),
            turn,
            sent_s: sent,
            ttft_ms: 50.0,
            itl_ms: 5.0,
            e2e_ms: 500.0,
            prompt_tokens: p,
            cached_tokens: c,
            completion_tokens: 100,
            endpoint: "e".into(),
            status: 200,
            outcome: Outcome::Ok,
            error: String::new(),
        }
    }

    /// The engines the routing benchmark runs.
    fn h100() -> EngineModel {
        EngineModel {
            profile: LatencyProfile::h100_8b(),
            max_num_batched_tokens: 8192,
        }
    }

    #[test]
    fn best_reuse_is_the_previous_turn_or_the_tenants_system_prompt() {
        let run = vec![
            // t1's first request: nothing before it.
            rec(0, "t1", 0, 0, 0.0, 3000, 0),
            // Its next turn: previous prompt + answer = 3100 -> 3088 in blocks.
            rec(1, "t1", 0, 1, 2.0, 3600, 0),
            // Another t1 conversation: the system prompt, 2496 as reused elsewhere.
            rec(2, "t1", 1, 0, 3.0, 2900, 0),
        ];
        // Another mode served conversation 1 with the system prompt cached.
        let other = vec![rec(2, "t1", 1, 0, 3.0, 2900, 2496)];
        let best = chat_best_reuse(&run, &[&run, &other], 16);
        assert_eq!(best, vec![0, 3088, 2496]);
    }

    #[test]
    fn best_reuse_stays_below_the_last_prompt_token_and_never_below_what_was_reused() {
        // Previous turn's prompt + answer covers the whole next prompt.
        let run = vec![
            rec(0, "t", 0, 0, 0.0, 1000, 0),
            rec(1, "t", 0, 1, 1.0, 1050, 1040),
        ];
        // min(1100, 1049) = 1049 -> 1040 in 16-token blocks.
        assert_eq!(chat_best_reuse(&run, &[&run], 16), vec![0, 1040]);
        let odd = vec![
            rec(0, "t", 0, 0, 0.0, 1000, 0),
            rec(1, "t", 0, 1, 1.0, 1050, 1045),
        ];
        assert_eq!(chat_best_reuse(&odd, &[&odd], 16)[1], 1045);
    }

    #[test]
    fn the_best_reuse_floor_is_never_above_the_own_reuse_price() {
        let m = h100();
        let run = vec![
            rec(0, "t1", 0, 0, 0.0, 3000, 0),
            rec(1, "t1", 0, 1, 2.0, 3600, 1000),
            rec(2, "t1", 1, 0, 3.0, 2900, 0),
        ];
        let other = vec![rec(2, "t1", 1, 0, 3.0, 2900, 2496)];
        let u = chat(("kvasir", 1.0), &run, &[&run, &other], 16, 8, &m);
        let best = u.best.unwrap();
        assert!(best.mean < u.own.mean && best.p99 <= u.own.p99, "{u:?}");
        let want = (m.unqueued_ttft_ms(3000, 0)
            + m.unqueued_ttft_ms(3600, 3088)
            + m.unqueued_ttft_ms(2900, 2496))
            / 3.0;
        assert!((best.mean - want).abs() < 1e-9);
        let hit = u.best_hit_rate.unwrap();
        assert!((hit - (3088.0 + 2496.0) / 9500.0).abs() < 1e-12, "{hit}");
    }

    #[test]
    fn unanswered_requests_are_left_out() {
        let m = h100();
        let mut lost = rec(1, "t", 0, 1, 1.0, 5000, 0);
        lost.outcome = Outcome::Timeout;
        lost.ttft_ms = f64::NAN;
        let run = vec![rec(0, "t", 0, 0, 0.0, 1000, 0), lost];
        let d = unqueued_dist(&run, &|r| r.cached_tokens, &m);
        assert!((d.mean - m.unqueued_ttft_ms(1000, 0)).abs() < 1e-9);
    }
}
