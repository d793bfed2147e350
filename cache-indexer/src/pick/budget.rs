//! Budget admission of a pick (issue 23): reserve the request's tokens
//! against its tenant's budget before it is placed or queued.
//!
//! Placeholder until the budgets module lands: every pick is admitted and
//! nothing is reserved.

use kvasir_proto::v1 as pb;

use super::matching::Matched;
use super::prompt::Call;
use super::tokenize::PickTokens;
use crate::pool::Pool;

/// What admission reserved for a pick (nothing yet).
#[derive(Debug, Default)]
pub(crate) struct Admission {}

impl Pool {
    /// Reserves `call`'s tokens against its budget; a refusal is the answer
    /// to send (decision RATE_LIMITED).
    pub(crate) fn admit(
        &self,
        _call: &Call,
        _tokens: &PickTokens,
        _matched: &Matched<'_>,
    ) -> Result<Admission, pb::PickResponse> {
        Ok(Admission::default())
    }

    /// Gives back what `admission` reserved (the pick was shed).
    pub(crate) fn give_back(&self, _call: &Call, _admission: Admission) {}

    /// Adds the budget's status to an admitted pick's answer.
    pub(crate) fn attach_budget(&self, _answer: &mut pb::PickResponse, _admission: &Admission) {}
}
