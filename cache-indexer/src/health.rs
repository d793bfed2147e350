//! Endpoints whose requests fail, from the filter's DONE reports.
//!
//! An engine that answers every request with an error finishes them at
//! once, so its scraped load (running, waiting) and this indexer's
//! in-flight count both look idle, and the load terms sent it most of the
//! traffic. Scrapes cannot see it; the reports can. Per endpoint, the
//! outcomes (SUCCESS against ERROR or TIMEOUT; CANCELLED and REJECTED say
//! nothing about the engine) are counted with exponential decay, and an
//! endpoint whose recent outcomes reach `minRequests` with an error share
//! of at least `errorRatio` is *failing*: ranked after every endpoint that
//! is not (still picked when every one is). After `coolDownMs` it is
//! probed: ranked as usual until one pick goes there; that request's
//! outcome closes the case (a success: the counts restart) or re-opens it
//! for another cool-down. A probe whose report never comes is replaced
//! after another cool-down. With no errors nothing changes: every flag is
//! false and the ranking is the cost order.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvasir_proto::v1 as pb;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::types::EndpointId;

/// When an endpoint counts as failing (`failures` in a pool's config).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct FailureConfig {
    /// Whether failing endpoints are ranked last at all.
    pub enabled: bool,
    /// Half-life of the outcome counts, ms: an outcome this old weighs half.
    #[serde(alias = "half_life_ms")]
    pub half_life_ms: u64,
    /// Least (decayed) outcomes before an endpoint is judged.
    #[serde(alias = "min_requests")]
    pub min_requests: f64,
    /// Share of errors among those outcomes at which it is failing.
    #[serde(alias = "error_ratio")]
    pub error_ratio: f64,
    /// How long a failing endpoint is ranked last before it is probed, ms.
    #[serde(alias = "cool_down_ms")]
    pub cool_down_ms: u64,
}

impl Default for FailureConfig {
    fn default() -> Self {
        FailureConfig {
            enabled: true,
            half_life_ms: 10_000,
            min_requests: 10.0,
            error_ratio: 0.5,
            cool_down_ms: 5_000,
        }
    }
}

impl FailureConfig {
    /// Checks ranges; on error, the field name and what is wrong.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.half_life_ms == 0 {
            return Err(("halfLifeMs", "must be at least 1".into()));
        }
        if !self.min_requests.is_finite() || self.min_requests < 1.0 {
            return Err((
                "minRequests",
                format!("must be a number >= 1, got {}", self.min_requests),
            ));
        }
        if !(self.error_ratio > 0.0 && self.error_ratio <= 1.0) {
            return Err((
                "errorRatio",
                format!("must be in (0, 1], got {}", self.error_ratio),
            ));
        }
        if self.cool_down_ms == 0 {
            return Err(("coolDownMs", "must be at least 1".into()));
        }
        Ok(())
    }
}

/// How a request ended, as far as the engine's health goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It served the request.
    Success,
    /// ERROR or TIMEOUT.
    Failure,
}

/// One endpoint's outcomes, state and counters.
#[derive(Debug, Clone, Copy)]
struct Tracked {
    ok: f64,
    err: f64,
    /// When `ok` and `err` were last decayed.
    at: Instant,
    /// Failing since (or since its last failed probe).
    failing_since: Option<Instant>,
    /// When the outstanding probe was sent.
    probe_sent: Option<Instant>,
    successes: u64,
    failures: u64,
    ejections: u64,
}

impl Tracked {
    fn new(now: Instant) -> Self {
        Tracked {
            ok: 0.0,
            err: 0.0,
            at: now,
            failing_since: None,
            probe_sent: None,
            successes: 0,
            failures: 0,
            ejections: 0,
        }
    }

    fn decay(&mut self, now: Instant, half_life: Duration) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        let f = 0.5f64.powf(dt / half_life.as_secs_f64());
        self.ok *= f;
        self.err *= f;
        self.at = self.at.max(now);
    }

    fn error_ratio(&self) -> f64 {
        let total = self.ok + self.err;
        if total > 0.0 {
            self.err / total
        } else {
            0.0
        }
    }
}

/// An endpoint's state as `/metrics` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct HealthView {
    /// Ranked after the endpoints that are not failing.
    pub failing: bool,
    /// Decayed share of errors among recent outcomes (0 with none).
    pub error_ratio: f64,
    /// Successful outcomes counted.
    pub successes: u64,
    /// Failed outcomes counted.
    pub failures: u64,
    /// Times it turned failing.
    pub ejections: u64,
}

/// A pool's failure tracking. `Send + Sync`; each call takes one short lock.
#[derive(Debug, Default)]
pub struct Failures {
    cfg: FailureConfig,
    endpoints: Mutex<HashMap<EndpointId, Tracked>>,
}

impl Failures {
    /// Tracking with these thresholds.
    pub fn new(cfg: FailureConfig) -> Self {
        Failures {
            cfg,
            endpoints: Mutex::new(HashMap::new()),
        }
    }

