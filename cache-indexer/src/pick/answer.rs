//! Stage 6 of a pick, answer: the ranking as the filter reads it.

use kvasir_proto::v1 as pb;

use super::prompt::Call;
use super::rank::Ranked;
use crate::load::pool_saturation;
use crate::metrics::PickDecision;
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
            decision = ranking.decision.as_str(),
            first = ranking.order.first().map(|r| endpoints[r.candidate].spec.address.as_str()),
            prompt_tokens,
            starts_conversation,
            "pick"
        );
        pb::PickResponse {
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
            decision: decision_to_pb(ranking.decision) as i32,
            reason: ranking.decision.as_str().to_string(),
            tokenize_mode: mode.as_str().to_string(),
            ..Default::default()
        }
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

/// The decision of a proto enum value (`Load` for one it does not know).
pub(crate) fn decision_from_pb(d: i32) -> PickDecision {
    match pb::Decision::try_from(d) {
        Ok(pb::Decision::Prefix) => PickDecision::Ranked(Decision::Prefix),
        Ok(pb::Decision::NoIndex) => PickDecision::Ranked(Decision::NoIndex),
        Ok(pb::Decision::AllSaturated) => PickDecision::Ranked(Decision::AllSaturated),
        Ok(pb::Decision::NoEndpoints) => PickDecision::Ranked(Decision::NoEndpoints),
        Ok(pb::Decision::Response) => PickDecision::Response,
        Ok(pb::Decision::UnknownResponse) => PickDecision::UnknownResponse,
        Ok(pb::Decision::RateLimited) => PickDecision::RateLimited,
        Ok(pb::Decision::Shed) => PickDecision::Shed,
        _ => PickDecision::Ranked(Decision::Load),
    }
}
