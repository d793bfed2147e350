//! What can be wrong with a configuration, and where.

use std::path::PathBuf;

/// A configuration problem, with where it is.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid YAML/JSON of the expected shape.
    #[error("parsing config file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (it names line and column).
        message: String,
    },
    /// A flag's value is malformed.
    #[error("{flag}: {message}")]
    Flag {
        /// The flag, e.g. `--endpoint[0]`.
        flag: String,
        /// What is wrong.
        message: String,
    },
    /// A value is out of range or inconsistent; `path` names it.
    #[error("{path}: {message}")]
    Invalid {
        /// Where, e.g. `pools[1].endpoints[0].address`.
        path: String,
        /// What is wrong.
        message: String,
    },
}

/// An [`ConfigError::Invalid`] at `path`.
pub(crate) fn invalid(path: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        path: path.into(),
        message: message.into(),
    }
}
