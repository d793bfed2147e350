//! Kvasir's endpoint scoring: pure functions from (request, per-endpoint
//! state) to an ordered endpoint list. No I/O, no clocks, no randomness: two
//! replicas with the same state give the same answer.
//!
//! The cache-indexer's picker ranks with it (re-exported there as
//! `kvasir_cache_indexer::scoring`), and so does the routing benchmark's
//! offline cluster model, which therefore needs none of the indexer's
//! service dependencies.
//!
//! # The cost
//!
//! Every term is in one unit, **prefill-token equivalents** (the time the
//! engine needs to prefill one token: ~0.03 ms for an 8B model on an H100,
//! FACTS.md), so the weights read as "how many prompt tokens is this worth":
//!
//! ```text
//! cost = w_prefill * (prefill work of this request + w_queued * queued prefill work)
//!      + w_decode  * max(running + waiting, in_flight)
//!      + w_queue   * waiting
//!      + w_kv      * max(0, (kv_usage - kv_knee) / (1 - kv_knee))^2
//!      + w_place   * min(1, (placed - least placed) / max(1, least placed))
//!                      (only for a request that starts a conversation)
//! ```
//!
//! * *prefill work*: the uncached prompt tokens plus attention's share,
//!   `uncached + w_attention * (prompt^2 - cached^2) / 2`: every new token
//!   attends to every token before it, so a 130k-token prompt costs several
//!   times its length (the simulator's and FACTS.md's model: ~1.2 ns per
//!   (token, context) pair against ~30 us per token, `w_attention = 4e-5`).
//!   Counting tokens alone made the picker put short requests behind a long
//!   prompt's prefill on the Mooncake trace.
//! * *uncached prompt tokens*: `prompt - predicted_cached`, where the
//!   prediction is the endpoint's longest cached prefix in full blocks, at
//!   most the blocks before the prompt's last token (vLLM always computes the
//!   last token, so a fully cached prompt still recomputes its last block).
//! * *queued prefill*: prefill work of this indexer's earlier picks to the
//!   endpoint that have not reached their first token: work the engine has
//!   accepted (or is about to) and will do before ours. This is what stops a
//!   burst of requests sharing a system prompt from all landing on the one
//!   endpoint that holds it (FACTS.md: "a load term is required"): each pick
//!   there adds its own uncached suffix to that endpoint's queue, so after a
//!   few picks another endpoint is cheaper even though it must prefill the
//!   system prompt once (after which it holds it too).
//! * *active requests*: the engine's own count (scraped, lagging by up to one
//!   interval) or the indexer's in-flight count (immediate, but only this
//!   replica's picks), whichever is larger.
//! * *recent placements*: conversations started on the endpoint lately, a
//!   count decaying with `placementHalfLifeMs` ([`placements`]: a request
//!   starts a conversation when its prompt extends no earlier pick's
//!   prompt). Where a conversation starts is where its later turns go (they
//!   find their history there), so this is load the endpoint has committed
//!   to that none of the other terms sees yet: with turns sent one at a
//!   time to idle engines every load term is zero whenever a request
//!   arrives. What counts is the excess over the least-placed ranked
//!   endpoint, relative to that endpoint's count once it exceeds one: one
//!   conversation more is a whole placement when engines hold one or two
//!   each, and a small share of the load when they hold dozens (then the
//!   other load terms see the conversations' turns, and a raw count
//!   difference, which grows with the arrival rate, would override them).
//!   It is capped at one placement: that is the most prefill spreading may
//!   cost now for load that may come later, so a shared prefix longer than
//!   `placement` (a document many one-shot requests ask about) stays with
//!   its holder until load moves it, as before.
//!   Only a request that starts a conversation pays it: a later turn pays
//!   nothing, so its stickiness is exactly what the other terms make it.
//!
//! # Default weights and why
//!
//! The measured results behind these defaults (which runs, which loads,
//! how many) are in `bench/results/scoring_weights.md`; here, the reasons.
//!
//! * `prefill = 1`: the unit.
//! * `decode = 64`: a running sequence adds ~20 us of scheduling plus its
//!   KV reads (~0.04 us per context token) to every step of the batch (the
//!   simulator's and FACTS.md's H100 model): ~100-600 us a step at 2k-15k
//!   tokens of context, i.e. 3-20 prefill tokens for each step our prefill
//!   shares with it. Over a whole ~100-token completion it would be ~300
//!   tokens (the figure this default was first set from, 256), but the
//!   load term decides where this request's first token comes soonest, and
//!   at 256 about 4 running requests outweighed a 1k-token cached prefix,
//!   which moved chat turns off the engine holding their history (every
//!   token of the chat's shortfall against the best reuse was a moved
//!   turn). At 64, 16 running requests outweigh 1k cached tokens and ~160
//!   a 10k-token history. 64 against 256 lowered the chat's TTFT and left
//!   the whole trace no worse (the 2-minute trace window from cold, which
//!   an earlier build's 256 was chosen on, was somewhat worse); 16 was no
//!   clear gain over 64 (measured: bench/results/scoring_weights.md).
//! * `attention = 4e-5`: see *prefill work* above.
//! * `queuedPrefill = 0.25`: queued work counts a quarter of the request's
//!   own. Prefill this request does here delays every request queued after
//!   it as well, so trading a cache hit for a shorter queue is worth less
//!   than the queue's length suggests. At 1.0 the picker spreads prefixes
//!   until nobody finds them (lower hit rate, slower TTFT); at 0.1 and
//!   below it piles long prompts onto their holders (a far worse p99)
//!   (measured: bench/results/scoring_weights.md).
//! * `queue = 1024`: a waiting request means the engine is already out of
//!   batch slots or KV space; ours waits behind at least one more prefill
//!   step (~30 ms fixed cost = ~1000 tokens). 16384 was worse on the whole
//!   trace (measured: bench/results/scoring_weights.md).
//! * `placement = 2048`, `placementHalfLifeMs = 60000`: a conversation
//!   brings its later turns to the engine it starts on, each an active
//!   request there (`decode`) for the others' turns; 2048 is 32 of those.
//!   What it buys: a new conversation whose only cached part is a shared
//!   system prompt or template (a real prefix hit, but one another engine
//!   prefills once in tens of milliseconds and then holds too) goes to the
//!   engine that has taken the fewest conversations, so tenants' and
//!   conversations' prompts spread over idle engines instead of all
//!   following the first one. A shared prefix longer than that (a
//!   document, a long few-shot set) stays with its holder (the term is
//!   capped at one placement). Later turns are not charged, so it never
//!   moves a conversation. The half-life is about a chat's length: the
//!   conversations that still send turns. 0 turns the term off.
//! * `kv = 8192`, `kvKnee = 0.7`: KV usage (blocks pinned by running
//!   requests) above ~70% means new requests start evicting cached prefixes
//!   and, near 100%, preemption (recomputation of whole sequences). The
//!   quadratic penalty is negligible at the knee and equals a long prompt's
//!   prefill at full usage.
//!
//! Ties (equal cost, e.g. an idle pool, equal placements and a brand-new
//! prompt) are broken by
//! a hash of the request's seed (its request id) and the endpoint address:
//! stable across replicas, and spread across endpoints over requests.
//!
//! *Failing* endpoints (most of their recent requests ended in ERROR or
//! TIMEOUT, the cache-indexer's `health` module) go after every other one
//! whatever their cost: failing fast makes an engine look idle.
//!
//! Unhealthy endpoints are left out, and so are *KV-full* ones (KV usage at
//! the saturation threshold: admitting more there preempts running
//! sequences) unless every healthy one is KV-full. An endpoint saturated by
//! its waiting queue alone stays in the ranking at its cost: the queue terms
//! already price that queue in the same unit as the cache hit.
//! `saturation.leaveOutQueued: true` leaves such endpoints out too. Leaving
//! them out wins once queues are deep everywhere and loses while they
//! build; no rule tried wins both (measured:
//! bench/results/scoring_weights.md). Ranking stays the default because a
//! pool is run to ride out bursts, not to live in a backlog; one that does
//! should set `leaveOutQueued`.
//!
//! When every healthy endpoint is saturated the decision says so (the
//! caller may shed instead) and the load terms (`decode`, `queue`,
//! `queuedPrefill`, `placement`) count `saturatedLoad = 0.25` of their weight: queues
//! exist everywhere then, their differences decide less about when a
//! request is served than the prefill work a pick adds to the pool. At full
//! weight they moved more requests off their prefix holders (lower hit
//! rates); at 0 requests pile onto their holders (measured:
//! bench/results/scoring_weights.md). It changes nothing while any
//! endpoint has room (every other run of the benchmark).
//!
//! At those weights one endpoint's queue can run far ahead of the others'
//! (in the whole-trace runs at twice the benchmark's base load, the p99 was
//! one engine's queue).
//! `maxQueueSkew` (off by default) bounds that: an endpoint whose queued
//! prefill work exceeds the least-queued ranked endpoint's by more than it
//! is ranked after every endpoint within the margin. It buys the tail with
//! the mean and p90 (the runaway queue holds long prompts with big cached
//! prefixes; spreading it makes every queue long), so it stays off; a pool
//! with a tail-latency objective can set it (measured:
//! bench/results/scoring_weights.md).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod placements;

