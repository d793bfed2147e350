//! One request's ext_proc exchange: Envoy's `ProcessingRequest`s in, the
//! filter's own request flow (`kvasir_filter::engine::Flow`) deciding over
//! [`ExchangeHost`], the picker's `ProcessingResponse`s out. No I/O here:
//! a pick the flow asks for is handed to the caller ([`Step::Pick`]), which
//! runs it against the pool and gives the outcome back
//! ([`Exchange::picked`]); reports are taken with [`Exchange::take_reports`].
//!
//! The endpoint-picker protocol on top of the flow: the picked list goes in
//! the `x-gateway-destination-endpoint` header and the `envoy.lb` metadata
//! (the same value); a request the flow lets go without a pick (a path it
//! does not parse, a batch prompt, a failed pick) is picked by load, and
//! when even that finds no endpoint it is answered 503; a policy that
//! sends the request to another pool or a provider, which the gateway's
//! backend cannot reach, is answered 503 as well, never silently served
//! by this pool.

use std::rc::Rc;
use std::sync::Arc;

use kvasir_filter::engine::{Flow, Verdict};
use kvasir_filter::pick::PickOutcome;
use kvasir_filter::reply::{error_reply, LocalReply, Shape};
use kvasir_filter::shared::Shared;
use kvasir_proto::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use kvasir_proto::envoy::service::ext_proc::v3 as ep;
use prost::Message;

use super::host::{ExchangeHost, PickCall};
use super::messages::{self as m, BodyOut};

/// What the picker serves: its pool, as the policy document names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Serving {
    /// The pool's name at the indexer.
    pub pool: String,
    /// The route header value the flow sets for this pool (its Envoy
    /// cluster in the policy document).
    pub cluster: String,
}

/// What the caller does next.
#[derive(Debug, PartialEq)]
pub enum Step {
    /// Send these (possibly none: the exchange waits for more).
    Send(Vec<ep::ProcessingResponse>),
    /// Run this pick, then hand its outcome to [`Exchange::picked`].
    Pick(PickCall),
}

/// Where the exchange is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the request headers.
    Start,
    /// Reading the request body.
    Body,
    /// A pick decided at the headers is out.
    PickingAtHeaders,
    /// A pick decided at the body's end is out.
    PickingAtBody,
    /// The request went on; the response is watched.
    Forwarded,
    /// Answered by the picker: nothing more is sent.
    Replied,
}

/// The token of the load-only pick the exchange makes itself.
const FALLBACK: u32 = 0;

/// Largest body chunk sent back in one message (Envoy's advice for
/// full-duplex responses: a gRPC message no larger than 64 KiB).
pub const CHUNK: usize = 64 * 1024;

/// `body` in chunks of at most [`CHUNK`] bytes, each with whether it is
/// the last (an empty body is one empty last chunk).
fn streamed(body: &[u8]) -> impl Iterator<Item = (&[u8], bool)> {
    let n = body.len().div_ceil(CHUNK).max(1);
    (0..n).map(move |i| {
        let end = ((i + 1) * CHUNK).min(body.len());
        (&body[(i * CHUNK).min(end)..end], i + 1 == n)
    })
}

/// One request's exchange.
pub struct Exchange {
    flow: Flow,
    host: ExchangeHost,
    shared: Rc<Shared>,
    serving: Arc<Serving>,
    phase: Phase,
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    subset: Option<Vec<String>>,
    shape: Shape,
}

impl Exchange {
    /// A new exchange under `shared`'s configuration.
    pub fn new(shared: Rc<Shared>, serving: Arc<Serving>) -> Exchange {
        Exchange {
            flow: Flow::new(Rc::clone(&shared)),
            host: ExchangeHost::new(),
            shared,
            serving,
            phase: Phase::Start,
            request_mode: BodySendMode::Buffered,
            response_mode: BodySendMode::None,
            subset: None,
            shape: Shape::OpenAi,
        }
    }

    /// The gateway's subset hint, once the headers came.
    pub fn subset(&self) -> Option<&[String]> {
        self.subset.as_deref()
    }

    /// Reports the flow dispatched since the last call (encoded
    /// `ReportRequest`s).
    pub fn take_reports(&mut self) -> Vec<Vec<u8>> {
        std::mem::take(&mut self.host.reports)
    }

    /// Whether the exchange answered the request itself.
    pub fn replied(&self) -> bool {
        self.phase == Phase::Replied
    }

