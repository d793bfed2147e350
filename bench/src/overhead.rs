//! The latency one proxy path adds over another (Envoy with the
//! filter and the pick against the same route without the filter).
//!
//! Both paths are driven open-loop at the same rate, in alternating blocks
//! (A for `block_s`, then B, then A...), so slow drift of a shared machine
//! (another process, CPU frequency, page cache) lands on both instead of on
//! whichever ran second. Within a block, request `i` is due at `i / rate`.
//! The client runs on one thread and does nothing but send and read, so it
//! takes as little as possible of the CPU the paths under test share.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::stats::{nonfinite, quantile, Dist};

/// One scheduled request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slot {
    /// Due time from the start.
    pub at: Duration,
    /// Which path (index into the targets).
    pub target: usize,
    /// Which body (index into the bodies, cycled).
    pub body: usize,
}

/// The schedule: `seconds` of requests at `rate` per path, in blocks of
/// `block_s` that take turns among `targets` paths. Bodies are cycled in
/// the order sent, the same sequence for every path.
pub fn schedule(rate: f64, seconds: f64, block_s: f64, targets: usize, bodies: usize) -> Vec<Slot> {
    if !(rate > 0.0 && seconds > 0.0 && block_s > 0.0) || targets == 0 || bodies == 0 {
        return Vec::new();
    }
    let per_block = ((rate * block_s).round() as usize).max(1);
    let blocks = ((seconds / block_s).ceil() as usize).max(1);
    let mut out = Vec::with_capacity(per_block * blocks * targets);
    let mut sent = vec![0usize; targets];
    for round in 0..blocks {
        for (t, count) in sent.iter_mut().enumerate() {
            let block = round * targets + t;
            let start = block as f64 * per_block as f64 / rate;
            for j in 0..per_block {
                out.push(Slot {
                    at: Duration::from_secs_f64(start + j as f64 / rate),
                    target: t,
                    body: *count % bodies,
                });
                *count += 1;
            }
        }
    }
    out
}

/// One path's latencies.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PathResult {
    /// Its label.
    pub name: String,
    /// Requests answered 2xx.
    pub n: usize,
    /// Requests that failed (non-2xx, transport error, timeout).
    pub errors: usize,
    /// Median latency, ms.
    #[serde(with = "nonfinite")]
    pub p50_ms: f64,
    /// 90th percentile, ms.
    #[serde(with = "nonfinite")]
    pub p90_ms: f64,
    /// 99th percentile, ms.
    #[serde(with = "nonfinite")]
    pub p99_ms: f64,
    /// Mean, ms.
    #[serde(with = "nonfinite")]
    pub mean_ms: f64,
}

impl PathResult {
    /// Of one path's latencies (ms, any order).
    pub fn of(name: &str, mut lat_ms: Vec<f64>, errors: usize) -> PathResult {
        lat_ms.sort_by(f64::total_cmp);
        let d = Dist::of_sorted(&lat_ms);
        PathResult {
            name: name.into(),
            n: lat_ms.len(),
            errors,
            p50_ms: d.p50,
            p90_ms: d.p90,
            p99_ms: d.p99,
            mean_ms: d.mean,
        }
    }
}

/// The result of one rate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RateResult {
    /// Requests per second on each path.
    pub rate_rps: f64,
    /// Per path, in the order given.
    pub paths: Vec<PathResult>,
    /// How late the client sent, ms past the due time: p99 and max. Large
    /// values mean the client, not the paths, set the pace.
    #[serde(with = "nonfinite")]
    pub send_lateness_p99_ms: f64,
    /// Max send lateness, ms.
    #[serde(with = "nonfinite")]
    pub send_lateness_max_ms: f64,
}

/// What to send.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Full URLs, one per path (e.g. `http://127.0.0.1:10000/v1/chat/completions`).
    pub urls: Vec<String>,
    /// Labels, one per path.
    pub names: Vec<String>,
    /// JSON bodies, cycled.
    pub bodies: Vec<bytes::Bytes>,
    /// Extra request headers (name, value).
    pub headers: Vec<(String, String)>,
    /// Per-request timeout.
    pub timeout: Duration,
}

struct Sample {
    target: usize,
    ok: bool,
    latency_ms: f64,
    late_ms: f64,
}

