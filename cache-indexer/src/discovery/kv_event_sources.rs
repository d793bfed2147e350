//! Where an engine publishes its KV events, as the engine itself says:
//! vLLM 0.34's `GET /kv_event_sources`.
//!
//! vLLM answers with its engine client's `get_kv_event_sources()`: a map
//! from data-parallel rank to that rank's `KVEventsConfig` as the running
//! publisher resolved it, which FastAPI writes with the rank as a string key:
//!
//! ```json
//! {"0": {"enable_kv_cache_events": true, "publisher": "zmq",
//!        "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
//!        "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
//!        "topic": ""}}
//! ```
//!
//! Each rank's ports are already offset by the rank (vLLM's
//! `offset_endpoint_port`: rank `r` of `tcp://*:5557` publishes on 5557 + r),
//! so every entry is directly subscribable. `{}` means no rank publishes:
//! KV events are off (or the server only renders). A wildcard host
//! (`*`, `0.0.0.0`, `::`) is a bind address and is replaced by the engine's
//! own host, the one its HTTP address names.
//!
//! The indexer's event worker follows one stream per endpoint, so of several
//! ranks only the lowest is subscribed ([`ResolvedSource::ranks`] lists them
//! all): in vLLM's internal load balancing that is rank 0 and the other
//! ranks' blocks are not indexed; with external load balancing each API
//! server advertises only its own rank, which is then the one followed.
//!
//! [`parse_kv_event_sources`] and [`resolve_source`] are pure; [`EngineSource`]
//! does the HTTP GET with the indexer's shared client.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use serde::Deserialize;

/// The path vLLM serves the sources on.
pub const KV_EVENT_SOURCES_PATH: &str = "/kv_event_sources";

/// Largest answer read: a handful of ranks is a few hundred bytes each, and
/// an engine's answer is input that must not take the indexer's memory.
const MAX_BODY_BYTES: usize = 256 * 1024;

/// One data-parallel rank's publisher as the engine advertises it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankSource {
    /// The data-parallel rank.
    pub rank: u32,
    /// `publisher` (`zmq` for vLLM's own; another name is a plug-in the
    /// indexer cannot follow).
    pub publisher: String,
    /// The PUB socket, e.g. `tcp://*:5557`.
    pub endpoint: String,
    /// The replay ROUTER socket, if the engine runs one.
    pub replay_endpoint: Option<String>,
    /// The topic every message carries.
    pub topic: String,
}

/// vLLM's `KVEventsConfig`, the fields the indexer reads; others (buffer
/// and queue sizes) are ignored, and unknown ones are allowed so a newer
/// vLLM with more fields still parses.
#[derive(Debug, Deserialize)]
struct WireConfig {
    #[serde(default)]
    publisher: Option<String>,
    #[serde(default)]
    endpoint: Option<String>,
    #[serde(default)]
    replay_endpoint: Option<String>,
    #[serde(default)]
    topic: Option<String>,
}

/// Why an answer of `/kv_event_sources` is not usable as such.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Not JSON, or not an object of objects.
    #[error("not a JSON object of rank -> KVEventsConfig: {0}")]
    Shape(String),
    /// A key is not a rank number.
    #[error("key {0:?} is not a data-parallel rank")]
    BadRank(String),
    /// A rank has no `endpoint`.
    #[error("rank {0} has no endpoint")]
    NoEndpoint(u32),
}

/// Parses an answer of `/kv_event_sources` into its ranks, lowest first.
/// An empty object gives no ranks (KV events are off).
pub fn parse_kv_event_sources(body: &[u8]) -> Result<Vec<RankSource>, ParseError> {
    let map: BTreeMap<String, WireConfig> =
        serde_json::from_slice(body).map_err(|e| ParseError::Shape(e.to_string()))?;
    let mut out = Vec::with_capacity(map.len());
    for (key, c) in map {
        let rank: u32 = key
            .trim()
            .parse()
            .map_err(|_| ParseError::BadRank(key.clone()))?;
        let endpoint = c
            .endpoint
            .filter(|e| !e.is_empty())
            .ok_or(ParseError::NoEndpoint(rank))?;
        out.push(RankSource {
            rank,
            publisher: c.publisher.unwrap_or_else(|| "zmq".to_string()),
            endpoint,
            replay_endpoint: c.replay_endpoint.filter(|e| !e.is_empty()),
            topic: c.topic.unwrap_or_default(),
        });
    }
    out.sort_by_key(|r| r.rank);
    Ok(out)
}

