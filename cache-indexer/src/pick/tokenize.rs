//! Stage 2 of a pick, tokenize: the prompt's ids (exact, or only their
//! head when the prompt cannot hit further or the [`TokenizeBudget`] runs
//! out), its block hashes as they grow, and the completion of a stopped
//! pick's chain off the pick's path.
//!
//! [`TokenizeBudget`]: crate::tokenize::TokenizeBudget

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use dynamo_kv_router::protocols::LocalBlockHash;
use kvasir_tokenizer::{ChatTokenizer, EncodeLimits, PrefixIds};

use super::prompt::{Call, OwnedPrompt};
use crate::index::PoolIndex;
use crate::load::{block_chain, extend_block_chain, PendingChains, Placed};
use crate::pool::{invalid, Endpoint, Pool, ServiceError};
use crate::scoring;
use crate::tokenize::{
    tokenize_local_prefix, PromptInput, RequestTokenizer, TokenizeError, TokenizeMode,
};
use crate::types::IndexSource;

/// A prompt's block hashes, grown with its ids: the index's per-block
/// hashes and the chained ones picks in prefill are matched by.
#[derive(Default)]
pub(crate) struct PrefixHashes {
    pub(crate) local: Vec<LocalBlockHash>,
    pub(crate) chain: Vec<u64>,
}

impl PrefixHashes {
    /// Hashes the full blocks of `ids` (which extend the ids hashed so
    /// far) not hashed yet.
    pub(crate) fn extend(&mut self, index: &PoolIndex, ids: &[u32], block_size: u32) {
        let bs = block_size.max(1) as usize;
        if let Some(new) = ids.get(self.local.len() * bs..) {
            self.local.extend(index.block_hashes(new));
        }
        extend_block_chain(&mut self.chain, ids, block_size);
    }
}

/// Most chain completions running at once per pool. Each is CPU work (a
/// long prompt is a millisecond); past this, a burst of fresh prompts
/// would only queue threads, so further picks keep their short chain
/// (counted in `kvasir_indexer_chain_completions_skipped_total`).
const MAX_COMPLETIONS: usize = 4;

/// Tokenizes `prompt` as far as `limits` allow and hands its chain to the
/// pick's pending entry and its end to the pool's recent placements, on
/// the blocking pool; `running` counts the pool's completions in progress
/// (at most [`MAX_COMPLETIONS`]). False when skipped.
pub(crate) fn complete_chain_later(
    tok: Arc<ChatTokenizer>,
    prompt: OwnedPrompt,
    (block_size, limits): (u32, EncodeLimits),
    request_id: String,
    (pending, placed): (PendingChains, Placed),
    running: &Arc<AtomicUsize>,
) -> bool {
    if running.fetch_add(1, Ordering::AcqRel) >= MAX_COMPLETIONS {
        running.fetch_sub(1, Ordering::AcqRel);
        return false;
    }
    let running = Arc::clone(running);
    let work = move || {
        let block = block_size.max(1) as usize;
        // It tokenized up to here, so an error is the template's: nothing to add.
        if let Ok(p) = tokenize_local_prefix(&tok, prompt.input(), block, &mut |_| true, limits) {
            let chain = block_chain(&p.ids, block_size);
            placed.remember_end(&chain);
            pending.complete(&request_id, chain.into());
        }
        running.fetch_sub(1, Ordering::AcqRel);
    };
    match tokio::runtime::Handle::try_current() {
        Ok(h) => drop(h.spawn_blocking(work)),
        Err(_) => work(),
    }
    true
}

/// What a pick's tokenization gave.
pub(crate) struct PickTokens {
    /// The ids (pseudo-ids in approx mode); empty when `ok` is false.
    pub(crate) ids: Vec<u32>,
    /// How they were made.
    pub(crate) mode: TokenizeMode,
    /// False when the tokenizer was unavailable: the pick goes by load.
    pub(crate) ok: bool,
    /// The whole prompt's estimated length when `ids` are only its head.
    pub(crate) estimated_len: Option<usize>,
    /// Stopped where no engine holds the prompt (not by the budget): the
    /// whole chain is worth computing off the pick's path.
    pub(crate) complete_later: bool,
}

impl Pool {
    /// Tokenizes the prompt; a template's refusal is the caller's fault
    /// (`INVALID_ARGUMENT`), any other failure leaves the pick to go by load.
    pub(crate) async fn tokenize_prompt(
        &self,
        call: &Call,
        prompt: &OwnedPrompt,
        endpoints: &[Arc<Endpoint>],
        hashes: &mut PrefixHashes,
    ) -> Result<PickTokens, ServiceError> {
        let render_via = self.render_via(call, endpoints);
        self.tokenize_pick(prompt.input(), call.salted, render_via, hashes)
            .await
            .map_err(|e| invalid("chat.messages", e.to_string()))
    }

