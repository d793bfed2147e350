//! The loader's checks of compiled budget and flow-control values (a
//! compiled config may come from anywhere: the ranges are checked again).

use super::doc::BudgetConfig;
use crate::bounds::{MAX_CONCURRENT, MAX_OUTPUT_TOKENS, MAX_PER_MINUTE, MAX_WAIT_MS, MAX_WEIGHT};

/// The loader's check of a compiled budget (a hand-written or damaged
/// document): the same bounds validation applies. Returns the field and
/// why.
pub(crate) fn budget(b: &BudgetConfig) -> Result<(), (&'static str, String)> {
    let rates = [
        ("tokensPerMinute", b.tokens_per_minute),
        ("promptTokensPerMinute", b.prompt_tokens_per_minute),
        ("completionTokensPerMinute", b.completion_tokens_per_minute),
        ("requestsPerMinute", b.requests_per_minute),
    ];
    for (field, v) in rates {
        if v.is_some_and(|v| !(1..=MAX_PER_MINUTE).contains(&v)) {
            return Err((field, format!("must be between 1 and {MAX_PER_MINUTE}")));
        }
    }
    if b.max_concurrent
        .is_some_and(|v| !(1..=MAX_CONCURRENT).contains(&v))
    {
        let msg = format!("must be between 1 and {MAX_CONCURRENT}");
        return Err(("maxConcurrent", msg));
    }
    if b.cached_token_weight_permille > 1000 {
        let msg = "must be at most 1000".to_owned();
        return Err(("cachedTokenWeightPermille", msg));
    }
    if !(1..=MAX_OUTPUT_TOKENS).contains(&b.default_output_tokens) {
        let msg = format!("must be between 1 and {MAX_OUTPUT_TOKENS}");
        return Err(("defaultOutputTokens", msg));
    }
    Ok(())
}

/// The loader's check of a compiled tenant weight.
pub(crate) fn weight(w: u32) -> Result<(), String> {
    match (1..=MAX_WEIGHT).contains(&w) {
        true => Ok(()),
        false => Err(format!("must be between 1 and {MAX_WEIGHT}")),
    }
}

/// The loader's check of a compiled `maxQueueWaitMs`.
pub(crate) fn queue_wait(ms: u32) -> Result<(), String> {
    match u64::from(ms) <= MAX_WAIT_MS {
        true => Ok(()),
        false => Err(format!("must be at most {MAX_WAIT_MS}")),
    }
}
