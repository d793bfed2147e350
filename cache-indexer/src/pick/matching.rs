//! Stage 3 of a pick, match: how much of the prompt each endpoint holds,
//! from the engines' KV events or from this replica's own pick history
//! (index `picks` whatever the ids, and approx pseudo-tokens, which cannot
//! be compared with the events).

use std::sync::Arc;

use parking_lot::RwLock;

use super::tokenize::{PickTokens, PrefixHashes};
use crate::history::PickHistory;
use crate::index::Overlap;
use crate::pool::Pool;
use crate::tokenize::TokenizeMode;
use crate::types::IndexSource;

/// What the prefix index says about a prompt.
pub(crate) struct Matched<'p> {
    /// The prompt was looked up (tokenized, not salted, an index to ask).
    pub(crate) indexed: bool,
    /// Its block chain, when looked up.
    pub(crate) chain: Option<Arc<[u64]>>,
    /// Blocks each endpoint holds, when looked up.
    pub(crate) overlap: Option<Overlap>,
    /// The pick history it was matched against, if that is the index.
    pub(crate) history: Option<&'p RwLock<PickHistory>>,
    /// The chain picks still in prefill are matched against (event-indexed
    /// pools only).
    pub(crate) pending_chain: Option<Arc<[u64]>>,
}

impl Pool {
    /// Looks the prompt up in the pool's prefix index. A salted request is
    /// not matched (nor recorded): KV events do not carry the salt.
    pub(crate) fn match_prefix(
        &self,
        tokens: &PickTokens,
        salted: bool,
        hashes: &mut PrefixHashes,
    ) -> Matched<'_> {
        let from_history =
            self.index_source == IndexSource::Picks || tokens.mode == TokenizeMode::Approx;
        let history = if from_history {
            self.history.as_ref()
        } else {
            None
        };
        // (A pool that matches from its history always has one: `new`,
        // `with_index`.)
        let indexed = tokens.ok && !salted && (history.is_some() || !from_history);
        // (Hashes the prefix tokenizer's checks computed are extended, not
        // recomputed.)
        if indexed {
            hashes.extend(&self.index, &tokens.ids, self.block_size);
        }
        let chain: Option<Arc<[u64]>> = indexed.then(|| std::mem::take(&mut hashes.chain).into());
        let overlap = match (&chain, history) {
            (Some(c), Some(h)) => Some(h.read().overlap(c)),
            (Some(_), None) => Some(self.index.overlap_of(&hashes.local)),
            (None, _) => None,
        };
        // Event-indexed picks also match against picks still in prefill: a
        // burst of requests sharing a prefix sees it as (about to be) cached
        // where the first of them went, before the engine's events say so.
        // The pick history needs no such help: it records each pick at once.
        let pending_chain = if history.is_none() {
            chain.clone()
        } else {
            None
        };
        Matched {
            indexed,
            chain,
            overlap,
            history,
            pending_chain,
        }
    }
}