use serde::{Deserialize, Serialize};

/// Scoring weights (see the module docs for the defaults' reasoning).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Weights {
    /// Cost per uncached or queued prefill token (the unit).
    pub prefill: f64,
    /// Cost per active request (running + waiting, or in flight).
    pub decode: f64,
    /// Extra cost per waiting request.
    pub queue: f64,
    /// KV penalty at 100% usage.
    pub kv: f64,
    /// KV usage where the penalty starts, 0..1.
    #[serde(alias = "kv_knee")]
    pub kv_knee: f64,
    /// Prefill work per (new token, earlier token) pair, in prefill tokens:
    /// attention's quadratic share of a long prompt's prefill.
    pub attention: f64,
    /// Weight of earlier picks' queued prefill work relative to this
    /// request's own (`prefill`): below 1, the picker prefers waiting
    /// behind others' prefills to doing more prefill work itself (work it
    /// adds delays everyone queued after it, too).
    #[serde(alias = "queued_prefill")]
    pub queued_prefill: f64,
    /// Multiplier of the load terms (`decode`, `queue`, `queuedPrefill`,
    /// `placement`) when every healthy endpoint is saturated: queues then exist
    /// everywhere, and what a pick still changes is how much prefill work
    /// the pool must do.
    #[serde(alias = "saturated_load")]
    pub saturated_load: f64,
    /// Most queued prefill work (prefill-token equivalents) an endpoint may
    /// have above the least-queued ranked one before it is ranked after
    /// every endpoint within that margin; `None` (the default) is no cap.
    #[serde(alias = "max_queue_skew")]
    pub max_queue_skew: Option<f64>,
    /// Cost per conversation started on an endpoint recently, beyond the
    /// least-placed endpoint's count; charged only to requests that start
    /// a conversation ([`Request::starts_conversation`]).
    pub placement: f64,
    /// Half-life of the recent-placement counts, ms (the caller that keeps
    /// them, [`placements::Placements`], decays them; the scorer only reads
    /// [`Candidate::recent_placements`]).
    #[serde(alias = "placement_half_life_ms")]
    pub placement_half_life_ms: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            prefill: 1.0,
            decode: 64.0,
            queue: 1024.0,
            kv: 8192.0,
            kv_knee: 0.7,
            attention: 4e-5,
            queued_prefill: 0.25,
            saturated_load: 0.25,
            max_queue_skew: None,
            placement: 2048.0,
            placement_half_life_ms: 60_000.0,
        }
    }
}

