//! Reading a configuration file.

use std::path::Path;

use super::error::ConfigError;
use super::pools_file::add_pools;
use super::schema::Config;

/// Parses a config file's text (YAML; JSON is YAML too).
pub fn parse(text: &str, path: &Path) -> Result<Config, ConfigError> {
    serde_yaml::from_str(text).map_err(|e| ConfigError::Parse {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Reads and parses a config file, with its `poolsFile`'s pools added
/// (those are validated; the rest is not yet).
pub fn load_file(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let mut cfg = parse(&text, path)?;
    add_pools(&mut cfg, path)?;
    Ok(cfg)
}
