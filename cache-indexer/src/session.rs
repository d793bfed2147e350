//! `Session`: picks and reports over one long-lived gRPC stream (the Envoy
//! filter keeps one per VM, so a pick costs a message on an open HTTP/2
//! stream rather than a new call).
//!
//! Messages are taken in order: a report is applied before the next
//! message is read, so a pick sent after it is scored with it; a pick runs
//! as its own task (up to [`MAX_CONCURRENT_PICKS`] per stream computing at
//! once) and is answered with its id whenever it is done. Errors are per
//! call (the stream goes on), in the codes the unary RPCs would have used.
//!
//! A pick's permit covers its work, not its wait: the pick is handed it
//! ([`crate::pick::PickPermit`]) and gives it back when it waits in a
//! flow-control queue, so picks
//! waiting for room (as many as the pools' queues hold) never stop the
//! stream from reading its next report or pick.

use std::pin::Pin;
use std::sync::Arc;

use futures::{SinkExt, Stream, StreamExt};
use kvasir_proto::v1 as pb;
use tokio::sync::Semaphore;

use crate::pick::PickPermit;
use crate::pool::ServiceError;
use crate::pools::Pools;

/// Picks of one stream computed at once; the next message waits (and,
/// through HTTP/2 flow control, so does the caller) while this many run.
pub const MAX_CONCURRENT_PICKS: usize = 256;

/// Answers buffered for a caller that reads slowly.
const ANSWER_BUFFER: usize = 1024;

/// The answer stream's type.
pub type SessionStream =
    Pin<Box<dyn Stream<Item = Result<pb::SessionResponse, tonic::Status>> + Send>>;

fn error_answer(id: u64, code: tonic::Code, message: String) -> pb::SessionResponse {
    pb::SessionResponse {
        id,
        result: Some(pb::session_response::Result::Error(pb::CallError {
            code: code as u32,
            message,
        })),
    }
}

/// What ends a pick whose answer could not be sent.
struct Unanswered {
    pool: String,
    request_id: String,
    budget_key: Option<String>,
}

impl Unanswered {
    fn of(req: &pb::PickRequest) -> Unanswered {
        Unanswered {
            pool: req.pool.clone(),
            request_id: req.request_id.clone(),
            budget_key: req.budget.as_ref().map(|b| b.key.clone()),
        }
    }

    fn end(&self, pools: &Pools) {
        if let Ok(p) = pools.get(&self.pool) {
            p.end_unanswered(&self.request_id, self.budget_key.as_deref());
        }
    }
}

fn service_error(id: u64, e: &ServiceError) -> pb::SessionResponse {
    error_answer(id, tonic::Code::InvalidArgument, e.to_string())
}

