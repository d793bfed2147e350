//! Flow control of a pick (issue 23): when the pool is saturated, the pick
//! waits in the pool's queue and is placed when it leaves (late binding).
//!
//! Placeholder until the flow-control wiring lands: picks never wait.

use std::sync::Arc;

use kvasir_proto::v1 as pb;

use super::matching::Matched;
use super::prompt::Call;
use super::tokenize::{PickTokens, PrefixHashes};
use crate::endpoint::Endpoint;
use crate::pool::Pool;

/// The endpoints and prefix match a pick is ranked with once it may go.
pub(crate) type Room<'p> = (Arc<Vec<Arc<Endpoint>>>, Matched<'p>);

impl Pool {
    /// Waits, when the pool's flow control says so, until the pick may be
    /// placed; then returns the endpoints and the prefix match as they are
    /// now. A pick that may not wait, or waited its longest, gets the
    /// answer to send (decision SHED).
    pub(crate) async fn wait_for_room<'p>(
        &'p self,
        _call: &Call,
        _tokens: &PickTokens,
        endpoints: Arc<Vec<Arc<Endpoint>>>,
        matched: Matched<'p>,
        _hashes: &mut PrefixHashes,
    ) -> Result<Room<'p>, pb::PickResponse> {
        Ok((endpoints, matched))
    }

    /// Something freed room in the pool (a report, a scrape, an endpoint
    /// change): waiting picks may go.
    pub(crate) fn capacity_freed(&self) {}
}
