//! What a plan holds, summed up before it runs.

use serde::Serialize;

use super::*;

/// A distribution's summary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Spread {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
}

impl Spread {
    fn of(mut v: Vec<f64>) -> Spread {
        if v.is_empty() {
            return Spread::default();
        }
        v.sort_by(f64::total_cmp);
        let q = |p| crate::stats::quantile(&v, p);
        Spread {
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: q(0.5),
            p90: q(0.9),
            p99: q(0.99),
            max: v[v.len() - 1],
        }
    }
}

/// What a plan holds if every session runs to its end, in about-tokens
/// (a word and a generated token count one each, a message its template).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanStats {
    /// The workload's name.
    pub workload: String,
    /// Sessions per simulated second asked for.
    pub rate: f64,
    /// Sessions planned.
    pub sessions: usize,
    /// Requests planned.
    pub requests: usize,
    /// Requests per session.
    pub turns: Spread,
    /// Prompt tokens per request.
    pub prompt_tokens: Spread,
    /// Largest context a session reaches: its last prompt and answer.
    pub session_tokens: Spread,
    /// Share of all prompt tokens that repeat an earlier request's prefix
    /// (a later turn its previous turn with the answer, a first turn its
    /// system prompt when an earlier session used it): the hit rate of an
    /// unbounded cache that every request reaches.
    pub shared_prefix_fraction: f64,
    /// Share of all prompt tokens that are system prompts (what sessions
    /// share with each other).
    pub system_fraction: f64,
    /// Share of requests whose prompt is at least 10k tokens.
    pub long_request_fraction: f64,
    /// Share of prompt tokens in those requests.
    pub long_token_fraction: f64,
    /// Variance over mean of the sessions started per second (1 for
    /// Poisson arrivals; above 1 when they come in bursts).
    pub arrivals_per_s_dispersion: f64,
    /// Coefficient of variation of the gaps between session starts (1 for
    /// Poisson).
    pub arrival_gap_cv: f64,
    /// Distinct prompt tokens reused by later requests: each system
    /// prompt once, and each session's context before its last turn (what
    /// the caches must hold for every reuse to hit).
    pub reused_tokens: u64,
    /// Longest prompt plus its answer, tokens.
    pub longest_sequence_tokens: u64,
}

/// Counts of `times` per second over `duration_s`: variance / mean.
fn dispersion(times: &[f64], duration_s: f64) -> f64 {
    let bins = duration_s.floor().max(1.0) as usize;
    let mut n = vec![0f64; bins];
    for &t in times {
        let b = t.floor() as usize;
        if b < bins {
            n[b] += 1.0;
        }
    }
    let mean = n.iter().sum::<f64>() / bins as f64;
    if mean == 0.0 {
        return f64::NAN;
    }
    n.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / bins as f64 / mean
}

fn gap_cv(times: &[f64]) -> f64 {
    let gaps: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    if gaps.len() < 2 {
        return f64::NAN;
    }
    let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
    let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
    var.sqrt() / mean
}

/// The statistics of `plan`, planned with `cfg`.
pub fn stats(cfg: &WorkloadConfig, plan: &ChatPlan) -> PlanStats {
    /// At least this many prompt tokens is a long request.
    const LONG: usize = 10_000;
    let system: Vec<usize> = plan
        .system_prompts
        .iter()
        .map(|s| message_tokens(words_in(s)))
        .collect();
    let mut seen = vec![false; system.len()];
    let (mut all, mut shared, mut sys, mut long_tokens, mut long_requests) =
        (0u64, 0u64, 0u64, 0u64, 0usize);
    let (mut prompts, mut sessions, mut turns) = (Vec::new(), Vec::new(), Vec::new());
    let mut reused = system.iter().map(|&s| s as u64).sum::<u64>();
    let mut longest = 0u64;
    for c in &plan.conversations {
        turns.push(c.turns.len() as f64);
        // The generation prompt (`<|im_start|>assistant\n`) ends every prompt.
        let mut context = system[c.tenant] + 3;
        let mut before_last = 0;
        for (k, t) in c.turns.iter().enumerate() {
            let prompt = context + message_tokens(words_in(&t.user));
            let repeated = if k == 0 {
                if seen[c.tenant] {
                    system[c.tenant]
                } else {
                    0
                }
            } else {
                context
            };
            seen[c.tenant] = true;
            all += prompt as u64;
            shared += repeated as u64;
            sys += system[c.tenant] as u64;
            if prompt >= LONG {
                long_requests += 1;
                long_tokens += prompt as u64;
            }
            prompts.push(prompt as f64);
            longest = longest.max((prompt + t.output_tokens as usize) as u64);
            before_last = context;
            context = prompt + t.output_tokens as usize + MESSAGE_OVERHEAD - 3;
        }
        sessions.push(context as f64);
        if c.turns.len() > 1 {
            reused += (before_last - system[c.tenant]) as u64;
        }
    }
    let starts: Vec<f64> = plan.conversations.iter().map(|c| c.arrival_s).collect();
    let frac = |x: u64| if all == 0 { 0.0 } else { x as f64 / all as f64 };
    let requests = prompts.len();
    PlanStats {
        workload: cfg.shape.shape().name().into(),
        rate: cfg.rate,
        sessions: plan.conversations.len(),
        requests,
        turns: Spread::of(turns),
        prompt_tokens: Spread::of(prompts),
        session_tokens: Spread::of(sessions),
        shared_prefix_fraction: frac(shared),
        system_fraction: frac(sys),
        long_request_fraction: if requests == 0 {
            0.0
        } else {
            long_requests as f64 / requests as f64
        },
        long_token_fraction: frac(long_tokens),
        arrivals_per_s_dispersion: dispersion(&starts, cfg.duration_s),
        arrival_gap_cv: gap_cv(&starts),
        reused_tokens: reused,
        longest_sequence_tokens: longest,
    }
}
