//! The governance benchmarks' multi-tenant workload: each tenant
//! sends token-id prompts open-loop, Poisson at its own rate, with a prefix
//! of its own (a system prompt every request of the tenant shares) and a
//! unique rest; one tenant may burst to a multiple of its rate for a while.
//!
//! Each tenant's arrivals come from their own random stream, and a burst's
//! extra requests from another, so a run with the burst replays exactly the
//! requests of the run without it plus the extra ones: every other tenant's
//! figures in the two runs are of the same requests.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::chat::{tenant_name, words};
use crate::trace::{prompt_tokens, TraceRequest, MOONCAKE_BLOCK_TOKENS};

/// One tenant sending at a multiple of its rate for a while.
#[derive(Debug, Clone, PartialEq)]
pub struct Burst {
    /// Which tenant (index).
    pub tenant: usize,
    /// Its rate during the burst over its usual rate (> 1).
    pub factor: f64,
    /// When the burst starts, simulated seconds from the run's start.
    pub from_s: f64,
    /// When it ends.
    pub to_s: f64,
}

/// The workload's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantsConfig {
    /// Tenants, named `t00`, `t01`, ...
    pub tenants: usize,
    /// Requests per simulated second of a tenant at share 1.
    pub rate: f64,
    /// Each tenant's rate over `rate` (empty: all 1).
    pub shares: Vec<f64>,
    /// Simulated seconds of arrivals.
    pub duration_s: f64,
    /// Tokens of the prefix each tenant's requests share (rounded down to
    /// whole 512-token blocks).
    pub prefix_tokens: usize,
    /// Tokens of each request's own part, MIN..=MAX.
    pub unique_tokens: (usize, usize),
    /// Completion tokens, MIN..=MAX.
    pub output_tokens: (u32, u32),
    /// Tenants (indices) whose requests leave `max_tokens` out, so a budget
    /// reserves a learned output estimate instead of the exact length.
    pub no_max_tokens: Vec<usize>,
    /// The burst, if any.
    pub burst: Option<Burst>,
    /// Seed.
    pub seed: u64,
}

/// A workload that cannot be planned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TenantsError {
    /// A setting out of range.
    #[error("{0}")]
    Invalid(String),
}

/// One planned request.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantRequest {
    /// Tenant index.
    pub tenant: usize,
    /// When it is sent, simulated seconds from the run's start.
    pub arrival_s: f64,
    /// Tokens after the tenant's prefix.
    pub unique_tokens: usize,
    /// Completion tokens asked for.
    pub output_tokens: u32,
    /// One of the burst's extra requests.
    pub burst: bool,
    /// Stable identity (tenant, stream, place in it): the same request has
    /// the same key, hence the same tokens, with or without the burst.
    pub key: u64,
}

/// The planned workload, requests in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantsPlan {
    /// Requests, by arrival.
    pub requests: Vec<TenantRequest>,
    /// Whole 512-token blocks of each tenant's shared prefix.
    pub prefix_blocks: usize,
    /// Per tenant: whether its requests carry `max_tokens`.
    pub max_tokens: Vec<bool>,
}

impl TenantsConfig {
    fn validate(&self) -> Result<(), TenantsError> {
        let bad = |m: String| Err(TenantsError::Invalid(m));
        if self.tenants == 0 || self.tenants > 100 {
            return bad(format!("tenants must be 1..=100, got {}", self.tenants));
        }
        if !(self.rate.is_finite() && self.rate > 0.0) {
            return bad(format!("rate must be > 0, got {}", self.rate));
        }
        if !self.shares.is_empty() && self.shares.len() != self.tenants {
            return bad(format!(
                "shares: {} given for {} tenants",
                self.shares.len(),
                self.tenants
            ));
        }
        if self.shares.iter().any(|s| !(s.is_finite() && *s >= 0.0)) {
            return bad("shares must be >= 0".into());
        }
        if !(self.duration_s.is_finite() && self.duration_s > 0.0) {
            return bad(format!("duration must be > 0, got {}", self.duration_s));
        }
        let (u0, u1) = self.unique_tokens;
        if u0 == 0 || u0 > u1 {
            return bad(format!(
                "unique tokens must be 1 <= MIN <= MAX, got {u0}..{u1}"
            ));
        }
        let (o0, o1) = self.output_tokens;
        if o0 == 0 || o0 > o1 {
            return bad(format!(
                "output tokens must be 1 <= MIN <= MAX, got {o0}..{o1}"
            ));
        }
        if let Some(&t) = self.no_max_tokens.iter().find(|&&t| t >= self.tenants) {
            return bad(format!(
                "no-max-tokens tenant {t} is not one of the {} tenants",
                self.tenants
            ));
        }
        if let Some(b) = &self.burst {
            if b.tenant >= self.tenants {
                return bad(format!(
                    "burst tenant {} is not one of the {} tenants",
                    b.tenant, self.tenants
                ));
            }
            if !(b.factor.is_finite() && b.factor >= 1.0) {
                return bad(format!("burst factor must be >= 1, got {}", b.factor));
            }
            if !(b.from_s >= 0.0 && b.from_s < b.to_s && b.to_s.is_finite()) {
                return bad(format!(
                    "burst window must be 0 <= FROM < TO, got {}..{}",
                    b.from_s, b.to_s
                ));
            }
        }
        Ok(())
    }