/// Serves one stream: reads `inbound` until it ends or fails, and returns
/// the answers. The answer stream ends once the caller's side has ended
/// and every pick it sent is answered; when `inbound` failed (a message
/// over the port's size limit is RESOURCE_EXHAUSTED), with that error.
pub fn serve<S>(pools: Arc<Pools>, mut inbound: S) -> SessionStream
where
    S: Stream<Item = Result<pb::SessionRequest, tonic::Status>> + Send + Unpin + 'static,
{
    let (mut tx, rx) = futures::channel::mpsc::channel(ANSWER_BUFFER);
    let (failed_tx, failed) = futures::channel::oneshot::channel::<tonic::Status>();
    let metrics = Arc::clone(pools.session_metrics());
    metrics.opened();
    tokio::spawn(async move {
        let permits = Arc::new(Semaphore::new(MAX_CONCURRENT_PICKS));
        while let Some(msg) = inbound.next().await {
            let msg = match msg {
                Ok(msg) => msg,
                // Nothing more can be read: the picks already running are
                // answered, then the stream ends with why (after a reset
                // nobody reads it).
                Err(status) => {
                    let _ = failed_tx.send(status);
                    break;
                }
            };
            match msg.call {
                Some(pb::session_request::Call::Report(r)) => {
                    metrics.reports.inc();
                    if let Err(e) = pools.report(&r) {
                        metrics.failed_reports.inc();
                        tracing::debug!(error = %e, "session: report refused");
                    }
                }
                Some(pb::session_request::Call::Pick(req)) => {
                    metrics.picks.inc();
                    let Ok(permit) = Arc::clone(&permits).acquire_owned().await else {
                        break;
                    };
                    let pools = Arc::clone(&pools);
                    let mut tx = tx.clone();
                    let id = msg.id;
                    tokio::spawn(async move {
                        let pick = Unanswered::of(&req);
                        // (The permit goes back when the pick is done, or
                        // earlier if it waits.)
                        let picked = pools.pick_with(req, PickPermit::held(permit)).await;
                        let placed = picked.as_ref().is_ok_and(|r| !r.endpoints.is_empty());
                        let answer = match picked {
                            Ok(r) => pb::SessionResponse {
                                id,
                                result: Some(pb::session_response::Result::Pick(r)),
                            },
                            Err(e) => service_error(id, &e),
                        };
                        // A caller that went away is not an error here,
                        // but what its pick holds goes back: it routes
                        // without the answer.
                        if tx.send(Ok(answer)).await.is_err() && placed {
                            pick.end(&pools);
                        }
                    });
                }
                None => {
                    metrics.invalid.inc();
                    let a = error_answer(
                        msg.id,
                        tonic::Code::InvalidArgument,
                        "call: one of pick or report is required".into(),
                    );
                    if tx.send(Ok(a)).await.is_err() {
                        break;
                    }
                }
            }
        }
        metrics.closed();
        // Dropping `tx` (not closing the channel: running picks hold
        // clones) ends the answer stream after the last pick's answer.
        drop(tx);
    });
    let failed = futures::stream::once(failed).filter_map(|r| async move { r.ok().map(Err) });
    Box::pin(rx.chain(failed))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::{EngineLoad, LoadConfig, LoadTracker};
    use crate::pool::Pool;
    use crate::scoring::Weights;
    use crate::tokenize::RequestTokenizer;
    use crate::types::EndpointSpec;
    use kvasir_flowcontrol::FlowControlConfig;
    use std::time::{Duration, Instant};

    fn pools() -> Arc<Pools> {
        let pool = Pool::new(
            "p",
            "m",
            4,
            RequestTokenizer::Approx,
            LoadTracker::new(LoadConfig::default()),
            Weights::default(),
        );
        pool.set_endpoints(
            vec![EndpointSpec {
                address: "127.0.0.1:8000".into(),
                kv_events: "tcp://127.0.0.1:9000".into(),
                replay: None,
                metrics_url: None,
                topic: String::new(),
            }],
            |_| None,
        );
        for e in pool.endpoints().iter() {
            pool.load
                .record_scrape(e.id, Some(EngineLoad::default()), Instant::now());
        }
        Arc::new(Pools::new(vec![Arc::new(pool)]))
    }

    fn pick(id: u64, pool: &str, request_id: &str) -> pb::SessionRequest {
        pb::SessionRequest {
            id,
            call: Some(pb::session_request::Call::Pick(pb::PickRequest {
                pool: pool.into(),
                request_id: request_id.into(),
                prompt: Some(pb::pick_request::Prompt::TokenIds(pb::TokenIds {
                    ids: (0..64).collect(),
                })),
                ..Default::default()
            })),
        }
    }

    async fn answers(pools: Arc<Pools>, msgs: Vec<pb::SessionRequest>) -> Vec<pb::SessionResponse> {
        let inbound = futures::stream::iter(msgs.into_iter().map(Ok));
        let out = serve(pools, inbound);
        tokio::time::timeout(Duration::from_secs(10), out.map(|r| r.unwrap()).collect())
            .await
            .expect("the answer stream ends once the caller's side has")
    }

    #[tokio::test]
    async fn picks_are_answered_by_id_and_errors_stay_per_call() {
        let pools = pools();
        let msgs = vec![
            pick(7, "p", "r7"),
            pick(8, "nope", "r8"),
            pb::SessionRequest { id: 9, call: None },
            pick(10, "p", "r10"),
        ];
        let mut got = answers(Arc::clone(&pools), msgs).await;
        got.sort_by_key(|a| a.id);
        assert_eq!(got.iter().map(|a| a.id).collect::<Vec<_>>(), [7, 8, 9, 10]);
        for a in [&got[0], &got[3]] {
            let Some(pb::session_response::Result::Pick(r)) = &a.result else {
                panic!("{a:?}")
            };
            assert_eq!(r.endpoints[0].address, "127.0.0.1:8000");
        }
        let Some(pb::session_response::Result::Error(e)) = &got[1].result else {
            panic!("{:?}", got[1])
        };
        assert_eq!(e.code, tonic::Code::InvalidArgument as u32);
        assert!(e.message.contains("nope"), "{}", e.message);
        let Some(pb::session_response::Result::Error(e)) = &got[2].result else {
            panic!("{:?}", got[2])
        };
        assert!(e.message.starts_with("call:"), "{}", e.message);
        let m = pools.session_metrics();
        assert_eq!((m.picks.get(), m.invalid.get()), (3, 1));
        assert_eq!(m.open(), 0);
    }

    #[tokio::test]
    async fn a_failed_inbound_ends_the_answers_with_its_error_after_the_running_picks() {
        let pools = pools();
        let inbound = futures::stream::iter(vec![
            Ok(pick(1, "p", "r1")),
            Err(tonic::Status::resource_exhausted("too large")),
            Ok(pick(2, "p", "r2")),
        ]);
        let got: Vec<_> = tokio::time::timeout(
            Duration::from_secs(10),
            serve(Arc::clone(&pools), inbound).collect(),
        )
        .await
        .expect("the answer stream ends");
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].as_ref().expect("the pick's answer").id, 1);
        let e = got[1].as_ref().expect_err("then the error");
        assert_eq!(
            (e.code(), e.message()),
            (tonic::Code::ResourceExhausted, "too large")
        );
    }

    /// Pool `p`, flow-controlled and saturated (its picks wait), and pool
    /// `q`, idle without flow control.
    fn saturated_and_idle() -> Arc<Pools> {
        let make = |name: &str, flow: FlowControlConfig| {
            let pool = Pool::new(
                name,
                "m",
                4,
                RequestTokenizer::Approx,
                LoadTracker::new(LoadConfig::default()),
                Weights::default(),
            )
            .with_flow_control(flow);
            pool.set_idle_loopback_endpoints(1);
            pool
        };
        let p = make(
            "p",
            FlowControlConfig {
                enabled: true,
                max_queued: 512,
                max_queued_per_tenant: 512,
                max_wait_ms: 60_000,
                ..FlowControlConfig::default()
            },
        );
        let busy = EngineLoad {
            running: 8,
            waiting: 5,
            kv_usage: 0.5,
        };
        for e in p.endpoints().iter() {
            p.load.record_scrape(e.id, Some(busy), Instant::now());
        }
        let q = make("q", FlowControlConfig::default());
        Arc::new(Pools::new(vec![Arc::new(p), Arc::new(q)]))
    }

    #[tokio::test]
    async fn picks_waiting_for_room_do_not_hold_the_stream() {
        const WAITING: usize = MAX_CONCURRENT_PICKS + 44;
        let pools = saturated_and_idle();
        let (tx, inbound) = futures::channel::mpsc::unbounded();
        let mut out = serve(Arc::clone(&pools), inbound.map(Ok));
        for i in 0..WAITING {
            let mut m = pick(i as u64, "p", &format!("w{i}"));
            if let Some(pb::session_request::Call::Pick(r)) = &mut m.call {
                r.max_wait_ms = 60_000;
            }
            tx.unbounded_send(m).unwrap();
        }
        let p = Arc::clone(pools.get("p").unwrap());
        let start = Instant::now();
        while p.flow.len() < WAITING {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{}",
                p.flow.len()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Another pool's pick, then a report, on the same stream.
        tx.unbounded_send(pick(9_000, "q", "q1")).unwrap();
        let got = tokio::time::timeout(Duration::from_secs(5), out.next())
            .await
            .expect("the other pool's pick is answered while picks wait")
            .unwrap()
            .unwrap();
        assert_eq!(got.id, 9_000);
        let report = pb::SessionRequest {
            id: 9_001,
            call: Some(pb::session_request::Call::Report(pb::ReportRequest {
                pool: "q".into(),
                request_id: "q1".into(),
                phase: pb::ReportPhase::Done as i32,
                ..Default::default()
            })),
        };
        tx.unbounded_send(report).unwrap();
        let q = Arc::clone(pools.get("q").unwrap());
        let start = Instant::now();
        while q.metrics.reports_matched.get() < 1 {
            assert!(start.elapsed() < Duration::from_secs(5), "report applied");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(p.flow.len(), WAITING, "they still wait");
    }

    #[tokio::test]
    async fn a_report_before_a_pick_is_applied_first() {
        let pools = pools();
        let report = |id: u64, request_id: &str| pb::SessionRequest {
            id,
            call: Some(pb::session_request::Call::Report(pb::ReportRequest {
                pool: "p".into(),
                request_id: request_id.into(),
                phase: pb::ReportPhase::Done as i32,
                ..Default::default()
            })),
        };
        // Only pick 1 is in flight when the report comes; it matches.
        let got = answers(Arc::clone(&pools), vec![pick(1, "p", "a")]).await;
        assert_eq!(got.len(), 1);
        let pool = pools.get("p").unwrap();
        let got = answers(
            Arc::clone(&pools),
            vec![report(2, "a"), report(3, "unknown"), pick(4, "p", "b")],
        )
        .await;
        assert_eq!(got.len(), 1, "reports are not answered: {got:?}");
        assert_eq!(pool.metrics.reports_matched.get(), 1);
        assert_eq!(pool.metrics.reports_unmatched.get(), 1);
        assert_eq!(pools.session_metrics().reports.get(), 2);
    }
}
