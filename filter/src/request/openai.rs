//! OpenAI's `/v1/chat/completions` and `/v1/completions` bodies.

use std::borrow::Cow;
use std::fmt;

use kvasir_policy::ApiKind;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use super::content::{Message, StreamOptions};
use super::{
    integral, parse, require_model, BodyError, Count, Obj, ParsedRequest, RequestPrompt, Str,
    TokenId,
};

/// A `/v1/completions` prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt<'a> {
    /// One text prompt.
    Text(Cow<'a, str>),
    /// Token ids.
    Ids(Vec<u32>),
    /// A batch (several prompts): parsed for stats, not picked.
    Batch(Vec<Cow<'a, str>>, Vec<Vec<u32>>),
}

enum PromptElem<'a> {
    Id(u32),
    Text(Cow<'a, str>),
    Ids(Vec<u32>),
}

impl<'de: 'a, 'a> Deserialize<'de> for PromptElem<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = PromptElem<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a token id, a string, or a list of token ids")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                u32::try_from(v)
                    .map(PromptElem::Id)
                    .map_err(|_| E::custom("token id out of range"))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                u32::try_from(v)
                    .map(PromptElem::Id)
                    .map_err(|_| E::custom("token id out of range"))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                u32::try_from(integral::<E>(v)?)
                    .map(PromptElem::Id)
                    .map_err(|_| E::custom("token id out of range"))
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(PromptElem::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(PromptElem::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut ids = Vec::new();
                while let Some(TokenId(id)) = seq.next_element()? {
                    ids.push(id);
                }
                Ok(PromptElem::Ids(ids))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Prompt<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Prompt<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a list of strings, a list of token ids, or a list of lists of token ids")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Prompt::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Prompt::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let (mut ids, mut texts, mut lists) = (Vec::new(), Vec::new(), Vec::new());
                while let Some(e) = seq.next_element::<PromptElem<'a>>()? {
                    match e {
                        PromptElem::Id(i) => ids.push(i),
                        PromptElem::Text(t) => texts.push(t),
                        PromptElem::Ids(l) => lists.push(l),
                    }
                }
                let kinds = usize::from(!ids.is_empty())
                    + usize::from(!texts.is_empty())
                    + usize::from(!lists.is_empty());
                if kinds > 1 {
                    return Err(de::Error::custom(
                        "prompt mixes token ids, strings and lists",
                    ));
                }
                Ok(if !ids.is_empty() {
                    Prompt::Ids(ids)
                } else if texts.len() == 1 {
                    Prompt::Text(texts.remove(0))
                } else if lists.len() == 1 {
                    Prompt::Ids(lists.remove(0))
                } else {
                    Prompt::Batch(texts, lists)
                })
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

#[derive(Deserialize)]
struct ChatBody<'a> {
    #[serde(borrow, default)]
    model: Option<Str<'a>>,
    #[serde(borrow, default)]
    messages: Option<Vec<Obj<Message<'a>>>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<Obj<StreamOptions>>,
    #[serde(default)]
    max_tokens: Option<Count>,
    #[serde(default)]
    max_completion_tokens: Option<Count>,
    #[serde(borrow, default)]
    cache_salt: Option<Str<'a>>,
}

#[derive(Deserialize)]
struct CompletionsBody<'a> {
    #[serde(borrow, default)]
    model: Option<Str<'a>>,
    #[serde(borrow, default)]
    prompt: Option<Prompt<'a>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<Obj<StreamOptions>>,
    #[serde(default)]
    max_tokens: Option<Count>,
    #[serde(borrow, default)]
    cache_salt: Option<Str<'a>>,
}

/// Parses a `/v1/chat/completions` body (`text` is `body`, checked UTF-8).
pub(super) fn chat<'a>(body: &'a [u8], text: &'a str) -> Result<ParsedRequest<'a>, BodyError> {
    let b: ChatBody = parse(body)?;
    let model = require_model(b.model)?;
    let messages = match b.messages {
        Some(m) if !m.is_empty() => m.into_iter().map(|Obj(m)| m).collect(),
        _ => {
            return Err(BodyError::new(
                "missing_messages",
                Some("messages"),
                "`messages` must be a non-empty list",
            ))
        }
    };
    Ok(ParsedRequest {
        stream: b.stream.unwrap_or(false),
        include_usage: b.stream_options.as_ref().and_then(|o| o.0.include_usage),
        has_stream_options: b.stream_options.is_some(),
        max_tokens: b.max_completion_tokens.or(b.max_tokens).map_or(0, |c| c.0),
        cache_salt: b.cache_salt.map(|s| s.0),
        ..ParsedRequest::new(ApiKind::Chat, model, RequestPrompt::Chat(messages), text)
    })
}

/// Parses a `/v1/completions` body.
pub(super) fn completions<'a>(
    body: &'a [u8],
    text: &'a str,
) -> Result<ParsedRequest<'a>, BodyError> {
    let b: CompletionsBody = parse(body)?;
    let model = require_model(b.model)?;
    let prompt = match b.prompt {
        Some(Prompt::Text(t)) => Prompt::Text(t),
        Some(Prompt::Ids(ids)) if !ids.is_empty() => Prompt::Ids(ids),
        Some(Prompt::Batch(t, l)) if !(t.is_empty() && l.is_empty()) => Prompt::Batch(t, l),
        _ => {
            return Err(BodyError::new(
                "missing_prompt",
                Some("prompt"),
                "`prompt` is required",
            ))
        }
    };
    Ok(ParsedRequest {
        stream: b.stream.unwrap_or(false),
        include_usage: b.stream_options.as_ref().and_then(|o| o.0.include_usage),
        has_stream_options: b.stream_options.is_some(),
        max_tokens: b.max_tokens.map_or(0, |c| c.0),
        cache_salt: b.cache_salt.map(|s| s.0),
        ..ParsedRequest::new(
            ApiKind::Completions,
            model,
            RequestPrompt::Completion(prompt),
            text,
        )
    })
}
