//! The ext_proc messages the picker reads and writes: headers in and out,
//! the `envoy.lb` metadata, the gateway's subset hint and served endpoint,
//! and the picker's answers (header and body responses, immediate
//! replies).

use std::collections::BTreeMap;

use kvasir_filter::reply::LocalReply;
use kvasir_proto::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use kvasir_proto::envoy::r#type::v3::{HttpStatus, StatusCode};
use kvasir_proto::envoy::service::ext_proc::v3 as ep;
use prost_types::value::Kind;
use prost_types::{Struct, Value};

/// The metadata namespace of the picked endpoints and the served one.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The metadata namespace of the gateway's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The picked endpoints' key (header and metadata).
pub const DESTINATION_KEY: &str = "x-gateway-destination-endpoint";
/// The subset hint's key.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The served endpoint's key.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// The attribute a gateway may send the served endpoint as instead.
pub const UPSTREAM_ADDRESS: &str = "upstream.address";
/// The metadata namespace `jwt_authn` writes verified claims under.
pub const JWT_NAMESPACE: &str = "envoy.filters.http.jwt_authn";

/// Headers as name (lower-case) and value, the raw bytes read lossily.
pub fn headers_of(h: Option<&HeaderMap>) -> Vec<(String, String)> {
    h.map(|m| {
        m.headers
            .iter()
            .map(|v| {
                let value = if v.raw_value.is_empty() {
                    v.value.clone()
                } else {
                    String::from_utf8_lossy(&v.raw_value).into_owned()
                };
                (v.key.to_ascii_lowercase(), value)
            })
            .collect()
    })
    .unwrap_or_default()
}

fn string_of(v: &Value) -> Option<String> {
    match &v.kind {
        Some(Kind::StringValue(s)) => Some(s.clone()),
        _ => None,
    }
}

fn field<'m>(md: &'m Metadata, namespace: &str, key: &str) -> Option<&'m Value> {
    md.filter_metadata.get(namespace)?.fields.get(key)
}

/// The gateway's subset hint: `Some` when it sent one (possibly empty),
/// as a list or a comma-separated string.
pub fn subset_of(md: Option<&Metadata>) -> Option<Vec<String>> {
    let v = field(md?, SUBSET_NAMESPACE, SUBSET_KEY)?;
    Some(match &v.kind {
        Some(Kind::ListValue(l)) => l.values.iter().filter_map(string_of).collect(),
        Some(Kind::StringValue(s)) => split_addresses(s),
        _ => Vec::new(),
    })
}

fn split_addresses(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(str::to_string)
        .collect()
}

/// The endpoint that served, from the gateway's `envoy.lb` metadata or the
/// `upstream.address` attribute.
pub fn served_of(
    md: Option<&Metadata>,
    attributes: &std::collections::HashMap<String, Struct>,
) -> Option<String> {
    if let Some(s) = md
        .and_then(|m| field(m, LB_NAMESPACE, SERVED_KEY))
        .and_then(string_of)
    {
        return split_addresses(&s).into_iter().next();
    }
    attributes
        .values()
        .find_map(|s| s.fields.get(UPSTREAM_ADDRESS))
        .and_then(string_of)
}

/// JWT claims `jwt_authn` forwarded: (metadata key, claim, value) for each
/// string claim.
pub fn jwt_claims_of(md: Option<&Metadata>) -> Vec<(String, String, String)> {
    let Some(ns) = md.and_then(|m| m.filter_metadata.get(JWT_NAMESPACE)) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (key, v) in &ns.fields {
        if let Some(Kind::StructValue(payload)) = &v.kind {
            for (claim, c) in &payload.fields {
                if let Some(s) = string_of(c) {
                    out.push((key.clone(), claim.clone(), s));
                }
            }
        }
    }
    out
}