/// Runs one rate: sends the schedule, waits for every answer (bounded by
/// the per-request timeout), and summarises per path. Latency runs from
/// the moment the request is handed to the client to the last byte of
/// the answer; the send lateness is reported beside it.
pub async fn run(
    client: &reqwest::Client,
    setup: &Arc<Setup>,
    rate_rps: f64,
    slots: &[Slot],
) -> RateResult {
    let start = Instant::now() + Duration::from_millis(20);
    let mut tasks = Vec::with_capacity(slots.len());
    for s in slots.iter().copied() {
        let due = start + s.at;
        tokio::time::sleep_until(due.into()).await;
        let client = client.clone();
        let setup = Arc::clone(setup);
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let late_ms = sent.saturating_duration_since(due).as_secs_f64() * 1e3;
            let mut req = client
                .post(&setup.urls[s.target])
                .timeout(setup.timeout)
                .header("content-type", "application/json")
                .body(setup.bodies[s.body].clone());
            for (k, v) in &setup.headers {
                req = req.header(k, v);
            }
            let ok = match req.send().await {
                Ok(r) => {
                    let status = r.status();
                    r.bytes().await.is_ok() && status.is_success()
                }
                Err(_) => false,
            };
            Sample {
                target: s.target,
                ok,
                latency_ms: sent.elapsed().as_secs_f64() * 1e3,
                late_ms,
            }
        }));
    }
    let mut per: Vec<(Vec<f64>, usize)> = vec![(Vec::new(), 0); setup.urls.len()];
    let mut late = Vec::with_capacity(tasks.len());
    // A task only fails by panicking, a bug here; it has nothing to count.
    for s in futures::future::join_all(tasks).await.into_iter().flatten() {
        late.push(s.late_ms);
        if s.ok {
            per[s.target].0.push(s.latency_ms);
        } else {
            per[s.target].1 += 1;
        }
    }
    late.sort_by(f64::total_cmp);
    RateResult {
        rate_rps,
        paths: per
            .into_iter()
            .zip(&setup.names)
            .map(|((lat, errors), name)| PathResult::of(name, lat, errors))
            .collect(),
        send_lateness_p99_ms: quantile(&late, 0.99),
        send_lateness_max_ms: late.last().copied().unwrap_or(f64::NAN),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_alternate_at_the_rate_and_bodies_cycle_per_path() {
        let s = schedule(100.0, 1.0, 0.5, 2, 3);
        // 50 a block, 2 blocks per path.
        assert_eq!(s.len(), 200);
        assert_eq!(s.iter().filter(|x| x.target == 0).count(), 100);
        assert!(s[..50].iter().all(|x| x.target == 0));
        assert!(s[50..100].iter().all(|x| x.target == 1));
        assert!(s[100..150].iter().all(|x| x.target == 0));
        // Spacing is 1/rate throughout, across block boundaries too.
        for w in s.windows(2) {
            let d = (w[1].at - w[0].at).as_secs_f64();
            assert!((d - 0.01).abs() < 1e-9, "{d}");
        }
        // Path B sends the same body sequence as path A.
        let a: Vec<usize> = s.iter().filter(|x| x.target == 0).map(|x| x.body).collect();
        let b: Vec<usize> = s.iter().filter(|x| x.target == 1).map(|x| x.body).collect();
        assert_eq!(a, b);
        assert_eq!(&a[..4], &[0, 1, 2, 0]);
    }

    #[test]
    fn degenerate_inputs_give_no_slots() {
        assert!(schedule(0.0, 1.0, 0.5, 2, 1).is_empty());
        assert!(schedule(10.0, 1.0, 0.5, 0, 1).is_empty());
        assert!(schedule(10.0, 1.0, 0.5, 2, 0).is_empty());
        assert!(schedule(f64::NAN, 1.0, 0.5, 2, 1).is_empty());
    }

    #[test]
    fn percentiles_per_path() {
        let r = PathResult::of("a", vec![3.0, 1.0, 2.0], 1);
        assert_eq!((r.n, r.errors), (3, 1));
        assert_eq!(r.p50_ms, 2.0);
        assert_eq!(r.mean_ms, 2.0);
        let e = PathResult::of("b", vec![], 4);
        assert!(e.p50_ms.is_nan());
    }
}
