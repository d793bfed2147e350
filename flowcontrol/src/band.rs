//! One priority band: start-time fair queueing (SFQ) between tenants, where a
//! request's size is its tokens.
//!
//! Tags are kept lazily, only for each tenant's head request: a request in
//! the middle of a tenant's queue has no tag yet, so cancelling or expiring
//! it needs no re-tagging of the ones behind it.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// Virtual time: tokens per unit of weight, in fixed point. Integers rather
/// than floats so tags compare exactly and two replicas fed the same
/// requests order them the same way.
pub(crate) type VTime = u128;

/// Fractional bits of [`VTime`]: a weight up to `u32::MAX` still advances a
/// one-token request's tag by a non-zero amount.
const FRAC_BITS: u32 = 32;

/// The virtual-time length of a request of `tokens` at `weight`. Both are
/// floored at one: a zero-token request would never advance its tenant's
/// tag, and a zero weight would divide by zero.
pub(crate) fn service(tokens: u64, weight: u32) -> VTime {
    per_weight(tokens.max(1), weight)
}

/// `tokens / weight` in virtual time, without the one-token floor (for
/// corrections, where zero is a real amount).
fn per_weight(tokens: u64, weight: u32) -> VTime {
    (VTime::from(tokens) << FRAC_BITS) / VTime::from(weight.max(1))
}

/// A tenant's state in one band.
#[derive(Debug, Default)]
struct Tenant {
    /// Waiting tickets (ticket order is arrival order) with their service.
    queue: BTreeMap<u64, VTime>,
    /// Start tag of the head request; meaningful while `queue` is non-empty.
    head_start: VTime,
    /// Finish tag of the tenant's last released request: where its next
    /// request starts if it is still ahead of the band's virtual time.
    finish: VTime,
}

/// One priority band.
#[derive(Debug, Default)]
pub(crate) struct Band {
    /// The start tag of the request released last.
    vtime: VTime,
    /// The largest finish tag handed out in this busy period.
    max_finish: VTime,
    tenants: HashMap<String, Tenant>,
    /// Backlogged tenants by (head start tag, head ticket): the next release
    /// is the first. The ticket breaks ties by arrival, so equal tags never
    /// depend on hashing order.
    ready: BTreeSet<(VTime, u64, String)>,
    /// Tenants with nothing waiting whose finish tag is still ahead of
    /// `vtime` (they owe service), by finish tag, so they can be dropped
    /// once `vtime` passes it.
    owing: BTreeSet<(VTime, String)>,
    len: usize,
}

impl Band {
    /// Requests waiting in the band.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Queues `ticket` for `tenant`. Tickets must grow with every call.
    pub(crate) fn push(&mut self, tenant: &str, ticket: u64, service: VTime) {
        let vtime = self.vtime;
        let t = match self.tenants.get_mut(tenant) {
            Some(t) => t,
            None => self.tenants.entry(tenant.to_owned()).or_default(),
        };
        if t.queue.is_empty() {
            // Joining (or rejoining): start now, or later if the tenant still
            // owes for what it was served; never earlier, so time spent idle
            // is not credit.
            self.owing.remove(&(t.finish, tenant.to_owned()));
            t.head_start = vtime.max(t.finish);
            self.ready.insert((t.head_start, ticket, tenant.to_owned()));
        }
        t.queue.insert(ticket, service);
        self.len += 1;
    }

    /// Releases the request with the smallest start tag: its ticket and
    /// tenant.
    pub(crate) fn pop(&mut self) -> Option<(u64, String)> {
        self.pop_where(|_| true)
    }

    /// Releases the request with the smallest start tag among the tenants
    /// `allow` lets go (the others' heads keep their tags and wait).
    pub(crate) fn pop_where(&mut self, allow: impl FnMut(&str) -> bool) -> Option<(u64, String)> {
        self.pop_chosen_where(allow, |tickets| tickets.next())
    }

