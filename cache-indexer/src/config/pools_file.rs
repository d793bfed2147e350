//! `poolsFile`: pools kept in a second file and added to the main file's
//! `pools`.
//!
//! In Kubernetes the controller generates it from the namespace's
//! InferencePools (`kvasir_api::indexer`: ConfigMap `kvasir-indexer-pools`,
//! key `pools.yaml`) while people keep writing the main file, so the two
//! have different owners and neither overwrites the other. The file is read
//! once, at start: the controller rolls the indexer's Deployment when the
//! pools change.
//!
//! ```yaml
//! pools:
//!   - name: main
//!     model: llama-3.1-8b-instruct
//!     blockSize: 16
//!     tokenizer: render
//!     discovery: { namespace: serving, inferencePool: main, eventsPort: 5557, replayPort: 5558, topic: "" }
//! ```
//!
//! Each pool has the main file's pool schema. Errors name the file and the
//! pool's place in it (`/etc/kvasir/pools/pools.yaml: pools[0].blockSize:
//! ...`), since a merged index would point nowhere a person can look.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::error::ConfigError;
use super::schema::{Config, PoolConfig};
use super::validate::validate_pool;

/// The file's shape: only `pools`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PoolsFile {
    #[serde(default)]
    pools: Vec<PoolConfig>,
}

/// Where `pools_file` is: relative paths are relative to the main config
/// file's directory, so a ConfigMap mounted next to it is found whatever the
/// working directory.
pub fn resolve(config_path: &Path, pools_file: &Path) -> PathBuf {
    match config_path.parent() {
        Some(dir) if pools_file.is_relative() => dir.join(pools_file),
        _ => pools_file.to_path_buf(),
    }
}

/// Adds the pools of `cfg.pools_file` (if set) to `cfg.pools`; the file
/// was read from `config_path`. A missing pools file is a warning, not an
/// error: the controller may not have written it yet, and rolls the
/// indexer once it has.
pub fn add_pools(cfg: &mut Config, config_path: &Path) -> Result<(), ConfigError> {
    let Some(pools_file) = &cfg.pools_file else {
        return Ok(());
    };
    let file = resolve(config_path, pools_file);
    let text = match std::fs::read_to_string(&file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::warn!(
                pools_file = %file.display(),
                inline_pools = cfg.pools.len(),
                "poolsFile not found: starting with the main config's pools only"
            );
            return Ok(());
        }
        Err(source) => return Err(ConfigError::Read { path: file, source }),
    };
    // An empty file (an empty ConfigMap key) holds no pools.
    let extra = match text.trim().is_empty() {
        true => PoolsFile { pools: Vec::new() },
        false => serde_yaml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: file.clone(),
            message: e.to_string(),
        })?,
    };
    let in_file = |path: String, message: String| ConfigError::Invalid {
        path: format!("{}: {path}", file.display()),
        message,
    };
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, pool) in extra.pools.iter().enumerate() {
        let at = format!("pools[{i}]");
        validate_pool(pool, &at).map_err(|e| match e {
            ConfigError::Invalid { path, message } => in_file(path, message),
            other => other,
        })?;
        if let Some(j) = seen.insert(pool.name.as_str(), i) {
            return Err(in_file(
                format!("{at}.name"),
                format!("duplicate pool name `{}` (also pools[{j}])", pool.name),
            ));
        }
        if let Some(j) = cfg.pools.iter().position(|p| p.name == pool.name) {
            return Err(in_file(
                format!("{at}.name"),
                format!(
                    "pool `{}` is also in {} at pools[{j}]; a name may be in one file only",
                    pool.name,
                    config_path.display()
                ),
            ));
        }
    }
    cfg.pools.extend(extra.pools);
    Ok(())
}

#[cfg(test)]
#[path = "pools_file_tests.rs"]
mod tests;
