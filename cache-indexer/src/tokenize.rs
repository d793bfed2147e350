//! Request -> token ids, exactly as the engine computes them (or, in
//! `approx` mode, a stable stand-in).
//!
//! Modes, one per pool (`tokenizer:` in the config):
//!
//! * **tokenizer** (a directory): the model's chat template with
//!   `add_generation_prompt = true`, then the model's tokenizer, in process
//!   ([`kvasir_tokenizer::ChatTokenizer`]). Exact ids. The tokenizer keeps a
//!   segment cache (text between special tokens, i.e. message bodies), so a
//!   multi-turn chat re-tokenizes only its newest message; the template itself
//!   is re-rendered each time (measured: well under the encode cost, see the
//!   README's benchmark), so no conversation-level cache is kept on top.
//! * **render**: ask one healthy engine for the ids
//!   (`/v1/chat/completions/render` for chats, `/tokenize` for text) with a
//!   short timeout. Exact ids, one round trip per pick. If the call fails the
//!   pick goes on by load alone (`no_index`), never fails.
//! * **approx**: no tokenizer at all. The prompt's bytes (chats: each
//!   message's role and content with separators) are cut into 4-byte
//!   pseudo-tokens (about one real token each for English). These cannot be
//!   compared with the engines' KV events, so they are matched against the
//!   pool's *pick history* ([`crate::history::PickHistory`]): when a request
//!   goes to an endpoint, its pseudo-blocks are recorded for that endpoint,
//!   and a later request sharing a prefix is matched against that history.
//!   It only knows what this replica sent and not what the engine evicted;
//!   each endpoint's history is an LRU of `pickHistoryBlocks` blocks.
//!   Predicted cached tokens are pseudo-tokens (approximate).
//!
//! A prompt given as token ids is used as is in every mode and matched
//! against the real index (the KV-event index, or the pick history when the
//! pool's `index` is `picks`: then every request is matched against it).

use std::sync::Arc;
use std::time::Duration;

use kvasir_tokenizer::{ChatMessage, ChatTokenizer, EncodeLimits, PrefixIds};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Bounds on one pick's in-process tokenization (`tokenizeBudget` in a
/// pool's config): BPE over a long piece is superlinear, so without them
/// one prompt of a repeated character could hold a core for a quarter of a
/// second. Past them the pick matches the prefix it tokenized (exact ids)
/// and estimates the rest's length; text the segment cache holds is free.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct TokenizeBudget {
    /// Most bytes of not-yet-seen prompt text one pick tokenizes.
    #[serde(alias = "max_bytes")]
    pub max_bytes: usize,
    /// Longest pre-tokenizer piece tokenized (a run of one character or of
    /// punctuation is one piece); a longer one ends the tokenization.
    #[serde(alias = "max_piece_bytes")]
    pub max_piece_bytes: usize,
}

impl Default for TokenizeBudget {
    fn default() -> Self {
        TokenizeBudget {
            max_bytes: 128 * 1024,
            max_piece_bytes: 4096,
        }
    }
}

impl TokenizeBudget {
    /// The tokenizer's form of the bounds.
    pub fn limits(&self) -> EncodeLimits {
        EncodeLimits {
            max_bytes: self.max_bytes,
            max_piece_bytes: self.max_piece_bytes,
        }
    }

    /// Checks ranges; on error, the field name and what is wrong.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.max_bytes < 1024 {
            return Err((
                "maxBytes",
                format!("must be at least 1024, got {}", self.max_bytes),
            ));
        }
        if !(16..=self.max_bytes).contains(&self.max_piece_bytes) {
            return Err((
                "maxPieceBytes",
                format!(
                    "must be 16..=maxBytes ({}), got {}",
                    self.max_bytes, self.max_piece_bytes
                ),
            ));
        }
        Ok(())
    }
}