    /// Render mode asks a healthy endpoint chosen by request id (spreads
    /// the render load, and replicas ask the same one).
    fn render_via<'e>(&self, call: &Call, endpoints: &'e [Arc<Endpoint>]) -> Option<&'e str> {
        if !self.tokenizer.needs_engine() {
            return None;
        }
        let seed = scoring::seed_of(&call.request_id, &[]);
        let views = self
            .load
            .views(endpoints.iter().map(|e| e.id), call.started);
        endpoints
            .iter()
            .zip(&views)
            .filter(|(_, v)| v.healthy)
            .min_by_key(|(e, _)| scoring::tie_key(seed, &e.spec.address))
            .map(|(e, _)| e.spec.address.as_str())
    }

    /// Chain completions running now (benchmarks wait for them).
    pub fn chain_completions_running(&self) -> usize {
        self.completions.load(Ordering::Acquire)
    }

    /// Tokenizes a pick's prompt and counts it. In process, it stops where
    /// the prompt cannot hit any more (index `events`) and where the
    /// pool's [`TokenizeBudget`](crate::tokenize::TokenizeBudget) runs
    /// out. Errors only for the caller's fault (the template's refusal).
    async fn tokenize_pick(
        &self,
        input: PromptInput<'_>,
        salted: bool,
        render_via: Option<&str>,
        hashes: &mut PrefixHashes,
    ) -> Result<PickTokens, TokenizeError> {
        let t0 = Instant::now();
        let local = match (&self.tokenizer, &input) {
            (_, PromptInput::TokenIds(_)) => None,
            (RequestTokenizer::Local(tok), _) => Some(tok),
            _ => None,
        };
        let Some(tok) = local else {
            return match self.tokenizer.tokenize(input, render_via).await {
                Ok(t) => {
                    self.metrics.observe_tokenize(t.mode, t0.elapsed());
                    Ok(self.counted(t.ids, t.mode, None, false))
                }
                Err(e) if e.is_caller_error() => Err(e),
                Err(e) => {
                    tracing::debug!(pool = %self.name, error = %e, "tokenization failed; picking by load");
                    self.metrics.tokenize_failures.inc();
                    Ok(PickTokens {
                        ids: Vec::new(),
                        mode: self.tokenizer.mode(),
                        ok: false,
                        estimated_len: None,
                        complete_later: false,
                    })
                }
            };
        };
        let p = self.tokenize_prefix(tok, input, salted, hashes)?;
        self.metrics
            .observe_tokenize(TokenizeMode::Tokenizer, t0.elapsed());
        let estimated = p.stopped_at.map(|_| p.estimated_len());
        Ok(self.counted(p.ids, TokenizeMode::Tokenizer, estimated, p.limited))
    }

    /// Counts a tokenization's stop, if any, and wraps it up.
    fn counted(
        &self,
        ids: Vec<u32>,
        mode: TokenizeMode,
        estimated_len: Option<usize>,
        limited: bool,
    ) -> PickTokens {
        if let Some(est) = estimated_len {
            if limited {
                self.metrics.tokenize_limited.inc();
            } else {
                self.metrics.tokenize_stopped.inc();
            }
            self.metrics
                .tokens_not_tokenized
                .add(est.saturating_sub(ids.len()) as u64);
        }
        let complete_later = estimated_len.is_some() && !limited && self.wants_events();
        PickTokens {
            ids,
            mode,
            ok: true,
            estimated_len,
            complete_later,
        }
    }

    /// Tokenizes in process only as far as the ids can matter and the
    /// budget allows. With index `events`, at block boundaries inside text
    /// the tokenizer has not seen (its segment cache), it asks whether
    /// some engine's blocks (the index) or a pick still in prefill hold the
    /// prompt up to there, and stops at the first no: nothing after a miss
    /// can be a hit. A salted request is never matched, so it stops at the
    /// first new text. The length of the rest is estimated (the scoring's
    /// prefill work uses it).
    fn tokenize_prefix(
        &self,
        tok: &ChatTokenizer,
        input: PromptInput<'_>,
        salted: bool,
        hashes: &mut PrefixHashes,
    ) -> Result<PrefixIds, TokenizeError> {
        let block = self.block_size.max(1) as usize;
        let probing = self.index_source == IndexSource::Events;
        let mut go_on = |ids: &[u32]| -> bool {
            if !probing {
                return true;
            }
            if salted {
                return false;
            }
            hashes.extend(&self.index, ids, self.block_size);
            let full = ids.len() / block;
            self.index.overlap_of(&hashes.local).max_blocks() >= full
                || self.load.pending_holds(&hashes.chain)
        };
        let limits = self.tokenize_budget.limits();
        tokenize_local_prefix(tok, input, block, &mut go_on, limits)
    }
}
