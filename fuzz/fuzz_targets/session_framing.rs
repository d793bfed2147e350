//! The gRPC message framing of the indexer's ports (the `Session` stream
//! among them): `FrameLimit` follows 5-byte prefixes through a request body
//! cut into arbitrary data frames. The bytes it passes are the input's
//! start: all of it when no prefix declares more than the limit, else the
//! messages before the first oversize one (plus at most the part of its
//! prefix that came in earlier frames), then RESOURCE_EXHAUSTED, then the
//! end. Each whole message passed is decoded as a `SessionRequest`.
#![no_main]

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body::{Body as _, Frame};
use kvasir_cache_indexer::grpc_limit::FrameLimit;
use kvasir_proto::v1::SessionRequest;
use libfuzzer_sys::fuzz_target;
use prost::Message;
use tonic::body::Body;

/// A request body that yields its chunks one data frame each.
struct Chunks(VecDeque<Bytes>);

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        Poll::Ready(self.0.pop_front().map(|c| Ok(Frame::data(c))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }
}

/// Where the first prefix over `limit` starts, if any.
fn first_oversize(wire: &[u8], limit: usize) -> Option<usize> {
    let mut at = 0;
    while at + 5 <= wire.len() {
        let len = u32::from_be_bytes([wire[at + 1], wire[at + 2], wire[at + 3], wire[at + 4]]);
        let len = len as usize;
        if len > limit {
            return Some(at);
        }
        at += 5 + len;
    }
    None
}

fuzz_target!(|data: &[u8]| {
    let [limit, split, wire @ ..] = data else {
        return;
    };
    let limit = usize::from(*limit) * 4;
    // Frame sizes cycle through 1..=split+1 so one input tries many cuts.
    let mut chunks = VecDeque::new();
    let (mut at, mut n) = (0, 1);
    while at < wire.len() {
        let end = (at + n).min(wire.len());
        chunks.push_back(Bytes::copy_from_slice(&wire[at..end]));
        at = end;
        n = n % (usize::from(*split) + 1) + 1;
    }
    let frames = chunks.len();
    let mut body = FrameLimit::new(Body::new(Chunks(chunks)), limit, "grpcMaxMessageBytes");
    let mut cx = Context::from_waker(Waker::noop());
    let mut passed = Vec::new();
    let mut refused = None;
    for _ in 0..=frames + 1 {
        match Pin::new(&mut body).poll_frame(&mut cx) {
            Poll::Ready(Some(Ok(f))) => {
                assert!(refused.is_none(), "data after the refusal");
                passed.extend_from_slice(f.data_ref().expect("data frames only"));
            }
            Poll::Ready(Some(Err(status))) => {
                assert!(refused.is_none(), "refused twice");
                assert_eq!(status.code(), tonic::Code::ResourceExhausted);
                refused = Some(status);
            }
            Poll::Ready(None) => break,
            Poll::Pending => panic!("a ready body is never pending"),
        }
    }
    assert!(body.is_end_stream(), "not at the end after {frames} frames");
    assert_eq!(
        passed,
        wire[..passed.len()],
        "passed bytes are the input's start"
    );
    match first_oversize(wire, limit) {
        None => {
            assert!(refused.is_none(), "refused a body within the limit");
            assert_eq!(passed.len(), wire.len());
        }
        Some(at) => {
            assert!(refused.is_some(), "an oversize message at {at} passed");
            assert!(
                (at..at + 5).contains(&passed.len()),
                "{} vs {at}",
                passed.len()
            );
        }
    }
    let mut rest = &passed[..];
    while rest.len() >= 5 {
        let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        let Some(msg) = rest.get(5..5 + len) else {
            break;
        };
        let _ = SessionRequest::decode(msg);
        rest = &rest[5 + len..];
    }
});
