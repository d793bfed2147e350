//! `poolsFile`: pools kept in a second file and added to the main file's
//! `pools`. It lives in [`crate::config::pools_file`], since reading a
//! config file adds them; this path stays for existing callers.

pub use crate::config::pools_file::{add_pools, resolve};
