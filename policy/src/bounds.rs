//! The ranges of budgets and flow control, shared by the checks of the
//! source (`budget`, `flow`) and of the compiled config (`config`).

/// Largest per-minute limit. Credit is kept in 1/60000 token units and a
/// shared store's script (Redis Lua numbers are doubles) must hold them
/// exactly: 10^9 x 60000 is far below 2^53.
pub const MAX_PER_MINUTE: u64 = 1_000_000_000;

/// Largest `maxConcurrent`.
pub const MAX_CONCURRENT: u32 = 1_000_000;

/// Largest `defaultOutputTokens`: beyond any model's context.
pub const MAX_OUTPUT_TOKENS: u32 = 10_000_000;

/// Default of `defaultOutputTokens`: generous, since a short estimate is
/// usage beyond the reservation, while a long one only delays admission
/// until the tenant's own lengths are learned.
pub const DEFAULT_OUTPUT_TOKENS: u32 = 512;

/// A tenant's weight when neither it nor its class sets one.
pub const DEFAULT_WEIGHT: u32 = 1;

/// Largest weight: a 1000:1 share is already beyond what a queue can show
/// within any realistic backlog, and the bound keeps `tokens / weight`
/// tags far from rounding.
pub const MAX_WEIGHT: u32 = 1000;

/// Largest `maxWaitMs`: the filter holds the request paused that long, and
/// the value must fit the compiled `maxQueueWaitMs` (u32).
pub const MAX_WAIT_MS: u64 = 600_000;

/// Largest `maxQueued` / `maxQueuedPerTenant`: a bound on the memory a
/// typo can ask the indexer to hold.
pub const MAX_QUEUED: u64 = 1_000_000;
