//! Leader election over a `coordination.k8s.io/v1` Lease, after client-go's
//! `leaderelection` package: kube-rs has none.
//!
//! Every replica reads the Lease each round and, from what it read,
//! [`decide`]s to create it, renew it, take it over or follow its holder.
//! Every write is a create or a PUT carrying the `resourceVersion` it read,
//! so of two replicas racing on one version the API server lets exactly one
//! through and answers the other 409; the loser follows.
//!
//! Timing, as in client-go: a leader renews every `retry_period` and steps
//! down when it has not renewed for `renew_deadline`, measured on its own
//! monotonic clock from the moment *before* the renewal it last got through.
//! Others may take over only once `renewTime + leaseDurationSeconds` has
//! passed, so the `lease_duration - renew_deadline` gap is what absorbs
//! clock skew and delays between replicas.
//!
//! Unlike client-go, a follower judges expiry from the Lease's `renewTime`
//! against its own wall clock rather than from when it last saw the Lease
//! change, so the margin above must exceed the replicas' clock skew (NTP
//! keeps nodes well inside the default 5 s).

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::PostParams;
use kube::core::Status;
use kube::{Api, Client};
use tokio::sync::watch;
use tokio::time::Instant;

/// Where the Lease lives, who we are, and the election's timing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// This replica's `holderIdentity`; unique per replica (the pod name).
    pub identity: String,
    /// How long a Lease stays valid after its last renewal (written as whole
    /// seconds, rounded up).
    pub lease_duration: std::time::Duration,
    /// How long a leader keeps leading without a successful renewal; must be
    /// shorter than `lease_duration`.
    pub renew_deadline: std::time::Duration,
    /// The pause between rounds, as leader and as follower.
    pub retry_period: std::time::Duration,
}

impl LeaseConfig {
    /// client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry period.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        identity: impl Into<String>,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// What to do about the Lease as read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// There is no Lease: create it, holding it.
    Create,
    /// We hold it: renew it.
    Renew,
    /// Someone else held it but it expired, or nobody holds it: take it.
    TakeOver,
    /// Someone else holds a valid Lease: leave it alone.
    Follow {
        /// The current holder.
        holder: String,
        /// Time left before the holder's Lease expires, as of `now`.
        expires_in: std::time::Duration,
    },
}

/// Pure decision from the Lease as read (`None` = absent), at `now`.
///
/// The Lease's own `leaseDurationSeconds` counts (the holder chose it);
/// `lease_duration` stands in where it is missing.
pub fn decide(
    lease: Option<&Lease>,
    identity: &str,
    now: Timestamp,
    lease_duration: std::time::Duration,
) -> Decision {
    let Some(lease) = lease else {
        return Decision::Create;
    };
    let Some(spec) = lease.spec.as_ref() else {
        return Decision::TakeOver;
    };
    let holder = spec.holder_identity.as_deref().unwrap_or_default();
    // An empty holder is how client-go (and `run`) release a Lease.
    if holder.is_empty() {
        return Decision::TakeOver;
    }
    if holder == identity {
        return Decision::Renew;
    }
    // Every holder writes renewTime with each acquire and renew; one that
    // wrote neither time cannot be shown to be alive, and honouring it
    // forever would leave the controller without a leader.
    let Some(renewed) = spec.renew_time.as_ref().or(spec.acquire_time.as_ref()) else {
        return Decision::TakeOver;
    };
    let valid_for = match spec.lease_duration_seconds {
        Some(seconds) if seconds > 0 => SignedDuration::from_secs(i64::from(seconds)),
        _ => SignedDuration::try_from(lease_duration).unwrap_or(SignedDuration::MAX),
    };
    let age = now.duration_since(renewed.0);
    if age > valid_for {
        return Decision::TakeOver;
    }
    let left = valid_for.checked_sub(age).unwrap_or(SignedDuration::MAX);
    Decision::Follow {
        holder: holder.to_owned(),
        expires_in: Duration::try_from(left).unwrap_or(Duration::MAX),
    }
}

/// One round: GET the Lease, then create it, update it (a PUT with the
/// `resourceVersion` read, so a concurrent writer gets 409), or leave it.
///
/// `Ok(true)`: we lead after this round. A 409 (conflict, or a create that
/// lost to another) or a 404 on the update means another replica won:
/// `Ok(false)`. Other API errors are returned; the caller retries.
pub async fn try_once(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    now: Timestamp,
) -> Result<bool, kube::Error> {
    let current = api.get_opt(&cfg.name).await?;
    let decision = decide(current.as_ref(), &cfg.identity, now, cfg.lease_duration);
    let (take_over, mut lease) = match (decision, current) {
        (Decision::Follow { holder, expires_in }, _) => {
            tracing::debug!(lease = %cfg.name, %holder, ?expires_in, "lease held by another replica");
            return Ok(false);
        }
        // Renew and TakeOver always come with the Lease they were read from.
        (Decision::Create, _) | (_, None) => return create(api, cfg, now).await,
        (decision, Some(lease)) => (decision == Decision::TakeOver, lease),
    };
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    let stamp = MicroTime(now);
    if take_over {
        spec.acquire_time = Some(stamp.clone());
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
    } else {
        spec.acquire_time.get_or_insert_with(|| stamp.clone());
        spec.lease_transitions.get_or_insert(0);
    }
    spec.holder_identity = Some(cfg.identity.clone());
    spec.lease_duration_seconds = Some(whole_seconds(cfg.lease_duration));
    spec.renew_time = Some(stamp);
    update(api, cfg, &lease).await
}

