//! `Session` over real gRPC (tonic client -> the indexer's server): picks
//! answered by id on one stream, a report applied before the pick sent
//! after it, errors per call, and the stream counted in `/metrics`.

use crate::service_support;
use std::time::Duration;

use futures::StreamExt;
use kvasir_proto::v1 as pb;
use service_support::*;

async fn next(answers: &mut tonic::Streaming<pb::SessionResponse>) -> pb::SessionResponse {
    tokio::time::timeout(Duration::from_secs(10), answers.next())
        .await
        .expect("an answer within 10 s")
        .expect("the stream goes on")
        .expect("no stream error")
}

fn pick(id: u64, req: pb::PickRequest) -> pb::SessionRequest {
    pb::SessionRequest {
        id,
        call: Some(pb::session_request::Call::Pick(req)),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picks_and_reports_share_one_stream() {
    let sims = Sim::start_many(2).await;
    let ix = start_indexer(&config(&sims.iter().collect::<Vec<_>>())).await;
    ix.wait_ready().await;
    let (tx, rx) = futures::channel::mpsc::unbounded();
    let mut answers = ix
        .client
        .clone()
        .session(rx)
        .await
        .expect("Session opens")
        .into_inner();
    let chat = vec![("user", format!("A question: {}", filler(5, 200)))];
    tx.unbounded_send(pick(1, chat_pick("s-1", &chat))).unwrap();
    let a = next(&mut answers).await;
    assert_eq!(a.id, 1);
    let Some(pb::session_response::Result::Pick(first)) = a.result else {
        panic!("{a:?}")
    };
    assert_eq!(first.endpoints.len(), 2);
    let addr = first.endpoints[0].address.clone();
    assert_eq!(ix.endpoint_state(&addr).await.in_flight, 1);

    // A bad pick is answered with an error for its id; the stream goes on.
    let mut bad = chat_pick("s-2", &chat);
    bad.pool = "nope".into();
    tx.unbounded_send(pick(2, bad)).unwrap();
    let a = next(&mut answers).await;
    let Some(pb::session_response::Result::Error(e)) = a.result else {
        panic!("{a:?}")
    };
    assert_eq!((a.id, e.code), (2, tonic::Code::InvalidArgument as u32));
    assert!(e.message.contains("nope"), "{}", e.message);

    // The report is applied before the pick sent after it: that pick sees
    // the first request gone from its endpoint.
    tx.unbounded_send(pb::SessionRequest {
        id: 3,
        call: Some(pb::session_request::Call::Report(pb::ReportRequest {
            pool: POOL.into(),
            request_id: "s-1".into(),
            endpoint: addr.clone(),
            phase: pb::ReportPhase::Done as i32,
            outcome: pb::Outcome::Success as i32,
            ..Default::default()
        })),
    })
    .unwrap();
    tx.unbounded_send(pick(4, chat_pick("s-4", &chat))).unwrap();
    let a = next(&mut answers).await;
    assert_eq!(a.id, 4, "the report is not answered");
    let Some(pb::session_response::Result::Pick(p)) = a.result else {
        panic!("{a:?}")
    };
    let e = p.endpoints.iter().find(|e| e.address == addr).unwrap();
    assert_eq!(e.score.as_ref().unwrap().queued_prefill_tokens, 0);

    let m = ix.metrics().await;
    assert!(m.contains("kvasir_indexer_sessions_open 1\n"), "{m}");
    assert!(
        m.contains("kvasir_indexer_session_calls_total{call=\"pick\"} 3\n"),
        "{m}"
    );
    assert!(
        m.contains("kvasir_indexer_session_calls_total{call=\"report\"} 1\n"),
        "{m}"
    );
    assert!(
        m.contains("kvasir_indexer_reports_total{pool=\"sims\",matched=\"true\"} 1\n"),
        "{m}"
    );

    // The caller ends its side: the answers end too, and the stream is
    // no longer counted as open.
    drop(tx);
    let end = tokio::time::timeout(Duration::from_secs(10), answers.next()).await;
    assert!(matches!(end, Ok(None)), "{end:?}");
    let m = ix.metrics().await;
    assert!(m.contains("kvasir_indexer_sessions_open 0\n"), "{m}");
}
