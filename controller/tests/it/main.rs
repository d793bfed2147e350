//! The crate's integration tests as one binary: one link instead of one
//! per file, which is most of a test build's time.

mod leader;
mod mock_api;
mod work_loop;
