//! The `budgets:` section: where tenants' token budgets are kept (see
//! `kvasir-budget`). The limits themselves come with each pick from the
//! filter's compiled policy; this only says where their state lives.
//!
//! ```yaml
//! budgets:
//!   store: memory          # memory (default: this process) | redis (shared by replicas)
//!   redisUrl: redis://redis.kvasir:6379
//! ```

use serde::{Deserialize, Serialize};

/// Where budget state is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum BudgetStoreKind {
    /// In this process: exact with one indexer replica.
    #[default]
    Memory,
    /// In Redis, shared by every replica (atomic server-side scripts).
    Redis,
}

/// The `budgets:` section.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct BudgetsConfig {
    /// Where budget state is kept.
    pub store: BudgetStoreKind,
    /// `redis://host:port[/db]`, with `store: redis`.
    #[serde(alias = "redis_url")]
    pub redis_url: Option<String>,
}
