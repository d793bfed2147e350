//! Shared pieces of the `responses_*` tests: an in-process indexer over
//! endpoints nothing serves (index `picks`, no engine needed: a response
//! pick goes to its endpoint healthy or not), the Report and Pick messages
//! of the Responses API affinity, a `Session` stream, and a real
//! `redis-server` on a free loopback port, killed on drop.
#![allow(dead_code)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvasir_cache_indexer::config::{self, Config};
use kvasir_cache_indexer::responses::config::{ResponsesConfig, StoreKind};
use kvasir_cache_indexer::types::EndpointSpec;
use kvasir_proto::v1 as pb;

use crate::service_support::{start_indexer, Proc, Running, POOL};

/// Endpoint `i`'s address (see [`EndpointSpec::loopback`]).
pub fn addr(i: usize) -> String {
    EndpointSpec::loopback(i).address
}

/// A config of one pool over `n` loopback endpoints (index `picks`, the
/// `approx` tokenizer) with `responses` as its affinity section.
pub fn config(n: usize, responses: &ResponsesConfig) -> Config {
    let endpoints: Vec<String> = (0..n)
        .map(|i| format!("      - address: {}", addr(i)))
        .collect();
    let yaml = format!(
        "grpcAddr: 127.0.0.1:0\nhttpAddr: 127.0.0.1:0\npools:\n  - name: {POOL}\n    tokenizer: approx\n    index: picks\n    scrape: {{ intervalMs: 100, timeoutMs: 50 }}\n    endpoints:\n{}\n",
        endpoints.join("\n")
    );
    let mut cfg = config::parse(&yaml, Path::new("test.yaml")).expect("test config parses");
    cfg.responses = responses.clone();
    cfg
}

/// An indexer over `n` loopback endpoints with `responses`.
pub async fn indexer(n: usize, responses: &ResponsesConfig) -> Running {
    start_indexer(&config(n, responses)).await
}

/// The responses section with `graceMs` set.
pub fn grace(ms: u64) -> ResponsesConfig {
    ResponsesConfig {
        grace_ms: ms,
        ..ResponsesConfig::default()
    }
}

/// The tenant of [`report`] and [`response_pick`]: a stored response is
/// its tenant's alone.
pub const TENANT: &str = "acme";

/// A report that `endpoint` produced `response_id` for [`TENANT`] (a DONE
/// report of request `request_id`).
pub fn report(request_id: &str, response_id: &str, endpoint: &str) -> pb::ReportRequest {
    pb::ReportRequest {
        pool: POOL.into(),
        request_id: request_id.into(),
        endpoint: endpoint.into(),
        phase: pb::ReportPhase::Done as i32,
        outcome: pb::Outcome::Success as i32,
        response_id: response_id.into(),
        tenant: TENANT.into(),
        ..Default::default()
    }
}

/// A pick of [`TENANT`] bound to `response_id`, no prompt (a
/// `GET /v1/responses/{id}`).
pub fn response_pick(request_id: &str, response_id: &str) -> pb::PickRequest {
    pb::PickRequest {
        pool: POOL.into(),
        request_id: request_id.into(),
        response_id: response_id.into(),
        tenant: TENANT.into(),
        ..Default::default()
    }
}

/// The one endpoint a RESPONSE answer names; panics on anything else.
pub fn routed(p: &pb::PickResponse) -> &str {
    assert_eq!(p.decision, pb::Decision::Response as i32, "{p:?}");
    assert_eq!(p.reason, "response");
    assert_eq!(p.endpoints.len(), 1, "{p:?}");
    &p.endpoints[0].address
}

/// Panics unless `p` is an UNKNOWN_RESPONSE answer.
pub fn assert_unknown(p: &pb::PickResponse) {
    assert_eq!(p.decision, pb::Decision::UnknownResponse as i32, "{p:?}");
    assert_eq!(p.reason, "unknown_response");
    assert!(p.endpoints.is_empty(), "{p:?}");
}

/// One `Session` stream: send calls, read pick answers (bounded).
pub struct Session {
    tx: futures::channel::mpsc::UnboundedSender<pb::SessionRequest>,
    answers: tonic::Streaming<pb::SessionResponse>,
    next_id: u64,
}

impl Session {
    /// Opens a stream on `ix`.
    pub async fn open(ix: &Running) -> Session {
        let (tx, rx) = futures::channel::mpsc::unbounded();
        let answers = ix
            .client
            .clone()
            .session(rx)
            .await
            .expect("Session opens")
            .into_inner();
        Session {
            tx,
            answers,
            next_id: 1,
        }
    }