    /// Releases one request of the tenant with the smallest start tag among
    /// those `allow` lets go: the ticket `choose` picks from that tenant's
    /// waiting tickets (given in arrival order), or its head when it picks
    /// none of them. The tenant's turn and start tag are what the fair
    /// order says either way; its finish tag is charged with the request
    /// actually released, so the tenants' shares of tokens keep their
    /// bound whichever of its requests goes.
    pub(crate) fn pop_chosen_where(
        &mut self,
        mut allow: impl FnMut(&str) -> bool,
        choose: impl FnOnce(&mut dyn Iterator<Item = u64>) -> Option<u64>,
    ) -> Option<(u64, String)> {
        let key = self
            .ready
            .iter()
            .find(|(_, _, name)| allow(name))
            .cloned()?;
        self.ready.remove(&key);
        let (start, head, name) = key;
        let t = self.tenants.get_mut(&name)?;
        let ticket = choose(&mut t.queue.keys().copied())
            .filter(|c| t.queue.contains_key(c))
            .unwrap_or(head);
        let service = t.queue.remove(&ticket).unwrap_or(0);
        self.len -= 1;
        self.vtime = self.vtime.max(start);
        t.finish = start.saturating_add(service);
        self.max_finish = self.max_finish.max(t.finish);
        if let Some(&next) = t.queue.keys().next() {
            t.head_start = t.finish;
            self.ready.insert((t.head_start, next, name.clone()));
        } else {
            self.owing.insert((t.finish, name.clone()));
        }
        self.settle_idle();
        Some((ticket, name))
    }

    /// Takes `ticket` out without serving it (cancelled or expired): nothing
    /// is charged, so the tenant's next request keeps the head's start tag.
    pub(crate) fn remove(&mut self, tenant: &str, ticket: u64) -> bool {
        let Some(t) = self.tenants.get_mut(tenant) else {
            return false;
        };
        let was_head = t.queue.keys().next() == Some(&ticket);
        if t.queue.remove(&ticket).is_none() {
            return false;
        }
        self.len -= 1;
        if was_head {
            self.ready
                .remove(&(t.head_start, ticket, tenant.to_owned()));
            match t.queue.keys().next() {
                Some(&next) => {
                    self.ready.insert((t.head_start, next, tenant.to_owned()));
                }
                None => {
                    self.owing.insert((t.finish, tenant.to_owned()));
                }
            }
        }
        self.settle_idle();
        true
    }

    /// Corrects a tenant's charge once a released request's real size is
    /// known: `charged` tokens were counted at release, `actual` were used.
    /// A refund never moves a tag before the band's virtual time (no credit
    /// beyond starting now).
    pub(crate) fn settle(&mut self, tenant: &str, weight: u32, charged: u64, actual: u64) {
        let vtime = self.vtime;
        let Some(t) = self.tenants.get_mut(tenant) else {
            // Nothing owed and nothing waiting: the tenant already starts at
            // the band's virtual time, which a refund cannot improve and a
            // debit is charged from.
            if actual > charged {
                let finish = vtime.saturating_add(per_weight(actual - charged, weight));
                self.tenants.insert(
                    tenant.to_owned(),
                    Tenant {
                        finish,
                        ..Tenant::default()
                    },
                );
                self.owing.insert((finish, tenant.to_owned()));
                self.max_finish = self.max_finish.max(finish);
            }
            return;
        };
        let old_finish = t.finish;
        t.finish = if actual >= charged {
            t.finish
                .saturating_add(per_weight(actual - charged, weight))
        } else {
            t.finish
                .saturating_sub(per_weight(charged - actual, weight))
                .max(vtime)
        };
        self.max_finish = self.max_finish.max(t.finish);
        match t.queue.keys().next() {
            Some(&head) => {
                let old = t.head_start;
                t.head_start = if t.finish >= old_finish {
                    old.max(t.finish)
                } else {
                    old.min(t.finish.max(vtime))
                };
                self.ready.remove(&(old, head, tenant.to_owned()));
                self.ready.insert((t.head_start, head, tenant.to_owned()));
            }
            None => {
                self.owing.remove(&(old_finish, tenant.to_owned()));
                self.owing.insert((t.finish, tenant.to_owned()));
            }
        }
        self.settle_idle();
    }

    /// Forgets idle tenants that no longer owe service (a fresh tenant would
    /// start at the same tag), and at the end of a busy period forgives what
    /// every tenant owes: with nothing waiting nobody was held back, so a
    /// debt carried into the next burst would only punish past traffic.
    fn settle_idle(&mut self) {
        if self.len == 0 {
            self.vtime = self.vtime.max(self.max_finish);
            self.tenants.clear();
            self.owing.clear();
            return;
        }
        while let Some((finish, name)) = self.owing.first().cloned() {
            if finish > self.vtime {
                break;
            }
            self.owing.pop_first();
            if self.tenants.get(&name).is_some_and(|t| t.queue.is_empty()) {
                self.tenants.remove(&name);
            }
        }
    }

    /// Tenants the band holds state for (waiting or owing); for tests of
    /// memory bounds.
    #[cfg(test)]
    pub(crate) fn tenants_held(&self) -> usize {
        self.tenants.len()
    }
}
