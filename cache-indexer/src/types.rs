//! Names shared by every part of the indexer: pools, endpoints, their ids.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Stable numeric id of one engine endpoint inside the indexer (the
/// radix tree's worker id). Derived from the endpoint's HTTP address so two
/// replicas configured with the same endpoints agree on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EndpointId(pub u64);

impl EndpointId {
    /// The id of the endpoint serving HTTP at `address` (`ip:port`):
    /// FNV-1a over the address bytes, stable across processes and versions.
    pub fn from_address(address: &str) -> Self {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in address.as_bytes() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        EndpointId(h)
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// Where a pool's prefix index comes from (`index:` in the config).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexSource {
    /// The engines' own KV events (exact: what each engine holds, evictions
    /// included). Every endpoint needs an events address.
    #[default]
    Events,
    /// This replica's own picks ([`crate::history::PickHistory`]): the
    /// Gateway API Inference Extension's approximate prefix-cache scorer, for
    /// engines without KV events. No subscriber is started.
    Picks,
}

impl IndexSource {
    /// Both sources, in a fixed order (metric label order).
    pub const ALL: [IndexSource; 2] = [IndexSource::Events, IndexSource::Picks];

    /// The source's name in the config and in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            IndexSource::Events => "events",
            IndexSource::Picks => "picks",
        }
    }
}

impl fmt::Display for IndexSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for IndexSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "events" => Ok(IndexSource::Events),
            "picks" => Ok(IndexSource::Picks),
            other => Err(format!(
                "`{other}` is not an index source (expected events or picks)"
            )),
        }
    }
}

/// One vLLM instance as the indexer sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointSpec {
    /// HTTP address `ip:port`: what the proxy routes to, and the name the
    /// picker answers with.
    pub address: String,
    /// ZMQ PUB endpoint of its KV events, e.g. `tcp://10.0.0.5:5557`
    /// (empty when the pool's index is [`IndexSource::Picks`] and none was
    /// given: nothing subscribes then).
    pub kv_events: String,
    /// ZMQ ROUTER replay endpoint, if the engine runs one.
    #[serde(default)]
    pub replay: Option<String>,
    /// Prometheus endpoint, default `http://<address>/metrics`.
    #[serde(default)]
    pub metrics_url: Option<String>,
    /// Topic the engine publishes on (vLLM's default is empty).
    #[serde(default)]
    pub topic: String,
}

impl EndpointSpec {
    /// Endpoint `i` of a pool on this machine: HTTP on `127.0.0.1:8000+i`,
    /// KV events on `tcp://127.0.0.1:9000+i`, no replay, default metrics
    /// URL: the pool fixture of the crate's tests and benchmarks.
    pub fn loopback(i: usize) -> EndpointSpec {
        EndpointSpec {
            address: format!("127.0.0.1:{}", 8000 + i),
            kv_events: format!("tcp://127.0.0.1:{}", 9000 + i),
            replay: None,
            metrics_url: None,
            topic: String::new(),
        }
    }

    /// The endpoint's indexer id.
    pub fn id(&self) -> EndpointId {
        EndpointId::from_address(&self.address)
    }

    /// The metrics URL, defaulted from the address.
    pub fn metrics_url(&self) -> String {
        self.metrics_url
            .clone()
            .unwrap_or_else(|| format!("http://{}/metrics", self.address))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_ids_are_stable() {
        // Pinned: replicas and versions must agree on ids.
        assert_eq!(
            EndpointId::from_address(""),
            EndpointId(0xcbf2_9ce4_8422_2325)
        );
        assert_eq!(
            EndpointId::from_address("10.0.0.1:8000"),
            EndpointId::from_address("10.0.0.1:8000")
        );
        assert_ne!(
            EndpointId::from_address("10.0.0.1:8000"),
            EndpointId::from_address("10.0.0.1:8001")
        );
    }
}
