//! Kvasir's flow control core: a bounded queue of waiting picks per pool,
//! released in priority bands and, within a band, in token-weighted fair
//! share between tenants. Pure: no I/O, no clocks (the caller passes
//! `now`), no randomness, no async; the cache-indexer's pick path drives it.
//!
//! # Admission and release
//!
//! * A pick **waits** when [`should_queue`]: the pool is at or above its
//!   threshold, or picks already wait (a newcomer never overtakes them).
//! * [`FlowQueue::push`] queues it or refuses it ([`Refusal`]: the pool or
//!   the tenant is at its maximum, or no time is left); refused picks are
//!   shed with 429.
//! * [`FlowQueue::pop_next`] releases the next pick when the caller has room
//!   ([`has_room`]: an endpoint below the threshold); the caller chooses its
//!   endpoint then (late binding), with the index and load as they are at
//!   release.
//! * [`FlowQueue::expire`] takes out picks past their deadline (the queue's
//!   maximum wait, or the pick's own if earlier); the caller sheds them (429,
//!   or 503 when no endpoint is ready). [`FlowQueue::next_deadline`] says
//!   when to call it next.
//! * [`FlowQueue::remove`] cancels one (its client went away).
//!
//! # The reserve
//!
//! Work-conserving flow control lets a flooding tenant keep every engine at
//! the threshold, so another tenant's pick, first in fair order, still
//! waits for a slot. [`Shares`] says which tenants hold more than their
//! weighted share of the work in flight; such a tenant may only go below
//! [`room_bound`] (`threshold x (1 - reserve)`), and
//! [`FlowQueue::pop_next_where`] releases past its held picks to the
//! tenants allowed. A tenant alone is never over its share.
//!
//! Release is triggered by **capacity freed**, never by a timer alone: a
//! report that a request reached its first token (its prefill no longer
//! queues ahead of others) or is done, a scrape that shows an endpoint below
//! the threshold, an endpoint joining the pool, and a config reload. On each
//! such event the caller expires, then pops and places while an endpoint
//! has room; placing updates its load view, so the loop ends by itself.
//!
//! # Order
//!
//! Bands are strict: a pick of priority `p` is released only when nothing
//! of a smaller value waits (lower is more urgent, as vLLM's `priority`;
//! batch traffic gets the largest value). Sustained urgent traffic can hold
//! a band back; the maximum wait bounds how long before its picks are shed.
//!
//! Within a band, **start-time fair queueing** (SFQ, Goyal, Vin and Cheng
//! 1996) with a request's tokens (prompt plus output estimate) as its size:
//!
//! * each tenant's head request has a start tag `S`; the smallest is
//!   released (ties: earliest arrival); the band's virtual time `V` becomes
//!   `S`, and the tenant's finish tag `F = S + tokens / weight`;
//! * a backlogged tenant's next request starts at `F`; a tenant that had
//!   nothing waiting starts at `max(V, F)`: never before now, so time spent
//!   idle banks no credit, and not before its last finish, so a burst right
//!   after a large request does not jump the queue;
//! * when a band empties, what its tenants owe is forgiven (nobody was held
//!   back) and their state dropped, so memory is bounded by what waits.
//!
//! Why SFQ rather than deficit round robin or finish-tag WFQ: two backlogged
//! tenants' served tokens per weight differ by at most one request of the
//! one ahead, whatever the sizes (a tenant of 30k-token prompts gets the
//! same tokens as one of 1k-token prompts, in fewer requests); a newcomer is
//! released at once and pays afterwards, so a light tenant's first request
//! does not wait behind a heavy tenant's backlog; DRR needs a quantum, and
//! with prompts from ten to a hundred thousand tokens any quantum is either
//! many idle rounds or a coarse unfairness bound. Tags are integers (fixed
//! point), so equal input gives equal order on every replica.
//!
//! # Quickest first within a tenant
//!
//! With [`ReleaseOrder::QuickestFirst`] the band and the tenant whose turn
//! it is are the fair order's, but of that tenant's waiting requests the
//! caller's cheapest goes ([`FlowQueue::pop_quickest_where`]: the cost is
//! the caller's, e.g. the prefill a request still needs on the engine with
//! room, so the queue stays free of any index), ties by arrival. Its
//! finish tag is charged with the request released, so the bound between
//! tenants holds as in the fair order. Aging: a tenant's oldest request
//! that has waited the caller's `max_skip` goes first, so short prompts
//! cannot starve a long one. It releases exactly when the fair order
//! would: a request is never held back to wait for a quicker one.
//!
//! Tags are computed lazily for each tenant's head only, so cancelling or
//! expiring a request in the middle of a queue touches nothing behind it.
//! [`FlowQueue::settle`] corrects a charge once the real output is known.
//!
//! Several indexer replicas: see this crate's README.

#![warn(missing_docs)]

mod band;
mod config;
mod queue;
mod shares;

pub use config::{
    engine_priority, has_room, prefill_priority, room_bound, should_queue, work_saturation,
    ConfigError, EnginePriorityBy, FlowControlConfig, Limits, ReleaseOrder,
    DEFAULT_MAX_QUICKEST_SKIP_MS, DEFAULT_OVER_SHARE_SLACK, DEFAULT_RELEASE_ORDER, DEFAULT_RESERVE,
    DEFAULT_RESERVE_COUNTS_WAITING, DEFAULT_SATURATED_PREFILL_TOKENS, PREFILL_PRIORITY_STEPS,
    PREFILL_PRIORITY_STEP_TOKENS,
};
pub use queue::{FlowQueue, Refusal, Refused, Released, Ticket, Waiting};
pub use shares::Shares;

#[cfg(test)]
mod queue_tests;

#[cfg(test)]
mod queue_props;

#[cfg(test)]
mod quickest_tests;
