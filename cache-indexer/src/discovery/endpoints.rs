//! The pure part of discovery: pool + pods -> endpoint set.

use super::pool::InferencePool;
use crate::types::EndpointSpec;
use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};

/// Pod annotation: port of the engine's KV-events ZMQ PUB socket.
pub const ANNOTATION_EVENTS_PORT: &str = "kvasir.io/kv-events-port";
/// Pod annotation: port of the engine's KV-events replay ROUTER socket.
pub const ANNOTATION_REPLAY_PORT: &str = "kvasir.io/kv-events-replay-port";
/// Pod annotation: topic the engine publishes its KV events on.
pub const ANNOTATION_TOPIC: &str = "kvasir.io/kv-events-topic";

/// What to assume about a pod's KV-event sockets when its annotations say
/// nothing: the pool-wide settings from the indexer's config.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoveryDefaults {
    /// Ask each engine where it publishes (vLLM's `GET /kv_event_sources`)
    /// instead of assuming the ports below: a pod without the
    /// `kvasir.io/kv-events-port` annotation then yields an endpoint with no
    /// events address, which its subscriber reads from the engine.
    pub kv_event_sources: bool,
    /// KV-events PUB port (vLLM's default `tcp://*:5557`).
    pub events_port: u16,
    /// Replay ROUTER port; vLLM runs none unless `replay_endpoint` is set.
    pub replay_port: Option<u16>,
    /// Topic (vLLM's default is empty).
    pub topic: String,
}

impl Default for DiscoveryDefaults {
    fn default() -> Self {
        DiscoveryDefaults {
            kv_event_sources: true,
            events_port: 5557,
            replay_port: None,
            topic: String::new(),
        }
    }
}

/// Why one selected pod contributed no endpoint.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct SkipReason {
    /// Name of the pod.
    pub pod: String,
    /// What was wrong with it.
    pub kind: SkipKind,
}

/// The kinds of [`SkipReason`]. The first three are a pod's normal life
/// (starting, stopping); the rest are configuration mistakes worth a warning.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum SkipKind {
    /// `metadata.deletionTimestamp` is set: it is shutting down, and new
    /// subscriptions to it would only churn.
    Terminating,
    /// No `Ready=True` condition.
    NotReady,
    /// Ready but `status.podIP` is unset or empty.
    NoPodIp,
    /// `status.podIP` is not an IP address.
    BadPodIp(String),
    /// An annotation that should hold a port number does not.
    BadAnnotation {
        /// The annotation key.
        key: String,
        /// Its value as found.
        value: String,
    },
    /// Events/replay port + target-port index went past 65535.
    PortOutOfRange {
        /// The base port (from annotation or default).
        base: u16,
        /// The offset (index of the target port) that overflowed.
        offset: usize,
    },
    /// Another pod (named) already yields the same `ip:port`, e.g. two
    /// host-network pods on one node; the first by name wins.
    DuplicateAddress(String),
}

impl SkipKind {
    /// Whether this is a configuration mistake (log a warning) rather than
    /// a pod starting or stopping.
    pub fn is_misconfiguration(&self) -> bool {
        !matches!(
            self,
            SkipKind::Terminating | SkipKind::NotReady | SkipKind::NoPodIp
        )
    }
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pod = &self.pod;
        match &self.kind {
            SkipKind::Terminating => write!(f, "pod {pod}: terminating"),
            SkipKind::NotReady => write!(f, "pod {pod}: not Ready"),
            SkipKind::NoPodIp => write!(f, "pod {pod}: no podIP yet"),
            SkipKind::BadPodIp(ip) => write!(f, "pod {pod}: podIP {ip:?} is not an IP address"),
            SkipKind::BadAnnotation { key, value } => {
                write!(
                    f,
                    "pod {pod}: annotation {key}={value:?} is not a port number (1-65535)"
                )
            }
            SkipKind::PortOutOfRange { base, offset } => {
                write!(
                    f,
                    "pod {pod}: port {base} + target-port index {offset} exceeds 65535"
                )
            }
            SkipKind::DuplicateAddress(other) => {
                write!(f, "pod {pod}: same ip:port as pod {other}")
            }
        }
    }
}

