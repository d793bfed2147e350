//! One pool's queue of waiting picks: bounds, deadlines, priority bands.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::band::{service, Band};
use crate::config::Limits;

/// Names a waiting request, to cancel it ([`FlowQueue::remove`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ticket(pub u64);

/// A pick that asks to wait.
#[derive(Debug, Clone, PartialEq)]
pub struct Waiting<T> {
    /// Who it is for; fair share is between tenants.
    pub tenant: String,
    /// The route action's priority (vLLM's convention: lower is more
    /// urgent; batch traffic is given the largest value).
    pub priority: i32,
    /// The tenant's share weight (0 is taken as 1).
    pub weight: u32,
    /// Its size for fair share: prompt tokens plus the output estimate.
    pub tokens: u64,
    /// A deadline of its own (e.g. what is left of the filter's pick
    /// deadline); the earlier of this and the queue's maximum wait holds.
    pub deadline: Option<Instant>,
    /// The caller's state for the pick (what it needs to answer it later).
    pub item: T,
}

/// Why a pick was refused a place; the caller sheds it (429).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Refusal {
    /// The pool's queue holds its maximum.
    #[error("the pool's queue is full ({max} waiting)")]
    PoolFull {
        /// The pool's maximum.
        max: usize,
    },
    /// The tenant has its maximum waiting.
    #[error("the tenant has its maximum waiting ({max})")]
    TenantFull {
        /// The per-tenant maximum.
        max: usize,
    },
    /// Its deadline has passed already (or the queue allows no wait).
    #[error("no time left to wait")]
    NoTime,
}

/// A refused pick, handed back with the reason.
#[derive(Debug, Clone, PartialEq, Error)]
#[error("{reason}")]
pub struct Refused<T> {
    /// Why.
    pub reason: Refusal,
    /// The pick, untouched.
    pub waiting: Waiting<T>,
}

/// A request leaving the queue: released to be placed, expired, or removed.
#[derive(Debug, Clone, PartialEq)]
pub struct Released<T> {
    /// Its ticket.
    pub ticket: Ticket,
    /// When it was queued (its wait is `now - enqueued_at`).
    pub enqueued_at: Instant,
    /// When it would have expired.
    pub deadline: Option<Instant>,
    /// The pick as pushed.
    pub waiting: Waiting<T>,
}

#[derive(Debug)]
struct Entry<T> {
    waiting: Waiting<T>,
    enqueued_at: Instant,
    deadline: Option<Instant>,
}

/// One pool's waiting picks. Release order: the most urgent priority band
/// first; within a band, start-time fair queueing between tenants by tokens
/// (see the crate docs); within a tenant and band, arrival order.
#[derive(Debug)]
pub struct FlowQueue<T> {
    limits: Limits,
    bands: BTreeMap<i32, Band>,
    entries: HashMap<u64, Entry<T>>,
    deadlines: BTreeSet<(Instant, u64)>,
    per_tenant: HashMap<String, usize>,
    next_ticket: u64,
}

impl<T> FlowQueue<T> {
    /// An empty queue with these bounds.
    pub fn new(limits: Limits) -> Self {
        FlowQueue {
            limits,
            bands: BTreeMap::new(),
            entries: HashMap::new(),
            deadlines: BTreeSet::new(),
            per_tenant: HashMap::new(),
            next_ticket: 0,
        }
    }

    /// The bounds.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// New bounds (a config reload). Requests already waiting stay, even
    /// past a smaller maximum, with the deadlines they were given: new
    /// pushes are refused until the queue is back under the bounds.
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Requests `tenant` has waiting (all bands).
    pub fn tenant_len(&self, tenant: &str) -> usize {
        self.per_tenant.get(tenant).copied().unwrap_or(0)
    }

    /// Waiting requests per tenant, for metrics (in no particular order).
    pub fn tenants(&self) -> impl Iterator<Item = (&str, usize)> {
        self.per_tenant.iter().map(|(t, n)| (t.as_str(), *n))
    }