    fn share(&self, t: usize) -> f64 {
        self.shares.get(t).copied().unwrap_or(1.0)
    }
}

/// SplitMix64's finaliser: independent seeds for the streams.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn exp(rng: &mut StdRng, mean: f64) -> f64 {
    // 1 - u is in (0, 1], so the log is finite.
    -mean * (1.0 - rng.random::<f64>()).ln()
}

/// Poisson arrivals at `rate` within `[from, to)` from stream `stream` of
/// tenant `t`.
fn stream(
    cfg: &TenantsConfig,
    t: usize,
    stream: u64,
    rate: f64,
    (from, to): (f64, f64),
) -> Vec<TenantRequest> {
    let mut out = Vec::new();
    if rate <= 0.0 {
        return out;
    }
    let base = mix(cfg.seed ^ mix((t as u64) << 8 | stream));
    let mut rng = StdRng::seed_from_u64(base);
    let mut at = from + exp(&mut rng, 1.0 / rate);
    while at < to {
        out.push(TenantRequest {
            tenant: t,
            arrival_s: at,
            unique_tokens: rng.random_range(cfg.unique_tokens.0..=cfg.unique_tokens.1),
            output_tokens: rng.random_range(cfg.output_tokens.0..=cfg.output_tokens.1),
            burst: stream == 1,
            key: (t as u64) << 40 | stream << 32 | out.len() as u64,
        });
        at += exp(&mut rng, 1.0 / rate);
    }
    out
}

/// Plans the workload. Deterministic in the config.
pub fn plan(cfg: &TenantsConfig) -> Result<TenantsPlan, TenantsError> {
    cfg.validate()?;
    let mut requests = Vec::new();
    for t in 0..cfg.tenants {
        let rate = cfg.rate * cfg.share(t);
        requests.extend(stream(cfg, t, 0, rate, (0.0, cfg.duration_s)));
        if let Some(b) = cfg.burst.as_ref().filter(|b| b.tenant == t) {
            let to = b.to_s.min(cfg.duration_s);
            requests.extend(stream(cfg, t, 1, rate * (b.factor - 1.0), (b.from_s, to)));
        }
    }
    requests.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s).then(a.key.cmp(&b.key)));
    Ok(TenantsPlan {
        requests,
        prefix_blocks: cfg.prefix_tokens / MOONCAKE_BLOCK_TOKENS,
        max_tokens: (0..cfg.tenants)
            .map(|t| !cfg.no_max_tokens.contains(&t))
            .collect(),
    })
}

/// Hash ids of tenant prefixes start here: far from a trace's ids and from
/// the ids of requests' own parts.
const PREFIX_IDS: u64 = 1 << 48;

impl TenantsPlan {
    /// The token ids of `r`'s prompt: its tenant's prefix, then its own part.
    pub fn prompt(&self, r: &TenantRequest) -> Vec<u32> {
        let ids: Vec<u64> = (0..self.prefix_blocks as u64)
            .map(|k| PREFIX_IDS + (r.tenant as u64) * 1_000_000 + k)
            .collect();
        let t = TraceRequest {
            timestamp: 0.0,
            input_length: self.prefix_blocks * MOONCAKE_BLOCK_TOKENS + r.unique_tokens,
            output_length: r.output_tokens as usize,
            hash_ids: ids,
        };
        // The key, not the place in the plan: the same request has the
        // same tokens with or without a burst.
        prompt_tokens(&t, MOONCAKE_BLOCK_TOKENS, r.key)
    }

    /// `r`'s prompt as chat messages, for a tenant whose requests leave
    /// `max_tokens` out: `/v1/completions` answers 16 tokens then (the
    /// API's default), the chat API as many as the engine is told. The
    /// tenant's prefix as a system prompt, `r`'s own part as the user's
    /// message, in words (about a token each), from the same seeds.
    pub fn chat(&self, r: &TenantRequest) -> Vec<(&'static str, String)> {
        let mut sys = StdRng::seed_from_u64(mix(PREFIX_IDS + r.tenant as u64));
        let mut own = StdRng::seed_from_u64(mix(r.key));
        let prefix = self.prefix_blocks * MOONCAKE_BLOCK_TOKENS;
        vec![
            (
                "system",
                format!("Tenant {}. {}", self.tenant(r), words(&mut sys, prefix)),
            ),
            ("user", words(&mut own, r.unique_tokens)),
        ]
    }

