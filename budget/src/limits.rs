//! What a budget limits and what a request costs against it.

use std::fmt;

/// The length of a budget's window: every rate is "per minute", and a
/// bucket holds at most one window of its rate.
pub const WINDOW_MS: u64 = 60_000;

/// The weight of a cached prompt token, in thousandths of an uncached one.
///
/// Integer thousandths keep the arithmetic exact (the same figure in the
/// filter, the indexer and a Redis script) and the compiled config
/// canonical; a coarser step would make cheap-cache pricing (0.1) awkward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CachedWeight(u16);

impl CachedWeight {
    /// Cached tokens cost as much as uncached ones.
    pub const FULL: CachedWeight = CachedWeight(1000);
    /// Cached tokens are free.
    pub const FREE: CachedWeight = CachedWeight(0);

    /// A weight of `permille` thousandths, at most 1000 (above is taken
    /// as 1000: a cached token never costs more than an uncached one).
    pub fn from_permille(permille: u16) -> CachedWeight {
        CachedWeight(permille.min(1000))
    }

    /// The weight in thousandths.
    pub fn permille(self) -> u16 {
        self.0
    }
}

impl Default for CachedWeight {
    fn default() -> Self {
        CachedWeight::FULL
    }
}

/// One limited quantity of a budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dimension {
    /// Requests per minute.
    Requests,
    /// Prompt tokens per minute (cached ones weighted).
    PromptTokens,
    /// Completion tokens per minute.
    CompletionTokens,
    /// Prompt (weighted) plus completion tokens per minute.
    TotalTokens,
}

impl Dimension {
    /// Every dimension, in the order of [`Cost`]'s array.
    pub const ALL: [Dimension; 4] = [
        Dimension::Requests,
        Dimension::PromptTokens,
        Dimension::CompletionTokens,
        Dimension::TotalTokens,
    ];

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// A short lowercase name for stats labels and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Dimension::Requests => "requests",
            Dimension::PromptTokens => "prompt_tokens",
            Dimension::CompletionTokens => "completion_tokens",
            Dimension::TotalTokens => "tokens",
        }
    }
}

impl fmt::Display for Dimension {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dimension::Requests => "requests",
            Dimension::PromptTokens => "prompt tokens",
            Dimension::CompletionTokens => "completion tokens",
            Dimension::TotalTokens => "tokens",
        })
    }
}

/// A tenant's limits. `None` means unlimited in that dimension; a budget
/// with every field `None` admits everything.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Limits {
    /// Requests per minute.
    pub requests_per_minute: Option<u64>,
    /// Prompt tokens per minute (cached tokens weighted by
    /// `cached_token_weight`).
    pub prompt_tokens_per_minute: Option<u64>,
    /// Completion tokens per minute.
    pub completion_tokens_per_minute: Option<u64>,
    /// Prompt (weighted) plus completion tokens per minute.
    pub total_tokens_per_minute: Option<u64>,
    /// Requests admitted and not yet released.
    pub max_concurrent: Option<u32>,
    /// What a cached prompt token costs in the prompt and total dimensions.
    pub cached_token_weight: CachedWeight,
}

impl Limits {
    /// Every limit divided by `n`, at least 1 each: the share of one of `n`
    /// admitters that must stay within the budget together without asking
    /// each other (indexer replicas without their shared store, Envoys
    /// without the indexer). `n` of 0 is taken as 1.
    pub fn divided(&self, n: u32) -> Limits {
        let n = n.max(1);
        let per = |v: Option<u64>| v.map(|v| (v / u64::from(n)).max(1));
        Limits {
            requests_per_minute: per(self.requests_per_minute),
            prompt_tokens_per_minute: per(self.prompt_tokens_per_minute),
            completion_tokens_per_minute: per(self.completion_tokens_per_minute),
            total_tokens_per_minute: per(self.total_tokens_per_minute),
            max_concurrent: self.max_concurrent.map(|c| (c / n).max(1)),
            cached_token_weight: self.cached_token_weight,
        }
    }

    /// The per-minute limit of a dimension.
    pub fn per_minute(&self, d: Dimension) -> Option<u64> {
        match d {
            Dimension::Requests => self.requests_per_minute,
            Dimension::PromptTokens => self.prompt_tokens_per_minute,
            Dimension::CompletionTokens => self.completion_tokens_per_minute,
            Dimension::TotalTokens => self.total_tokens_per_minute,
        }
    }
}

