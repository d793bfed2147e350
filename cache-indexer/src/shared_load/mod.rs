//! Shared load: indexer replicas that act as one.
//!
//! Each replica counts the picks it placed (in flight, queued prefill) in
//! its pools' trackers; behind an Envoy that spreads picks over several
//! replicas each would see only its share of what the engines are about to
//! receive, and two replicas could pile work on the same engine between two
//! scrapes. With a `sharedLoad` section every replica keeps, per pool, one
//! field in a Redis hash (`<keyPrefix><pool>`, field = its replica id,
//! value = its per-endpoint in-flight count and queued prefill tokens, see
//! [`merge`]) and every `intervalMs` runs one pipelined round trip for all
//! pools: `HSET` its field when its load changed or a heartbeat is due,
//! `HGETALL` the hash. The other live replicas' load, summed, goes into the
//! tracker ([`crate::load::peers`]), whose views add it to the in-flight
//! and queued-prefill terms the scorer prices; a replica's own field is
//! skipped, so its own picks count once.
//!
//! * **Staleness.** A pick on one replica reaches another's views after at
//!   most two intervals plus two round trips (the writer's next round, the
//!   reader's next round). Read load is used for at most `ttlMs` after its
//!   read; then, without a newer read, the views hold this replica's own
//!   counts only.
//! * **Dead replicas.** Every write bumps a sequence number and a live
//!   replica writes at least every `ttlMs / 3`; a reader counts a replica
//!   whose number has not moved for `ttlMs` (its own clock: no clock is
//!   shared) as dead, and deletes its field after ten TTLs. A replica that
//!   stops gracefully deletes its fields at once.
//! * **Cost.** Nothing on the pick path: a pick reads the tracker as
//!   before (one map lookup per endpoint more, and matching peers' sampled
//!   chains, bounded per endpoint). Per replica, one round trip
//!   per interval carrying one small hash per pool out (when changed) and
//!   back; Redis holds one hash per pool with one field per replica.
//! * **Failures.** Every call is bounded by `timeoutMs`; after a failure
//!   Redis is left alone for `retryMs`. Failed rounds are counted, the last
//!   read serves until its TTL, then each replica steers by its own counts
//!   (`kvasir_indexer_shared_load_local_only`): never a hang, never a slower
//!   pick.
//!
//! * **Picks in prefill.** The prompts of a replica's picks still in
//!   prefill (the tracker's pending prefixes) go into a second hash,
//!   `<keyPrefix><pool>:pending`, in the same round trip, as sampled chains
//!   ([`pending`], [`crate::load::SampledChain`]): until a prefill is done
//!   the engine's KV events do not say where its prefix will be cached, and
//!   a repeat picked by another replica would otherwise be prefilled again
//!   elsewhere. Read only for live replicas, deleted with their load field.
//!
//! * **Recent placements.** With `placements` on (the default), the
//!   conversations each replica started per endpoint and the prompt ends it
//!   recorded ([`crate::load::Placed`], the `placement` term) go into a
//!   stream per pool, `<keyPrefix><pool>:placed`, in the same round trip:
//!   one entry per replica and round with placements since its last, read
//!   by the others from where they left off ([`placed`]). So a later turn
//!   through another replica continues its conversation there (no
//!   `placement` charge on the engine holding its history), and cold
//!   conversations spread by the pool's counts, not each replica's. Bounded:
//!   an outbox keeps at most 1,024 starts and 4,096 ends per round, a read
//!   takes at most 256 entries, the stream keeps about 4,096. Staleness as
//!   the load's (two intervals plus two round trips); each start counts
//!   what is left of it after its age (the server's `TIME` and the
//!   entry's id, no shared clock), and one from before an endpoint's
//!   restart, as this replica saw it, is not counted.
//!
//! * **Reports that reached another replica.** With `shareReports` (on by default), reports that match none of
//!   a replica's picks go into a stream per pool,
//!   `<keyPrefix><pool>:reports`, in the same round trip, and each replica
//!   applies the others' to its own picks ([`reports`]): a pick made by a
//!   unary call before the filter's stream was open, or before a stream
//!   was reopened on another replica, ends where it was made instead of
//!   counting as queued prefill until the prefill horizon.
//!
//! * **Waking on change.** With `wakeOnChange` a replica does not wait
//!   for its interval to publish: its trackers notify the sync task on
//!   every pick, report and completed chain, and the round that writes
//!   the change also `PUBLISH`es the replica's id on
//!   `<keyPrefix>wake`; every other replica listens on that channel (one
//!   more connection) and runs a round at once. Staleness drops from up to
//!   two intervals plus two round trips to about two round trips, and the
//!   interval becomes the heartbeat and fallback. Rounds are at least
//!   [`wake::MIN_GAP`] apart, so a burst of picks costs one round per gap;
//!   a lost subscription only brings back the interval's staleness.
//!
//! * **Flow control.** A pool with flow control on also keeps a third hash,
//!   `<keyPrefix><pool>:flow`: each replica's picks placed on and ended at
//!   each endpoint, as running totals ([`moves`]), written in the same
//!   round when they changed. Their increments reach the other replicas'
//!   flow control one round later, instead of at their next scrape.

pub mod config;
pub(crate) mod exposition;
pub mod merge;
pub mod moves;
pub mod pending;
pub mod placed;
pub mod reports;
mod store;
mod sync;
mod wake;

use std::time::Duration;

pub use merge::{decode, encode, Entry, Merged, PeerTable};
pub use store::StoreError;
pub use sync::run;

/// The running settings (from [`config::SharedLoadConfig`]).
#[derive(Debug, Clone)]
pub struct Settings {
    /// The Redis client (connects on first use).
    pub client: redis::Client,
    /// Its URL, for logs.
    pub url: String,
    /// Time between rounds.
    pub interval: Duration,
    /// Liveness bound of a replica's entry, and how long a read is used.
    pub ttl: Duration,
    /// Bound of one round trip, connect included.
    pub timeout: Duration,
    /// After a failure, Redis is left alone this long.
    pub retry_after: Duration,
    /// Key prefix (then the pool's name).
    pub key_prefix: String,
    /// This replica's field.
    pub replica_id: String,
    /// Whether recent placements are shared too ([`placed`]).
    pub placements: bool,
    /// Whether a change of own load starts a round at once and a peer's
    /// published change wakes this replica's read ([`wake`]).
    pub wake_on_change: bool,
    /// Whether unmatched reports are passed to the other replicas ([`reports`]).
    pub share_reports: bool,
}
