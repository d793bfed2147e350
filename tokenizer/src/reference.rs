//! The Hugging Face `tokenizers` crate, as ground truth.
//!
//! This is the implementation vLLM's tokenizer wraps; the fast encoder is
//! tested to give exactly its ids. Slow (a few hundred thousand tokens per
//! second), so it is behind the `reference` feature and not for hot paths.

use std::path::Path;

use crate::TokenizerError;

/// A `tokenizer.json` loaded by Hugging Face `tokenizers`.
pub struct ReferenceTokenizer {
    inner: tokenizers::Tokenizer,
}

impl ReferenceTokenizer {
    /// Loads a `tokenizer.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let inner = tokenizers::Tokenizer::from_file(path.as_ref())
            .map_err(|e| TokenizerError::Reference(e.to_string()))?;
        Ok(ReferenceTokenizer { inner })
    }

    /// Loads from the contents of a `tokenizer.json`.
    pub fn from_json(json: &str) -> Result<Self, TokenizerError> {
        let inner: tokenizers::Tokenizer = json
            .parse()
            .map_err(|e: tokenizers::Error| TokenizerError::Reference(e.to_string()))?;
        Ok(ReferenceTokenizer { inner })
    }

    /// Ids of `text` with `add_special_tokens=False`, as vLLM tokenizes a
    /// rendered chat prompt.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Reference(e.to_string()))
    }
}
