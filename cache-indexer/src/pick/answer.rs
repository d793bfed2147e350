//! Stage 6 of a pick, answer: the ranking as the filter reads it.

use kvasir_proto::v1 as pb;

use super::prompt::Call;
use super::rank::Ranked;
use crate::load::pool_saturation;
use crate::pool::Pool;
use crate::scoring::Decision;
use crate::tokenize::TokenizeMode;

impl Pool {
    /// The `PickResponse` for `ranked` (logged at debug).
    pub(crate) fn answer(
        &self,
        call: &Call,
        ranked: &Ranked,
        mode: TokenizeMode,
    ) -> pb::PickResponse {
        let Ranked {
            endpoints,
            views,
            ranking,
            prompt_tokens,
            starts_conversation,
        } = ranked;
        tracing::debug!(
            pool = %self.name,
            tenant = %call.tenant,
            request_id = %call.request_id,
            decision = decision_to_pb(ranking.decision).as_label(),
            first = ranking.order.first().map(|r| endpoints[r.candidate].spec.address.as_str()),
            prompt_tokens,
            starts_conversation,
            "pick"
        );
        let mut answer = pb::PickResponse {
            endpoints: ranking
                .order
                .iter()
                .map(|r| pb::PickedEndpoint {
                    address: endpoints[r.candidate].spec.address.clone(),
                    predicted_cached_tokens: r.predicted_cached_tokens,
                    score: Some(pb::ScoreBreakdown {
                        total: r.cost.total,
                        prefill: r.cost.prefill,
                        decode: r.cost.decode,
                        queue: r.cost.queue,
                        kv: r.cost.kv,
                        placement: r.cost.placement,
                        matched_blocks: r.cost.matched_blocks,
                        uncached_tokens: r.cost.uncached_tokens,
                        queued_prefill_tokens: r.cost.queued_prefill_tokens,
                    }),
                    saturated: r.saturated,
                })
                .collect(),
            prompt_tokens: *prompt_tokens,
            pool_saturation: pool_saturation(views),
            ..Default::default()
        };
        answer.set_decision_and_reason(decision_to_pb(ranking.decision));
        answer.set_tokenize_mode(mode);
        answer
    }
}

/// The proto enum of a decision.
fn decision_to_pb(d: Decision) -> pb::Decision {
    match d {
        Decision::Prefix => pb::Decision::Prefix,
        Decision::Load => pb::Decision::Load,
        Decision::NoIndex => pb::Decision::NoIndex,
        Decision::AllSaturated => pb::Decision::AllSaturated,
        Decision::NoEndpoints => pb::Decision::NoEndpoints,
    }
}
