//! One endpoint of a pool: what the pool, the pick stages and the
//! Responses records all refer to, so it sits below each of them.

use std::sync::atomic::Ordering;

use crate::events::{SubscriberHandle, SyncState};
use crate::types::{EndpointId, EndpointSpec};

/// One endpoint of a pool, with its event subscriber.
pub struct Endpoint {
    /// What it is.
    pub spec: EndpointSpec,
    /// Its id (`spec.id()`).
    pub id: EndpointId,
    /// Its KV-event subscriber (none in tests that feed the index directly).
    pub subscriber: Option<SubscriberHandle>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("address", &self.spec.address)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// Sync state of its event stream (`None` without a subscriber).
    pub fn sync_state(&self) -> Option<SyncState> {
        self.subscriber.as_ref().map(SubscriberHandle::state)
    }

    /// Engine restarts its event stream has shown (0 without a subscriber).
    pub fn restarts(&self) -> u64 {
        self.subscriber
            .as_ref()
            .map_or(0, |s| s.stats().restarts.load(Ordering::Relaxed))
    }
}
