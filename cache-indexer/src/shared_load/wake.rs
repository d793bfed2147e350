//! Waking the sync task on change (`wakeOnChange`): own changes come from
//! the pools' trackers ([`crate::load::LoadTracker::changes`]), the other
//! replicas' from a Redis channel each round that wrote a change publishes
//! to. Both only wake the task; what a round reads and writes is the same
//! as an interval's round.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Least time between two rounds that a wake started: a burst of picks
/// costs one round per gap, not one per pick.
pub const MIN_GAP: Duration = Duration::from_millis(1);

/// The channel every replica of `key_prefix` publishes its changes on.
pub(crate) fn channel(key_prefix: &str) -> String {
    format!("{key_prefix}wake")
}

/// Forwards each notification of `changes` (one pool's tracker) to `wake`
/// until `cancel`.
pub(crate) fn forward(changes: Arc<Notify>, wake: Arc<Notify>, cancel: CancellationToken) {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = changes.notified() => wake.notify_one(),
            }
        }
    });
}

/// What the listener needs.
pub(crate) struct Listen {
    pub client: redis::Client,
    pub channel: String,
    /// Messages carrying this id (this replica's own) are ignored.
    pub replica_id: String,
    /// Bound of the connect and the subscribe.
    pub timeout: Duration,
    /// After a failure, how long before connecting again.
    pub retry_after: Duration,
}

/// Listens on the channel until `cancel`, waking `wake` on every other
/// replica's message; a failed or dropped subscription is retried after
/// `retry_after` (meanwhile the interval's rounds still read).
pub(crate) fn listen(l: Listen, wake: Arc<Notify>, cancel: CancellationToken) {
    tokio::spawn(async move {
        loop {
            let session = subscribe_and_wake(&l, &wake);
            tokio::select! {
                () = cancel.cancelled() => return,
                why = session => {
                    tracing::debug!(channel = %l.channel, %why, "shared load: wake subscription ended; retrying");
                }
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(l.retry_after) => {}
            }
        }
    });
}

/// One subscription: returns why it ended.
async fn subscribe_and_wake(l: &Listen, wake: &Notify) -> String {
    let connect = async {
        let mut ps = l.client.get_async_pubsub().await?;
        ps.subscribe(&l.channel).await?;
        Ok::<_, redis::RedisError>(ps)
    };
    let mut ps = match tokio::time::timeout(l.timeout, connect).await {
        Ok(Ok(ps)) => ps,
        Ok(Err(e)) => return e.to_string(),
        Err(_) => return "timed out".into(),
    };
    // A subscription starts after changes it missed: read once now.
    wake.notify_one();
    let mut messages = ps.on_message();
    while let Some(m) = messages.next().await {
        let from: String = m.get_payload().unwrap_or_default();
        if from != l.replica_id {
            wake.notify_one();
        }
    }
    "connection closed".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_channel_is_under_the_key_prefix() {
        assert_eq!(channel("kvasir:load:"), "kvasir:load:wake");
    }

    #[tokio::test]
    async fn a_trackers_change_wakes_the_sync_task() {
        let (changes, wake) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let cancel = CancellationToken::new();
        forward(Arc::clone(&changes), Arc::clone(&wake), cancel.clone());
        changes.notify_one();
        tokio::time::timeout(Duration::from_secs(5), wake.notified())
            .await
            .expect("a change wakes the sync task");
        cancel.cancel();
    }
}