/// The request's prompt.
#[derive(Debug, Clone, Copy)]
pub enum PromptInput<'a> {
    /// Chat messages.
    Chat(&'a [ChatMessage]),
    /// A plain prompt string.
    Text(&'a str),
    /// Token ids.
    TokenIds(&'a [u32]),
}

/// How a prompt was turned into ids: the contract's enum, so the answer's
/// `tokenized_by` and the `mode` label ([`TokenizeMode::as_label`]) come
/// from one table.
pub use kvasir_proto::v1::TokenizeMode;

/// A tokenized prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    /// The ids (pseudo-ids in approx mode).
    pub ids: Vec<u32>,
    /// How they were made.
    pub mode: TokenizeMode,
}

impl Tokenized {
    /// Whether the ids are the engine's own (comparable with KV events).
    pub fn exact(&self) -> bool {
        self.mode != TokenizeMode::Approx
    }
}

/// Why a prompt could not be tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// The chat template rejected the conversation (a caller error).
    #[error("chat template rejected the messages: {0}")]
    Template(String),
    /// No healthy endpoint to ask (render mode).
    #[error("no healthy endpoint to render the prompt")]
    NoRenderTarget,
    /// The render call failed (timeout, connection, bad answer).
    #[error("render via {address} failed: {message}")]
    Render {
        /// The endpoint asked.
        address: String,
        /// What went wrong.
        message: String,
    },
}

impl TokenizeError {
    /// Whether the request itself is at fault (INVALID_ARGUMENT), as opposed
    /// to the tokenizer being unavailable (pick by load instead).
    pub fn is_caller_error(&self) -> bool {
        matches!(self, TokenizeError::Template(_))
    }
}

/// A pool's tokenizer.
#[derive(Clone)]
pub enum RequestTokenizer {
    /// In process.
    Local(Arc<ChatTokenizer>),
    /// Through an engine.
    Render {
        /// HTTP client (shared, keep-alive).
        client: reqwest::Client,
        /// Model name sent with each call.
        model: String,
        /// Timeout of one call.
        timeout: Duration,
    },
    /// Pseudo-tokens.
    Approx,
}

impl std::fmt::Debug for RequestTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RequestTokenizer::Local(_) => "RequestTokenizer::Local",
            RequestTokenizer::Render { .. } => "RequestTokenizer::Render",
            RequestTokenizer::Approx => "RequestTokenizer::Approx",
        })
    }
}

impl RequestTokenizer {
    /// The pool's configured mode (what `kvasir_indexer_tokenize_mode` shows).
    pub fn mode(&self) -> TokenizeMode {
        match self {
            RequestTokenizer::Local(_) => TokenizeMode::Tokenizer,
            RequestTokenizer::Render { .. } => TokenizeMode::Render,
            RequestTokenizer::Approx => TokenizeMode::Approx,
        }
    }

    /// Whether tokenizing needs an engine address ([`Self::tokenize`]'s
    /// `render_via`).
    pub fn needs_engine(&self) -> bool {
        matches!(self, RequestTokenizer::Render { .. })
    }

    /// Token ids of a prompt. `render_via` is the engine to ask in render
    /// mode (ignored otherwise).
    pub async fn tokenize(
        &self,
        prompt: PromptInput<'_>,
        render_via: Option<&str>,
    ) -> Result<Tokenized, TokenizeError> {
        if let PromptInput::TokenIds(ids) = prompt {
            return Ok(Tokenized {
                ids: ids.to_vec(),
                mode: TokenizeMode::TokenIds,
            });
        }
        match self {
            RequestTokenizer::Local(tok) => Ok(Tokenized {
                ids: tokenize_local(tok, prompt)?,
                mode: TokenizeMode::Tokenizer,
            }),
            RequestTokenizer::Approx => Ok(Tokenized {
                ids: approx_ids(prompt),
                mode: TokenizeMode::Approx,
            }),
            RequestTokenizer::Render {
                client,
                model,
                timeout,
            } => {
                let address = render_via.ok_or(TokenizeError::NoRenderTarget)?;
                let ids = render(client, address, model, *timeout, prompt).await?;
                Ok(Tokenized {
                    ids,
                    mode: TokenizeMode::Render,
                })
            }
        }
    }
}

