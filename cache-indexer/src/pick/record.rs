//! Stage 5 of a pick, record: the first endpoint gets the request in the
//! pool's books before the answer leaves, so the next pick sees its load,
//! its prefix (pick history, picks in prefill), the conversation it starts
//! or continues there and, for a failing endpoint, that this pick is its
//! probe.

use std::sync::Arc;

use super::matching::Matched;
use super::prompt::{Call, OwnedPrompt};
use super::rank::Ranked;
use super::tokenize::{complete_chain_later, PickTokens};
use crate::pool::Pool;
use crate::tokenize::RequestTokenizer;

impl Pool {
    /// Records the pick on the first endpoint of `ranked` (none: nothing).
    pub(crate) fn record(
        &self,
        call: &Call,
        prompt: OwnedPrompt,
        tokens: &PickTokens,
        matched: Matched<'_>,
        ranked: &Ranked,
    ) {
        let Some(first) = ranked.ranking.order.first() else {
            return;
        };
        let e = &ranked.endpoints[first.candidate];
        self.failures.picked(e.id, call.started);
        self.load.record_pick(
            &call.request_id,
            e.id,
            first.cost.prefill_work,
            first.predicted_cached_tokens,
            matched.pending_chain,
            call.started,
        );
        if let (Some(h), Some(c)) = (matched.history, &matched.chain) {
            h.write().record(e.id, c);
        }
        // A chain stopped where no engine holds the prompt ends inside
        // text other prompts may share: its completion remembers the end.
        let whole = matched
            .chain
            .as_deref()
            .filter(|_| matched.indexed && !tokens.complete_later);
        self.placements
            .record(e.id, ranked.starts_conversation, whole, call.started);
        // A stopped tokenization left the pick's chain short: finish it
        // off the pick's path, so that requests sharing this prompt's
        // fresh part while it is in prefill see it there.
        if let (true, RequestTokenizer::Local(tok), false) = (
            tokens.complete_later,
            &self.tokenizer,
            call.request_id.is_empty() || call.salted,
        ) {
            let started = complete_chain_later(
                Arc::clone(tok),
                prompt,
                (self.block_size, self.tokenize_budget.limits()),
                call.request_id.clone(),
                (self.load.pending_chains(), self.placements.clone()),
                &self.completions,
            );
            if !started {
                self.metrics.chain_completions_skipped.inc();
            }
        }
    }
}