impl Weights {
    /// Checks ranges; on error, the field name and what is wrong.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        for (name, v) in [
            ("prefill", self.prefill),
            ("decode", self.decode),
            ("queue", self.queue),
            ("kv", self.kv),
            ("attention", self.attention),
            ("queuedPrefill", self.queued_prefill),
            ("saturatedLoad", self.saturated_load),
            ("maxQueueSkew", self.max_queue_skew.unwrap_or(0.0)),
            ("placement", self.placement),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err((name, format!("must be a finite number >= 0, got {v}")));
            }
        }
        let h = self.placement_half_life_ms;
        if !h.is_finite() || h <= 0.0 {
            return Err((
                "placementHalfLifeMs",
                format!("must be a finite number > 0, got {h}"),
            ));
        }
        if !(0.0..1.0).contains(&self.kv_knee) {
            return Err(("kvKnee", format!("must be in [0, 1), got {}", self.kv_knee)));
        }
        Ok(())
    }
}

/// One endpoint as the scorer sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate<'a> {
    /// HTTP address; also the tie-break key.
    pub address: &'a str,
    /// Leading prompt blocks the endpoint holds (0 when unknown).
    pub matched_blocks: u32,
    /// Engine's running requests (last scrape).
    pub running: u32,
    /// Engine's waiting requests (last scrape).
    pub waiting: u32,
    /// Engine's KV usage, 0..1 (last scrape).
    pub kv_usage: f64,
    /// This indexer's picks to the endpoint not yet reported done.
    pub in_flight: u32,
    /// Uncached prefill tokens of in-flight picks before their first token.
    pub queued_prefill_tokens: u64,
    /// Whether the endpoint is healthy (scrapes succeed).
    pub healthy: bool,
    /// Whether it is saturated (reported; see `left_out` for exclusion).
    pub saturated: bool,
    /// Whether picks leave it out (KV-full, or queue-saturated with
    /// `saturation.leaveOutQueued`), unless every healthy candidate is.
    pub left_out: bool,
    /// Whether its recent requests mostly failed (the cache-indexer's
    /// `health` module): ranked after every candidate that is not.
    pub failing: bool,
    /// Conversations started on it recently (decayed count,
    /// [`placements::Placements::recent`]).
    pub recent_placements: f64,
}

