//! Request size limits on every port the indexer listens on: the gRPC port
//! and an endpoint picker refuse a message over their limit with
//! RESOURCE_EXHAUSTED (naming the setting), unary and streaming alike,
//! before buffering it; the HTTP port answers a body over its limit 413.
//! An in-process indexer on 127.0.0.1:0 with one pool whose engine is never
//! reached (the limits come before any pick).

use std::path::PathBuf;
use std::time::Duration;

use futures::StreamExt;
use kvasir_cache_indexer::config::{parse, Config};
use kvasir_cache_indexer::{start, AppError, Indexer};
use kvasir_proto::envoy::service::ext_proc::v3 as ep;
use kvasir_proto::v1 as pb;
use serde_json::json;

const LIMIT: usize = 64 << 10;
const PICKER_LIMIT: usize = 80 << 10;
const BODY_LIMIT: usize = 1000;
/// Bound on each call, so a hang fails the test instead of CI.
const CALL: Duration = Duration::from_secs(10);

/// A file in the temp folder, removed on drop.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, contents: &[u8]) -> TempFile {
        let path =
            std::env::temp_dir().join(format!("kvasir-limits-{}-{name}", std::process::id()));
        std::fs::write(&path, contents).expect("write temp file");
        TempFile(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A compiled policy for pool `main` with the filter's body limit set.
fn policy_file(name: &str) -> TempFile {
    let set = json!({
        "tenantSource": {"apiKey": {}},
        "tenants": [{"name": "acme", "apiKeyHashes": [
            "sha256:953d0ab8229abd463060e52204c8cb44e32297002500258c1181e18379c54626"]}],
        "pools": [{"name": "main", "models": ["m"], "cluster": "pool-main",
                   "indexerCluster": "indexer", "indexerPool": "main"}],
        "defaultAction": {"route": {"pool": "main"}}
    });
    let set = kvasir_policy::parse_json(&set.to_string()).expect("policy set");
    let doc: serde_json::Value =
        serde_json::from_slice(&kvasir_policy::compile(&set).expect("compiles").to_json())
            .expect("json");
    let bytes =
        serde_json::to_vec(&json!({"policy": doc, "filter": {"bodyLimitBytes": BODY_LIMIT}}))
            .expect("json");
    TempFile::new(name, &bytes)
}

fn config(policy: &TempFile, picker_limit: usize) -> Config {
    let text = format!(
        r#"
grpcAddr: 127.0.0.1:0
httpAddr: 127.0.0.1:0
grpcMaxMessageBytes: {LIMIT}
pools:
  - name: main
    tokenizer: approx
    index: picks
    endpoints: [{{ address: "127.0.0.1:1" }}]
pickers:
  - {{ addr: "127.0.0.1:0", pool: main, policyFile: "{}", maxMessageBytes: {picker_limit} }}
"#,
        policy.0.display()
    );
    let cfg = parse(&text, std::path::Path::new("limits.yaml")).expect("parses");
    cfg.validate().expect("valid");
    cfg
}

async fn channel(addr: std::net::SocketAddr) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .expect("connect")
}

fn assert_exhausted(s: &tonic::Status, setting: &str) {
    assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
    assert!(
        s.message().contains("over this port's limit") && s.message().contains(setting),
        "a clear message naming {setting}: {}",
        s.message()
    );
}

fn text_pick(id: &str, len: usize) -> pb::PickRequest {
    pb::PickRequest {
        pool: "main".into(),
        request_id: id.into(),
        prompt: Some(pb::pick_request::Prompt::Text("x".repeat(len))),
        ..Default::default()
    }
}