/// In-process tokenization (chat template + tokenizer, as vLLM does).
pub fn tokenize_local(
    tok: &ChatTokenizer,
    prompt: PromptInput<'_>,
) -> Result<Vec<u32>, TokenizeError> {
    match prompt {
        PromptInput::Chat(messages) => tok
            .encode_chat(messages, true)
            .map_err(|e| TokenizeError::Template(e.to_string())),
        PromptInput::Text(text) => Ok(tok.encode(text)),
        PromptInput::TokenIds(ids) => Ok(ids.to_vec()),
    }
}

/// [`tokenize_local`] that stops where `go_on` says no or past `limits`
/// (see [`ChatTokenizer::encode_prefix_limited`]); token ids are taken
/// whole.
pub fn tokenize_local_prefix(
    tok: &ChatTokenizer,
    prompt: PromptInput<'_>,
    block: usize,
    go_on: &mut dyn FnMut(&[u32]) -> bool,
    limits: EncodeLimits,
) -> Result<PrefixIds, TokenizeError> {
    match prompt {
        PromptInput::Chat(messages) => tok
            .encode_chat_prefix_limited(messages, true, block, go_on, limits)
            .map_err(|e| TokenizeError::Template(e.to_string())),
        PromptInput::Text(text) => Ok(tok.encode_prefix_limited(text, block, go_on, limits)),
        PromptInput::TokenIds(ids) => Ok(PrefixIds {
            ids: ids.to_vec(),
            stopped_at: None,
            text_len: 0,
            limited: false,
        }),
    }
}

/// Pseudo-token ids of a prompt in approx mode: its bytes, 4 to a token
/// (little-endian, the last one zero-padded). Chats are laid out as
/// `\x01role\x02content` per message so that different role/content splits
/// never produce the same bytes. Stable forever: replicas and versions must
/// agree.
pub fn approx_ids(prompt: PromptInput<'_>) -> Vec<u32> {
    let bytes: Vec<u8> = match prompt {
        PromptInput::Chat(messages) => {
            let mut b = Vec::with_capacity(
                messages
                    .iter()
                    .map(|m| m.role.len() + m.content.len() + 2)
                    .sum(),
            );
            for m in messages {
                b.push(1);
                b.extend_from_slice(m.role.as_bytes());
                b.push(2);
                b.extend_from_slice(m.content.as_bytes());
            }
            b
        }
        PromptInput::Text(t) => t.as_bytes().to_vec(),
        PromptInput::TokenIds(ids) => return ids.to_vec(),
    };
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_le_bytes(w)
        })
        .collect()
}

async fn render(
    client: &reqwest::Client,
    address: &str,
    model: &str,
    timeout: Duration,
    prompt: PromptInput<'_>,
) -> Result<Vec<u32>, TokenizeError> {
    let fail = |message: String| TokenizeError::Render {
        address: address.to_string(),
        message,
    };
    let (url, body) = match prompt {
        PromptInput::Chat(messages) => {
            let mut body = serde_json::json!({
                "messages": messages,
                "add_generation_prompt": true,
            });
            if !model.is_empty() {
                body["model"] = Value::String(model.to_string());
            }
            (format!("http://{address}/v1/chat/completions/render"), body)
        }
        PromptInput::Text(text) => {
            let mut body = serde_json::json!({ "prompt": text });
            if !model.is_empty() {
                body["model"] = Value::String(model.to_string());
            }
            (format!("http://{address}/tokenize"), body)
        }
        PromptInput::TokenIds(ids) => return Ok(ids.to_vec()),
    };
    let resp = client
        .post(&url)
        .timeout(timeout)
        .json(&body)
        .send()
        .await
        .map_err(|e| fail(e.to_string()))?;
    let status = resp.status();
    let bytes = resp.bytes().await.map_err(|e| fail(e.to_string()))?;
    if !status.is_success() {
        let text = String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned();
        return Err(fail(format!("status {status}: {text}")));
    }
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| fail(format!("bad JSON: {e}")))?;
    extract_ids(&v).ok_or_else(|| fail("answer has no token ids".into()))
}