/// The request's side of scoring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Tie-break seed (see [`seed_of`]).
    pub seed: u64,
    /// Most endpoints to return (0 = all).
    pub max_endpoints: usize,
    /// False when the request could not be matched against the index.
    pub indexed: bool,
    /// Whether its prompt extends no earlier pick's prompt
    /// ([`placements::Placements::starts_conversation`]): only such a
    /// request pays the `placement` term. False when unknown.
    pub starts_conversation: bool,
}

/// An endpoint's cost, by term.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Cost {
    /// The sum of the terms.
    pub total: f64,
    /// Prefill term.
    pub prefill: f64,
    /// Decode (active requests) term.
    pub decode: f64,
    /// Waiting-queue term.
    pub queue: f64,
    /// KV-usage term.
    pub kv: f64,
    /// Recent-placement term (0 for a request that continues a
    /// conversation).
    pub placement: f64,
    /// Matched prompt blocks.
    pub matched_blocks: u32,
    /// Prompt tokens to prefill here.
    pub uncached_tokens: u32,
    /// Earlier picks' queued prefill work, prefill-token equivalents.
    pub queued_prefill_tokens: u64,
    /// This request's prefill work here, prefill-token equivalents (what
    /// a pick adds to the endpoint's queued prefill).
    pub prefill_work: u64,
}

/// One entry of the answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ranked {
    /// Index of the endpoint in the candidates slice.
    pub candidate: usize,
    /// Its cost.
    pub cost: Cost,
    /// Prompt tokens it is expected to find cached.
    pub predicted_cached_tokens: u32,
    /// Whether it is saturated (by its waiting queue in any answer; KV-full
    /// only in [`Decision::AllSaturated`]).
    pub saturated: bool,
}

