//! A pick, stage by stage: the prompt from the request ([`prompt`]), its
//! tokens ([`tokenize`]), what the prefix index holds of it ([`matching`]),
//! the endpoints ranked ([`rank`]), the first one recorded ([`record`]) and
//! the answer ([`answer`]). [`Pool::pick`] runs them in that order; each
//! stage only reads what the ones before it produced. A pick bound to a
//! stored response takes its own short path instead ([`affinity`]). Rank
//! and record share the pool's recent placements ([`placed`]). Between
//! match and rank, the tenant's budget is reserved ([`budget`]) and, when
//! the pool is saturated, the pick waits in its flow-control queue
//! ([`flow`]): ranking after the wait uses the load and index as they are
//! then (late binding).

mod affinity;
mod answer;
mod budget;
mod flow;
mod matching;
mod prompt;
mod rank;
mod record;
mod tokenize;

use std::time::Instant;

use std::sync::Arc;

use kvasir_proto::v1 as pb;
use tokio::sync::OwnedSemaphorePermit;

use crate::pool::{Endpoint, Pool, ServiceError};

/// What a pick's caller lends it while it computes (a `Session` stream's
/// concurrency permit): given back as soon as the pick waits in a
/// flow-control queue, since its work is done until it is released, and a
/// full queue must not stop the stream's other calls.
#[derive(Debug, Default)]
pub(crate) struct PickPermit(Option<OwnedSemaphorePermit>);

impl PickPermit {
    /// Nothing lent (a unary pick).
    pub(crate) fn none() -> Self {
        PickPermit(None)
    }

    /// The caller's permit, held until the pick ends or waits.
    pub(crate) fn held(permit: OwnedSemaphorePermit) -> Self {
        PickPermit(Some(permit))
    }

    /// Gives the permit back now (the pick is about to wait).
    pub(crate) fn give_back(&mut self) {
        self.0 = None;
    }
}

impl Pool {
    /// Answers a pick. Counts and times itself. A pick whose request was
    /// admitted without it meanwhile ([`crate::abandoned`]) is ended as
    /// soon as it is done.
    pub async fn pick(&self, req: pb::PickRequest) -> Result<pb::PickResponse, ServiceError> {
        self.pick_with(req, PickPermit::none()).await
    }

    /// [`Pool::pick`] holding the caller's `permit` while it computes (see
    /// [`PickPermit`]).
    pub(crate) async fn pick_with(
        &self,
        req: pb::PickRequest,
        mut permit: PickPermit,
    ) -> Result<pb::PickResponse, ServiceError> {
        let started = Instant::now();
        let request_id = req.request_id.clone();
        let budget_key = req.budget.as_ref().map(|b| b.key.clone());
        let r = self.run_pick(req, started, &mut permit).await;
        drop(permit);
        if r.as_ref().is_ok_and(|a| !a.endpoints.is_empty()) {
            self.end_if_abandoned(&request_id, budget_key.as_deref());
        }
        match &r {
            Ok(resp) => {
                self.metrics.count_pick(resp.decision());
                // (Time waiting for room is the queue-wait histogram's.)
                let waited = std::time::Duration::from_millis(resp.queued_ms.into());
                let took = started.elapsed().saturating_sub(waited);
                self.metrics.pick_latency.observe(took);
            }
            Err(_) => self.metrics.pick_invalid.inc(),
        }
        r
    }

    /// The endpoints `call` may be placed on: the pool's, within the
    /// caller's subset when it gives one.
    fn candidates(&self, call: &prompt::Call) -> Arc<Vec<Arc<Endpoint>>> {
        let all = self.endpoints();
        match &call.subset {
            None => all,
            Some(allowed) => Arc::new(
                all.iter()
                    .filter(|e| allowed.iter().any(|a| *a == e.spec.address))
                    .cloned()
                    .collect(),
            ),
        }
    }

    async fn run_pick(
        &self,
        req: pb::PickRequest,
        started: Instant,
        permit: &mut PickPermit,
    ) -> Result<pb::PickResponse, ServiceError> {
        if !req.response_id.is_empty() {
            return self.pick_response(req, started).await;
        }
        let (call, prompt) = prompt::from_request(req, started)?;
        let endpoints = self.candidates(&call);
        let mut hashes = tokenize::PrefixHashes::default();
        let tokens = self
            .tokenize_prompt(&call, &prompt, &endpoints, &mut hashes)
            .await?;
        let matched = self.match_prefix(&tokens, call.salted, &mut hashes);
        // Budget before the queue: a tenant over its budget never takes
        // queue room.
        let admission = match self.admit(&call, &tokens, &matched).await {
            Ok(a) => a,
            Err(refused) => return Ok(refused),
        };
        let (endpoints, matched, pass) = match self
            .wait_for_room(&call, &tokens, endpoints, matched, &mut hashes, permit)
            .await
        {
            Ok(room) => room,
            Err(shed) => {
                self.give_back(&call, admission);
                return Ok(shed);
            }
        };
        let ranked = self.rank(&call, &tokens, &matched, endpoints);
        self.record(&call, prompt, &tokens, matched, &ranked);
        let mut answer = self.answer(&call, &ranked, tokens.mode);
        self.attach_budget(&mut answer, &admission);
        self.flow_placed(pass, &ranked, &mut answer);
        Ok(answer)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::Semaphore;

    use super::PickPermit;

    #[test]
    fn a_pick_gives_its_callers_permit_back_when_it_waits_or_ends() {
        let permits = Arc::new(Semaphore::new(1));
        let take = || Arc::clone(&permits).try_acquire_owned().unwrap();
        let mut waiting = PickPermit::held(take());
        assert_eq!(permits.available_permits(), 0, "held while it computes");
        waiting.give_back();
        assert_eq!(permits.available_permits(), 1, "given back as it waits");
        drop(waiting);
        assert_eq!(permits.available_permits(), 1);
        let done = PickPermit::held(take());
        drop(done);
        assert_eq!(permits.available_permits(), 1, "given back as it ends");
        let mut none = PickPermit::none();
        none.give_back();
    }
}