/// The addresses to subscribe to, resolved from what the engine advertised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedSource {
    /// The rank followed (the lowest advertised).
    pub rank: u32,
    /// Every rank the engine advertised, lowest first.
    pub ranks: Vec<u32>,
    /// `tcp://host:port` of the PUB socket.
    pub kv_events: String,
    /// `tcp://host:port` of the replay socket, if usable.
    pub replay: Option<String>,
    /// The replay endpoint the engine advertised but the indexer cannot
    /// reach (an `ipc://` socket, say): followed without replay.
    pub unusable_replay: Option<String>,
    /// The topic.
    pub topic: String,
}

/// Why nothing can be subscribed to from what the engine advertised.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// `{}`: no rank publishes.
    #[error(
        "the engine publishes no KV events ({{}}: start vLLM with --kv-events-config \
         '{{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\"}}', or give the endpoint's \
         events address)"
    )]
    Disabled,
    /// Every rank uses a publisher other than ZMQ.
    #[error("no rank publishes over zmq (publishers: {0})")]
    NoZmq(String),
    /// The lowest ZMQ rank's endpoint cannot be subscribed to.
    #[error("rank {rank} endpoint {endpoint:?}: {why}")]
    Endpoint {
        /// The rank.
        rank: u32,
        /// As advertised.
        endpoint: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

/// The subscription for an engine whose HTTP address is on `host` (an IP,
/// or a name) from its advertised `ranks`: the lowest rank publishing over
/// ZMQ, its wildcard host replaced by `host`.
pub fn resolve_source(ranks: &[RankSource], host: &str) -> Result<ResolvedSource, ResolveError> {
    if ranks.is_empty() {
        return Err(ResolveError::Disabled);
    }
    let Some(first) = ranks.iter().find(|r| r.publisher == "zmq") else {
        let names: Vec<&str> = ranks.iter().map(|r| r.publisher.as_str()).collect();
        return Err(ResolveError::NoZmq(names.join(", ")));
    };
    let kv_events =
        subscribe_address(&first.endpoint, host).map_err(|why| ResolveError::Endpoint {
            rank: first.rank,
            endpoint: first.endpoint.clone(),
            why,
        })?;
    let (replay, unusable_replay) = match &first.replay_endpoint {
        None => (None, None),
        Some(r) => match subscribe_address(r, host) {
            Ok(a) => (Some(a), None),
            Err(_) => (None, Some(r.clone())),
        },
    };
    Ok(ResolvedSource {
        rank: first.rank,
        ranks: ranks.iter().map(|r| r.rank).collect(),
        kv_events,
        replay,
        unusable_replay,
        topic: first.topic.clone(),
    })
}

/// The `tcp://host:port` to connect to for an advertised ZMQ endpoint: a
/// wildcard host becomes `host`; any other host is kept as advertised.
pub fn subscribe_address(endpoint: &str, host: &str) -> Result<String, &'static str> {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        if endpoint.starts_with("ipc://") || endpoint.starts_with("inproc://") {
            return Err("a socket local to the engine's machine (ipc/inproc)");
        }
        return Err("not a tcp:// endpoint");
    };
    let (h, port) = rest.rsplit_once(':').ok_or("no port")?;
    let port: u16 = port.parse().map_err(|_| "port is not a number")?;
    if port == 0 {
        return Err("port 0 (the engine did not say which port it bound)");
    }
    if matches!(h, "*" | "0.0.0.0" | "::" | "[::]" | "[::0]" | "") {
        return Ok(format!("tcp://{}:{port}", bracketed(host)));
    }
    Ok(endpoint.to_string())
}

/// `host` as it goes before `:port`: IPv6 addresses in brackets.
fn bracketed(host: &str) -> String {
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(v6)) => format!("[{v6}]"),
        _ => host.to_string(),
    }
}

/// The host of an HTTP address `ip:port` (`[v6]:port`, or `name:port`).
pub fn host_of(address: &str) -> String {
    if let Ok(sa) = address.parse::<SocketAddr>() {
        return sa.ip().to_string();
    }
    let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_string()
}