async fn grpc_port(ix: &Indexer) {
    let mut c = pb::indexer_client::IndexerClient::new(channel(ix.grpc_addr).await);
    // Unary: a message within the limit is served (whatever the answer),
    // one over it refused.
    let within = tokio::time::timeout(CALL, c.pick(text_pick("a", LIMIT - 100)))
        .await
        .expect("answered");
    if let Err(s) = &within {
        assert_ne!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
    }
    let over = tokio::time::timeout(CALL, c.pick(text_pick("b", LIMIT + 1)))
        .await
        .expect("answered")
        .expect_err("refused");
    assert_exhausted(&over, "grpcMaxMessageBytes");
    let over = tokio::time::timeout(
        CALL,
        c.pool_state(pb::PoolStateRequest {
            pool: "p".repeat(LIMIT * 4),
        }),
    )
    .await
    .expect("answered")
    .expect_err("refused");
    assert_exhausted(&over, "grpcMaxMessageBytes");

    // Session: the stream ends with RESOURCE_EXHAUSTED at the oversize
    // pick, after answering the one before it.
    let (tx, rx) = futures::channel::mpsc::unbounded::<pb::SessionRequest>();
    let pick = |id: u64, len: usize| pb::SessionRequest {
        id,
        call: Some(pb::session_request::Call::Pick(text_pick(
            &format!("s{id}"),
            len,
        ))),
    };
    tx.unbounded_send(pick(1, 10)).expect("send");
    tx.unbounded_send(pick(2, LIMIT * 2)).expect("send");
    let mut answers = tokio::time::timeout(CALL, c.session(rx))
        .await
        .expect("opened")
        .expect("session")
        .into_inner();
    let first = tokio::time::timeout(CALL, answers.next())
        .await
        .expect("answered")
        .expect("an item")
        .expect("the small pick's answer");
    assert_eq!(first.id, 1);
    let end = tokio::time::timeout(CALL, answers.next())
        .await
        .expect("answered")
        .expect("an item")
        .expect_err("the stream's error");
    assert_exhausted(&end, "grpcMaxMessageBytes");
    drop(tx);
}

async fn picker_port(ix: &Indexer) {
    let (_, addr) = ix.picker_addrs[0].clone();
    let mut c = ep::external_processor_client::ExternalProcessorClient::new(channel(addr).await);
    let body = |len: usize| ep::ProcessingRequest {
        request: Some(ep::processing_request::Request::RequestBody(ep::HttpBody {
            body: vec![b'x'; len],
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    };
    let mut answers = tokio::time::timeout(
        CALL,
        c.process(futures::stream::iter(vec![body(PICKER_LIMIT * 2)])),
    )
    .await
    .expect("opened")
    .expect("process")
    .into_inner();
    let end = tokio::time::timeout(CALL, answers.next())
        .await
        .expect("answered")
        .expect("an item")
        .expect_err("refused");
    assert_exhausted(&end, "pickers[].maxMessageBytes");
}

async fn http_port(ix: &Indexer) {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(CALL)
        .build()
        .expect("client");
    let url = format!("http://{}/metrics", ix.http_addr);
    let r = client
        .get(&url)
        .body(vec![b'x'; 1 << 20])
        .send()
        .await
        .expect("answered");
    assert_eq!(r.status(), 413);
    assert!(r.text().await.expect("body").contains("request body over"));
    let r = client.get(&url).send().await.expect("answered");
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_port_refuses_what_is_over_its_limit() {
    let policy = policy_file("policy.json");
    let ix = start(&config(&policy, PICKER_LIMIT))
        .await
        .expect("indexer starts");
    grpc_port(&ix).await;
    picker_port(&ix).await;
    http_port(&ix).await;
    ix.cancel_token().cancel();
    tokio::time::timeout(Duration::from_secs(15), ix.join())
        .await
        .expect("stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_below_what_the_port_must_carry_are_refused_at_start() {
    let policy = policy_file("small.json");
    let mut cfg = config(&policy, PICKER_LIMIT);
    cfg.grpc_max_message_bytes = 1000;
    let e = cfg.validate().expect_err("too small");
    assert!(e.to_string().contains("grpcMaxMessageBytes"), "{e}");

    // A picker whose limit cannot hold its policy's body limit.
    let cfg = config(&policy, BODY_LIMIT);
    match start(&cfg).await {
        Err(AppError::PickerLimit(m)) => {
            assert!(
                m.contains("maxMessageBytes") && m.contains("bodyLimitBytes"),
                "{m}"
            )
        }
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("started"),
    }
}