/// Token usage as the engine reports it (`usage` of a response, or of a
/// streamed chunk so far).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// All prompt tokens, cached ones included (`prompt_tokens`).
    pub prompt_tokens: u64,
    /// Prompt tokens found in the engine's cache
    /// (`prompt_tokens_details.cached_tokens`); more than `prompt_tokens`
    /// is read as `prompt_tokens`.
    pub cached_tokens: u64,
    /// Completion tokens (`completion_tokens`).
    pub completion_tokens: u64,
}

impl Usage {
    /// The larger of two usages, field by field: usage only grows while a
    /// response streams, so a smaller late figure is a stale one.
    pub fn max(self, other: Usage) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens.max(other.prompt_tokens),
            cached_tokens: self.cached_tokens.max(other.cached_tokens),
            completion_tokens: self.completion_tokens.max(other.completion_tokens),
        }
    }

    /// The token cost (the request dimension left at 0).
    pub fn cost(&self, weight: CachedWeight) -> Cost {
        let cached = self.cached_tokens.min(self.prompt_tokens);
        let uncached = self.prompt_tokens - cached;
        // Rounded up: a fraction of a token is still charged, so the
        // weighted figure never undercounts.
        let weighted = (u128::from(cached) * u128::from(weight.permille())).div_ceil(1000);
        let prompt = u64::try_from(u128::from(uncached) + weighted).unwrap_or(u64::MAX);
        Cost([
            0,
            prompt,
            self.completion_tokens,
            prompt.saturating_add(self.completion_tokens),
        ])
    }
}

/// What an admission asks for: the prompt as tokenized, the prompt tokens
/// the picked engine is expected to hold, and the output estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Request {
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Prompt tokens expected to be cached (the pick's prediction; 0 to
    /// charge the whole prompt at full price until usage says otherwise).
    pub cached_tokens: u64,
    /// Completion tokens reserved: `max_tokens`, else the learned estimate
    /// ([`crate::OutputEstimate`]).
    pub output_tokens: u64,
}

impl Request {
    /// The cost reserved at admission: one request plus the tokens.
    pub fn cost(&self, weight: CachedWeight) -> Cost {
        let mut c = Usage {
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            completion_tokens: self.output_tokens,
        }
        .cost(weight);
        c.0[Dimension::Requests.index()] = 1;
        c
    }
}

/// An amount in every dimension (requests, prompt, completion, total).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cost(pub [u64; 4]);

impl Cost {
    /// The amount in one dimension.
    pub fn get(&self, d: Dimension) -> u64 {
        self.0[d.index()]
    }

    /// The larger of two costs, dimension by dimension.
    pub fn max(self, other: Cost) -> Cost {
        Cost(std::array::from_fn(|i| self.0[i].max(other.0[i])))
    }

    /// `self - other` per dimension, 0 where `other` is larger.
    pub fn saturating_sub(self, other: Cost) -> Cost {
        Cost(std::array::from_fn(|i| {
            self.0[i].saturating_sub(other.0[i])
        }))
    }

    /// `self + other` per dimension.
    pub fn saturating_add(self, other: Cost) -> Cost {
        Cost(std::array::from_fn(|i| {
            self.0[i].saturating_add(other.0[i])
        }))
    }

    /// Whether every dimension is 0.
    pub fn is_zero(&self) -> bool {
        self.0.iter().all(|&x| x == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_tokens_are_weighted_and_rounded_up() {
        let u = Usage {
            prompt_tokens: 1000,
            cached_tokens: 801,
            completion_tokens: 10,
        };
        let c = u.cost(CachedWeight::from_permille(100));
        // 199 uncached + ceil(80.1)
        assert_eq!(c.get(Dimension::PromptTokens), 280);
        assert_eq!(c.get(Dimension::TotalTokens), 290);
        assert_eq!(c.get(Dimension::Requests), 0);
        assert_eq!(u.cost(CachedWeight::FREE).get(Dimension::PromptTokens), 199);
        assert_eq!(
            u.cost(CachedWeight::FULL).get(Dimension::PromptTokens),
            1000
        );
    }

    #[test]
    fn cached_above_prompt_is_clamped() {
        let u = Usage {
            prompt_tokens: 10,
            cached_tokens: 50,
            completion_tokens: 0,
        };
        assert_eq!(u.cost(CachedWeight::FREE).get(Dimension::PromptTokens), 0);
    }

    #[test]
    fn weight_above_one_is_one() {
        assert_eq!(CachedWeight::from_permille(5000), CachedWeight::FULL);
    }

    #[test]
    fn a_request_costs_one_request() {
        let r = Request {
            prompt_tokens: 5,
            cached_tokens: 0,
            output_tokens: 7,
        };
        assert_eq!(r.cost(CachedWeight::FULL), Cost([1, 5, 7, 12]));
    }
}
