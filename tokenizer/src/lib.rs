//! Chat templating and tokenization that reproduce what vLLM does for a
//! Qwen3 model, fast enough for a simulator's and a cache indexer's hot path.
//!
//! vLLM renders a chat request with the model's Jinja template
//! (`add_generation_prompt=true`) and tokenizes the result with the Hugging
//! Face tokenizer, `add_special_tokens=False`, matching special tokens that
//! appear in the text. [`ChatTokenizer::encode_chat`] does both and yields
//! the same ids; the encoder re-implements that one tokenizer pipeline
//! (byte-level BPE, NFC, Qwen's split regex), is faster than the
//! `tokenizers` crate (the `tokenizer_speed` example measures both), and is
//! tested against it id for id.
//!
//! ```no_run
//! use kvasir_tokenizer::{ChatMessage, ChatTokenizer};
//!
//! let tok = ChatTokenizer::from_dir(".tools/tokenizers/qwen3")?;
//! let ids = tok.encode_chat(&[ChatMessage::new("user", "Hello!")], true)?;
//! assert_eq!(ids[0], tok.token_to_id("<|im_start|>").unwrap());
//! # Ok::<(), kvasir_tokenizer::TokenizerError>(())
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod bpe;
mod cache;
mod encoder;
mod error;
mod pretok;
#[cfg(feature = "reference")]
pub mod reference;
mod template;

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use encoder::EncodeLimits;
pub use error::TokenizerError;

use encoder::Encoder;
use template::{ChatTemplate, ConfigFile};

/// Default size of the segment cache: enough for thousands of distinct
/// system prompts and conversation turns.
pub const DEFAULT_CACHE_BYTES: usize = 64 << 20;

/// One chat message, as the chat template sees it.
///
/// Deserializes from an OpenAI-style message: `content` may be a string,
/// `null`/absent (empty), or an array of content parts, whose text parts are
/// joined with `"\n"` as vLLM does (see [`flatten_content`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool` for Qwen3's template; the
    /// template skips roles it does not know, and so does vLLM.
    pub role: String,
    /// The message text.
    #[serde(default, deserialize_with = "deserialize_content")]
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and text.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

fn deserialize_content<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let v = Value::deserialize(d)?;
    flatten_content(&v).map_err(serde::de::Error::custom)
}

/// Flattens OpenAI message `content` into the string a text-only chat
/// template sees: a string as is, `null` as empty, and an array of parts
/// (`{"type": "text", "text": ...}` or bare strings) joined with `"\n"`,
/// which is how vLLM flattens them. Non-text parts are an error.
pub fn flatten_content(content: &Value) -> Result<String, TokenizerError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let texts = parts
                .iter()
                .map(|p| match p {
                    Value::String(s) => Ok(s.as_str()),
                    Value::Object(o) => {
                        match (o.get("type").and_then(Value::as_str), o.get("text")) {
                            (Some("text") | None, Some(Value::String(s))) => Ok(s.as_str()),
                            (t, _) => Err(TokenizerError::Message(format!(
                                "unsupported content part type {}",
                                t.unwrap_or("(none)")
                            ))),
                        }
                    }
                    other => Err(TokenizerError::Message(format!("content part {other}"))),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(texts.join("\n"))
        }
        other => Err(TokenizerError::Message(format!(
            "content must be a string or an array of parts, not {other}"
        ))),
    }
}

/// What [`ChatTokenizer::encode_prefix`] encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixIds {
    /// The ids: a prefix of the whole text's ids.
    pub ids: Vec<u32>,
    /// Where encoding stopped, a byte offset in the text (approximate
    /// inside NFC-normalized text); `None` when the text was encoded to its
    /// end and `ids` are all of them.
    pub stopped_at: Option<usize>,
    /// The text's length in bytes.
    pub text_len: usize,
    /// Whether an [`EncodeLimits`] bound stopped it (rather than the
    /// caller's `go_on`).
    pub limited: bool,
}

impl PrefixIds {
    /// Whether `ids` are the whole text's.
    pub fn complete(&self) -> bool {
        self.stopped_at.is_none()
    }

    /// The whole text's token count: exact when complete, else the ids so
    /// far plus the rest of the text at the encoded part's bytes per token.
    pub fn estimated_len(&self) -> usize {
        match self.stopped_at {
            None => self.ids.len(),
            Some(at) => {
                let rest = self.text_len.saturating_sub(at);
                let per_byte = if at > 0 {
                    self.ids.len() as f64 / at as f64
                } else {
                    0.25
                };
                self.ids.len() + (rest as f64 * per_byte).ceil() as usize
            }
        }
    }
}

