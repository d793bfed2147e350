//! The sync task: every interval, one pipelined round trip to Redis that,
//! for every pool, writes this replica's field (when its load changed or a
//! heartbeat is due) and reads the whole hash back; the other replicas'
//! load goes into each pool's tracker. Pools with flow control also write
//! and read their picks' running totals ([`moves`]), whose increments go to
//! the pool's flow control. With `placements` on, every pool also adds this
//! replica's recent placements to its stream and reads the others'
//! ([`placed`]), merged into the pool's [`crate::load::Placed`]. Nothing
//! here runs on a pick's path: a pick reads what the last round left in the
//! tracker, the placements and the flow state.

use std::collections::HashMap;
use std::convert::identity;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::merge::{encode, PeerTable, FORGET_AFTER_TTLS};
use super::moves::{self, MovesTable};
use super::pending::{self, Fingerprint};
use super::placed::{self, PlacedTable};
use super::reports::{self, ReportsTable};
use super::store::{Store, StoreError};
use super::{wake, Settings};
use crate::load::{PeerLoad, Phase};
use crate::pool::Pool;
use crate::pools::Pools;
use crate::types::EndpointId;

/// A live replica publishes at least this often in TTLs, load changed or
/// not, so readers can tell it from a dead one.
const HEARTBEATS_PER_TTL: u32 = 3;

type Loads = Vec<(EndpointId, PeerLoad)>;
type Totals = Vec<(EndpointId, u64, u64)>;

/// One pool's side of the sync.
struct PoolSync {
    pool: Arc<Pool>,
    key: String,
    /// The second hash: picks still in prefill ([`pending`]).
    pending_key: String,
    table: PeerTable,
    /// What was last written, and when (none: write at the next round).
    published: Option<(Loads, Instant)>,
    /// The pending chains last written (none: write at the next round).
    published_pending: Option<Fingerprint>,
    /// Dead replicas' fields to delete at the next round.
    forget: Vec<String>,
    /// The third hash, picks' running totals for flow control: only for a
    /// pool with flow control on.
    flow: Option<FlowSync>,
    /// The placements stream: only with `placements` on.
    placed: Option<PlacedSync>,
    /// The stream of reports that matched no pick here ([`reports`]): only
    /// with `shareReports` on.
    reports: Option<(String, ReportsTable)>,
}

/// A pool's placements side of the sync ([`placed`]).
struct PlacedSync {
    key: String,
    table: PlacedTable,
}

/// A pool's flow-control side of the sync ([`moves`]).
struct FlowSync {
    key: String,
    table: MovesTable,
    /// The totals last written (none: write at the next round).
    published: Option<Totals>,
}

/// The rounds of one replica.
struct Sync {
    s: Settings,
    store: Store,
    pools: Vec<PoolSync>,
    /// Grows with every write; starts at the start time so a restarted
    /// replica with the same id never repeats an old number.
    seq: u64,
    failing: bool,
    /// Where a round that wrote a change publishes it (`wakeOnChange`).
    wake_channel: String,
}