    /// The tenant's name as sent.
    pub fn tenant(&self, r: &TenantRequest) -> String {
        tenant_name(r.tenant)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> TenantsConfig {
        TenantsConfig {
            tenants: 4,
            rate: 2.0,
            shares: vec![],
            duration_s: 200.0,
            prefix_tokens: 1100,
            unique_tokens: (100, 300),
            output_tokens: (10, 20),
            no_max_tokens: vec![2],
            burst: None,
            seed: 7,
        }
    }

    #[test]
    fn each_tenant_sends_poisson_at_its_rate() {
        let mut c = cfg();
        c.shares = vec![1.0, 1.0, 0.5, 0.0];
        let p = plan(&c).unwrap();
        let count = |t| p.requests.iter().filter(|r| r.tenant == t).count() as f64;
        // 400 expected for share 1 over 200 s at 2/s: within 4 sigma (80).
        for (t, want) in [(0, 400.0), (1, 400.0), (2, 200.0)] {
            assert!(
                (count(t) - want).abs() < 4.0 * want.sqrt(),
                "tenant {t}: {}",
                count(t)
            );
        }
        assert_eq!(count(3), 0.0);
        assert!(p
            .requests
            .windows(2)
            .all(|w| w[0].arrival_s <= w[1].arrival_s));
        assert!(p
            .requests
            .iter()
            .all(|r| (0.0..200.0).contains(&r.arrival_s)));
        assert!(p
            .requests
            .iter()
            .all(|r| (100..=300).contains(&r.unique_tokens)));
        assert_eq!(p.max_tokens, vec![true, true, false, true]);
        assert_eq!(plan(&c).unwrap(), p, "deterministic");
    }

    #[test]
    fn a_burst_adds_requests_and_leaves_everything_else_as_it_was() {
        let base = plan(&cfg()).unwrap();
        let mut c = cfg();
        c.burst = Some(Burst {
            tenant: 0,
            factor: 3.0,
            from_s: 50.0,
            to_s: 150.0,
        });
        let burst = plan(&c).unwrap();
        let extra: Vec<&TenantRequest> = burst.requests.iter().filter(|r| r.burst).collect();
        // 2 x (3 - 1) = 4 more per second for tenant 0 during 100 s: about 400.
        assert!(
            (extra.len() as f64 - 400.0).abs() < 4.0 * 400f64.sqrt(),
            "{}",
            extra.len()
        );
        assert!(extra
            .iter()
            .all(|r| r.tenant == 0 && (50.0..150.0).contains(&r.arrival_s)));
        let without: Vec<TenantRequest> = burst
            .requests
            .iter()
            .filter(|r| !r.burst)
            .cloned()
            .collect();
        assert_eq!(without, base.requests);
    }

    #[test]
    fn prompts_share_the_tenant_prefix_and_nothing_else() {
        let p = plan(&cfg()).unwrap();
        // 1100 tokens of prefix: two whole blocks.
        assert_eq!(p.prefix_blocks, 2);
        let of = |t| p.requests.iter().filter(move |r| r.tenant == t);
        let a: Vec<Vec<u32>> = of(0).take(2).map(|r| p.prompt(r)).collect();
        let b = p.prompt(of(1).next().unwrap());
        let r0 = of(0).next().unwrap();
        assert_eq!(a[0].len(), 1024 + r0.unique_tokens);
        assert_eq!(a[0][..1024], a[1][..1024]);
        assert_ne!(a[0][1024..1034], a[1][1024..1034]);
        assert_ne!(a[0][..16], b[..16]);
        assert_eq!(p.prompt(r0), a[0], "the same request has the same tokens");
        assert_eq!(p.tenant(r0), "t00");
        // As chat messages: the same system prompt for the tenant, its own
        // user message, about a word a token.
        let (c0, c1) = (p.chat(r0), p.chat(of(0).nth(1).unwrap()));
        assert_eq!(c0[0], c1[0]);
        assert_ne!(c0[1], c1[1]);
        assert_eq!(c0[1].1.split(' ').count(), r0.unique_tokens);
        assert_eq!(p.chat(r0), c0);
    }

    #[test]
    fn bad_settings_are_refused() {
        for f in [
            (|c: &mut TenantsConfig| c.tenants = 0) as fn(&mut TenantsConfig),
            |c| c.rate = 0.0,
            |c| c.shares = vec![1.0],
            |c| c.unique_tokens = (5, 4),
            |c| c.output_tokens = (0, 4),
            |c| c.no_max_tokens = vec![9],
            |c| {
                c.burst = Some(Burst {
                    tenant: 0,
                    factor: 0.5,
                    from_s: 1.0,
                    to_s: 2.0,
                })
            },
            |c| {
                c.burst = Some(Burst {
                    tenant: 0,
                    factor: 3.0,
                    from_s: 2.0,
                    to_s: 1.0,
                })
            },
        ] {
            let mut c = cfg();
            f(&mut c);
            assert!(plan(&c).is_err(), "{c:?}");
        }
    }
}