    /// Sends a report (not answered).
    pub fn report(&mut self, r: pb::ReportRequest) {
        self.send(pb::session_request::Call::Report(r));
    }

    /// Sends a pick; returns its id.
    pub fn send_pick(&mut self, p: pb::PickRequest) -> u64 {
        self.send(pb::session_request::Call::Pick(p))
    }

    fn send(&mut self, call: pb::session_request::Call) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.tx
            .unbounded_send(pb::SessionRequest {
                id,
                call: Some(call),
            })
            .expect("stream open");
        id
    }

    /// The next answer, which must be the pick `id`'s.
    pub async fn answer(&mut self, id: u64) -> pb::PickResponse {
        let a = tokio::time::timeout(Duration::from_secs(10), self.answers.next())
            .await
            .expect("an answer within 10 s")
            .expect("the stream goes on")
            .expect("no stream error");
        assert_eq!(a.id, id, "{a:?}");
        match a.result {
            Some(pb::session_response::Result::Pick(p)) => p,
            other => panic!("pick {id}: {other:?}"),
        }
    }

    /// A pick and its answer.
    pub async fn pick(&mut self, p: pb::PickRequest) -> pb::PickResponse {
        let id = self.send_pick(p);
        self.answer(id).await
    }
}

/// The value of the sample `line_prefix` on `/metrics` (0 when absent).
pub async fn metric(ix: &Running, line_prefix: &str) -> f64 {
    let text = ix.metrics().await;
    crate::service_support::metric_value(&text, line_prefix).unwrap_or(0.0)
}

/// A `redis-server` on a free 127.0.0.1 port, no persistence; killed on
/// drop. `make setup` installs Debian's package: without it the tests
/// fail, they do not skip.
pub struct Redis {
    proc: Proc,
    /// Its port.
    pub port: u16,
}

impl Redis {
    /// Starts one and waits (bounded) until it answers PING.
    pub async fn start() -> Redis {
        assert!(
            Command::new("redis-server")
                .arg("--version")
                .output()
                .is_ok(),
            "redis-server is not installed: `make setup` installs Debian's redis-server"
        );
        let mut failures = Vec::new();
        for attempt in 1..=3 {
            // Released before the server binds it: another process could
            // take it meanwhile, hence the attempts.
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let mut r = Redis {
                proc: Proc::new("redis-server"),
                port,
            };
            r.spawn();
            match r.wait_up().await {
                Ok(()) => return r,
                Err(e) => failures.push(format!("attempt {attempt} (port {port}): {e}")),
            }
        }
        panic!("redis-server would not start:\n{}", failures.join("\n"));
    }

    fn spawn(&mut self) {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "no"]);
        self.proc.spawn(&mut cmd);
    }

    async fn wait_up(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(why) = self.proc.not_running() {
                return Err(format!("{why}; {}", self.proc.tail()));
            }
            if self.ping().await {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("no PONG within 10 s; {}", self.proc.tail()));
            }
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }

    /// Whether it answers PING now.
    pub async fn ping(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url()) else {
            return false;
        };
        let fut = async {
            let mut c = client.get_multiplexed_async_connection().await.ok()?;
            redis::cmd("PING").query_async::<String>(&mut c).await.ok()
        };
        matches!(
            tokio::time::timeout(Duration::from_secs(1), fut).await,
            Ok(Some(s)) if s == "PONG"
        )
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The responses section using it, with `graceMs` set.
    pub fn responses(&self, grace_ms: u64) -> ResponsesConfig {
        ResponsesConfig {
            store: StoreKind::Redis,
            redis_url: Some(self.url()),
            grace_ms,
            ..ResponsesConfig::default()
        }
    }

    /// The value under `key`, read directly.
    pub async fn get(&self, key: &str) -> Option<String> {
        let client = redis::Client::open(self.url()).ok()?;
        let fut = async {
            let mut c = client.get_multiplexed_async_connection().await.ok()?;
            redis::cmd("GET")
                .arg(key)
                .query_async::<Option<String>>(&mut c)
                .await
                .ok()?
        };
        tokio::time::timeout(Duration::from_secs(2), fut)
            .await
            .ok()?
    }

    /// Kills the server.
    pub fn kill(&mut self) {
        self.proc.kill();
    }

    /// Starts it again on the same port (bounded wait).
    pub async fn restart(&mut self) {
        self.spawn();
        self.wait_up()
            .await
            .expect("redis-server restarts on its port");
    }
}