/// Finds the prompt ids in a render / tokenize answer. Accepts the shapes
/// vLLM versions use: `token_ids`, `prompt_token_ids` or `tokens` at the top
/// level, possibly inside a one-element array or an `engine_prompts` list.
pub fn extract_ids(v: &Value) -> Option<Vec<u32>> {
    match v {
        Value::Array(items) => items.first().and_then(extract_ids),
        Value::Object(o) => {
            for key in ["token_ids", "prompt_token_ids", "tokens"] {
                if let Some(Value::Array(ids)) = o.get(key) {
                    return ids
                        .iter()
                        .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
                        .collect();
                }
            }
            o.get("engine_prompts").and_then(extract_ids)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn approx_ids_are_stable_and_prefix_preserving() {
        let a = [
            ChatMessage::new("system", "You are helpful."),
            ChatMessage::new("user", "Hi"),
        ];
        let b = [
            ChatMessage::new("system", "You are helpful."),
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello! How can I help?"),
        ];
        let ia = approx_ids(PromptInput::Chat(&a));
        let ib = approx_ids(PromptInput::Chat(&b));
        // Byte prefix -> id prefix, except the zero-padded last id.
        assert_eq!(ia[..ia.len() - 1], ib[..ia.len() - 1]);
        assert_eq!(
            approx_ids(PromptInput::Text("abcd")),
            vec![u32::from_le_bytes(*b"abcd")]
        );
        assert_eq!(approx_ids(PromptInput::Text("abcde")).len(), 2);
        // Role/content boundaries matter.
        let x = [ChatMessage::new("user", "ab")];
        let y = [ChatMessage::new("usera", "b")];
        assert_ne!(
            approx_ids(PromptInput::Chat(&x)),
            approx_ids(PromptInput::Chat(&y))
        );
    }

    #[test]
    fn extracts_ids_from_answer_shapes() {
        assert_eq!(extract_ids(&json!({"token_ids": [1, 2]})), Some(vec![1, 2]));
        assert_eq!(
            extract_ids(&json!({"count": 2, "tokens": [3]})),
            Some(vec![3])
        );
        assert_eq!(
            extract_ids(&json!([{"prompt_token_ids": [4]}])),
            Some(vec![4])
        );
        assert_eq!(
            extract_ids(&json!({"engine_prompts": [{"prompt_token_ids": [5]}]})),
            Some(vec![5])
        );
        assert_eq!(extract_ids(&json!({"token_ids": [-1]})), None);
        assert_eq!(extract_ids(&json!({"x": 1})), None);
    }

    #[tokio::test]
    async fn token_ids_pass_through_in_every_mode() {
        let t = RequestTokenizer::Approx;
        let r = t
            .tokenize(PromptInput::TokenIds(&[7, 8]), None)
            .await
            .unwrap();
        assert_eq!(
            r,
            Tokenized {
                ids: vec![7, 8],
                mode: TokenizeMode::TokenIds
            }
        );
        assert!(r.exact());
        let render = RequestTokenizer::Render {
            client: reqwest::Client::new(),
            model: String::new(),
            timeout: Duration::from_millis(10),
        };
        assert!(matches!(
            render.tokenize(PromptInput::Text("x"), None).await,
            Err(TokenizeError::NoRenderTarget)
        ));
    }

    #[test]
    fn local_matches_the_tokenizer_crate() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/tokenizers/qwen3");
        let Ok(tok) = ChatTokenizer::from_dir(&dir) else {
            eprintln!("skipped: no tokenizer at {}", dir.display());
            return;
        };
        let m = [ChatMessage::new("user", "Hello there")];
        let ids = tokenize_local(&tok, PromptInput::Chat(&m)).unwrap();
        assert_eq!(ids, tok.encode_chat(&m, true).unwrap());
        assert!(matches!(
            tokenize_local(&tok, PromptInput::Chat(&[])),
            Err(TokenizeError::Template(_))
        ));
    }
}
