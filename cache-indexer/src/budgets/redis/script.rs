//! The budget script in Redis: [`BudgetStore`] runs `budget.lua`, a transcription of `kvasir-budget`'s
//! integer arithmetic, as one `EVALSHA` per reserve / settle / release /
//! cancel (`EVAL` when Redis answers `NOSCRIPT`), so the check and the
//! charge are atomic across replicas and a report may reach any replica.
//! The script reads Redis's `TIME`: replicas' clocks never disagree about a
//! refill or a retry time. A key's state is the hash
//! `<prefix>budget:<key>` and its open reservations
//! `<prefix>budget:<key>:open` (request id to what it holds); both expire a
//! few idle windows after the budget is whole again.
//!
//! Never in the way of a pick, after the pattern of
//! [`crate::responses::RedisStore`]: every call, the connect included, is
//! bounded by the timeout, and after a failure Redis is left alone for the
//! retry delay ([`BudgetStoreError::Down`] at once) and the next call
//! after it connects anew. A reserve given up on is undone once Redis
//! answers again ([`super::abandon`]).

use std::time::Duration;

use kvasir_budget::{
    Cost, Dimension, LimitState, Limits, RateLimitHeaders, Refusal, Released, Request, Usage,
};
use parking_lot::Mutex;

use super::abandon::{Abandon, Abandoned, Undo, ABANDONS_PER_CALL, ABANDON_TTL};
use crate::redis_link::{LinkError, RedisLink};
use redis::{ServerErrorKind, Value};

/// The script (see its header for keys, arguments and replies).
pub const SCRIPT: &str = include_str!("../budget.lua");
/// Highest per-minute limit sent to the script: the policy's own bound,
/// and where credit (in 1/60000 token units) stays exact in Lua's doubles.
pub const MAX_PER_MINUTE: u64 = 1_000_000_000;
/// Highest token count of one field sent to the script (far past any
/// context length); keeps every figure an exact double.
pub const MAX_TOKENS: u64 = 100_000_000;
/// Keys live this long past the time their budget is whole again (a
/// missing key is read as a whole budget), and an open reservation needs
/// a report at least this often.
pub const DEFAULT_IDLE: Duration = Duration::from_secs(5 * 60);

/// Why a call to the budget store failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BudgetStoreError {
    /// Left alone after an earlier failure (the retry delay).
    #[error("budget store left alone after a failure")]
    Down,
    /// The call or the connect took longer than the timeout.
    #[error("budget store timed out")]
    Timeout,
    /// Redis refused or the connection broke.
    #[error("budget store: {0}")]
    Failed(String),
    /// The script answered something this code does not read.
    #[error("budget store: malformed reply {0}")]
    Malformed(String),
}

/// One dimension's state after a call, per [`Dimension::ALL`]; `None`
/// where the budget does not limit it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DimensionStates(pub [Option<LimitState>; 4]);

impl DimensionStates {
    /// One dimension's state.
    pub fn get(&self, d: Dimension) -> Option<LimitState> {
        Dimension::ALL
            .iter()
            .position(|x| *x == d)
            .and_then(|i| self.0[i])
    }

    /// OpenAI's `x-ratelimit-*` values, chosen as
    /// [`RateLimitHeaders::of`] chooses them: the total token budget when
    /// set, else the prompt or completion budget with the least share left.
    pub fn headers(&self) -> RateLimitHeaders {
        let tokens = self.get(Dimension::TotalTokens).or_else(|| {
            [Dimension::PromptTokens, Dimension::CompletionTokens]
                .into_iter()
                .filter_map(|d| self.get(d))
                .min_by(|a, b| {
                    (u128::from(a.remaining) * u128::from(b.limit))
                        .cmp(&(u128::from(b.remaining) * u128::from(a.limit)))
                })
        });
        RateLimitHeaders {
            requests: self.get(Dimension::Requests),
            tokens,
        }
    }
}

