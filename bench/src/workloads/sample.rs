//! Seeded random streams, the distributions the shapes draw from, and
//! the arrival process.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{BurstyConfig, ShapeConfig, WorkloadConfig, MESSAGE_OVERHEAD};

/// SplitMix64's finaliser: independent seeds for independent streams.
pub(super) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The random stream `stream` (a fixed tag) of item `index` under `seed`.
pub(super) fn stream(seed: u64, stream: u64, index: u64) -> StdRng {
    StdRng::seed_from_u64(mix(
        mix(seed ^ stream.wrapping_mul(0x2545_F491_4F6C_DD1D)) ^ index
    ))
}

pub(super) const SYSTEM_STREAM: u64 = 1;
pub(super) const SESSION_STREAM: u64 = 2;
pub(super) const ARRIVAL_STREAM: u64 = 3;
pub(super) const SCHEDULE_STREAM: u64 = 4;

pub(super) fn exp(rng: &mut StdRng, mean: f64) -> f64 {
    if mean == 0.0 {
        return 0.0;
    }
    -mean * (1.0 - rng.random::<f64>()).ln()
}

pub(super) fn uniform(rng: &mut StdRng, (lo, hi): (usize, usize)) -> usize {
    rng.random_range(lo..=hi)
}

pub(super) fn uniform_u32(rng: &mut StdRng, (lo, hi): (u32, u32)) -> u32 {
    rng.random_range(lo..=hi)
}

/// Log-uniform on `lo..=hi`: as many values in 50-100 as in 500-1000.
pub(super) fn log_uniform(rng: &mut StdRng, (lo, hi): (usize, usize)) -> usize {
    let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
    let v = (a + (b - a) * rng.random::<f64>()).exp().round() as usize;
    v.clamp(lo, hi)
}

/// Index drawn with weight 1/(i+1)^skew.
pub(super) fn zipf(rng: &mut StdRng, n: usize, skew: f64) -> usize {
    let w: Vec<f64> = (0..n).map(|i| 1.0 / ((i + 1) as f64).powf(skew)).collect();
    let mut x = rng.random::<f64>() * w.iter().sum::<f64>();
    for (i, wi) in w.iter().enumerate() {
        if x < *wi {
            return i;
        }
        x -= wi;
    }
    n - 1
}

/// About the tokens of a message of `words` words (one token each) in
/// the chat template.
pub(super) fn message_tokens(words: usize) -> usize {
    words + MESSAGE_OVERHEAD
}

/// The arrival intensity at mean rate 1: constant, or on/off.
pub(super) enum Intensity {
    Poisson,
    /// Alternating spells `(start_s, rate)`, the last open-ended.
    OnOff(Vec<(f64, f64)>),
}

impl Intensity {
    /// The time at which the cumulative intensity reaches `target`.
    fn inverse(&self, target: f64) -> f64 {
        match self {
            Intensity::Poisson => target,
            Intensity::OnOff(spells) => {
                let mut acc = 0.0;
                for (i, &(start, rate)) in spells.iter().enumerate() {
                    let end = spells.get(i + 1).map_or(f64::INFINITY, |s| s.0);
                    let mass = rate * (end - start);
                    if acc + mass >= target {
                        return start + (target - acc) / rate;
                    }
                    acc += mass;
                }
                f64::INFINITY
            }
        }
    }
}

/// The on/off spells over `duration_s` at mean rate 1: the first spell's
/// state drawn from the stationary shares, durations exponential.
pub(super) fn on_off(c: &BurstyConfig, duration_s: f64, seed: u64) -> Vec<(f64, f64)> {
    let mut rng = stream(seed, SCHEDULE_STREAM, 0);
    let quiet = (c.on_s + c.off_s) / (c.peak_over_quiet * c.on_s + c.off_s);
    let peak = quiet * c.peak_over_quiet;
    let mut on = rng.random::<f64>() < c.on_s / (c.on_s + c.off_s);
    let mut t = 0.0;
    let mut spells = Vec::new();
    while t < duration_s {
        spells.push((t, if on { peak } else { quiet }));
        t += exp(&mut rng, if on { c.on_s } else { c.off_s }).max(1e-3);
        on = !on;
    }
    // Past the window the rate stays at the mean.
    spells.push((t, 1.0));
    spells
}

/// Arrival times of sessions 0, 1, ... within the window.
pub(super) fn arrivals(cfg: &WorkloadConfig) -> Vec<f64> {
    let intensity = match &cfg.shape {
        ShapeConfig::Bursty(c) => Intensity::OnOff(on_off(c, cfg.duration_s, cfg.seed)),
        _ => Intensity::Poisson,
    };
    let mut rng = stream(cfg.seed, ARRIVAL_STREAM, 0);
    let mut e = 0.0;
    let mut out = Vec::new();
    loop {
        e += exp(&mut rng, 1.0);
        let t = intensity.inverse(e / cfg.rate);
        if t >= cfg.duration_s {
            return out;
        }
        out.push(t);
    }
}

/// Words in a planned text (one token each, [`crate::chat`]'s list).
pub(super) fn words_in(s: &str) -> usize {
    s.split(' ').count()
}