/// Why the first endpoint won. The indexer answers and counts it as the
/// contract's `kvasir.v1.Decision`, whose table holds the words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// It holds the longest cached prefix.
    Prefix,
    /// Chosen by load.
    Load,
    /// The request was not matched against the index; load only.
    NoIndex,
    /// All healthy endpoints are saturated; ranked anyway.
    AllSaturated,
    /// No healthy endpoint.
    NoEndpoints,
}

/// The ordered answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Ranking {
    /// Best first, at most `max_endpoints`.
    pub order: Vec<Ranked>,
    /// Why the first one won.
    pub decision: Decision,
}

/// Prompt tokens vLLM will report as cached when `matched_blocks` leading
/// blocks are in its cache: whole blocks, and never the block holding the
/// last prompt token's position when the prompt fills it (vLLM always
/// computes at least the last token).
pub fn predicted_cached_tokens(prompt_tokens: u32, matched_blocks: u32, block_size: u32) -> u32 {
    if prompt_tokens == 0 || block_size == 0 {
        return 0;
    }
    let limit = (prompt_tokens - 1) / block_size;
    matched_blocks.min(limit) * block_size
}

/// The tie-break seed of a request: its id when it has one, else its
/// prompt tokens (so identical anonymous requests land alike).
pub fn seed_of(request_id: &str, tokens: &[u32]) -> u64 {
    if request_id.is_empty() {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for t in tokens {
            h.update(&t.to_le_bytes());
        }
        h.digest()
    } else {
        xxhash_rust::xxh3::xxh3_64(request_id.as_bytes())
    }
}

/// The tie-break key of an endpoint for a request seed.
pub fn tie_key(seed: u64, address: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(address.as_bytes(), seed)
}

/// The cost of one candidate, but for the `placement` term, which is
/// relative to the other candidates ([`placement_cost`]; [`rank`] adds it).
pub fn cost(req: &Request, c: &Candidate<'_>, w: &Weights) -> (Cost, u32) {
    let matched = if req.indexed { c.matched_blocks } else { 0 };
    let cached = predicted_cached_tokens(req.prompt_tokens, matched, req.block_size);
    let uncached = req.prompt_tokens - cached;
    let active = (c.running + c.waiting).max(c.in_flight);
    let kv = if c.kv_usage > w.kv_knee {
        let x = ((c.kv_usage - w.kv_knee) / (1.0 - w.kv_knee)).min(1.0);
        w.kv * x * x
    } else {
        0.0
    };
    let work = prefill_work(req.prompt_tokens, cached, w.attention);
    let prefill = w.prefill * (work + w.queued_prefill * c.queued_prefill_tokens as f64);
    let decode = w.decode * f64::from(active);
    let queue = w.queue * f64::from(c.waiting);
    (
        Cost {
            total: prefill + decode + queue + kv,
            prefill,
            decode,
            queue,
            kv,
            placement: 0.0,
            matched_blocks: matched,
            uncached_tokens: uncached,
            queued_prefill_tokens: c.queued_prefill_tokens,
            prefill_work: work.round() as u64,
        },
        cached,
    )
}

/// The `placement` term of a candidate, for a request that starts a
/// conversation (0 otherwise): its recent placements beyond the
/// least-placed ranked candidate's (`least_placed`), relative to that
/// count once it exceeds one, and at most one placement.
/// Relative, so it lives outside [`cost`], which sees one candidate.
pub fn placement_cost(req: &Request, c: &Candidate<'_>, least_placed: f64, w: &Weights) -> f64 {
    if !req.starts_conversation || !req.indexed {
        return 0.0;
    }
    let least = if least_placed.is_finite() {
        least_placed.max(0.0)
    } else {
        0.0
    };
    let excess = (placements_of(c) - least).max(0.0) / least.max(1.0);
    w.placement * excess.min(1.0)
}

/// A candidate's recent placements, 0 when not a finite count >= 0.
fn placements_of(c: &Candidate<'_>) -> f64 {
    let n = c.recent_placements;
    if n.is_finite() && n > 0.0 {
        n
    } else {
        0.0
    }
}