/// The engine endpoints of `pool`: one per (ready pod, target port).
///
/// `pods` may hold pods outside the pool: only those in the pool's
/// namespace whose labels carry every `matchLabels` pair are considered,
/// so the same list serves whether or not the API server filtered it.
/// Each considered pod yields endpoints only when it is not terminating, is
/// `Ready=True` and has a `podIP`; otherwise (or when its annotations are
/// unusable) it yields exactly one [`SkipReason`] and no endpoint, so a
/// typo on one pod never takes the rest down.
///
/// Ports: the HTTP address is `podIP:targetPort`. A pod with the
/// `kvasir.io/kv-events-port` annotation gets its KV events there (it wins
/// over what the engine advertises). Without it, and with
/// `defaults.kv_event_sources`, the endpoint has no events address, replay
/// or topic: its subscriber reads them from the engine's
/// `/kv_event_sources`. Otherwise the port comes from `defaults`. The
/// replay port comes from `kvasir.io/kv-events-replay-port` or `defaults`
/// (none when neither says), the topic from `kvasir.io/kv-events-topic` or
/// `defaults`; both only where the events port does not come from the
/// engine.
/// With several target ports, the i-th target port (spec order, 0-based)
/// gets events port `base + i` (replay likewise): a pod serving several
/// ports runs one engine per port, and two engines cannot share a PUB
/// socket. This matches vLLM's data-parallel layout, where rank `r`
/// publishes on `base + r`; a DP deployment behind a single API port shows
/// up as one endpoint publishing on `base` only, and its other ranks'
/// events are not subscribed here.
///
/// Output is sorted by socket address (numerically) and skip reasons by
/// pod name, so equal inputs give equal outputs whatever the pod order.
/// Target ports that fail [`InferencePool::target_ports`] yield no
/// endpoints; [`InferencePool::validate`] says why.
pub fn endpoints_for(
    pool: &InferencePool,
    pods: &[Pod],
    defaults: &DiscoveryDefaults,
) -> (Vec<EndpointSpec>, Vec<SkipReason>) {
    let target_ports = pool.target_ports().unwrap_or_default();
    let pool_ns = pool.metadata.namespace.as_deref();

    // Visit pods by name so "first wins" on duplicate addresses is stable.
    let mut selected: Vec<&Pod> = pods
        .iter()
        .filter(|p| match (pool_ns, p.metadata.namespace.as_deref()) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        })
        .filter(|p| pool.selects(p.metadata.labels.as_ref()))
        .collect();
    selected.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));

    let mut by_addr: BTreeMap<SocketAddr, (String, EndpointSpec)> = BTreeMap::new();
    let mut skipped = Vec::new();
    for pod in selected {
        let name = pod.metadata.name.clone().unwrap_or_default();
        match pod_endpoints(pod, &target_ports, defaults) {
            Err(kind) => skipped.push(SkipReason { pod: name, kind }),
            Ok(eps) => {
                if let Some((_, (owner, _))) =
                    eps.iter().find_map(|(a, _)| by_addr.get_key_value(a))
                {
                    skipped.push(SkipReason {
                        pod: name,
                        kind: SkipKind::DuplicateAddress(owner.clone()),
                    });
                    continue;
                }
                for (addr, ep) in eps {
                    by_addr.insert(addr, (name.clone(), ep));
                }
            }
        }
    }
    skipped.sort();
    (by_addr.into_values().map(|(_, ep)| ep).collect(), skipped)
}

/// One pod's endpoints, or the single reason it has none.
fn pod_endpoints(
    pod: &Pod,
    target_ports: &[u16],
    defaults: &DiscoveryDefaults,
) -> Result<Vec<(SocketAddr, EndpointSpec)>, SkipKind> {
    if pod.metadata.deletion_timestamp.is_some() {
        return Err(SkipKind::Terminating);
    }
    let status = pod.status.as_ref();
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    if !ready {
        return Err(SkipKind::NotReady);
    }
    let ip_text = status
        .and_then(|s| s.pod_ip.as_deref())
        .filter(|s| !s.is_empty())
        .ok_or(SkipKind::NoPodIp)?;
    let ip: IpAddr = ip_text
        .parse()
        .map_err(|_| SkipKind::BadPodIp(ip_text.to_string()))?;

    let annotations = pod.metadata.annotations.as_ref();
    let annotation = |key: &str| annotations.and_then(|a| a.get(key));
    let events_base = match annotation(ANNOTATION_EVENTS_PORT) {
        Some(v) => parse_port(ANNOTATION_EVENTS_PORT, v)?,
        None if defaults.kv_event_sources => {
            return Ok(target_ports
                .iter()
                .map(|&port| engine_advertised(SocketAddr::new(ip, port)))
                .collect());
        }
        None => defaults.events_port,
    };
    let replay_base = match annotation(ANNOTATION_REPLAY_PORT) {
        Some(v) => Some(parse_port(ANNOTATION_REPLAY_PORT, v)?),
        None => defaults.replay_port,
    };
    let topic = annotation(ANNOTATION_TOPIC)
        .cloned()
        .unwrap_or_else(|| defaults.topic.clone());

    let mut out = Vec::with_capacity(target_ports.len());
    for (i, &port) in target_ports.iter().enumerate() {
        let events = offset_port(events_base, i)?;
        let replay = replay_base.map(|b| offset_port(b, i)).transpose()?;
        let http = SocketAddr::new(ip, port);
        // SocketAddr's Display brackets IPv6 (`[fd00::1]:8000`), which is
        // also the form ZMQ's tcp:// transport expects.
        out.push((
            http,
            EndpointSpec {
                address: http.to_string(),
                kv_events: format!("tcp://{}", SocketAddr::new(ip, events)),
                replay: replay.map(|r| format!("tcp://{}", SocketAddr::new(ip, r))),
                metrics_url: None,
                topic: topic.clone(),
            },
        ));
    }
    Ok(out)
}

/// An endpoint whose KV-event sockets the engine itself advertises: each
/// target port is its own engine, so each is asked separately.
fn engine_advertised(http: SocketAddr) -> (SocketAddr, EndpointSpec) {
    (
        http,
        EndpointSpec {
            address: http.to_string(),
            kv_events: String::new(),
            replay: None,
            metrics_url: None,
            topic: String::new(),
        },
    )
}

fn parse_port(key: &str, value: &str) -> Result<u16, SkipKind> {
    value
        .trim()
        .parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| SkipKind::BadAnnotation {
            key: key.to_string(),
            value: value.to_string(),
        })
}

fn offset_port(base: u16, offset: usize) -> Result<u16, SkipKind> {
    u16::try_from(offset)
        .ok()
        .and_then(|o| base.checked_add(o))
        .ok_or(SkipKind::PortOutOfRange { base, offset })
}
