//! The largest gRPC message a port accepts, checked on the wire.
//!
//! tonic refuses an oversize message itself, but with OUT_OF_RANGE; gRPC's
//! own servers answer RESOURCE_EXHAUSTED, which is what clients (Envoy's
//! gRPC client among them) expect for "too large". [`Limited`] wraps a
//! service so that its request body is read through [`FrameLimit`], which
//! follows the gRPC framing (a 5-byte prefix: compression flag, big-endian
//! length) and fails the body with RESOURCE_EXHAUSTED as soon as a prefix
//! declares more than the limit: the message is never buffered. Unary
//! calls are answered with that status by tonic; streaming handlers get it
//! from their inbound stream and end their answer with it.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use tonic::body::Body;
use tonic::codegen::http::Request;
use tonic::codegen::{Body as HttpBody, Service};
use tonic::server::NamedService;
use tonic::Status;

/// Bytes of a gRPC message's prefix.
const PREFIX: usize = 5;

/// Default limit of an endpoint picker's port: 4 MiB, gRPC's usual limit,
/// above the 2 MiB buffer the shipped gateways give a request body.
pub const DEFAULT_PICKER_MAX_MESSAGE_BYTES: usize = 4 << 20;
/// Room in a picker's message beside the body: a body chunk's framing, or
/// a headers message's headers, attributes and metadata.
pub const PICKER_MESSAGE_HEADROOM: usize = 64 << 10;

/// The message limit of the picker `cfg`, whose policy buffers bodies of
/// up to `body_limit` bytes (`filter.bodyLimitBytes`): a gateway sends a
/// buffered body in one message, so the limit must hold that body and its
/// framing. Default: [`DEFAULT_PICKER_MAX_MESSAGE_BYTES`], or that need
/// when it is more; a configured `maxMessageBytes` below the need is an
/// error naming it.
pub fn picker_limit(cfg: &crate::picker::PickerConfig, body_limit: usize) -> Result<usize, String> {
    let need = body_limit.saturating_add(PICKER_MESSAGE_HEADROOM);
    match cfg.max_message_bytes {
        None => Ok(need.max(DEFAULT_PICKER_MAX_MESSAGE_BYTES)),
        Some(limit) if limit >= need => Ok(limit),
        Some(limit) => Err(format!(
            "picker for pool `{}`: maxMessageBytes {limit} cannot hold a body of its policy's bodyLimitBytes ({body_limit}) with its framing: give at least {need}",
            cfg.pool
        )),
    }
}

/// A gRPC service whose request messages may be at most `limit` bytes.
#[derive(Debug, Clone)]
pub struct Limited<S> {
    inner: S,
    limit: usize,
    /// Named in the refusal: the setting that raises the limit.
    setting: &'static str,
}

impl<S> Limited<S> {
    /// `inner` with messages of at most `limit` bytes; `setting` is the
    /// configuration key that raises it.
    pub fn new(inner: S, limit: usize, setting: &'static str) -> Limited<S> {
        Limited {
            inner,
            limit,
            setting,
        }
    }
}

impl<S: NamedService> NamedService for Limited<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<Request<Body>> for Limited<S>
where
    S: Service<Request<Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let (limit, setting) = (self.limit, self.setting);
        self.inner
            .call(req.map(|b| Body::new(FrameLimit::new(b, limit, setting))))
    }
}

/// A request body that fails once a gRPC message prefix declares more
/// than `limit` bytes. The messages before it pass whole, even when they
/// share a data frame with that prefix, so a stream's earlier calls are
/// still served.
#[derive(Debug)]
pub struct FrameLimit {
    inner: Body,
    limit: usize,
    setting: &'static str,
    /// The prefix read so far.
    prefix: [u8; PREFIX],
    have: usize,
    /// Bytes of the current message still to pass.
    skip: usize,
    /// The refusal, once the data before the oversize message has passed.
    refusal: Option<Status>,
    failed: bool,
}

impl FrameLimit {
    /// `inner`, checked against `limit`.
    pub fn new(inner: Body, limit: usize, setting: &'static str) -> FrameLimit {
        FrameLimit {
            inner,
            limit,
            setting,
            prefix: [0; PREFIX],
            have: 0,
            skip: 0,
            refusal: None,
            failed: false,
        }
    }

