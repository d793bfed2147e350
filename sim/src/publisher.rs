//! The KV-event publisher: vLLM's ZMQ PUB socket and ROUTER replay socket.
//!
//! Each batch goes out as 3 frames `[topic, seq (8 bytes BE), payload]`.
//! The last `buffer_steps` batches are kept; a DEALER that sends
//! `["", start_seq]` to the replay socket gets every kept batch with
//! seq >= start as `["", topic, seq, payload]`, then `["", "", 0xFF x 8, ""]`.

use crate::faults::Faults;
use crate::kv_events::{encode_batch, EventEncoding, HashFormat, KvEvent};
use bytes::Bytes;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// Publisher settings (vLLM's `--kv-events-config` fields).
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// PUB endpoint, e.g. `tcp://127.0.0.1:5557` (port 0 picks a free one).
    pub endpoint: String,
    /// ROUTER replay endpoint, if any.
    pub replay_endpoint: Option<String>,
    /// Topic frame.
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Event layout.
    pub encoding: EventEncoding,
    /// Hash layout.
    pub hash_format: HashFormat,
    /// The data-parallel rank written into each batch.
    pub dp_rank: Option<u32>,
}

/// Commands to the publisher task.
#[derive(Debug)]
pub enum PublisherCmd {
    /// One engine step's events.
    Batch(Vec<KvEvent>),
    /// Start the sequence again at 0 and forget the replay buffer, as a
    /// restarted vLLM process does.
    RestartSequence,
}

/// Where the sockets ended up.
#[derive(Debug, Clone)]
pub struct BoundEndpoints {
    /// The PUB socket's resolved endpoint.
    pub publish: String,
    /// The ROUTER socket's resolved endpoint.
    pub replay: Option<String>,
}

type Ring = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// The sequence number that ends a replay.
pub const END_SEQ: [u8; 8] = [0xFF; 8];

/// Binds the sockets and starts the publisher and replay tasks.
pub async fn start(
    cfg: PublisherConfig,
    faults: Arc<Faults>,
) -> anyhow::Result<(UnboundedSender<PublisherCmd>, BoundEndpoints)> {
    let mut pub_sock = zeromq::PubSocket::new();
    let publish = pub_sock.bind(&cfg.endpoint).await?.to_string();
    let ring: Ring = Arc::new(Mutex::new(VecDeque::with_capacity(
        cfg.buffer_steps.min(1 << 16),
    )));
    let topic = Bytes::from(cfg.topic.clone().into_bytes());
    let mut replay = None;
    if let Some(ep) = &cfg.replay_endpoint {
        let mut router = zeromq::RouterSocket::new();
        replay = Some(router.bind(ep).await?.to_string());
        tokio::spawn(replay_task(router, ring.clone(), topic.clone()));
    }
    let (tx, rx) = unbounded_channel();
    tokio::spawn(publish_task(pub_sock, rx, ring, topic, cfg, faults));
    Ok((tx, BoundEndpoints { publish, replay }))
}

async fn publish_task(
    mut sock: zeromq::PubSocket,
    mut rx: UnboundedReceiver<PublisherCmd>,
    ring: Ring,
    topic: Bytes,
    cfg: PublisherConfig,
    faults: Arc<Faults>,
) {
    let mut seq: u64 = 0;
    // A batch held back by the reorder fault, sent after the next one.
    let mut held: Option<ZmqMessage> = None;
    while let Some(cmd) = rx.recv().await {
        let events = match cmd {
            PublisherCmd::RestartSequence => {
                seq = 0;
                held = None;
                ring.lock().clear();
                tracing::info!("kv events: sequence restarted at 0");
                continue;
            }
            PublisherCmd::Batch(e) => e,
        };
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = Bytes::from(encode_batch(
            ts,
            &events,
            cfg.dp_rank,
            cfg.encoding,
            cfg.hash_format,
        ));
        {
            let mut r = ring.lock();
            if r.len() >= cfg.buffer_steps.max(1) {
                r.pop_front();
            }
            r.push_back((seq, payload.clone()));
        }
        let this = seq;
        seq += 1;
        if faults.drop_event_batch(rand::random::<f64>()) {
            tracing::debug!(seq = this, "kv events: batch dropped by fault injection");
            continue;
        }
        let msg = frames(vec![
            topic.clone(),
            Bytes::copy_from_slice(&this.to_be_bytes()),
            payload,
        ]);
        if held.is_none() && faults.reorder_event_batch() {
            tracing::debug!(seq = this, "kv events: batch held back by fault injection");
            held = Some(msg);
            continue;
        }
        let mut out = vec![msg.clone()];
        if faults.duplicate_event_batch() {
            tracing::debug!(seq = this, "kv events: batch sent twice by fault injection");
            out.push(msg);
        }
        out.extend(held.take());
        for m in out {
            if let Err(e) = sock.send(m).await {
                tracing::warn!(error = %e, "kv events: publish failed");
            }
        }
    }
}

fn frames(v: Vec<Bytes>) -> ZmqMessage {
    ZmqMessage::try_from(v).expect("non-empty frame list")
}

async fn replay_task(mut sock: zeromq::RouterSocket, ring: Ring, topic: Bytes) {
    loop {
        let msg = match sock.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "kv events replay: receive failed");
                continue;
            }
        };
        let f = msg.into_vec();
        // [identity, "", start_seq8]; anything else is ignored as vLLM does.
        let (Some(id), Some(start)) = (f.first(), f.last()) else {
            continue;
        };
        if f.len() != 3 || start.len() != 8 {
            tracing::warn!(
                frames = f.len(),
                "kv events replay: malformed request ignored"
            );
            continue;
        }
        let start = u64::from_be_bytes(start[..8].try_into().expect("8 bytes"));
        let batches: Vec<(u64, Bytes)> = ring
            .lock()
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        tracing::debug!(start, n = batches.len(), "kv events replay");
        for (s, p) in batches {
            let m = frames(vec![
                id.clone(),
                Bytes::new(),
                topic.clone(),
                Bytes::copy_from_slice(&s.to_be_bytes()),
                p,
            ]);
            if sock.send(m).await.is_err() {
                break;
            }
        }
        let end = frames(vec![
            id.clone(),
            Bytes::new(),
            Bytes::new(),
            Bytes::from_static(&END_SEQ),
            Bytes::new(),
        ]);
        let _ = sock.send(end).await;
    }
}