    /// The earliest deadline of a waiting request: when to call
    /// [`FlowQueue::expire`] next.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first().map(|(d, _)| *d)
    }

    /// Queues a pick, or refuses it (the caller sheds it). Its deadline is
    /// `now + max_wait`, or its own if earlier.
    pub fn push(&mut self, waiting: Waiting<T>, now: Instant) -> Result<Ticket, Refused<T>> {
        if let Some(reason) = self.refusal(&waiting, now) {
            return Err(Refused { reason, waiting });
        }
        let own = now.checked_add(self.limits.max_wait);
        let deadline = match (own, waiting.deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.bands.entry(waiting.priority).or_default().push(
            &waiting.tenant,
            ticket,
            service(waiting.tokens, waiting.weight),
        );
        *self.per_tenant.entry(waiting.tenant.clone()).or_default() += 1;
        if let Some(d) = deadline {
            self.deadlines.insert((d, ticket));
        }
        self.entries.insert(
            ticket,
            Entry {
                waiting,
                enqueued_at: now,
                deadline,
            },
        );
        Ok(Ticket(ticket))
    }

    fn refusal(&self, waiting: &Waiting<T>, now: Instant) -> Option<Refusal> {
        if self.len() >= self.limits.max_queued {
            return Some(Refusal::PoolFull {
                max: self.limits.max_queued,
            });
        }
        if self.tenant_len(&waiting.tenant) >= self.limits.max_queued_per_tenant {
            return Some(Refusal::TenantFull {
                max: self.limits.max_queued_per_tenant,
            });
        }
        let past = waiting.deadline.is_some_and(|d| d <= now);
        if self.limits.max_wait.is_zero() || past {
            return Some(Refusal::NoTime);
        }
        None
    }

    /// The next request to place, when the caller has room for one
    /// (`capacity_available`); `None` without room or with nothing waiting.
    /// The caller picks its endpoint now (late binding), places it, and asks
    /// again while room is left. Call [`FlowQueue::expire`] first so nothing
    /// past its deadline is released.
    pub fn pop_next(&mut self, capacity_available: bool) -> Option<Released<T>> {
        if !capacity_available {
            return None;
        }
        let mut band = self.bands.first_entry()?;
        let popped = band.get_mut().pop();
        if band.get().len() == 0 {
            band.remove();
        }
        let (ticket, _) = popped?;
        self.take(ticket)
    }

    /// The next request to place among the tenants `allow` lets go now
    /// (the reserve: a tenant over its share may only take room a tenant
    /// under it would not need, see [`crate::Shares`]). In band order, then
    /// fair order; a band whose waiting tenants are all held back does not
    /// hold a less urgent band's allowed tenants back (the held ones could
    /// not use the room anyway). With `allow` always true it is
    /// [`FlowQueue::pop_next`]'s order.
    pub fn pop_next_where(&mut self, allow: impl FnMut(&str) -> bool) -> Option<Released<T>> {
        let ticket = pop_from_bands(&mut self.bands, allow, |tickets| tickets.next())?;
        self.take(ticket)
    }

    /// [`FlowQueue::pop_next_where`] with the tenant's request chosen by
    /// cost ([`crate::ReleaseOrder::QuickestFirst`]): the band and the
    /// tenant are those of the fair order, and of that tenant's requests in
    /// the band the one with the least `cost` goes (ties: the earliest),
    /// unless its oldest has waited `max_skip` or longer, which then goes
    /// (the aging bound: a long prompt is passed over for at most that
    /// long). `cost` is the caller's price of a request on the engine that
    /// would take it now (its predicted prefill there): the queue knows no
    /// index. It releases exactly when [`FlowQueue::pop_next_where`] would
    /// (never holds a request back for a quicker one), and the tenant's
    /// finish tag is charged with the tokens of the one released.
    pub fn pop_quickest_where(
        &mut self,
        allow: impl FnMut(&str) -> bool,
        now: Instant,
        max_skip: Duration,
        mut cost: impl FnMut(&Waiting<T>) -> u64,
    ) -> Option<Released<T>> {
        let entries = &self.entries;
        let choose = |tickets: &mut dyn Iterator<Item = u64>| {
            let mut best: Option<(u64, u64)> = None;
            for (i, ticket) in tickets.enumerate() {
                let Some(e) = entries.get(&ticket) else {
                    continue;
                };
                if i == 0 && now.saturating_duration_since(e.enqueued_at) >= max_skip {
                    return Some(ticket);
                }
                let c = cost(&e.waiting);
                if best.is_none_or(|(b, _)| c < b) {
                    best = Some((c, ticket));
                }
            }
            best.map(|(_, ticket)| ticket)
        };
        let ticket = pop_from_bands(&mut self.bands, allow, choose)?;
        self.take(ticket)
    }

    /// Takes out every request whose deadline is at or before `now`, earliest
    /// deadline first: the caller sheds them (429, or 503 when no endpoint is
    /// ready).
    pub fn expire(&mut self, now: Instant) -> Vec<Released<T>> {
        let mut out = Vec::new();
        while let Some(&(deadline, ticket)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            if let Some(r) = self.remove(Ticket(ticket)) {
                out.push(r);
            } else {
                self.deadlines.pop_first();
            }
        }
        out
    }

    /// Takes a request out without releasing it (its client went away).
    /// Nothing is charged to its tenant.
    pub fn remove(&mut self, ticket: Ticket) -> Option<Released<T>> {
        let entry = self.entries.get(&ticket.0)?;
        let priority = entry.waiting.priority;
        if let Some(band) = self.bands.get_mut(&priority) {
            band.remove(&entry.waiting.tenant, ticket.0);
            if band.len() == 0 {
                self.bands.remove(&priority);
            }
        }
        self.take(ticket.0)
    }

    /// Corrects the fair-share charge of a released request once its real
    /// size is known (`charged`: the tokens it was queued with; `actual`:
    /// prompt plus the output it really produced), so a tenant whose output
    /// estimates run high is not held back for them, and one whose run low
    /// pays. Only matters while its band has requests waiting: when a band
    /// empties, what its tenants owe is forgiven anyway.
    pub fn settle(&mut self, tenant: &str, priority: i32, weight: u32, charged: u64, actual: u64) {
        if let Some(band) = self.bands.get_mut(&priority) {
            band.settle(tenant, weight, charged, actual);
        }
    }

    /// Drops a ticket's bookkeeping (already out of its band).
    fn take(&mut self, ticket: u64) -> Option<Released<T>> {
        let entry = self.entries.remove(&ticket)?;
        if let Some(d) = entry.deadline {
            self.deadlines.remove(&(d, ticket));
        }
        if let Some(n) = self.per_tenant.get_mut(&entry.waiting.tenant) {
            *n -= 1;
            if *n == 0 {
                self.per_tenant.remove(&entry.waiting.tenant);
            }
        }
        Some(Released {
            ticket: Ticket(ticket),
            enqueued_at: entry.enqueued_at,
            deadline: entry.deadline,
            waiting: entry.waiting,
        })
    }

    /// Tenant states held across all bands, for tests of memory bounds.
    #[cfg(test)]
    pub(crate) fn tenant_states(&self) -> usize {
        self.bands.values().map(Band::tenants_held).sum()
    }
}

/// Releases from the most urgent band in which `allow` lets a tenant go:
/// that band's fair turn, with the request of that tenant `choose` picks
/// ([`Band::pop_chosen_where`]); a band left empty is dropped. A band whose
/// tenants are all held back does not hold a less urgent band back.
fn pop_from_bands(
    bands: &mut BTreeMap<i32, Band>,
    mut allow: impl FnMut(&str) -> bool,
    mut choose: impl FnMut(&mut dyn Iterator<Item = u64>) -> Option<u64>,
) -> Option<u64> {
    let mut found = None;
    for (&priority, band) in bands.iter_mut() {
        if let Some((ticket, _)) = band.pop_chosen_where(&mut allow, &mut choose) {
            found = Some((priority, ticket, band.len() == 0));
            break;
        }
    }
    let (priority, ticket, emptied) = found?;
    if emptied {
        bands.remove(&priority);
    }
    Some(ticket)
}