/// A model's tokenizer and chat template.
///
/// Cheap to share: all methods take `&self` and it is `Send + Sync`; wrap it
/// in an `Arc` for many tasks. Encoding keeps a bounded, thread-safe cache
/// of recently seen segments (text between special tokens, i.e. message
/// bodies), so repeated system prompts and chat histories are not
/// re-tokenized; see [`ChatTokenizer::with_cache_bytes`].
pub struct ChatTokenizer {
    encoder: Encoder,
    template: ChatTemplate,
    eos_token_id: u32,
}

impl std::fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("eos_token_id", &self.eos_token_id)
            .finish_non_exhaustive()
    }
}

fn read(path: &Path) -> Result<String, TokenizerError> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })
}

impl ChatTokenizer {
    /// Loads `tokenizer.json` and `tokenizer_config.json` from a Hugging
    /// Face model directory. A `chat_template.jinja` there is used when the
    /// config has no `chat_template` (newer models ship it separately).
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let dir = dir.as_ref();
        let tokenizer = read(&dir.join("tokenizer.json"))?;
        let config = read(&dir.join("tokenizer_config.json"))?;
        let jinja = dir.join("chat_template.jinja");
        let fallback = if jinja.is_file() {
            Some(read(&jinja)?)
        } else {
            None
        };
        Self::build(&tokenizer, &config, fallback)
    }

    /// Loads the two files from explicit paths.
    pub fn from_files(
        tokenizer_json: impl AsRef<Path>,
        tokenizer_config_json: impl AsRef<Path>,
    ) -> Result<Self, TokenizerError> {
        Self::from_json(
            &read(tokenizer_json.as_ref())?,
            &read(tokenizer_config_json.as_ref())?,
        )
    }

    /// Builds from the two files' contents.
    pub fn from_json(
        tokenizer_json: &str,
        tokenizer_config_json: &str,
    ) -> Result<Self, TokenizerError> {
        Self::build(tokenizer_json, tokenizer_config_json, None)
    }

    fn build(
        tokenizer_json: &str,
        config_json: &str,
        fallback_template: Option<String>,
    ) -> Result<Self, TokenizerError> {
        let config = ConfigFile::parse(config_json)?;
        let source = match config.template() {
            Some(s) => s.to_string(),
            None => fallback_template.ok_or_else(|| {
                TokenizerError::Invalid("tokenizer_config.json has no chat_template".into())
            })?,
        };
        let template = ChatTemplate::new(source, &config)?;
        let mut encoder = Encoder::from_json(tokenizer_json)?;
        encoder.set_cache(DEFAULT_CACHE_BYTES);
        let eos = config.eos_token.as_ref().ok_or_else(|| {
            TokenizerError::Invalid("tokenizer_config.json has no eos_token".into())
        })?;
        let eos_token_id = encoder.token_to_id(eos.as_str()).ok_or_else(|| {
            TokenizerError::Invalid(format!("eos_token {:?} is not a token", eos.as_str()))
        })?;
        Ok(ChatTokenizer {
            encoder,
            template,
            eos_token_id,
        })
    }

    /// Sets the segment cache's size in bytes (keys plus ids); 0 turns it
    /// off. Replaces the current cache, empty.
    pub fn with_cache_bytes(mut self, bytes: usize) -> Self {
        self.encoder.set_cache(bytes);
        self
    }

    /// Renders `messages` with the model's chat template, as vLLM does
    /// before tokenizing. Errors if the template rejects the conversation
    /// (Qwen3's, for example, needs at least one message).
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.template.render(messages, add_generation_prompt)
    }

    /// Token ids of `text`, exactly as Hugging Face `tokenizers` gives them
    /// with `add_special_tokens=False`: added and special tokens written in
    /// the text (`<|im_start|>`, `<think>`, ...) become their single ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encoder.encode(text)
    }

    /// [`render_chat`](Self::render_chat) then [`encode`](Self::encode):
    /// the prompt ids vLLM computes for a chat request.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        Ok(self.encode(&self.render_chat(messages, add_generation_prompt)?))
    }

    /// Encodes `text` like [`encode`](Self::encode), but only as far as the
    /// ids can matter to the caller: before and while encoding text that is
    /// not in the segment cache, it asks `go_on` with the ids up to a block
    /// boundary (multiples of `block` tokens: first the block the new text
    /// starts in, then 2, 4, 8... blocks on), and stops when the answer is
    /// no. A prefix router stops where no engine holds the prompt's blocks:
    /// nothing after that point can be a cache hit, so the usually fresh
    /// tail of a prompt is never encoded.
    ///
    /// The ids are always a prefix of `encode(text)` (segments between
    /// added tokens, and the pre-tokenizer's pieces within them, encode
    /// independently), and whole when `go_on` never said no. Text that was
    /// encoded to its end is cached as usual.
    pub fn encode_prefix(
        &self,
        text: &str,
        block: usize,
        go_on: &mut dyn FnMut(&[u32]) -> bool,
    ) -> PrefixIds {
        self.encode_prefix_limited(text, block, go_on, EncodeLimits::NONE)
    }

    /// [`encode_prefix`](Self::encode_prefix) that also stops before the
    /// first piece past `limits` (see [`EncodeLimits`]): the work of one
    /// call is bounded whatever the text. The ids are still a prefix of
    /// `encode(text)`'s; [`PrefixIds::limited`] says a limit stopped it.
    pub fn encode_prefix_limited(
        &self,
        text: &str,
        block: usize,
        go_on: &mut dyn FnMut(&[u32]) -> bool,
        limits: EncodeLimits,
    ) -> PrefixIds {
        let mut probe = encoder::Probe::new(block, go_on).with_limits(limits);
        let (ids, stopped_at) = self.encoder.encode_prefix(text, &mut probe);
        PrefixIds {
            ids,
            stopped_at,
            text_len: text.len(),
            limited: probe.limited,
        }
    }

    /// [`render_chat`](Self::render_chat) then
    /// [`encode_prefix`](Self::encode_prefix).
    pub fn encode_chat_prefix(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        block: usize,
        go_on: &mut dyn FnMut(&[u32]) -> bool,
    ) -> Result<PrefixIds, TokenizerError> {
        self.encode_chat_prefix_limited(
            messages,
            add_generation_prompt,
            block,
            go_on,
            EncodeLimits::NONE,
        )
    }

    /// [`render_chat`](Self::render_chat) then
    /// [`encode_prefix_limited`](Self::encode_prefix_limited).
    pub fn encode_chat_prefix_limited(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        block: usize,
        go_on: &mut dyn FnMut(&[u32]) -> bool,
        limits: EncodeLimits,
    ) -> Result<PrefixIds, TokenizerError> {
        let text = self.render_chat(messages, add_generation_prompt)?;
        Ok(self.encode_prefix_limited(&text, block, go_on, limits))
    }

    /// Text of `ids`, special tokens included; unknown ids are skipped and
    /// byte sequences that are not UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.encoder.decode(ids)
    }

    /// The id of a token written as in `tokenizer.json` (byte-level form,
    /// e.g. `"Ġthe"`, or an added token such as `"<|im_end|>"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.encoder.token_to_id(token)
    }

    /// The token of an id, written as in `tokenizer.json`.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.encoder.id_to_token(id)
    }

    /// Whether `id` is an added token marked `special` (e.g. `<|im_end|>`,
    /// but not `<think>`).
    pub fn is_special(&self, id: u32) -> bool {
        self.encoder.added_token(id).is_some_and(|t| t.special)
    }

    /// Number of tokens, added tokens included (151,669 for Qwen3; the
    /// model's embedding table is padded larger).
    pub fn vocab_size(&self) -> usize {
        self.encoder.vocab_size()
    }

    /// The id of the config's `eos_token` (`<|im_end|>` for Qwen3 chat).
    pub fn eos_token_id(&self) -> u32 {
        self.eos_token_id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_parts_are_joined_like_vllm() {
        let v: Value = serde_json::json!([
            {"type": "text", "text": "a"},
            "b",
            {"type": "text", "text": "c"}
        ]);
        assert_eq!(flatten_content(&v).unwrap(), "a\nb\nc");
        assert_eq!(flatten_content(&Value::Null).unwrap(), "");
        let image = serde_json::json!([{"type": "image_url", "image_url": {"url": "x"}}]);
        assert!(matches!(
            flatten_content(&image),
            Err(TokenizerError::Message(_))
        ));
        assert!(flatten_content(&serde_json::json!(3)).is_err());
    }

    #[test]
    fn messages_deserialize_from_openai_json() {
        let m: Vec<ChatMessage> = serde_json::from_str(
            r#"[{"role":"user","content":[{"type":"text","text":"hi"}]},
                {"role":"assistant","content":null,"tool_calls":[]},
                {"role":"assistant"}]"#,
        )
        .unwrap();
        assert_eq!(m[0], ChatMessage::new("user", "hi"));
        assert_eq!(m[1], ChatMessage::new("assistant", ""));
        assert_eq!(m[2], ChatMessage::new("assistant", ""));
        assert!(serde_json::from_str::<ChatMessage>(r#"{"content":"no role"}"#).is_err());
        assert!(serde_json::from_str::<ChatMessage>(
            r#"{"role":"user","content":[{"type":"image_url"}]}"#
        )
        .is_err());
    }
}