    /// A message from Envoy.
    pub fn on_message(&mut self, req: ep::ProcessingRequest) -> Step {
        use ep::processing_request::Request;
        if let Some(pc) = &req.protocol_config {
            self.request_mode =
                BodySendMode::try_from(pc.request_body_mode).unwrap_or(BodySendMode::None);
            self.response_mode =
                BodySendMode::try_from(pc.response_body_mode).unwrap_or(BodySendMode::None);
        }
        if self.phase == Phase::Replied {
            return Step::Send(Vec::new());
        }
        match req.request {
            Some(Request::RequestHeaders(h)) => {
                self.subset = m::subset_of(req.metadata_context.as_ref());
                self.host.jwt_claims = m::jwt_claims_of(req.metadata_context.as_ref());
                self.on_request_headers(h)
            }
            Some(Request::RequestBody(b)) => self.on_request_body(b),
            Some(Request::RequestTrailers(_)) => {
                self.flow.on_request_trailers(&mut self.host);
                if let Some(r) = self.host.reply.take() {
                    return self.reply(&r, "trailers");
                }
                Step::Send(vec![m::trailers_response(true)])
            }
            Some(Request::ResponseHeaders(h)) => {
                self.host.served = m::served_of(req.metadata_context.as_ref(), &req.attributes)
                    .or_else(|| self.host.served.take());
                self.on_response_headers(h)
            }
            Some(Request::ResponseBody(b)) => self.on_response_body(b),
            Some(Request::ResponseTrailers(_)) => {
                self.flow.on_response_trailers(&mut self.host);
                Step::Send(vec![m::trailers_response(false)])
            }
            None => Step::Send(Vec::new()),
        }
    }

    fn on_request_headers(&mut self, h: ep::HttpHeaders) -> Step {
        self.host.request_headers = m::headers_of(h.headers.as_ref());
        let path = self
            .host
            .request_headers
            .iter()
            .find(|(k, _)| k == ":path")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        if path.starts_with("/v1/messages") {
            self.shape = Shape::Anthropic;
        }
        let needs_body = !h.end_of_stream;
        if needs_body
            && !matches!(
                self.request_mode,
                BodySendMode::Buffered | BodySendMode::FullDuplexStreamed
            )
        {
            let r = error_reply(
                self.shape,
                503,
                "picker_misconfigured",
                None,
                "the endpoint picker needs the request body BUFFERED or FULL_DUPLEX_STREAMED",
            );
            return self.reply(&r, "request_body_mode");
        }
        let v = self
            .flow
            .on_request_headers(&mut self.host, h.end_of_stream);
        if let Some(r) = self.host.reply.take() {
            return self.reply(&r, "filter");
        }
        if let Some(step) = self.misrouted() {
            return step;
        }
        if let Some(call) = self.host.pick.take() {
            self.phase = Phase::PickingAtHeaders;
            return Step::Pick(call);
        }
        if v == Verdict::Pause {
            // The body is read before deciding.
            self.phase = Phase::Body;
            return match self.request_mode {
                BodySendMode::Buffered => {
                    let (set, removed) = self.host.take_request_mutations();
                    Step::Send(vec![m::request_headers_response(
                        m::mutation(&set, &removed),
                        None,
                    )])
                }
                _ => Step::Send(Vec::new()),
            };
        }
        // Decided at the headers without a pick (a path the flow passes
        // through): picked by load.
        self.phase = Phase::PickingAtHeaders;
        Step::Pick(self.fallback_pick())
    }

    fn on_request_body(&mut self, b: ep::HttpBody) -> Step {
        if self.phase != Phase::Body {
            // A body after the decision (it came at the headers): sent on.
            return Step::Send(vec![self.pass_request_body(b)]);
        }
        self.host.body.extend_from_slice(&b.body);
        if !b.end_of_stream {
            // Held until the whole body is in (full duplex sends it on
            // with the decision).
            return Step::Send(Vec::new());
        }
        let size = self.host.body.len();
        self.flow.on_request_body(&mut self.host, size, true);
        if let Some(r) = self.host.reply.take() {
            return self.reply(&r, "filter");
        }
        // Before the pick runs: a pick in another pool must not reserve
        // or place anything.
        if let Some(step) = self.misrouted() {
            return step;
        }
        self.phase = Phase::PickingAtBody;
        match self.host.pick.take() {
            Some(call) => Step::Pick(call),
            None => Step::Pick(self.fallback_pick()),
        }
    }

    fn pass_request_body(&self, b: ep::HttpBody) -> ep::ProcessingResponse {
        match self.request_mode {
            BodySendMode::FullDuplexStreamed => m::request_body_response(
                None,
                Some(BodyOut::Chunk {
                    body: b.body,
                    end_of_stream: b.end_of_stream,
                }),
                None,
            ),
            _ => m::request_body_response(None, None, None),
        }
    }

    /// A load-only pick for a request the flow let go without one: no
    /// prompt to match, not accounted in flight (no report will end it).
    fn fallback_pick(&self) -> PickCall {
        let req = kvasir_proto::v1::PickRequest {
            pool: self.serving.pool.clone(),
            prompt: Some(kvasir_proto::v1::pick_request::Prompt::TokenIds(
                kvasir_proto::v1::TokenIds { ids: vec![0] },
            )),
            max_endpoints: self.shared.config.settings.max_endpoints,
            ..Default::default()
        };
        PickCall {
            token: FALLBACK,
            msg: req.encode_to_vec(),
            timeout_ms: 1_000,
        }
    }