/// Prefill work of computing prompt tokens `cached..prompt`, in prefill
/// tokens: one per token plus `attention` per (token, earlier token) pair.
pub fn prefill_work(prompt: u32, cached: u32, attention: f64) -> f64 {
    let (p, c) = (f64::from(prompt), f64::from(cached.min(prompt)));
    (p - c) + attention * (p * p - c * c) / 2.0
}

/// Ranks the candidates for a request: unhealthy ones never, left-out ones
/// ([`Candidate::left_out`]) only when every healthy one is, failing ones
/// ([`Candidate::failing`]) after the others. Lowest cost first; ties by
/// [`tie_key`], then address.
pub fn rank(req: &Request, candidates: &[Candidate<'_>], w: &Weights) -> Ranking {
    let healthy = candidates.iter().filter(|c| c.healthy).count();
    if healthy == 0 {
        return Ranking {
            order: Vec::new(),
            decision: Decision::NoEndpoints,
        };
    }
    let all_saturated = candidates.iter().filter(|c| c.healthy).all(|c| c.saturated);
    let all_left_out = candidates.iter().filter(|c| c.healthy).all(|c| c.left_out);
    let overload;
    let w = if all_saturated && w.saturated_load != 1.0 {
        overload = Weights {
            decode: w.decode * w.saturated_load,
            queue: w.queue * w.saturated_load,
            queued_prefill: w.queued_prefill * w.saturated_load,
            placement: w.placement * w.saturated_load,
            ..w.clone()
        };
        &overload
    } else {
        w
    };
    let ranked = |c: &&Candidate<'_>| c.healthy && (all_left_out || !c.left_out);
    let least_placed = candidates
        .iter()
        .filter(ranked)
        .map(placements_of)
        .fold(f64::INFINITY, f64::min);
    let mut scored: Vec<(Ranked, u64)> = candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| ranked(c))
        .map(|(i, c)| {
            let (mut cost, cached) = cost(req, c, w);
            cost.placement = placement_cost(req, c, least_placed, w);
            cost.total += cost.placement;
            (
                Ranked {
                    candidate: i,
                    cost,
                    predicted_cached_tokens: cached,
                    saturated: c.saturated,
                },
                tie_key(req.seed, c.address),
            )
        })
        .collect();
    // The most queued prefill a ranked endpoint may carry before it goes
    // after all the others; derived once, only when a cap is set.
    let queue_limit = w.max_queue_skew.map(|cap| {
        let least = scored
            .iter()
            .map(|(r, _)| r.cost.queued_prefill_tokens)
            .min()
            .unwrap_or(0);
        least as f64 + cap
    });
    let over_skew =
        |r: &Ranked| queue_limit.is_some_and(|limit| r.cost.queued_prefill_tokens as f64 > limit);
    let failing = |r: &Ranked| candidates[r.candidate].failing;
    scored.sort_by(|(a, ta), (b, tb)| {
        failing(a)
            .cmp(&failing(b))
            .then(over_skew(a).cmp(&over_skew(b)))
            .then(a.cost.total.total_cmp(&b.cost.total))
            .then(ta.cmp(tb))
            .then_with(|| {
                candidates[a.candidate]
                    .address
                    .cmp(candidates[b.candidate].address)
            })
    });
    let best_match = scored
        .iter()
        .map(|(r, _)| r.cost.matched_blocks)
        .max()
        .unwrap_or(0);
    let decision = if all_saturated {
        Decision::AllSaturated
    } else if !req.indexed {
        Decision::NoIndex
    } else {
        match scored.first() {
            Some((first, _))
                if first.cost.matched_blocks > 0 && first.cost.matched_blocks == best_match =>
            {
                Decision::Prefix
            }
            _ => Decision::Load,
        }
    };
    let mut order: Vec<Ranked> = scored.into_iter().map(|(r, _)| r).collect();
    if req.max_endpoints > 0 {
        order.truncate(req.max_endpoints);
    }
    Ranking { order, decision }
}

#[cfg(test)]
mod spread_tests;
#[cfg(test)]
mod tests;