/// Why asking an engine for its sources failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceError {
    /// No answer: connection refused, timeout, or a 5xx.
    #[error("GET {url}: {message}")]
    Unreachable {
        /// The URL asked.
        url: String,
        /// What happened.
        message: String,
    },
    /// The server has no such route (vLLM before 0.34 answers 404).
    #[error(
        "GET {url}: status {status}: the engine does not serve {KV_EVENT_SOURCES_PATH} \
         (vLLM before 0.34?); give its events address (endpoint events:, the pod annotation \
         kvasir.io/kv-events-port, or discovery eventsPort)"
    )]
    NoRoute {
        /// The URL asked.
        url: String,
        /// 404 or 405.
        status: u16,
    },
    /// Another status the indexer cannot use.
    #[error("GET {url}: status {status}")]
    Status {
        /// The URL asked.
        url: String,
        /// The status.
        status: u16,
    },
    /// The answer is not vLLM's shape.
    #[error("GET {url}: {source}")]
    Malformed {
        /// The URL asked.
        url: String,
        /// Why.
        #[source]
        source: ParseError,
    },
    /// The answer parsed but nothing in it can be followed.
    #[error("GET {url}: {source}")]
    Unusable {
        /// The URL asked.
        url: String,
        /// Why.
        #[source]
        source: ResolveError,
    },
}

impl SourceError {
    /// Whether the engine's answer says there is nothing to follow (events
    /// off, no such route, sockets out of reach), so sockets followed before
    /// are given up. Any other failure keeps them: an engine that cannot be
    /// asked right now may still be publishing where it said.
    pub fn withdraws(&self) -> bool {
        matches!(
            self,
            SourceError::NoRoute { .. } | SourceError::Unusable { .. }
        )
    }

    /// A short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            SourceError::Unreachable { .. } => "unreachable",
            SourceError::NoRoute { .. } => "no_route",
            SourceError::Status { .. } => "status",
            SourceError::Malformed { .. } => "malformed",
            SourceError::Unusable {
                source: ResolveError::Disabled,
                ..
            } => "disabled",
            SourceError::Unusable { .. } => "unusable",
        }
    }
}

/// One engine's `/kv_event_sources`, asked through the indexer's HTTP
/// client.
#[derive(Debug, Clone)]
pub struct EngineSource {
    client: reqwest::Client,
    url: String,
    host: String,
    /// Longest one request may take.
    pub timeout: Duration,
}

impl EngineSource {
    /// The source of the engine serving HTTP at `address` (`ip:port`).
    pub fn new(client: reqwest::Client, address: &str) -> Self {
        EngineSource {
            client,
            url: format!("http://{address}{KV_EVENT_SOURCES_PATH}"),
            host: host_of(address),
            timeout: Duration::from_secs(2),
        }
    }

    /// The URL asked.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Asks the engine and resolves its answer.
    pub async fn lookup(&self) -> Result<ResolvedSource, SourceError> {
        let body = self.fetch().await?;
        let ranks = parse_kv_event_sources(&body).map_err(|source| SourceError::Malformed {
            url: self.url.clone(),
            source,
        })?;
        resolve_source(&ranks, &self.host).map_err(|source| SourceError::Unusable {
            url: self.url.clone(),
            source,
        })
    }

    async fn fetch(&self) -> Result<Vec<u8>, SourceError> {
        let unreachable = |message: String| SourceError::Unreachable {
            url: self.url.clone(),
            message,
        };
        let read = async {
            let mut resp = self
                .client
                .get(&self.url)
                .send()
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            let status = resp.status();
            if status.is_server_error() {
                return Err(unreachable(format!("status {status}")));
            }
            let url = self.url.clone();
            match status.as_u16() {
                404 | 405 => {
                    return Err(SourceError::NoRoute {
                        url,
                        status: status.as_u16(),
                    })
                }
                s if !status.is_success() => return Err(SourceError::Status { url, status: s }),
                _ => {}
            }
            let mut body = Vec::new();
            while let Some(chunk) = resp.chunk().await.map_err(|e| unreachable(e.to_string()))? {
                if body.len() + chunk.len() > MAX_BODY_BYTES {
                    return Err(SourceError::Malformed {
                        url,
                        source: ParseError::Shape(format!("longer than {MAX_BODY_BYTES} bytes")),
                    });
                }
                body.extend_from_slice(&chunk);
            }
            Ok(body)
        };
        // One deadline for the whole exchange: a server that trickles its
        // body must not hold the subscriber.
        tokio::time::timeout(self.timeout, read)
            .await
            .unwrap_or_else(|_| Err(unreachable(format!("timed out after {:?}", self.timeout))))
    }
}

#[cfg(test)]
#[path = "kv_event_sources_tests.rs"]
mod tests;
