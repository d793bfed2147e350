//! A pick bound to a stored response (`PickRequest.response_id`): no
//! prompt stages, the answer is the one endpoint holding that response
//! (decision RESPONSE) or none (UNKNOWN_RESPONSE, also when another tenant
//! stored it), see [`crate::responses`].
//! The request is accounted on that endpoint like any pick, with no prefill
//! estimate (a GET or cancel has none; a follow-up's history is on that
//! engine already). A budgeted follow-up reserves against its tenant's
//! budget like any pick, its prompt counted from its bytes
//! ([`super::prompt::bound_call`]); it does not wait in the flow-control
//! queue (only one engine can serve it, so there is no placement to defer).

use std::sync::Arc;
use std::time::Instant;

use kvasir_proto::v1 as pb;

use crate::load::pool_saturation;
use crate::pool::{invalid, Endpoint, Pool, ServiceError};
use crate::responses::{check_id, Lost};
use crate::tokenize::TokenizeMode;

impl Pool {
    /// Answers a pick whose `response_id` is set.
    pub(crate) async fn pick_response(
        &self,
        req: pb::PickRequest,
        started: Instant,
    ) -> Result<pb::PickResponse, ServiceError> {
        check_id(&req.response_id).map_err(|m| invalid("response_id", m))?;
        let (call, prompt_tokens) = super::prompt::bound_call(&req, started)?;
        let admission = match self
            .admit_counted(&call, prompt_tokens, 0, TokenizeMode::Approx)
            .await
        {
            Ok(a) => a,
            Err(refused) => return Ok(refused),
        };
        let id = req.response_id;
        let holder = self
            .responses
            .resolve(&id, &req.tenant, || self.endpoints())
            .await;
        tracing::debug!(
            pool = %self.name,
            tenant = %req.tenant,
            request_id = %req.request_id,
            response_id = %id,
            holder = ?holder.as_ref().map(|e| e.spec.address.as_str()),
            "response pick"
        );
        let outside = |e: &Arc<Endpoint>| {
            call.subset
                .as_ref()
                .is_some_and(|s| !s.iter().any(|a| *a == e.spec.address))
        };
        Ok(match holder {
            Ok(e) if outside(&e) => {
                // Only that engine can serve it, and the caller may not
                // use it: nothing to answer with.
                self.give_back(&call, admission);
                let mut answer = self.response_answer(None, started);
                answer.set_decision_and_reason(pb::Decision::NoEndpoints);
                answer
            }
            Ok(e) => {
                self.failures.picked(e.id, started);
                self.load
                    .record_pick(&req.request_id, e.id, 0, 0, None, started);
                let mut answer = self.response_answer(Some(&e), started);
                self.attach_budget(&mut answer, &admission);
                answer
            }
            Err(why) => {
                if !matches!(why, Lost::NotRecorded | Lost::OtherTenant) {
                    tracing::info!(pool = %self.name, response_id = %id, why = why.as_str(), "response pick: its engine no longer holds it");
                }
                // Nothing will be served: the reservation goes back now.
                self.give_back(&call, admission);
                self.response_answer(None, started)
            }
        })
    }

    fn response_answer(&self, holder: Option<&Arc<Endpoint>>, now: Instant) -> pb::PickResponse {
        let endpoints = self.endpoints();
        let views = self.load.views(endpoints.iter().map(|e| e.id), now);
        let saturated = |e: &Endpoint| {
            endpoints
                .iter()
                .zip(&views)
                .find(|(x, _)| x.id == e.id)
                .is_some_and(|(_, v)| v.saturated)
        };
        let decision = match holder {
            Some(_) => pb::Decision::Response,
            None => pb::Decision::UnknownResponse,
        };
        let mut answer = pb::PickResponse {
            endpoints: holder
                .map(|e| pb::PickedEndpoint {
                    address: e.spec.address.clone(),
                    predicted_cached_tokens: 0,
                    score: None,
                    saturated: saturated(e),
                })
                .into_iter()
                .collect(),
            prompt_tokens: 0,
            pool_saturation: pool_saturation(&views),
            ..Default::default()
        };
        // Nothing was tokenized: `tokenized_by` stays UNSPECIFIED.
        answer.set_decision_and_reason(decision);
        answer
    }
}