/// Runs rounds until `cancel`, then deletes this replica's fields (bounded
/// by the timeout) so the others stop counting its load at once.
pub async fn run(pools: Arc<Pools>, s: Settings, cancel: CancellationToken) {
    let mut sync = Sync::new(&pools, s);
    tracing::info!(url = %sync.s.url, replica = %sync.s.replica_id, interval = ?sync.s.interval, ttl = ?sync.s.ttl, wake_on_change = sync.s.wake_on_change, "shared load: on");
    // Never notified without `wakeOnChange`: then only the interval runs rounds.
    let woken = Arc::new(Notify::new());
    let helpers = cancel.child_token();
    if sync.s.wake_on_change {
        for p in pools.iter() {
            wake::forward(p.load.changes(), Arc::clone(&woken), helpers.clone());
        }
        let listen = wake::Listen {
            client: sync.s.client.clone(),
            channel: sync.wake_channel.clone(),
            replica_id: sync.s.replica_id.clone(),
            timeout: sync.s.timeout,
            retry_after: sync.s.retry_after,
        };
        wake::listen(listen, Arc::clone(&woken), helpers.clone());
    }
    let mut tick = tokio::time::interval(sync.s.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = Instant::now();
    loop {
        tokio::select! {
            () = cancel.cancelled() => break,
            _ = tick.tick() => {}
            () = woken.notified() => {
                // Changes during the gap are in the same round.
                tokio::time::sleep_until((last + wake::MIN_GAP).into()).await;
            }
        }
        sync.round().await;
        last = Instant::now();
    }
    helpers.cancel();
    sync.withdraw().await;
}

impl Sync {
    fn new(pools: &Pools, s: Settings) -> Self {
        let store = Store::new(s.client.clone(), s.timeout, s.retry_after);
        let pools = pools
            .iter()
            .map(|p| PoolSync {
                pool: Arc::clone(p),
                key: format!("{}{}", s.key_prefix, p.name),
                pending_key: format!("{}{}:pending", s.key_prefix, p.name),
                reports: s.share_reports.then(|| {
                    (
                        format!("{}{}:reports", s.key_prefix, p.name),
                        ReportsTable::default(),
                    )
                }),
                table: PeerTable::default(),
                published: None,
                published_pending: None,
                forget: Vec::new(),
                flow: p.flow.enabled().then(|| FlowSync {
                    key: format!("{}{}:flow", s.key_prefix, p.name),
                    table: MovesTable::default(),
                    published: None,
                }),
                placed: s.placements.then(|| {
                    p.placements.share();
                    PlacedSync {
                        key: format!("{}{}:placed", s.key_prefix, p.name),
                        table: PlacedTable::default(),
                    }
                }),
            })
            .collect();
        let seq = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        Sync {
            wake_channel: wake::channel(&s.key_prefix),
            s,
            store,
            pools,
            seq,
            failing: false,
        }
    }

    /// One round trip; a failure leaves every pool on what it last read
    /// (until that read's TTL) and is counted in each.
    async fn round(&mut self) {
        let now = Instant::now();
        if self.store.resting(now) {
            return;
        }
        let (pipe, writes) = self.pipeline(now);
        let result = self.store.query::<Vec<redis::Value>>(&pipe).await;
        let expected: usize =
            usize::from(self.s.placements) + self.pools.iter().map(PoolSync::reads).sum::<usize>();
        match result {
            Ok(reads) if reads.len() == expected => self.apply(reads, writes),
            Ok(reads) => self.fail(&StoreError::Failed(format!(
                "{} replies for {} pools ({expected} expected)",
                reads.len(),
                self.pools.len()
            ))),
            Err(e) => self.fail(&e),
        }
    }

    /// The round's commands, and per pool what it writes (if anything).
    fn pipeline(&mut self, now: Instant) -> (redis::Pipeline, Vec<Written>) {
        let heartbeat = self.s.ttl / HEARTBEATS_PER_TTL;
        let key_ttl_ms = millis(self.s.ttl.saturating_mul(FORGET_AFTER_TTLS));
        let mut pipe = redis::pipe();
        if self.s.placements {
            // The server's clock, so a reader ages the placements it reads
            // without any clock shared between replicas.
            pipe.cmd("TIME");
        }
        let mut writes = Vec::with_capacity(self.pools.len());
        let mut changed = false;
        for p in &mut self.pools {
            // Before the load entry: a reader that finds this replica live
            // finds its totals too (see [`moves::MovesTable::merge`]).
            let totals = write_totals(&mut pipe, p, &self.s.replica_id);
            let own = p.pool.load.own_loads();
            let moved = p.published.as_ref().is_none_or(|(last, _)| *last != own);
            let due = moved
                || p.published
                    .as_ref()
                    .is_some_and(|(_, at)| now.saturating_duration_since(*at) >= heartbeat);
            if due {
                self.seq += 1;
                pipe.cmd("HSET")
                    .arg(&p.key)
                    .arg(&self.s.replica_id)
                    .arg(encode(self.seq, &own))
                    .ignore();
                pipe.cmd("PEXPIRE").arg(&p.key).arg(key_ttl_ms).ignore();
                pipe.cmd("PEXPIRE")
                    .arg(&p.pending_key)
                    .arg(key_ttl_ms)
                    .ignore();
                if let Some(f) = &p.flow {
                    pipe.cmd("PEXPIRE").arg(&f.key).arg(key_ttl_ms).ignore();
                }
            }
            let pending = write_pending(&mut pipe, p, &self.s.replica_id);
            if !p.forget.is_empty() {
                let forget = std::mem::take(&mut p.forget);
                if let Some(f) = &p.flow {
                    pipe.cmd("HDEL").arg(&f.key).arg(&forget).ignore();
                }
                pipe.cmd("HDEL").arg(&p.key).arg(&forget).ignore();
                pipe.cmd("HDEL").arg(&p.pending_key).arg(forget).ignore();
            }
            pipe.cmd("HGETALL").arg(&p.key);
            pipe.cmd("HGETALL").arg(&p.pending_key);
            if let Some(f) = &p.flow {
                pipe.cmd("HGETALL").arg(&f.key);
            }
            let placed = placed_round(&mut pipe, p, &self.s.replica_id, key_ttl_ms, now);
            let forwarded = reports_round(&mut pipe, p, &self.s.replica_id, key_ttl_ms);
            changed |= moved || placed || forwarded || pending.is_some() || totals.is_some();
            writes.push(Written {
                loads: due.then_some(own),
                pending,
                totals,
            });
        }
        if changed && self.s.wake_on_change {
            // After the writes: a peer woken by it reads them.
            pipe.cmd("PUBLISH")
                .arg(&self.wake_channel)
                .arg(&self.s.replica_id)
                .ignore();
        }
        (pipe, writes)
    }

    fn apply(&mut self, reads: Vec<redis::Value>, writes: Vec<Written>) {
        let now = Instant::now();
        if self.failing {
            self.failing = false;
            tracing::info!(url = %self.s.url, "shared load: redis reachable again; counting other replicas' load");
        }
        let mut reads = reads.into_iter();
        let server_ms = if self.s.placements {
            reads.next().and_then(placed::server_ms)
        } else {
            None
        };
        for (p, wrote) in self.pools.iter_mut().zip(writes) {
            let (Some(read), Some(pending_read)) = (reads.next(), reads.next()) else {
                break;
            };
            let (read, pending_read) = (hash(read), hash(pending_read));
            let flow_read = if p.flow.is_some() {
                reads.next().map(hash)
            } else {
                None
            };
            let placed_read = if p.placed.is_some() {
                reads.next()
            } else {
                None
            };
            let reports_read = if p.reports.is_some() {
                reads.next()
            } else {
                None
            };
            if let Some(own) = wrote.loads {
                p.published = Some((own, now));
            }
            if let Some(f) = wrote.pending {
                p.published_pending = Some(f);
            }
            if let (Some(t), Some(f)) = (wrote.totals, &mut p.flow) {
                f.published = Some(t);
            }
            let merged = p
                .table
                .merge(&self.s.replica_id, fields(read), now, self.s.ttl);
            let mut peer_pending = pending::merge(&merged.live_fields, fields(pending_read));
            peer_pending.refused += merged.malformed;
            let freed = match (&mut p.flow, flow_read) {
                (Some(f), Some(read)) => {
                    let m = f.table.merge(&merged.live_fields, fields(read));
                    peer_pending.refused += m.refused;
                    let moves = m.moves.iter().map(|(id, m)| (*id, m.placed, m.done));
                    // Read now, written by the writer's last round: each
                    // move happened at most two intervals ago (rounds that
                    // take a fraction of one, as Redis answers).
                    let lag = self.s.interval.saturating_mul(2);
                    p.pool.flow.peer_moves(moves, now, lag)
                }
                _ => false,
            };
            if let (Some(ps), Some(read)) = (&mut p.placed, placed_read) {
                let got = ps.table.merge(&self.s.replica_id, read, server_ms);
                peer_pending.refused += got.refused;
                if !(got.starts.is_empty() && got.ends.is_empty()) {
                    p.pool.placements.merge_peers(&got.starts, &got.ends, now);
                }
            }
            if let (Some((_, table)), Some(read)) = (&mut p.reports, reports_read) {
                let got = table.merge(&self.s.replica_id, read);
                peer_pending.refused += got.refused;
                let ours = got
                    .reports
                    .iter()
                    .filter(|(id, phase)| {
                        let ours = p.pool.load.peer_report(id, *phase);
                        if ours && *phase == Phase::Done {
                            // Its tenant's fair-share charge ends too (at
                            // the estimate: the stream carries no usage).
                            p.pool.flow.settle(id, 0);
                        }
                        ours
                    })
                    .count();
                if ours > 0 {
                    tracing::debug!(pool = %p.pool.name, reports = ours, "shared load: reports another replica received, applied to this one's picks");
                    p.pool.capacity_freed();
                }
            }
            if peer_pending.refused > 0 {
                tracing::debug!(pool = %p.pool.name, fields = peer_pending.refused, "shared load: unreadable fields left out");
            }
            p.forget = merged.forget;
            p.pool.load.set_peer_pending(peer_pending);
            p.pool
                .load
                .set_peer_loads(merged.loads, merged.live, now, self.s.ttl);
            if freed {
                // Another replica's picks ended: waiting picks may go.
                p.pool.capacity_freed();
            }
        }
    }

    fn fail(&mut self, e: &StoreError) {
        if !self.failing {
            self.failing = true;
            tracing::warn!(url = %self.s.url, error = %e, retry_in = ?self.s.retry_after, "shared load: redis unavailable; each pool uses this replica's own counts once the last read is older than the TTL");
        }
        for p in &mut self.pools {
            p.pool.load.peer_round_failed();
            // Whether the write landed is unknown: write again next time.
            p.published = None;
            p.published_pending = None;
            if let Some(f) = &mut p.flow {
                f.published = None;
            }
        }
    }

    /// Deletes this replica's fields; best effort, bounded.
    async fn withdraw(&mut self) {
        let mut pipe = redis::pipe();
        for p in &self.pools {
            let flow = p.flow.as_ref().map(|f| &f.key);
            for key in [Some(&p.key), Some(&p.pending_key), flow]
                .into_iter()
                .flatten()
            {
                pipe.cmd("HDEL").arg(key).arg(&self.s.replica_id).ignore();
            }
        }
        if let Err(e) = self.store.query::<()>(&pipe).await {
            tracing::debug!(error = %e, "shared load: fields not withdrawn; they expire by the TTL");
        }
    }
}

/// What a round writes for one pool.
struct Written {
    /// The load entry, when written.
    loads: Option<Loads>,
    /// The pending entry's fingerprint, when written.
    pending: Option<Fingerprint>,
    /// The flow entry's totals, when written.
    totals: Option<Totals>,
}

impl PoolSync {
    /// Replies a round gets for this pool.
    fn reads(&self) -> usize {
        2 + usize::from(self.flow.is_some())
            + usize::from(self.placed.is_some())
            + usize::from(self.reports.is_some())
    }
}

/// Adds this pool's placements to `pipe` (a pool sharing them): this
/// replica's since the last round as one stream entry, when there are any,
/// then the read of the entries after the last one read. A failed round
/// loses the entry (each replica then steers by its own counts anyway).
/// Returns whether it added an entry.
fn placed_round(
    pipe: &mut redis::Pipeline,
    p: &PoolSync,
    replica: &str,
    key_ttl_ms: u64,
    now: Instant,
) -> bool {
    let Some(ps) = &p.placed else {
        return false;
    };
    let own = p.pool.placements.take_shared(now);
    let entry = (!own.is_empty()).then(|| (placed::PLACED_FIELD, placed::encode(&own)));
    stream_round(pipe, &ps.key, replica, entry, ps.table.start(), key_ttl_ms)
}

/// Adds this pool's reports that matched none of its picks since the last
/// round to `pipe` as one stream entry (when there are any), then the read
/// of the other replicas' entries after the last one read. Returns whether
/// it added an entry.
fn reports_round(pipe: &mut redis::Pipeline, p: &PoolSync, replica: &str, key_ttl_ms: u64) -> bool {
    let Some((key, table)) = &p.reports else {
        return false;
    };
    let own = p.pool.load.take_unmatched();
    let entry = (!own.is_empty()).then(|| (reports::REPORTS_FIELD, reports::encode(&own)));
    stream_round(pipe, key, replica, entry, table.start(), key_ttl_ms)
}

/// Adds to `pipe` one entry of this replica's to the stream `key` (when
/// there is one: its field and value), the key's TTL, then the read of the
/// entries from `start` on (at most [`placed::READ_ENTRIES`]). Returns
/// whether it added an entry.
fn stream_round(
    pipe: &mut redis::Pipeline,
    key: &str,
    replica: &str,
    entry: Option<(&str, String)>,
    start: String,
    key_ttl_ms: u64,
) -> bool {
    let added = entry.is_some();
    if let Some((field, value)) = entry {
        pipe.cmd("XADD")
            .arg(key)
            .arg("MAXLEN")
            .arg("~")
            .arg(placed::STREAM_MAX_ENTRIES)
            .arg("*")
            .arg(placed::REPLICA_FIELD)
            .arg(replica)
            .arg(field)
            .arg(value)
            .ignore();
        pipe.cmd("PEXPIRE").arg(key).arg(key_ttl_ms).ignore();
    }
    pipe.cmd("XRANGE")
        .arg(key)
        .arg(start)
        .arg("+")
        .arg("COUNT")
        .arg(placed::READ_ENTRIES);
    added
}

/// A hash read back; anything else reads as empty.
fn hash(v: redis::Value) -> HashMap<Vec<u8>, Vec<u8>> {
    redis::from_redis_value(v).map_or_else(|_| HashMap::new(), identity)
}

/// Adds the `HSET` of this replica's flow entry to `pipe` when its totals
/// changed since the last write (a pool with flow control only); returns
/// what it wrote.
fn write_totals(pipe: &mut redis::Pipeline, p: &PoolSync, replica: &str) -> Option<Totals> {
    let f = p.flow.as_ref()?;
    let own = p.pool.load.own_moves();
    if f.published.as_ref() == Some(&own) {
        return None;
    }
    pipe.cmd("HSET")
        .arg(&f.key)
        .arg(replica)
        .arg(moves::encode(&own))
        .ignore();
    Some(own)
}

/// Adds the `HSET` of this replica's pending entry to `pipe` when its
/// chains changed since the last write (sampling and encoding them only
/// then); returns what it wrote.
fn write_pending(pipe: &mut redis::Pipeline, p: &PoolSync, replica: &str) -> Option<Fingerprint> {
    let own = p.pool.load.own_pending();
    let f = pending::fingerprint(&own);
    if p.published_pending.as_ref() == Some(&f) {
        return None;
    }
    pipe.cmd("HSET")
        .arg(&p.pending_key)
        .arg(replica)
        .arg(pending::encode(&own))
        .ignore();
    Some(f)
}

fn fields(read: HashMap<Vec<u8>, Vec<u8>>) -> Vec<(String, String)> {
    read.into_iter().map(|(k, v)| (text(k), text(v))).collect()
}

/// Field names and entries are ASCII when written by a replica; anything
/// else becomes text that does not decode (counted as unreadable).
fn text(b: Vec<u8>) -> String {
    String::from_utf8(b).unwrap_or_default()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}