/// What a reserve did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserved {
    /// What the reservation holds, or why it was refused.
    pub outcome: Result<Cost, Refusal>,
    /// The request id was already open (a repeated pick): admitted, as
    /// held before, and not charged again.
    pub repeated: bool,
    /// The budget after the call.
    pub states: DimensionStates,
}

/// What a release did, and the request's final cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ended {
    /// Given back and taken beyond the hold.
    pub released: Released,
    /// The final cost (one request plus the final usage's tokens).
    pub settled: Cost,
    /// False when nothing was open under the id and the usage was charged
    /// on its own (a release asked to charge).
    pub reserved: bool,
}

/// A settle, release or cancel's result and the budget after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer<T> {
    /// `None` when the request id was not open.
    pub value: Option<T>,
    /// The budget after the call.
    pub states: DimensionStates,
}

/// Budgets in one Redis server, shared by the replicas that use it.
pub struct BudgetStore {
    link: RedisLink,
    key_prefix: String,
    idle: Duration,
    /// The script's SHA1 as Redis reported it (`SCRIPT LOAD`).
    sha: Mutex<Option<String>>,
    /// Reserve attempts given up on, to be undone.
    abandoned: Abandoned,
}

impl std::fmt::Debug for BudgetStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BudgetStore")
            .field("url", &self.link.url())
            .field("timeout", &self.link.timeout())
            .field("key_prefix", &self.key_prefix)
            .finish_non_exhaustive()
    }
}

/// One script call: the op and its own arguments.
pub(super) enum Op<'a> {
    Reserve {
        id: &'a str,
        req: &'a Request,
        max_age_ms: Option<u64>,
        /// This attempt's, kept with the reservation it opens.
        token: &'a str,
    },
    Settle {
        id: &'a str,
        usage: &'a Usage,
    },
    /// `usage` `None`: the prompt as reserved, the completion as last
    /// settled. `charge`: with nothing open under `id`, charge `usage`
    /// (one request plus its tokens) on its own.
    Release {
        id: &'a str,
        usage: Option<&'a Usage>,
        charge: bool,
    },
    Cancel {
        id: &'a str,
    },
    Expire {
        max_age_ms: u64,
    },
    /// Undoes the reserve attempt `token` under `id` ([`super::abandon`]).
    Abandon {
        id: &'a str,
        token: &'a str,
    },
}

impl Op<'_> {
    fn name(&self) -> &'static str {
        match self {
            Op::Reserve { .. } => "reserve",
            Op::Settle { .. } => "settle",
            Op::Release { .. } => "release",
            Op::Cancel { .. } => "cancel",
            Op::Expire { .. } => "expire",
            Op::Abandon { .. } => "abandon",
        }
    }

    /// ARGV[15]: the attempt's token (reserve, abandon).
    fn token(&self) -> &str {
        match self {
            Op::Reserve { token, .. } | Op::Abandon { token, .. } => token,
            _ => "",
        }
    }

    /// ARGV[10..]: the request id, then three figures, then reserve's
    /// max age.
    fn tail(&self) -> (&str, [i64; 3], i64) {
        let t = |x: u64| clamp(x, MAX_TOKENS);
        let u = |u: &Usage| {
            [
                t(u.prompt_tokens),
                t(u.cached_tokens),
                t(u.completion_tokens),
            ]
        };
        let ms = |m: u64| clamp(m, i64::MAX as u64);
        match self {
            Op::Reserve {
                id,
                req,
                max_age_ms,
                ..
            } => (
                id,
                [
                    t(req.prompt_tokens),
                    t(req.cached_tokens),
                    t(req.output_tokens),
                ],
                max_age_ms.map_or(-1, ms),
            ),
            Op::Settle { id, usage } => (id, u(usage), -1),
            Op::Release { id, usage, charge } => (
                id,
                usage.map_or([-1, 0, 0], u),
                if *charge && usage.is_some() { 1 } else { -1 },
            ),
            Op::Cancel { id } => (id, [0; 3], -1),
            Op::Expire { max_age_ms } => ("", [ms(*max_age_ms), 0, 0], -1),
            Op::Abandon { id, .. } => (
                id,
                [
                    ms(u64::try_from(ABANDON_TTL.as_millis()).unwrap_or(u64::MAX)),
                    0,
                    0,
                ],
                -1,
            ),
        }
    }
}

