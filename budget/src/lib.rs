//! # kvasir-budget
//!
//! Per-tenant token budgets, reserved before admission and settled from
//! the usage the response reports: the arithmetic only. No I/O and no
//! clock (every call takes `now_ms`), so the same code serves the
//! cache-indexer's in-process budgets, the Redis script's reference (the
//! script mirrors this integer arithmetic), and host unit tests. See the
//! crate README for where budgets are enforced and how several replicas
//! share them.
//!
//! * [`Limits`]: tokens per minute on prompt, completion and total (cached
//!   prompt tokens weighted by [`CachedWeight`]), requests per minute,
//!   concurrent requests.
//! * [`TenantBudget`]: one token bucket per limited dimension.
//!   [`TenantBudget::reserve`] takes a request's estimated cost from every
//!   bucket or refuses with a [`Refusal`] that says when a retry succeeds;
//!   [`TenantBudget::settle`] takes usage beyond the estimate as the
//!   response streams (monotone, any number of times);
//!   [`TenantBudget::release`] ends it with the final usage and gives back
//!   the unused part (idempotent); [`TenantBudget::cancel`] gives back
//!   everything for a request never served.
//! * [`OutputEstimate`]: the completion tokens to reserve, `max_tokens` or a
//!   learned per-tenant figure.
//! * [`TenantBudget::to_bytes`] / [`TenantBudget::from_bytes`]: the state
//!   as bytes, for a budget kept where only bytes can be (a proxy's shared
//!   memory).
//! * [`RateLimitHeaders`], [`go_duration`], [`retry_after_secs`]: OpenAI's
//!   `x-ratelimit-*` values and `Retry-After`.
//!
//! ```
//! use kvasir_budget::*;
//!
//! let mut b = TenantBudget::new(Limits {
//!     total_tokens_per_minute: Some(6_000),
//!     ..Limits::default()
//! });
//! let est = OutputEstimate::new(256);
//! let req = Request { prompt_tokens: 4_000, cached_tokens: 0, output_tokens: est.estimate(Some(1_000)) };
//! let r = b.reserve(0, &req).unwrap();
//! // A second one does not fit: 5,000 of 6,000 are reserved.
//! let e = b.reserve(0, &req).unwrap_err();
//! assert_eq!(e.retry_after_ms(), Some(40_000));
//! // The first streams 300 tokens and ends: 700 go back.
//! b.settle(10, r.id, &Usage { prompt_tokens: 4_000, cached_tokens: 0, completion_tokens: 120 });
//! let done = b.release(20, r.id, &Usage { prompt_tokens: 4_000, cached_tokens: 0, completion_tokens: 300 }).unwrap();
//! assert_eq!(done.refunded.get(Dimension::TotalTokens), 700);
//! assert_eq!(retry_after_secs(e.retry_after_ms().unwrap()), 40);
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod bucket;
mod estimate;
mod headers;
mod ledger;
mod limits;
mod snapshot;

pub use bucket::Bucket;
pub use estimate::OutputEstimate;
pub use headers::{go_duration, retry_after_secs, LimitState, RateLimitHeaders};
pub use ledger::{Refusal, Released, Reservation, TenantBudget};
pub use limits::{CachedWeight, Cost, Dimension, Limits, Request, Usage, WINDOW_MS};