    /// The thresholds.
    pub fn config(&self) -> &FailureConfig {
        &self.cfg
    }

    fn half_life(&self) -> Duration {
        Duration::from_millis(self.cfg.half_life_ms.max(1))
    }

    fn cool_down(&self) -> Duration {
        Duration::from_millis(self.cfg.cool_down_ms)
    }

    /// Counts a request's outcome on `endpoint`.
    pub fn record(&self, endpoint: EndpointId, verdict: Verdict, now: Instant) {
        let mut g = self.endpoints.lock();
        let t = g.entry(endpoint).or_insert_with(|| Tracked::new(now));
        t.decay(now, self.half_life());
        match verdict {
            Verdict::Success => {
                t.ok += 1.0;
                t.successes += 1;
            }
            Verdict::Failure => {
                t.err += 1.0;
                t.failures += 1;
            }
        }
        self.judge(t, verdict, now);
    }

    fn judge(&self, t: &mut Tracked, verdict: Verdict, now: Instant) {
        let cooled = |since: Instant| now.saturating_duration_since(since) >= self.cool_down();
        match (t.failing_since, verdict) {
            // A success inside the cool-down is a straggler's; only counted.
            (Some(since), Verdict::Success) if !cooled(since) => {}
            // After it, the probe's: the engine serves again.
            (Some(_), Verdict::Success) => {
                *t = Tracked {
                    ok: 1.0,
                    err: 0.0,
                    failing_since: None,
                    probe_sent: None,
                    ..*t
                };
            }
            // A failure after the cool-down is a failed probe: wait again.
            (Some(since), Verdict::Failure) => {
                if cooled(since) {
                    t.failing_since = Some(now);
                    t.probe_sent = None;
                }
            }
            (None, _) => {
                // Decay leaves n quick outcomes just under n: count them whole.
                let total = t.ok + t.err + 0.05;
                if total >= self.cfg.min_requests && t.error_ratio() >= self.cfg.error_ratio {
                    t.failing_since = Some(now);
                    t.probe_sent = None;
                    t.ejections += 1;
                }
            }
        }
    }

    /// Whether picks rank `endpoint` after those that are not failing now:
    /// failing, and not due for a probe.
    pub fn ranked_last(&self, endpoint: EndpointId, now: Instant) -> bool {
        if !self.cfg.enabled {
            return false;
        }
        let g = self.endpoints.lock();
        g.get(&endpoint).is_some_and(|t| self.held_back(t, now))
    }

    /// [`Failures::ranked_last`] of each of `ids`, in order, under one lock.
    pub fn ranked_last_all(
        &self,
        ids: impl IntoIterator<Item = EndpointId>,
        now: Instant,
    ) -> Vec<bool> {
        let g = self.endpoints.lock();
        ids.into_iter()
            .map(|id| self.cfg.enabled && g.get(&id).is_some_and(|t| self.held_back(t, now)))
            .collect()
    }

    fn held_back(&self, t: &Tracked, now: Instant) -> bool {
        let Some(since) = t.failing_since else {
            return false;
        };
        let cool = self.cool_down();
        let cooling = now.saturating_duration_since(since) < cool;
        let probing = t
            .probe_sent
            .is_some_and(|p| now.saturating_duration_since(p) < cool);
        cooling || probing
    }

    /// Notes that a pick went to `endpoint` first: when it is failing and
    /// due for a probe, this pick is the probe.
    pub fn picked(&self, endpoint: EndpointId, now: Instant) {
        let mut g = self.endpoints.lock();
        if let Some(t) = g.get_mut(&endpoint) {
            if t.failing_since.is_some() && !self.held_back(t, now) {
                t.probe_sent = Some(now);
            }
        }
    }

    /// Forgets a removed endpoint.
    pub fn remove_endpoint(&self, endpoint: EndpointId) {
        self.endpoints.lock().remove(&endpoint);
    }

    /// The endpoint's state (defaults before any outcome).
    pub fn view(&self, endpoint: EndpointId, now: Instant) -> HealthView {
        let g = self.endpoints.lock();
        g.get(&endpoint).map_or_else(HealthView::default, |t| {
            let mut d = *t;
            d.decay(now, self.half_life());
            HealthView {
                failing: t.failing_since.is_some(),
                error_ratio: d.error_ratio(),
                successes: t.successes,
                failures: t.failures,
                ejections: t.ejections,
            }
        })
    }
}

impl Verdict {
    /// What a DONE report's outcome says about the engine, if anything.
    pub fn of(outcome: pb::Outcome) -> Option<Verdict> {
        match outcome {
            pb::Outcome::Success | pb::Outcome::Unspecified => Some(Verdict::Success),
            pb::Outcome::Error | pb::Outcome::Timeout => Some(Verdict::Failure),
            pb::Outcome::Cancelled | pb::Outcome::Rejected | pb::Outcome::ClientError => None,
        }
    }
}

#[cfg(test)]
#[path = "health_tests.rs"]
mod tests;
