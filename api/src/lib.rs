//! # kvasir-api
//!
//! Kvasir's Kubernetes API, group `kvasir.dev`, version `v1alpha1`
//! ([`types`]), the CRDs generated from it ([`crds`]), and the pure
//! function both `kvasirctl` and the controller use to turn a namespace's
//! resources into the filter's compiled configuration ([`assemble`]).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod assemble;
pub mod crds;
pub mod document;
pub mod eep;
pub mod flow;
pub mod indexer;
pub mod routes;
pub mod schema;
pub mod status;
pub mod types;

pub use assemble::{compile, targets, Compiled, Finding, ObjectRef, Options, Resources, Secrets};
pub use document::{Document, DocumentError};
pub use types::*;