fn clamp(x: u64, max: u64) -> i64 {
    i64::try_from(x.min(max)).unwrap_or(i64::MAX)
}

/// ARGV[3..8]: the limits as the script reads them (-1: unlimited),
/// clamped to [`MAX_PER_MINUTE`]; `None`: those the last reserve stored.
fn limit_args(l: Option<&Limits>) -> [String; 6] {
    let Some(l) = l else {
        return std::array::from_fn(|_| String::new());
    };
    let per = |d| l.per_minute(d).map_or(-1, |v| clamp(v, MAX_PER_MINUTE));
    [
        per(Dimension::Requests),
        per(Dimension::PromptTokens),
        per(Dimension::CompletionTokens),
        per(Dimension::TotalTokens),
        l.max_concurrent.map_or(-1, i64::from),
        i64::from(l.cached_token_weight.permille()),
    ]
    .map(|x| x.to_string())
}

impl BudgetStore {
    /// A store at `url` (`redis://host:port[/db]`) with keys under
    /// `key_prefix`; connects on first use. `timeout` bounds each call,
    /// `retry_after` is how long a failed store is left alone.
    pub fn new(
        url: &str,
        timeout: Duration,
        retry_after: Duration,
        key_prefix: &str,
    ) -> Result<Self, BudgetStoreError> {
        let link = RedisLink::open(url, timeout, retry_after, "budgets")
            .map_err(|e| BudgetStoreError::Failed(e.to_string()))?;
        Ok(BudgetStore {
            link,
            key_prefix: key_prefix.to_string(),
            idle: DEFAULT_IDLE,
            sha: Mutex::new(None),
            abandoned: Abandoned::default(),
        })
    }

    /// The same store with keys living `idle` past a whole budget.
    pub fn with_idle(mut self, idle: Duration) -> Self {
        self.idle = idle;
        self
    }

    /// The bound of one call.
    pub fn timeout(&self) -> Duration {
        self.link.timeout()
    }

    /// How long a failed store is left alone.
    pub fn retry_after(&self) -> Duration {
        self.link.retry_after()
    }

    /// The state hash of budget `key` (its open reservations: the same
    /// with `:open`).
    pub fn state_key(&self, key: &str) -> String {
        format!("{}budget:{key}", self.key_prefix)
    }

    /// Whether calls are answered [`BudgetStoreError::Down`] now (the
    /// retry delay after a failure).
    pub fn resting(&self) -> bool {
        self.link.resting()
    }

    /// Reserve attempts given up on and what became of them.
    pub fn abandoned(&self) -> &Abandoned {
        &self.abandoned
    }

    /// Reserves `req` under request id `id` with `limits` (stored for the
    /// reports); an open reservation older than `max_age_ms` is dropped
    /// first (at most once a second). `now_ms` replaces Redis's clock
    /// (tests only). When the call fails after it may have been sent (any
    /// error but [`BudgetStoreError::Down`]), or its answer is not
    /// understood, the attempt is remembered and undone once Redis answers
    /// again ([`super::abandon`]): whatever it opens is no one's.
    pub async fn reserve(
        &self,
        key: &str,
        limits: &Limits,
        id: &str,
        req: &Request,
        max_age_ms: Option<u64>,
        now_ms: Option<u64>,
    ) -> Result<Reserved, BudgetStoreError> {
        let token = self.abandoned.token();
        let op = Op::Reserve {
            id,
            req,
            max_age_ms,
            token: &token,
        };
        let r = self
            .call(key, Some(limits), &op, now_ms)
            .await
            .and_then(|v| decode_reserve(&v));
        if matches!(&r, Err(e) if *e != BudgetStoreError::Down) {
            self.abandoned.push(Abandon {
                key: key.to_owned(),
                id: id.to_owned(),
                undo: Undo::Reserve(token),
            });
        }
        r
    }

