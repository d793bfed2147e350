//! Stage 4 of a pick, rank: each endpoint's load (with the picks in
//! prefill that share the prompt), failure state and matched blocks,
//! ordered by the scoring's cost.

use std::sync::Arc;

use super::matching::Matched;
use super::prompt::Call;
use super::tokenize::PickTokens;
use crate::load::LoadView;
use crate::pool::{Endpoint, Pool};
use crate::scoring::{self, Candidate, Ranking};

/// The endpoints, best first.
pub(crate) struct Ranked {
    /// The endpoint snapshot the ranking indexes.
    pub(crate) endpoints: Arc<Vec<Arc<Endpoint>>>,
    /// Their load views, in the same order.
    pub(crate) views: Vec<LoadView>,
    pub(crate) ranking: Ranking,
    /// The prompt's length (estimated when only its head was tokenized).
    pub(crate) prompt_tokens: u32,
    /// Whether the prompt extends no earlier pick's prompt (see
    /// `scoring::placements`); false when it was not looked up.
    pub(crate) starts_conversation: bool,
}

impl Pool {
    /// Ranks `endpoints` for the prompt.
    pub(crate) fn rank(
        &self,
        call: &Call,
        tokens: &PickTokens,
        matched: &Matched<'_>,
        endpoints: Arc<Vec<Arc<Endpoint>>>,
    ) -> Ranked {
        let prompt_tokens =
            u32::try_from(tokens.estimated_len.unwrap_or(tokens.ids.len())).unwrap_or(u32::MAX);
        let views = self.load.views_matching(
            endpoints.iter().map(|e| e.id),
            call.started,
            matched.pending_chain.as_deref(),
        );
        let failing = self
            .failures
            .ranked_last_all(endpoints.iter().map(|e| e.id), call.started);
        let chain = matched.chain.as_deref().filter(|_| matched.indexed);
        let (starts_conversation, placed) = self.placements.view(
            chain,
            endpoints.iter().map(|e| (e.id, e.restarts())),
            call.started,
        );
        let candidates: Vec<Candidate<'_>> = endpoints
            .iter()
            .zip(&views)
            .zip(failing.into_iter().zip(placed))
            .map(|((e, v), (failing, recent_placements))| {
                let indexed_blocks = matched.overlap.as_ref().map_or(0, |o| o.blocks_for(e.id));
                Candidate {
                    failing,
                    recent_placements,
                    ..candidate(e, v, indexed_blocks.max(v.pending_matched_blocks))
                }
            })
            .collect();
        let request = scoring::Request {
            prompt_tokens,
            block_size: self.block_size,
            seed: scoring::seed_of(&call.request_id, &tokens.ids),
            max_endpoints: call.max_endpoints as usize,
            indexed: matched.indexed,
            starts_conversation,
        };
        let ranking = scoring::rank(&request, &candidates, &self.weights);
        Ranked {
            endpoints,
            views,
            ranking,
            prompt_tokens,
            starts_conversation,
        }
    }
}

fn candidate<'a>(e: &'a Endpoint, v: &LoadView, matched: usize) -> Candidate<'a> {
    Candidate {
        address: &e.spec.address,
        matched_blocks: u32::try_from(matched).unwrap_or(u32::MAX),
        running: v.running(),
        waiting: v.engine.waiting,
        kv_usage: v.engine.kv_usage,
        in_flight: v.in_flight,
        queued_prefill_tokens: v.queued_prefill_tokens,
        healthy: v.healthy,
        saturated: v.saturated,
        left_out: v.left_out,
        failing: false,
        recent_placements: 0.0,
    }
}
