//! Probes of an engine's liveness outside the scrape ticks.
//!
//! An engine that dies is left out of picks only once its scrapes fail
//! (`unhealthyAfter` in a row, or one refused connection), and until then
//! picks may choose it first for the prefix it held. Its KV-event socket
//! usually sees the death within milliseconds; a disconnect there is only
//! a hint (a network blip on a live engine looks the same), so it asks for
//! a probe: one scrape of the engine's `/metrics` at once. A refused
//! connection marks the endpoint unhealthy at once; a good answer is
//! recorded as a scrape; anything else (a timeout) is left to the ticks.
//!
//! [`Liveness`] is the bounded queue of those requests: at most one probe
//! queued or in flight per endpoint, each bounded by the scrape timeout.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::types::EndpointId;

/// Probe requests of one pool, and what the probes did.
#[derive(Debug, Default)]
pub struct Liveness {
    inner: Mutex<Queue>,
    wake: Notify,
    probes: AtomicU64,
}

#[derive(Debug, Default)]
struct Queue {
    /// Requested, not started, in request order.
    requested: Vec<EndpointId>,
    /// Requested or running: a second request for one of them is dropped.
    busy: HashSet<EndpointId>,
}

impl Liveness {
    /// Asks for a probe of `id`; returns false when one is already queued
    /// or running (it will see the same engine).
    pub fn request(&self, id: EndpointId) -> bool {
        let mut q = self.inner.lock();
        if !q.busy.insert(id) {
            return false;
        }
        q.requested.push(id);
        drop(q);
        self.wake.notify_one();
        true
    }

    /// Waits for requests and takes them; each stays busy until
    /// [`Liveness::done`].
    pub async fn next(&self) -> Vec<EndpointId> {
        loop {
            let notified = self.wake.notified();
            {
                let mut q = self.inner.lock();
                if !q.requested.is_empty() {
                    let ids = std::mem::take(&mut q.requested);
                    self.probes.fetch_add(ids.len() as u64, Ordering::Relaxed);
                    return ids;
                }
            }
            notified.await;
        }
    }

    /// The probe of `id` finished: it may be requested again.
    pub fn done(&self, id: EndpointId) {
        self.inner.lock().busy.remove(&id);
    }

    /// Probes started so far (the endpoints marked unhealthy by them are
    /// counted per endpoint, [`LoadView::refused_marks`](super::LoadView::refused_marks)).
    pub fn probes(&self) -> u64 {
        self.probes.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn one_probe_per_endpoint_at_a_time() {
        let l = Liveness::default();
        let (a, b) = (EndpointId(1), EndpointId(2));
        assert!(l.request(a));
        assert!(!l.request(a), "already queued");
        assert!(l.request(b));
        assert_eq!(l.next().await, vec![a, b]);
        assert!(!l.request(a), "still running");
        l.done(a);
        assert!(l.request(a));
        assert_eq!(l.next().await, vec![a]);
        assert_eq!(l.probes(), 3);
        // Nothing requested: `next` waits (bounded here).
        let waited = tokio::time::timeout(Duration::from_millis(20), l.next()).await;
        assert!(waited.is_err());
    }

    #[tokio::test]
    async fn a_request_wakes_a_waiting_prober() {
        let l = std::sync::Arc::new(Liveness::default());
        let waiter = tokio::spawn({
            let l = std::sync::Arc::clone(&l);
            async move { l.next().await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        l.request(EndpointId(7));
        let got = tokio::time::timeout(Duration::from_secs(2), waiter)
            .await
            .expect("woken")
            .expect("task");
        assert_eq!(got, vec![EndpointId(7)]);
    }
}
