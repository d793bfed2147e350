//! One tenant's budget: reserve at admission, settle while the response
//! streams, release at the end.
//!
//! Every dimension is a [`Bucket`]. A reservation takes the request's
//! whole estimated cost from every limited bucket at once, or nothing;
//! it then *holds* that cost. A settle raises what it holds to the cost of
//! the usage so far when that is more (usage beyond the estimate is taken
//! as it happens, and may put the bucket in debt); a release sets what it
//! holds to the final cost, giving back the unused part. So the net
//! charge of a request is always exactly the cost of its final usage, and
//! every admission is paid for in the window it is admitted in.

use std::collections::BTreeMap;

use crate::bucket::Bucket;
use crate::limits::{Cost, Dimension, Limits, Request, Usage};

/// Why a reservation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Over a per-minute budget; a retry `retry_after_ms` from now
    /// succeeds if nothing else is admitted meanwhile.
    #[error("over the {dimension} per minute budget; retry in {retry_after_ms} ms")]
    Limited {
        /// The dimension that needs the longest wait.
        dimension: Dimension,
        /// Milliseconds until the request fits.
        retry_after_ms: u64,
    },
    /// At the concurrency limit: a slot frees when a request ends, which
    /// no budget arithmetic can foretell.
    #[error("{limit} requests already in flight, the most allowed")]
    Concurrency {
        /// The limit.
        limit: u32,
    },
    /// The request alone needs more than a whole window of the budget: no
    /// retry can succeed.
    #[error(
        "the request needs {requested} {dimension}, more than the budget of {limit} per minute"
    )]
    TooLarge {
        /// The dimension.
        dimension: Dimension,
        /// What the request needs.
        requested: u64,
        /// The per-minute limit.
        limit: u64,
    },
}

impl Refusal {
    /// Milliseconds until a retry succeeds, when the budget can say.
    pub fn retry_after_ms(&self) -> Option<u64> {
        match self {
            Refusal::Limited { retry_after_ms, .. } => Some(*retry_after_ms),
            _ => None,
        }
    }
}

/// A granted reservation: the id to settle and release it by, and what
/// it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// Unique within the budget, never reused.
    pub id: u64,
    /// The cost taken at admission.
    pub held: Cost,
}

/// What a release did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Released {
    /// Given back: held but not used.
    pub refunded: Cost,
    /// Taken beyond what was held (usage above the estimate).
    pub charged: Cost,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Held {
    pub(crate) since_ms: u64,
    pub(crate) held: Cost,
    pub(crate) usage: Usage,
}

/// One tenant's budget state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantBudget {
    pub(crate) limits: Limits,
    pub(crate) buckets: [Bucket; 4],
    pub(crate) open: BTreeMap<u64, Held>,
    pub(crate) next_id: u64,
}

