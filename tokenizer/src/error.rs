use std::path::PathBuf;

/// Everything that can go wrong loading a tokenizer or rendering a chat.
///
/// Encoding itself cannot fail: every `&str` has a tokenization.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A tokenizer file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file that was being read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },

    /// A tokenizer file is not valid JSON or lacks required fields.
    #[error("malformed {what}: {source}")]
    Json {
        /// Which file ("tokenizer.json" or "tokenizer_config.json").
        what: &'static str,
        /// The parse error, with line and column.
        #[source]
        source: serde_json::Error,
    },

    /// The files parse but are inconsistent (e.g. a merge names a token that
    /// is not in the vocabulary).
    #[error("invalid tokenizer: {0}")]
    Invalid(String),

    /// The tokenizer uses a feature the fast encoder does not reproduce
    /// exactly; refusing is better than silently producing different ids.
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),

    /// The chat template failed to compile or to render (including the
    /// template's own `raise_exception`).
    #[error("chat template error: {0:#}")]
    Template(#[from] Box<minijinja::Error>),

    /// A chat message could not be turned into text (e.g. an image part).
    #[error("invalid chat message: {0}")]
    Message(String),

    /// The reference implementation (Hugging Face `tokenizers`) failed.
    #[cfg(feature = "reference")]
    #[error("reference tokenizer: {0}")]
    Reference(String),
}

impl From<minijinja::Error> for TokenizerError {
    fn from(e: minijinja::Error) -> Self {
        TokenizerError::Template(Box::new(e))
    }
}