    /// Settles request `id` to the usage so far (monotone). `limits`
    /// `None`: those of the key's last reserve.
    pub async fn settle(
        &self,
        key: &str,
        limits: Option<&Limits>,
        id: &str,
        usage: &Usage,
        now_ms: Option<u64>,
    ) -> Result<Answer<Cost>, BudgetStoreError> {
        let v = self
            .call(key, limits, &Op::Settle { id, usage }, now_ms)
            .await?;
        decode_cost_answer(&v)
    }

    /// Releases request `id` with its final usage (idempotent); `usage`
    /// `None`: the prompt as reserved and the completion as last settled.
    /// `charge`: when nothing is open under `id`, `usage` is charged on
    /// its own (the end of a request a proxy admitted itself).
    pub async fn release(
        &self,
        key: &str,
        limits: Option<&Limits>,
        id: &str,
        usage: Option<&Usage>,
        charge: bool,
        now_ms: Option<u64>,
    ) -> Result<Answer<Ended>, BudgetStoreError> {
        let op = Op::Release { id, usage, charge };
        let v = self.call(key, limits, &op, now_ms).await?;
        let (found, rest) = match v.split_first() {
            // 2: nothing was open, the usage was charged on its own.
            Some((2, rest)) if rest.len() == 24 => (2, rest),
            _ => {
                let (f, rest) = split_found(&v, 12)?;
                (i64::from(f), rest)
            }
        };
        let ended = Ended {
            released: Released {
                refunded: cost(&rest[..4])?,
                charged: cost(&rest[4..8])?,
            },
            settled: cost(&rest[8..12])?,
            reserved: found == 1,
        };
        Ok(Answer {
            value: (found > 0).then_some(ended),
            states: states(&rest[12..])?,
        })
    }

    /// Cancels request `id`: everything it holds goes back.
    pub async fn cancel(
        &self,
        key: &str,
        limits: Option<&Limits>,
        id: &str,
        now_ms: Option<u64>,
    ) -> Result<Answer<Cost>, BudgetStoreError> {
        let v = self.call(key, limits, &Op::Cancel { id }, now_ms).await?;
        decode_cost_answer(&v)
    }

    /// Drops budget `key`'s reservations opened more than `max_age_ms`
    /// ago; returns how many.
    pub async fn expire(
        &self,
        key: &str,
        max_age_ms: u64,
        now_ms: Option<u64>,
    ) -> Result<usize, BudgetStoreError> {
        let v = self
            .call(key, None, &Op::Expire { max_age_ms }, now_ms)
            .await?;
        match v.as_slice() {
            [n] => usize::try_from(*n).map_err(|_| malformed(&v)),
            _ => Err(malformed(&v)),
        }
    }

    /// Runs one script call, bounded, behind the abandons waiting (in the
    /// same pipeline, so Redis runs them first).
    async fn call(
        &self,
        key: &str,
        limits: Option<&Limits>,
        op: &Op<'_>,
        now_ms: Option<u64>,
    ) -> Result<Vec<i64>, BudgetStoreError> {
        let behind = self.abandoned.take(ABANDONS_PER_CALL);
        let mut calls: Vec<Vec<String>> = behind
            .iter()
            .map(|a| {
                let id = a.id.as_str();
                let op = match &a.undo {
                    Undo::Reserve(token) => Op::Abandon { id, token },
                    Undo::Release(usage) => Op::Release {
                        id,
                        usage: usage.as_ref(),
                        charge: false,
                    },
                    Undo::Cancel => Op::Cancel { id },
                };
                self.args(&a.key, None, &op, None)
            })
            .collect();
        calls.push(self.args(key, limits, op, now_ms));
        let mut replies = match self.eval(&calls).await {
            Ok(r) => r,
            Err(e) => {
                self.abandoned.put_back(behind);
                return Err(e);
            }
        };
        let mine = replies.pop().ok_or_else(|| malformed(&[]))?;
        for r in replies {
            match r {
                Value::ServerError(_) => self.abandoned.dropped.inc(),
                _ => self.abandoned.answered.inc(),
            }
        }
        match mine {
            Value::ServerError(e) if e.kind() == Some(ServerErrorKind::ResponseError) => {
                Err(BudgetStoreError::Malformed(e.to_string()))
            }
            v => redis::from_redis_value::<Vec<i64>>(v)
                .map_err(|e| self.link.failed(BudgetStoreError::Failed(e.to_string()))),
        }
    }