async fn create(api: &Api<Lease>, cfg: &LeaseConfig, now: Timestamp) -> Result<bool, kube::Error> {
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(cfg.name.clone()),
            namespace: Some(cfg.namespace.clone()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(cfg.identity.clone()),
            lease_duration_seconds: Some(whole_seconds(cfg.lease_duration)),
            acquire_time: Some(MicroTime(now)),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(0),
            ..LeaseSpec::default()
        }),
    };
    match api.create(&PostParams::default(), &lease).await {
        Ok(_) => Ok(true),
        // Another replica created it between our GET and our POST.
        Err(kube::Error::Api(status)) if status.code == 409 || status.is_already_exists() => {
            Ok(false)
        }
        Err(err) => Err(err),
    }
}

/// PUT `lease` as modified from what was read; `Ok(false)` when another
/// writer got there first.
async fn update(api: &Api<Lease>, cfg: &LeaseConfig, lease: &Lease) -> Result<bool, kube::Error> {
    match api.replace(&cfg.name, &PostParams::default(), lease).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if lost(&status) => Ok(false),
        Err(err) => Err(err),
    }
}

/// A 409 on our PUT: someone wrote after our GET. A 404: someone deleted it.
fn lost(status: &Status) -> bool {
    status.code == 409 || status.code == 404 || status.is_conflict() || status.is_not_found()
}

/// Hands the Lease back the way client-go does (`ReleaseOnCancel`): no
/// holder and a 1 s duration, so a follower takes it on its next round
/// instead of waiting out the lease. Only a Lease still naming us is touched.
async fn release(api: &Api<Lease>, cfg: &LeaseConfig, now: Timestamp) -> Result<bool, kube::Error> {
    let Some(mut lease) = api.get_opt(&cfg.name).await? else {
        return Ok(false);
    };
    let Some(spec) = lease.spec.as_mut() else {
        return Ok(false);
    };
    if spec.holder_identity.as_deref() != Some(cfg.identity.as_str()) {
        return Ok(false);
    }
    spec.holder_identity = Some(String::new());
    spec.lease_duration_seconds = Some(1);
    spec.acquire_time = Some(MicroTime(now));
    spec.renew_time = Some(MicroTime(now));
    update(api, cfg, &lease).await
}

/// `leaseDurationSeconds` holds whole seconds; rounding up keeps the Lease
/// at least as long as the timing `run` steps down by assumes.
fn whole_seconds(duration: Duration) -> i32 {
    let seconds = duration
        .as_secs()
        .saturating_add(u64::from(duration.subsec_nanos() > 0));
    i32::try_from(seconds.max(1)).unwrap_or(i32::MAX)
}

/// The timing `run` actually uses: the configured one, made safe.
#[derive(Clone, Copy, Debug)]
struct Timing {
    renew_deadline: Duration,
    retry_period: Duration,
}

impl Timing {
    fn of(cfg: &LeaseConfig) -> Self {
        let mut renew_deadline = cfg.renew_deadline;
        // A deadline at or past the lease's end would let a stalled leader
        // keep writing after a follower took over: two writers.
        if renew_deadline >= cfg.lease_duration {
            renew_deadline = cfg.lease_duration.saturating_mul(2) / 3;
            tracing::warn!(
                configured = ?cfg.renew_deadline,
                lease_duration = ?cfg.lease_duration,
                using = ?renew_deadline,
                "renew deadline must be shorter than the lease duration"
            );
        }
        // A zero period would spin on the API server.
        let retry_period = cfg.retry_period.max(Duration::from_millis(10));
        Self {
            renew_deadline,
            retry_period,
        }
    }
}

/// What one replica knows between rounds.
#[derive(Debug, Default)]
struct State {
    /// `Some` while leading: the instant taken just before the `renewTime`
    /// of our last successful write.
    renewed_at: Option<Instant>,
    /// The Lease may still name us (we wrote it and have not seen another
    /// holder since), so shutdown should release it.
    may_hold: bool,
}