impl TenantBudget {
    /// A budget with these limits, every bucket full.
    pub fn new(limits: Limits) -> TenantBudget {
        TenantBudget {
            limits,
            ..TenantBudget::default()
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Replaces the limits (a new config); open reservations keep what
    /// they hold.
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    fn refill(&mut self, now_ms: u64) {
        for d in Dimension::ALL {
            if let Some(limit) = self.limits.per_minute(d) {
                self.buckets[d.index()].refill(now_ms, limit);
            }
        }
    }

    /// Admits `req` or says why not. All or nothing: a refused request
    /// takes nothing.
    pub fn reserve(&mut self, now_ms: u64, req: &Request) -> Result<Reservation, Refusal> {
        self.refill(now_ms);
        let cost = req.cost(self.limits.cached_token_weight);
        self.check(&cost)?;
        for d in Dimension::ALL {
            if self.limits.per_minute(d).is_some() {
                self.buckets[d.index()].take(cost.get(d));
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.open.insert(
            id,
            Held {
                since_ms: now_ms,
                held: cost,
                usage: Usage::default(),
            },
        );
        Ok(Reservation { id, held: cost })
    }

    fn check(&self, cost: &Cost) -> Result<(), Refusal> {
        let mut worst: Option<(Dimension, u64)> = None;
        for d in Dimension::ALL {
            let Some(limit) = self.limits.per_minute(d) else {
                continue;
            };
            match self.buckets[d.index()].wait_ms(cost.get(d), limit) {
                None => {
                    return Err(Refusal::TooLarge {
                        dimension: d,
                        requested: cost.get(d),
                        limit,
                    })
                }
                Some(0) => {}
                Some(ms) if worst.is_none_or(|(_, w)| ms > w) => worst = Some((d, ms)),
                Some(_) => {}
            }
        }
        if let Some(limit) = self.limits.max_concurrent {
            if self.open.len() >= limit as usize {
                return Err(Refusal::Concurrency { limit });
            }
        }
        match worst {
            Some((dimension, retry_after_ms)) => Err(Refusal::Limited {
                dimension,
                retry_after_ms,
            }),
            None => Ok(()),
        }
    }

    /// Raises what reservation `id` holds to the cost of `usage` (the
    /// usage so far) where that is more; returns what was taken beyond the
    /// hold. Monotone: usage lower than an earlier settle's is ignored.
    /// `None` for an id that is not open (released, expired, unknown).
    pub fn settle(&mut self, now_ms: u64, id: u64, usage: &Usage) -> Option<Cost> {
        self.refill(now_ms);
        let weight = self.limits.cached_token_weight;
        let h = self.open.get_mut(&id)?;
        h.usage = h.usage.max(*usage);
        let target = h.held.max(h.usage.cost(weight));
        let extra = target.saturating_sub(h.held);
        h.held = target;
        self.take(&extra);
        Some(extra)
    }

    /// Ends reservation `id` with its final usage: what it holds becomes
    /// the cost of that usage (one request plus tokens), the unused part
    /// goes back. Idempotent: `None` once released (or for an id that was
    /// never open), and nothing changes.
    pub fn release(&mut self, now_ms: u64, id: u64, usage: &Usage) -> Option<Released> {
        self.refill(now_ms);
        let weight = self.limits.cached_token_weight;
        let h = self.open.remove(&id)?;
        let mut fin = h.usage.max(*usage).cost(weight);
        fin.0[Dimension::Requests.index()] = h.held.get(Dimension::Requests);
        let out = Released {
            refunded: h.held.saturating_sub(fin),
            charged: fin.saturating_sub(h.held),
        };
        self.take(&out.charged);
        self.give(&out.refunded);
        Some(out)
    }

    /// Ends reservation `id` as never served (shed after admission, never
    /// sent): everything it holds goes back, the request included. `None`
    /// when not open.
    pub fn cancel(&mut self, now_ms: u64, id: u64) -> Option<Cost> {
        self.refill(now_ms);
        let h = self.open.remove(&id)?;
        self.give(&h.held);
        Some(h.held)
    }

    /// Charges a request that was admitted without a reservation here (a
    /// proxy admitted it from its own share while it could not ask): one
    /// request plus the cost of its usage, taken at once (it may put a
    /// bucket in debt). Returns what was taken.
    pub fn charge(&mut self, now_ms: u64, usage: &Usage) -> Cost {
        self.refill(now_ms);
        let mut c = usage.cost(self.limits.cached_token_weight);
        c.0[Dimension::Requests.index()] = 1;
        self.take(&c);
        c
    }

    /// Drops reservations opened more than `max_age_ms` before `now_ms`
    /// whose end was never reported (a proxy that went away): they keep
    /// what they hold, since their real usage is unknown. Returns how many.
    pub fn expire(&mut self, now_ms: u64, max_age_ms: u64) -> usize {
        let before = self.open.len();
        self.open
            .retain(|_, h| now_ms.saturating_sub(h.since_ms) <= max_age_ms);
        before - self.open.len()
    }

    fn take(&mut self, c: &Cost) {
        for d in Dimension::ALL {
            if self.limits.per_minute(d).is_some() {
                self.buckets[d.index()].take(c.get(d));
            }
        }
    }

    fn give(&mut self, c: &Cost) {
        for d in Dimension::ALL {
            if let Some(limit) = self.limits.per_minute(d) {
                self.buckets[d.index()].give(c.get(d), limit);
            }
        }
    }

    /// Requests admitted and not yet released.
    pub fn in_flight(&self) -> usize {
        self.open.len()
    }

    /// The sum of what open reservations hold.
    pub fn held(&self) -> Cost {
        self.open
            .values()
            .fold(Cost::default(), |a, h| a.saturating_add(h.held))
    }

    /// One dimension's bucket as of `now_ms` (`None` when unlimited).
    pub fn bucket(&self, now_ms: u64, d: Dimension) -> Option<Bucket> {
        let limit = self.limits.per_minute(d)?;
        let mut b = self.buckets[d.index()];
        b.refill(now_ms, limit);
        Some(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(prompt: u64, out: u64) -> Request {
        Request {
            prompt_tokens: prompt,
            cached_tokens: 0,
            output_tokens: out,
        }
    }

    fn usage(prompt: u64, completion: u64) -> Usage {
        Usage {
            prompt_tokens: prompt,
            cached_tokens: 0,
            completion_tokens: completion,
        }
    }

    fn tpm(n: u64) -> Limits {
        Limits {
            total_tokens_per_minute: Some(n),
            ..Limits::default()
        }
    }

    #[test]
    fn reserve_then_release_returns_the_unused_part() {
        let mut b = TenantBudget::new(tpm(1000));
        let r = b.reserve(0, &req(100, 500)).unwrap();
        assert_eq!(
            b.bucket(0, Dimension::TotalTokens).unwrap().remaining(),
            400
        );
        let out = b.release(0, r.id, &usage(100, 50)).unwrap();
        assert_eq!(out.refunded.get(Dimension::TotalTokens), 450);
        assert_eq!(
            b.bucket(0, Dimension::TotalTokens).unwrap().remaining(),
            850
        );
        assert_eq!(b.release(0, r.id, &usage(100, 50)), None);
        assert_eq!(
            b.bucket(0, Dimension::TotalTokens).unwrap().remaining(),
            850
        );
    }

    #[test]
    fn over_budget_is_refused_with_the_exact_wait() {
        let mut b = TenantBudget::new(tpm(600));
        b.reserve(0, &req(500, 0)).unwrap();
        let e = b.reserve(0, &req(200, 0)).unwrap_err();
        // 100 short at 10 tokens a second.
        assert_eq!(
            e,
            Refusal::Limited {
                dimension: Dimension::TotalTokens,
                retry_after_ms: 10_000
            }
        );
        assert!(b.reserve(9_999, &req(200, 0)).is_err());
        assert!(b.reserve(10_000, &req(200, 0)).is_ok());
    }

    #[test]
    fn a_request_larger_than_the_budget_is_too_large() {
        let mut b = TenantBudget::new(tpm(100));
        assert!(matches!(
            b.reserve(0, &req(80, 30)),
            Err(Refusal::TooLarge {
                requested: 110,
                limit: 100,
                ..
            })
        ));
        assert_eq!(b.in_flight(), 0);
    }

    #[test]
    fn settle_takes_overrun_as_it_streams_and_is_monotone() {
        let mut b = TenantBudget::new(tpm(1000));
        let r = b.reserve(0, &req(100, 100)).unwrap();
        assert_eq!(b.settle(0, r.id, &usage(100, 50)), Some(Cost::default()));
        let extra = b.settle(0, r.id, &usage(100, 150)).unwrap();
        assert_eq!(extra.get(Dimension::TotalTokens), 50);
        // A stale, lower figure changes nothing.
        assert_eq!(b.settle(0, r.id, &usage(100, 120)), Some(Cost::default()));
        let out = b.release(0, r.id, &usage(100, 160)).unwrap();
        assert_eq!(out.charged.get(Dimension::TotalTokens), 10);
        assert_eq!(
            b.bucket(0, Dimension::TotalTokens).unwrap().remaining(),
            740
        );
    }

    #[test]
    fn concurrency_limit_frees_on_release() {
        let mut b = TenantBudget::new(Limits {
            max_concurrent: Some(1),
            ..Limits::default()
        });
        let r = b.reserve(0, &req(1, 1)).unwrap();
        assert_eq!(
            b.reserve(0, &req(1, 1)),
            Err(Refusal::Concurrency { limit: 1 })
        );
        b.release(0, r.id, &usage(1, 1));
        assert!(b.reserve(0, &req(1, 1)).is_ok());
    }

    #[test]
    fn requests_are_not_refunded_but_cancel_refunds_everything() {
        let mut b = TenantBudget::new(Limits {
            requests_per_minute: Some(2),
            ..Limits::default()
        });
        let r = b.reserve(0, &req(1, 1)).unwrap();
        b.release(0, r.id, &usage(0, 0));
        let r = b.reserve(0, &req(1, 1)).unwrap();
        b.cancel(0, r.id);
        assert!(b.reserve(0, &req(1, 1)).is_ok());
        assert!(matches!(
            b.reserve(0, &req(1, 1)),
            Err(Refusal::Limited {
                dimension: Dimension::Requests,
                retry_after_ms: 30_000
            })
        ));
    }

    #[test]
    fn expired_reservations_keep_their_charge() {
        let mut b = TenantBudget::new(tpm(1000));
        let r = b.reserve(0, &req(100, 100)).unwrap();
        assert_eq!(b.expire(10_000, 60_000), 0);
        assert_eq!(b.expire(60_001, 60_000), 1);
        assert_eq!(b.release(60_001, r.id, &usage(1, 1)), None);
        assert_eq!(b.in_flight(), 0);
    }

    #[test]
    fn unlimited_admits_everything() {
        let mut b = TenantBudget::new(Limits::default());
        for _ in 0..1000 {
            b.reserve(0, &req(u64::MAX / 4, u64::MAX / 4)).unwrap();
        }
    }

    #[test]
    fn a_charge_takes_one_request_and_the_usage_without_holding_it() {
        let mut b = TenantBudget::new(Limits {
            requests_per_minute: Some(10),
            total_tokens_per_minute: Some(1_000),
            max_concurrent: Some(1),
            ..Limits::default()
        });
        let u = Usage {
            prompt_tokens: 300,
            cached_tokens: 0,
            completion_tokens: 900,
        };
        let c = b.charge(0, &u);
        assert_eq!(c.0, [1, 300, 900, 1_200]);
        assert_eq!(
            b.in_flight(),
            0,
            "nothing held: the concurrency slot is free"
        );
        // In debt by 200 tokens: the next request waits for the refill.
        let r = b.reserve(0, &req(10, 10));
        assert!(matches!(r, Err(Refusal::Limited { .. })), "{r:?}");
        assert!(b.reserve(60_000, &req(10, 10)).is_ok());
    }
}
