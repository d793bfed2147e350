//! The crate's integration tests as one binary: one link instead of one
//! per file, which is most of a test build's time.

mod budget;
mod common;
mod compile;
mod examples;
mod flow;
mod matching;
mod parse;
mod pii_guard;
mod tenant;
mod validation;