    /// Follows the framing through `data`; when a message is over the
    /// limit, where its prefix starts in `data` (0 when it began in an
    /// earlier frame) and the refusal.
    fn check(&mut self, data: &[u8]) -> Result<(), (usize, Status)> {
        let mut at = 0;
        while at < data.len() {
            if self.skip > 0 {
                let n = self.skip.min(data.len() - at);
                self.skip -= n;
                at += n;
                continue;
            }
            let start = at.saturating_sub(self.have);
            let n = (PREFIX - self.have).min(data.len() - at);
            self.prefix[self.have..self.have + n].copy_from_slice(&data[at..at + n]);
            self.have += n;
            at += n;
            if self.have == PREFIX {
                self.have = 0;
                let len = u32::from_be_bytes([
                    self.prefix[1],
                    self.prefix[2],
                    self.prefix[3],
                    self.prefix[4],
                ]) as usize;
                if len > self.limit {
                    return Err((
                        start,
                        Status::resource_exhausted(format!(
                            "request message of {len} bytes is over this port's limit of {} bytes ({})",
                            self.limit, self.setting
                        )),
                    ));
                }
                self.skip = len;
            }
        }
        Ok(())
    }
}

impl HttpBody for FrameLimit {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Status>>> {
        if let Some(status) = self.refusal.take() {
            self.failed = true;
            return Poll::Ready(Some(Err(status)));
        }
        if self.failed {
            return Poll::Ready(None);
        }
        let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            other => return other,
        };
        let Some(data) = frame.data_ref().cloned() else {
            return Poll::Ready(Some(Ok(frame)));
        };
        match self.check(&data) {
            Ok(()) => Poll::Ready(Some(Ok(frame))),
            Err((0, status)) => {
                self.failed = true;
                Poll::Ready(Some(Err(status)))
            }
            // The messages before the oversize one first.
            Err((start, status)) => {
                self.refusal = Some(status);
                Poll::Ready(Some(Ok(http_body::Frame::data(data.slice(..start)))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.failed || (self.refusal.is_none() && self.inner.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(n: usize) -> FrameLimit {
        FrameLimit::new(Body::empty(), n, "grpcMaxMessageBytes")
    }

    fn message(len: usize) -> Vec<u8> {
        let mut m = vec![0u8];
        m.extend_from_slice(&u32::try_from(len).expect("small").to_be_bytes());
        m.extend(std::iter::repeat_n(7u8, len));
        m
    }

    #[test]
    fn a_pickers_limit_holds_its_policys_body() {
        let cfg = |max: Option<usize>| crate::picker::PickerConfig {
            addr: "127.0.0.1:0".parse().expect("addr"),
            pool: "main".into(),
            policy_file: "p.json".into(),
            max_message_bytes: max,
        };
        let mib = 1 << 20;
        // The filter's default body limit fits the default.
        assert_eq!(
            picker_limit(&cfg(None), mib - 1),
            Ok(DEFAULT_PICKER_MAX_MESSAGE_BYTES)
        );
        // A larger body raises it.
        assert_eq!(
            picker_limit(&cfg(None), 8 * mib),
            Ok(8 * mib + PICKER_MESSAGE_HEADROOM)
        );
        // A configured limit is kept when it holds the body, else refused.
        assert_eq!(picker_limit(&cfg(Some(2 * mib)), mib - 1), Ok(2 * mib));
        let e = picker_limit(&cfg(Some(mib)), mib - 1).expect_err("too small");
        assert!(
            e.contains("maxMessageBytes 1048576")
                && e.contains(&format!("{}", mib - 1 + PICKER_MESSAGE_HEADROOM)),
            "{e}"
        );
    }

    #[test]
    fn messages_up_to_the_limit_pass_in_any_split() {
        let mut wire = message(10);
        wire.extend(message(0));
        wire.extend(message(10));
        for split in 1..wire.len() {
            let mut f = limit(10);
            for chunk in wire.chunks(split) {
                f.check(chunk).expect("within the limit");
            }
            assert_eq!((f.have, f.skip), (0, 0), "split {split}");
        }
    }

    #[test]
    fn a_prefix_over_the_limit_is_resource_exhausted_whatever_the_split() {
        let mut wire = message(3);
        wire.extend(&message(11)[..PREFIX]);
        for split in 1..wire.len() {
            let mut f = limit(10);
            let mut passed = 0;
            let mut refused = None;
            for chunk in wire.chunks(split) {
                match f.check(chunk) {
                    Ok(()) => passed += chunk.len(),
                    Err((start, e)) => {
                        refused = Some(e);
                        passed += start;
                        break;
                    }
                }
            }
            let err = refused.expect("refused");
            assert_eq!(err.code(), tonic::Code::ResourceExhausted);
            assert!(
                err.message().contains("11 bytes")
                    && err.message().contains("limit of 10 bytes")
                    && err.message().contains("grpcMaxMessageBytes"),
                "{}",
                err.message()
            );
            // What passes is the message before, and at most the part of
            // the oversize prefix that came in earlier frames.
            assert!(
                (message(3).len()..message(3).len() + PREFIX).contains(&passed),
                "split {split}: {passed}"
            );
            if split >= message(3).len() + PREFIX {
                assert_eq!(passed, message(3).len(), "one frame: cut at the prefix");
            }
        }
    }
}
