//! # kvasir-controller
//!
//! Turns the `kvasir.dev` resources of each namespace into the
//! `EnvoyExtensionPolicy` that carries the filter to each target, through
//! the same [`kvasir_api::compile`] as `kvasirctl`.
//!
//! - [`plan`]: pure; from a namespace's objects and the compile results to
//!   the writes and the status conditions.
//! - [`reconcile`]: one namespace against the API server.
//! - [`run`]: the watches that trigger reconciles, and the work loop.
//! - [`leader`]: leader election over a `coordination.k8s.io` Lease.
//! - [`http`], [`metrics`]: `/healthz`, `/readyz`, `/metrics`, and the
//!   filter module Envoy Gateway downloads.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod http;
pub mod leader;
pub mod metrics;
pub mod plan;
pub mod reconcile;
pub mod run;