/// Runs the election until `shutdown` resolves, keeping `leading` true
/// exactly while this replica may write.
///
/// A leader renews every `retry_period` and sets `leading` false as soon as
/// `renew_deadline` passes without a successful renewal, which is before the
/// Lease can expire for the others. On shutdown it sets `leading` false and
/// then releases the Lease, so another replica takes over at once.
pub async fn run(
    client: Client,
    cfg: LeaseConfig,
    leading: watch::Sender<bool>,
    shutdown: impl Future<Output = ()>,
) {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let timing = Timing::of(&cfg);
    let mut shutdown = pin!(shutdown);
    let mut state = State::default();
    set(&leading, false);
    loop {
        let next = tokio::select! {
            biased;
            () = &mut shutdown => break,
            next = round(&api, &cfg, timing, &mut state, &leading) => next,
        };
        tokio::select! {
            biased;
            () = &mut shutdown => break,
            () = tokio::time::sleep_until(next) => {}
        }
    }
    if state.renewed_at.take().is_some() {
        set(&leading, false);
        tracing::info!(lease = %cfg.name, identity = %cfg.identity, "stopped leading: shutting down");
    }
    if state.may_hold {
        // Bounded: a dead API server must not hold up the process's exit,
        // and the Lease then simply expires.
        match tokio::time::timeout(timing.renew_deadline, release(&api, &cfg, Timestamp::now()))
            .await
        {
            Ok(Ok(true)) => tracing::info!(lease = %cfg.name, "released the lease"),
            Ok(Ok(false)) => {}
            Ok(Err(err)) => {
                tracing::warn!(lease = %cfg.name, error = %err, "could not release the lease")
            }
            Err(_) => tracing::warn!(lease = %cfg.name, "releasing the lease timed out"),
        }
    }
}

/// One round; returns when the next one is due.
async fn round(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    timing: Timing,
    state: &mut State,
    leading: &watch::Sender<bool>,
) -> Instant {
    // The instant before the wall-clock time we write as renewTime, so the
    // deadline counted from it ends no later than the Lease seen by others.
    let started = Instant::now();
    let now = Timestamp::now();
    let next = started + timing.retry_period;
    let Some(renewed_at) = state.renewed_at else {
        // As follower a hung request only delays the next round.
        match tokio::time::timeout(timing.renew_deadline, try_once(api, cfg, now)).await {
            Ok(Ok(true)) => {
                state.renewed_at = Some(started);
                state.may_hold = true;
                set(leading, true);
                tracing::info!(lease = %cfg.name, identity = %cfg.identity, "acquired the lease: leading");
            }
            Ok(Ok(false)) => state.may_hold = false,
            Ok(Err(err)) => {
                tracing::warn!(lease = %cfg.name, error = %err, "leader election round failed")
            }
            Err(_) => tracing::warn!(lease = %cfg.name, "leader election round timed out"),
        }
        return next;
    };
    let deadline = renewed_at + timing.renew_deadline;
    if started >= deadline {
        step_down(state, leading, cfg, "renew deadline passed");
        return next;
    }
    match tokio::time::timeout_at(deadline, try_once(api, cfg, now)).await {
        Ok(Ok(true)) => {
            state.renewed_at = Some(started);
            next
        }
        Ok(Ok(false)) => {
            state.may_hold = false;
            step_down(state, leading, cfg, "another replica holds the lease");
            next
        }
        Ok(Err(err)) => {
            tracing::warn!(lease = %cfg.name, error = %err, "renewing the lease failed");
            // Wake at the deadline at the latest, to step down on time.
            next.min(deadline)
        }
        Err(_) => {
            step_down(state, leading, cfg, "renew deadline passed");
            next
        }
    }
}

fn step_down(state: &mut State, leading: &watch::Sender<bool>, cfg: &LeaseConfig, why: &str) {
    state.renewed_at = None;
    set(leading, false);
    tracing::warn!(lease = %cfg.name, identity = %cfg.identity, reason = why, "lost the lease: stopped leading");
}

