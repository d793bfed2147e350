//! `kvasir.v1`: the one contract between Kvasir's Envoy filter and its
//! cache-indexer, as prost types (always; they build for `wasm32-wasip1`)
//! and tonic service code (features `server`, `client`).
//!
//! The source of truth is `proto/kvasir/v1/indexer.proto`, which documents
//! every field and the versioning rules; the generated items carry those
//! comments. [`labels`] holds the one table of words for each closed set
//! (metric labels, stat names) and the readers that fall back to the
//! words an older indexer sends.
#![forbid(unsafe_code)]

/// The `kvasir.v1` package: `Indexer` service messages and enums.
#[allow(
    missing_docs,
    clippy::doc_lazy_continuation,
    clippy::doc_overindented_list_items
)]
pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/kvasir.v1.rs"));
}

pub mod budget;
pub mod labels;

/// Envoy's external processing service and the types it uses, as their
/// packages lay them out (generated code names each other by these paths).
#[cfg(feature = "ext-proc")]
#[allow(missing_docs, clippy::all, clippy::pedantic, rustdoc::all)]
pub mod envoy {
    macro_rules! package {
        ($file:literal) => {
            include!(concat!(env!("OUT_DIR"), "/", $file));
        };
    }
    pub mod config {
        pub mod core {
            pub mod v3 {
                package!("envoy.config.core.v3.rs");
            }
        }
    }
    pub mod extensions {
        pub mod filters {
            pub mod http {
                pub mod ext_proc {
                    pub mod v3 {
                        package!("envoy.extensions.filters.http.ext_proc.v3.rs");
                    }
                }
            }
        }
    }
    pub mod r#type {
        pub mod v3 {
            package!("envoy.r#type.v3.rs");
        }
    }
    pub mod service {
        pub mod ext_proc {
            pub mod v3 {
                package!("envoy.service.ext_proc.v3.rs");
            }
        }
    }
}

/// The `xds` packages Envoy's protos import.
#[cfg(feature = "ext-proc")]
#[allow(missing_docs, clippy::all, rustdoc::all)]
pub mod xds {
    pub mod annotations {
        pub mod v3 {
            include!(concat!(env!("OUT_DIR"), "/xds.annotations.v3.rs"));
        }
    }
    pub mod core {
        pub mod v3 {
            include!(concat!(env!("OUT_DIR"), "/xds.core.v3.rs"));
        }
    }
}

/// The `udpa` annotations Envoy's protos import.
#[cfg(feature = "ext-proc")]
#[allow(missing_docs, clippy::all, rustdoc::all)]
pub mod udpa {
    pub mod annotations {
        include!(concat!(env!("OUT_DIR"), "/udpa.annotations.rs"));
    }
}

/// protoc-gen-validate's rules, imported by Envoy's protos.
#[cfg(feature = "ext-proc")]
#[allow(missing_docs, clippy::all, rustdoc::all)]
pub mod validate {
    include!(concat!(env!("OUT_DIR"), "/validate.rs"));
}

/// The fully qualified name of the `Indexer` service, as gRPC health
/// checks and Envoy's `dispatch_grpc_call` name it.
pub const INDEXER_SERVICE: &str = "kvasir.v1.Indexer";

#[cfg(test)]
mod tests {
    use super::v1::*;
    use prost::Message;

    #[test]
    fn pick_request_round_trips() {
        let req = PickRequest {
            pool: "p".into(),
            request_id: "r1".into(),
            prompt: Some(pick_request::Prompt::Chat(Chat {
                messages: vec![ChatMessage {
                    role: "user".into(),
                    content: "hi".into(),
                }],
            })),
            hints: Some(Hints {
                cache_salt: "s".into(),
                ..Default::default()
            }),
            max_endpoints: 3,
            ..Default::default()
        };
        let bytes = req.encode_to_vec();
        assert_eq!(PickRequest::decode(bytes.as_slice()).unwrap(), req);
    }

    #[test]
    fn enums_have_stable_names() {
        assert_eq!(
            Decision::AllSaturated.as_str_name(),
            "DECISION_ALL_SATURATED"
        );
        assert_eq!(
            Outcome::from_str_name("OUTCOME_SUCCESS"),
            Some(Outcome::Success)
        );
        assert_eq!(SyncState::InSync as i32, 2);
    }
}