    /// The script's KEYS and ARGV for `op` on budget `key`.
    pub(super) fn args(
        &self,
        key: &str,
        limits: Option<&Limits>,
        op: &Op<'_>,
        now_ms: Option<u64>,
    ) -> Vec<String> {
        let state = self.state_key(key);
        let (id, figures, max_age) = op.tail();
        let mut args: Vec<String> = vec![
            "3".into(),
            format!("{state}:open"),
            format!("{state}:gone"),
            op.name().into(),
            now_ms.map_or(-1, |n| clamp(n, i64::MAX as u64)).to_string(),
        ];
        args.insert(1, state);
        args.extend(limit_args(limits));
        args.push(self.idle.as_millis().to_string());
        args.push(id.to_string());
        args.extend(figures.iter().map(i64::to_string));
        args.push(max_age.to_string());
        args.push(op.token().to_string());
        args
    }

    /// `calls` in one pipeline, in order: `EVALSHA` with the script's
    /// SHA1; `EVAL` when Redis does not have it (first call, or a
    /// restarted / flushed server), loading it in the same round trip.
    /// One reply per call, an error reply among them (the script's own).
    pub(super) async fn eval(&self, calls: &[Vec<String>]) -> Result<Vec<Value>, BudgetStoreError> {
        let mut conn = self.link.connection().await?;
        let sha = self.sha.lock().clone();
        if let Some(sha) = sha {
            let mut pipe = redis::pipe();
            pipe.ignore_errors();
            for args in calls {
                pipe.cmd("EVALSHA").arg(&sha).arg(args);
            }
            let v = self.settled(
                self.bounded(pipe.query_async::<Vec<Value>>(&mut conn))
                    .await,
            )?;
            let no_script = |x: &Value| matches!(x, Value::ServerError(e) if e.kind() == Some(ServerErrorKind::NoScript));
            if v.len() == calls.len() && !v.iter().any(no_script) {
                return Ok(v);
            }
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        pipe.cmd("SCRIPT").arg("LOAD").arg(SCRIPT);
        for args in calls {
            pipe.cmd("EVAL").arg(SCRIPT).arg(args);
        }
        let mut v = self.settled(
            self.bounded(pipe.query_async::<Vec<Value>>(&mut conn))
                .await,
        )?;
        if v.len() != calls.len() + 1 {
            let e = format!("{} replies to {} calls", v.len(), calls.len() + 1);
            return Err(self.link.failed(BudgetStoreError::Failed(e)));
        }
        let sha = redis::from_redis_value::<String>(v.remove(0))
            .map_err(|e| self.link.failed(BudgetStoreError::Failed(e.to_string())))?;
        *self.sha.lock() = Some(sha);
        Ok(v)
    }

    /// `fut` within the timeout: `Err(Err(()))` when it ran out.
    async fn bounded<T>(
        &self,
        fut: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, Result<redis::RedisError, ()>> {
        match tokio::time::timeout(self.link.timeout(), fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(Ok(e)),
            Err(_) => Err(Err(())),
        }
    }

    /// A bounded call's result; a failure leaves the store alone. An error
    /// the script itself raised (a general error reply) is not the store's
    /// failure.
    fn settled<T>(
        &self,
        r: Result<T, Result<redis::RedisError, ()>>,
    ) -> Result<T, BudgetStoreError> {
        match r {
            Ok(v) => Ok(v),
            Err(Ok(e)) if e.kind() == redis::ErrorKind::Server(ServerErrorKind::ResponseError) => {
                Err(BudgetStoreError::Malformed(e.to_string()))
            }
            Err(Ok(e)) => Err(self.link.failed(BudgetStoreError::Failed(e.to_string()))),
            Err(Err(())) => Err(self.link.failed(BudgetStoreError::Timeout)),
        }
    }
}

fn malformed(v: &[i64]) -> BudgetStoreError {
    BudgetStoreError::Malformed(format!("{v:?}"))
}

fn dimension(d: i64) -> Option<Dimension> {
    Dimension::ALL
        .get(usize::try_from(d).ok()?.checked_sub(1)?)
        .copied()
}

fn nonneg(x: i64) -> Result<u64, BudgetStoreError> {
    u64::try_from(x).map_err(|_| BudgetStoreError::Malformed(format!("negative figure {x}")))
}

fn cost(v: &[i64]) -> Result<Cost, BudgetStoreError> {
    let mut c = [0u64; 4];
    for (slot, x) in c.iter_mut().zip(v) {
        *slot = nonneg(*x)?;
    }
    Ok(Cost(c))
}

/// The trailing per-dimension limit / remaining / reset triples.
fn states(v: &[i64]) -> Result<DimensionStates, BudgetStoreError> {
    if v.len() != 12 {
        return Err(malformed(v));
    }
    let mut out = DimensionStates::default();
    for (i, t) in v.chunks_exact(3).enumerate() {
        out.0[i] = match *t {
            [-1, -1, -1] => None,
            [limit, remaining, reset_ms] => Some(LimitState {
                limit: nonneg(limit)?,
                remaining: nonneg(remaining)?,
                reset_ms: nonneg(reset_ms)?,
            }),
            _ => return Err(malformed(v)),
        };
    }
    Ok(out)
}

/// `{found, n figures, states}`.
fn split_found(v: &[i64], n: usize) -> Result<(bool, &[i64]), BudgetStoreError> {
    match v.split_first() {
        Some((&f, rest)) if (f == 0 || f == 1) && rest.len() == n + 12 => Ok((f == 1, rest)),
        _ => Err(malformed(v)),
    }
}

fn decode_cost_answer(v: &[i64]) -> Result<Answer<Cost>, BudgetStoreError> {
    let (found, rest) = split_found(v, 4)?;
    Ok(Answer {
        value: if found { Some(cost(&rest[..4])?) } else { None },
        states: states(&rest[4..])?,
    })
}

fn decode_reserve(v: &[i64]) -> Result<Reserved, BudgetStoreError> {
    if v.len() != 20 {
        return Err(malformed(v));
    }
    let (code, a, b, c) = (v[0], v[1], v[2], v[3]);
    let held = cost(&v[4..8])?;
    let dim = || dimension(a).ok_or_else(|| malformed(v));
    let outcome = match code {
        0 | 4 => Ok(held),
        1 => Err(Refusal::Limited {
            dimension: dim()?,
            retry_after_ms: nonneg(b)?,
        }),
        2 => Err(Refusal::Concurrency {
            limit: u32::try_from(a).map_err(|_| malformed(v))?,
        }),
        3 => Err(Refusal::TooLarge {
            dimension: dim()?,
            requested: nonneg(b)?,
            limit: nonneg(c)?,
        }),
        _ => return Err(malformed(v)),
    };
    Ok(Reserved {
        outcome,
        repeated: code == 4,
        states: states(&v[8..])?,
    })
}

impl From<LinkError> for BudgetStoreError {
    fn from(e: LinkError) -> Self {
        match e {
            LinkError::Down => BudgetStoreError::Down,
            LinkError::Timeout => BudgetStoreError::Timeout,
            LinkError::Failed(m) => BudgetStoreError::Failed(m),
        }
    }
}

#[cfg(test)]
#[path = "script_tests.rs"]
mod tests;