    /// A policy sent the request somewhere this pool's backend cannot
    /// reach: answered 503, naming where.
    fn misrouted(&mut self) -> Option<Step> {
        let route = self.shared.config.settings.route_header.clone();
        let chosen = self.host.set_value(&route)?.to_string();
        if chosen == self.serving.cluster {
            return None;
        }
        let msg = format!(
            "a policy sends this request to `{chosen}`, which this gateway's endpoint picker for pool `{}` cannot reach; route it through the Kvasir filter",
            self.serving.pool
        );
        let r = error_reply(self.shape, 503, "policy_not_servable", None, &msg);
        Some(self.reply(&r, "policy_not_servable"))
    }

    /// The outcome of the pick [`Step::Pick`] asked for.
    pub fn picked(&mut self, token: u32, outcome: PickOutcome) -> Step {
        let at_headers = self.phase == Phase::PickingAtHeaders;
        if token == FALLBACK {
            return match outcome.result {
                Ok(p) => self.forward(&p.header, at_headers),
                Err(why) => self.no_endpoint(&format!("{why:?}")),
            };
        }
        self.flow.on_pick_outcome(&mut self.host, token, outcome);
        if let Some(r) = self.host.reply.take() {
            return self.reply(&r, "filter");
        }
        let endpoint_header = self.shared.config.settings.endpoint_header.clone();
        match self.host.set_value(&endpoint_header).map(str::to_string) {
            Some(list) => self.forward(&list, at_headers),
            // The flow went on without an endpoint (it failed open):
            // picked by load instead.
            None => Step::Pick(self.fallback_pick()),
        }
    }

    fn no_endpoint(&mut self, why: &str) -> Step {
        tracing::debug!(pool = %self.serving.pool, why, "picker: no endpoint");
        let r = error_reply(
            self.shape,
            503,
            "no_endpoint",
            None,
            "no endpoint of the pool can take the request now",
        );
        self.reply(&r, "no_endpoint")
    }

    /// The request goes on to `endpoints`: its header mutations (the list
    /// included, the route header removed: it is the filter's, never an
    /// upstream's) and the `envoy.lb` metadata, on the message that
    /// answers where the request is.
    fn forward(&mut self, endpoints: &str, at_headers: bool) -> Step {
        let s = &self.shared.config.settings;
        let (mut set, mut removed) = self.host.take_request_mutations();
        set.retain(|(k, _)| *k != s.route_header);
        set.push((s.endpoint_header.clone(), endpoints.to_string()));
        if !removed.contains(&s.route_header) {
            removed.push(s.route_header.clone());
        }
        let mutation = m::mutation(&set, &removed);
        let md = Some(m::destination_metadata(endpoints));
        self.phase = Phase::Forwarded;
        if at_headers {
            return Step::Send(vec![m::request_headers_response(mutation, md)]);
        }
        let body = self.host.new_body.take();
        match self.request_mode {
            BodySendMode::FullDuplexStreamed => {
                let body = body.unwrap_or_else(|| std::mem::take(&mut self.host.body));
                let mut out = vec![m::request_headers_response(mutation, md)];
                out.extend(streamed(&body).map(|(chunk, last)| {
                    m::request_body_response(
                        None,
                        Some(BodyOut::Chunk {
                            body: chunk.to_vec(),
                            end_of_stream: last,
                        }),
                        None,
                    )
                }));
                Step::Send(out)
            }
            _ => Step::Send(vec![m::request_body_response(
                mutation,
                body.map(BodyOut::Whole),
                md,
            )]),
        }
    }

    fn reply(&mut self, r: &LocalReply, details: &str) -> Step {
        self.phase = Phase::Replied;
        Step::Send(vec![m::immediate(r, details)])
    }

    fn on_response_headers(&mut self, h: ep::HttpHeaders) -> Step {
        self.host.response_headers = m::headers_of(h.headers.as_ref());
        self.flow
            .on_response_headers(&mut self.host, h.end_of_stream);
        let added = self.host.take_response_mutations();
        Step::Send(vec![m::response_headers_response(m::mutation(&added, &[]))])
    }

    fn on_response_body(&mut self, b: ep::HttpBody) -> Step {
        let size = b.body.len();
        self.host.response_chunk = b.body;
        self.flow
            .on_response_body(&mut self.host, size, b.end_of_stream);
        let out = match self.response_mode {
            BodySendMode::FullDuplexStreamed => Some(BodyOut::Chunk {
                body: std::mem::take(&mut self.host.response_chunk),
                end_of_stream: b.end_of_stream,
            }),
            _ => None,
        };
        Step::Send(vec![m::response_body_response(out)])
    }

    /// The stream ended (the request is over, however it ended): its last
    /// reports.
    pub fn on_end(&mut self) {
        self.flow.on_log(&mut self.host);
    }
}