/// Notifies receivers only on a change; works with no receivers left.
fn set(leading: &watch::Sender<bool>, value: bool) {
    leading.send_if_modified(|current| std::mem::replace(current, value) != value);
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: &str = "2026-01-02T03:04:05.000006Z";

    fn now() -> Timestamp {
        NOW.parse().expect("valid timestamp")
    }

    fn lease(holder: Option<&str>, renewed_secs_ago: Option<i64>, duration: Option<i32>) -> Lease {
        let at = |ago: i64| MicroTime(now() - SignedDuration::from_secs(ago));
        Lease {
            metadata: ObjectMeta {
                name: Some("kvasir-controller".into()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_owned),
                lease_duration_seconds: duration,
                acquire_time: renewed_secs_ago.map(|ago| at(ago + 100)),
                renew_time: renewed_secs_ago.map(at),
                lease_transitions: Some(3),
                ..LeaseSpec::default()
            }),
        }
    }

    const FIFTEEN: Duration = Duration::from_secs(15);

    /// What replica `a`, asking for 15 s, does about `lease` now.
    fn decide_a(lease: &Lease) -> Decision {
        decide(Some(lease), "a", now(), FIFTEEN)
    }

    fn follows_b(expires_in: Duration) -> Decision {
        Decision::Follow {
            holder: "b".into(),
            expires_in,
        }
    }

    #[test]
    fn absent_lease_is_created() {
        assert_eq!(decide(None, "a", now(), FIFTEEN), Decision::Create);
    }

    #[test]
    fn lease_held_by_me_is_renewed_even_when_expired() {
        let fresh = lease(Some("a"), Some(1), Some(15));
        assert_eq!(decide_a(&fresh), Decision::Renew);
        let stale = lease(Some("a"), Some(100), Some(15));
        assert_eq!(decide_a(&stale), Decision::Renew);
    }

    #[test]
    fn fresh_lease_held_by_other_is_followed() {
        let held = lease(Some("b"), Some(5), Some(15));
        assert_eq!(decide_a(&held), follows_b(Duration::from_secs(10)));
    }

    #[test]
    fn lease_expiring_exactly_now_is_still_followed() {
        let held = lease(Some("b"), Some(15), Some(15));
        assert_eq!(decide_a(&held), follows_b(Duration::ZERO));
    }

    #[test]
    fn expired_lease_held_by_other_is_taken_over() {
        let held = lease(Some("b"), Some(16), Some(15));
        assert_eq!(decide_a(&held), Decision::TakeOver);
    }

    #[test]
    fn holders_duration_counts_over_ours() {
        // b asked for 60 s; our 15 s must not cut its lease short.
        let held = lease(Some("b"), Some(30), Some(60));
        assert!(matches!(
            decide_a(&held),
            Decision::Follow { expires_in, .. } if expires_in == Duration::from_secs(30)
        ));
        // Without a duration on the Lease, ours stands in.
        let held = lease(Some("b"), Some(30), None);
        assert_eq!(decide_a(&held), Decision::TakeOver);
    }

    #[test]
    fn released_lease_is_taken_at_once() {
        let released = lease(Some(""), Some(0), Some(1));
        assert_eq!(decide_a(&released), Decision::TakeOver);
        let no_holder = lease(None, Some(0), Some(15));
        assert_eq!(decide_a(&no_holder), Decision::TakeOver);
        let no_spec = Lease::default();
        assert_eq!(decide_a(&no_spec), Decision::TakeOver);
    }

    #[test]
    fn missing_renew_time_falls_back_to_acquire_time() {
        let mut held = lease(Some("b"), Some(5), Some(15));
        let spec = held.spec.as_mut().expect("spec");
        spec.renew_time = None;
        spec.acquire_time = Some(MicroTime(now() - SignedDuration::from_secs(5)));
        assert_eq!(decide_a(&held), follows_b(Duration::from_secs(10)));
    }

    #[test]
    fn lease_with_neither_time_is_taken_over() {
        let held = lease(Some("b"), None, Some(15));
        assert_eq!(decide_a(&held), Decision::TakeOver);
    }

    #[test]
    fn renew_time_in_the_future_is_followed() {
        // Another node's clock running ahead: still b's, for longer.
        let held = lease(Some("b"), Some(-3), Some(15));
        assert_eq!(decide_a(&held), follows_b(Duration::from_secs(18)));
    }

    #[test]
    fn durations_are_written_as_whole_seconds_rounded_up() {
        assert_eq!(whole_seconds(Duration::from_secs(15)), 15);
        assert_eq!(whole_seconds(Duration::from_millis(1500)), 2);
        assert_eq!(whole_seconds(Duration::ZERO), 1);
        assert_eq!(whole_seconds(Duration::MAX), i32::MAX);
    }

    #[test]
    fn unsafe_renew_deadline_is_pulled_inside_the_lease() {
        let mut cfg = LeaseConfig::new("ns", "lease", "a");
        assert_eq!(Timing::of(&cfg).renew_deadline, Duration::from_secs(10));
        cfg.renew_deadline = Duration::from_secs(20);
        assert_eq!(Timing::of(&cfg).renew_deadline, Duration::from_secs(10));
        cfg.retry_period = Duration::ZERO;
        assert_eq!(Timing::of(&cfg).retry_period, Duration::from_millis(10));
    }

    #[test]
    fn defaults_are_client_gos() {
        let cfg = LeaseConfig::new("kvasir-system", "kvasir-controller", "pod-0");
        assert_eq!(cfg.lease_duration, Duration::from_secs(15));
        assert_eq!(cfg.renew_deadline, Duration::from_secs(10));
        assert_eq!(cfg.retry_period, Duration::from_secs(2));
    }
}