fn header(name: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: name.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// A header mutation: `set` (last value per name wins), then `remove`.
pub fn mutation(set: &[(String, String)], remove: &[String]) -> Option<ep::HeaderMutation> {
    if set.is_empty() && remove.is_empty() {
        return None;
    }
    let mut last: BTreeMap<&str, &str> = BTreeMap::new();
    for (k, v) in set {
        last.insert(k, v);
    }
    Some(ep::HeaderMutation {
        set_headers: last.into_iter().map(|(k, v)| header(k, v)).collect(),
        remove_headers: remove.to_vec(),
    })
}

/// The `envoy.lb` metadata naming the picked endpoints.
pub fn destination_metadata(endpoints: &str) -> Struct {
    let inner = Struct {
        fields: [(
            DESTINATION_KEY.to_string(),
            Value {
                kind: Some(Kind::StringValue(endpoints.to_string())),
            },
        )]
        .into(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

/// A list value (gateways send the subset as one).
#[cfg(test)]
pub fn list_of(items: &[&str]) -> Value {
    Value {
        kind: Some(Kind::ListValue(prost_types::ListValue {
            values: items
                .iter()
                .map(|s| Value {
                    kind: Some(Kind::StringValue((*s).to_string())),
                })
                .collect(),
        })),
    }
}

fn common(
    header_mutation: Option<ep::HeaderMutation>,
    body_mutation: Option<ep::BodyMutation>,
) -> ep::CommonResponse {
    ep::CommonResponse {
        header_mutation,
        body_mutation,
        ..Default::default()
    }
}

/// The answer to request headers.
pub fn request_headers_response(
    header_mutation: Option<ep::HeaderMutation>,
    metadata: Option<Struct>,
) -> ep::ProcessingResponse {
    ep::ProcessingResponse {
        dynamic_metadata: metadata,
        response: Some(ep::processing_response::Response::RequestHeaders(
            ep::HeadersResponse {
                response: Some(common(header_mutation, None)),
            },
        )),
        ..Default::default()
    }
}

/// The answer to a request body message: `header_mutation` and a whole
/// replacement body apply in buffered mode; in full-duplex mode `streamed`
/// carries the body chunk sent on.
pub fn request_body_response(
    header_mutation: Option<ep::HeaderMutation>,
    body: Option<BodyOut>,
    metadata: Option<Struct>,
) -> ep::ProcessingResponse {
    ep::ProcessingResponse {
        dynamic_metadata: metadata,
        response: Some(ep::processing_response::Response::RequestBody(
            ep::BodyResponse {
                response: Some(common(header_mutation, body.map(BodyOut::mutation))),
            },
        )),
        ..Default::default()
    }
}

/// The answer to response headers.
pub fn response_headers_response(
    header_mutation: Option<ep::HeaderMutation>,
) -> ep::ProcessingResponse {
    ep::ProcessingResponse {
        response: Some(ep::processing_response::Response::ResponseHeaders(
            ep::HeadersResponse {
                response: Some(common(header_mutation, None)),
            },
        )),
        ..Default::default()
    }
}

/// The answer to a response body chunk.
pub fn response_body_response(body: Option<BodyOut>) -> ep::ProcessingResponse {
    ep::ProcessingResponse {
        response: Some(ep::processing_response::Response::ResponseBody(
            ep::BodyResponse {
                response: Some(common(None, body.map(BodyOut::mutation))),
            },
        )),
        ..Default::default()
    }
}

/// The answer to trailers.
pub fn trailers_response(request: bool) -> ep::ProcessingResponse {
    let t = ep::TrailersResponse::default();
    ep::ProcessingResponse {
        response: Some(if request {
            ep::processing_response::Response::RequestTrailers(t)
        } else {
            ep::processing_response::Response::ResponseTrailers(t)
        }),
        ..Default::default()
    }
}

/// A body sent on: whole (buffered mode) or as a stream chunk (full
/// duplex).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyOut {
    /// Replaces the whole body.
    Whole(Vec<u8>),
    /// A chunk of a full-duplex stream.
    Chunk {
        /// The bytes.
        body: Vec<u8>,
        /// Whether it is the last.
        end_of_stream: bool,
    },
}

impl BodyOut {
    fn mutation(self) -> ep::BodyMutation {
        use ep::body_mutation::Mutation;
        ep::BodyMutation {
            mutation: Some(match self {
                BodyOut::Whole(b) => Mutation::Body(b),
                BodyOut::Chunk {
                    body,
                    end_of_stream,
                } => Mutation::StreamedResponse(ep::StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..Default::default()
                }),
            }),
        }
    }
}

/// A reply the picker gives instead of letting the request go on.
pub fn immediate(reply: &LocalReply, details: &str) -> ep::ProcessingResponse {
    let mut headers = reply.headers.clone();
    if !headers.iter().any(|(k, _)| k == "content-type") {
        headers.push(("content-type".into(), "application/json".into()));
    }
    ep::ProcessingResponse {
        response: Some(ep::processing_response::Response::ImmediateResponse(
            ep::ImmediateResponse {
                status: Some(HttpStatus {
                    code: status_code(reply.status),
                }),
                headers: mutation(&headers, &[]),
                body: reply.body.clone(),
                grpc_status: None,
                details: details.to_string(),
            },
        )),
        ..Default::default()
    }
}

fn status_code(status: u16) -> i32 {
    // Envoy's StatusCode enum numbers each code as itself.
    StatusCode::try_from(i32::from(status)).map_or(i32::from(status), |c| c as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(ns: &str, key: &str, v: Value) -> Metadata {
        Metadata {
            filter_metadata: [(
                ns.to_string(),
                Struct {
                    fields: [(key.to_string(), v)].into(),
                },
            )]
            .into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_subset_hint_is_read_as_a_list_or_a_string_and_may_be_empty() {
        assert_eq!(subset_of(None), None);
        let m = md(
            SUBSET_NAMESPACE,
            SUBSET_KEY,
            list_of(&["10.0.0.1:8000", "10.0.0.2:8000"]),
        );
        assert_eq!(
            subset_of(Some(&m)),
            Some(vec!["10.0.0.1:8000".into(), "10.0.0.2:8000".into()])
        );
        let m = md(SUBSET_NAMESPACE, SUBSET_KEY, list_of(&[]));
        assert_eq!(subset_of(Some(&m)), Some(vec![]), "an empty subset");
        let s = Value {
            kind: Some(Kind::StringValue("10.0.0.1:8000, 10.0.0.3:8000".into())),
        };
        let m = md(SUBSET_NAMESPACE, SUBSET_KEY, s);
        assert_eq!(subset_of(Some(&m)).unwrap().len(), 2);
        assert_eq!(
            subset_of(Some(&md("other", SUBSET_KEY, list_of(&[])))),
            None
        );
    }

    #[test]
    fn the_served_endpoint_comes_from_metadata_else_the_upstream_address() {
        let s = Value {
            kind: Some(Kind::StringValue("10.0.0.9:8000".into())),
        };
        let m = md(LB_NAMESPACE, SERVED_KEY, s);
        assert_eq!(
            served_of(Some(&m), &Default::default()).as_deref(),
            Some("10.0.0.9:8000")
        );
        let attrs = [(
            "envoy.filters.http.ext_proc".to_string(),
            Struct {
                fields: [(
                    UPSTREAM_ADDRESS.to_string(),
                    Value {
                        kind: Some(Kind::StringValue("10.0.0.7:8000".into())),
                    },
                )]
                .into(),
            },
        )]
        .into();
        assert_eq!(served_of(None, &attrs).as_deref(), Some("10.0.0.7:8000"));
        assert_eq!(served_of(None, &Default::default()), None);
    }

    #[test]
    fn mutations_keep_the_last_value_of_a_name_and_write_raw_values() {
        let m = mutation(
            &[
                ("a".into(), "1".into()),
                ("b".into(), "2".into()),
                ("a".into(), "3".into()),
            ],
            &["c".into()],
        )
        .unwrap();
        let set: Vec<(String, Vec<u8>)> = m
            .set_headers
            .iter()
            .map(|h| {
                let h = h.header.as_ref().unwrap();
                (h.key.clone(), h.raw_value.clone())
            })
            .collect();
        assert_eq!(
            set,
            vec![("a".into(), b"3".to_vec()), ("b".into(), b"2".to_vec())]
        );
        assert_eq!(m.remove_headers, vec!["c".to_string()]);
        assert!(mutation(&[], &[]).is_none());
    }

    #[test]
    fn an_immediate_reply_keeps_its_status_headers_and_body() {
        let r = LocalReply {
            status: 429,
            headers: vec![("retry-after".into(), "2".into())],
            body: b"{}".to_vec(),
        };
        let Some(ep::processing_response::Response::ImmediateResponse(i)) =
            immediate(&r, "rate_limited").response
        else {
            panic!()
        };
        assert_eq!(i.status.unwrap().code, 429);
        assert_eq!(i.body, b"{}");
        let names: Vec<&str> = i
            .headers
            .as_ref()
            .unwrap()
            .set_headers
            .iter()
            .map(|h| h.header.as_ref().unwrap().key.as_str())
            .collect();
        assert_eq!(names, vec!["content-type", "retry-after"]);
    }
}
