//! OpenAI's `/v1/chat/completions` and `/v1/completions` bodies.

use std::borrow::Cow;
use std::fmt;

use kvasir_policy::ApiKind;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use super::content::{Message, StreamOptions};
use super::{
    parse, require_model, BodyError, Count, CountVisitor, Obj, ParsedRequest, RequestPrompt, Str,
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

/// An element of a `prompt` list, before the list's type is known.
enum PromptElem<'a> {
    /// A number or a boolean: a token id.
    Id(u32),
    /// A string: a prompt, or a token id if the list holds ids.
    Text(Cow<'a, str>),
    /// A list: one prompt's token ids.
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
                TokenId::of(CountVisitor.visit_u64(v)?).map(|t| PromptElem::Id(t.0))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                TokenId::of(CountVisitor.visit_i64(v)?).map(|t| PromptElem::Id(t.0))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                TokenId::of(CountVisitor.visit_f64(v)?).map(|t| PromptElem::Id(t.0))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
                TokenId::of(CountVisitor.visit_bool(v)?).map(|t| PromptElem::Id(t.0))
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

/// A `prompt` list as vLLM's pydantic union reads it
/// (`list[int] | list[list[int]] | str | list[str]`, in smart mode): a
/// list of strings only is a list of prompts (the exact match wins);
/// otherwise either every element is a token id (lax: numbers, booleans,
/// and strings holding integers, so `[1, "2"]` is `[1, 2]`) or every
/// element is a list of token ids. Anything else (`["a", 1]`, `[[1], 2]`)
/// matches no member and vLLM refuses it.
fn prompt_list<'a, E: de::Error>(elems: Vec<PromptElem<'a>>) -> Result<Prompt<'a>, E> {
    let lists = elems
        .iter()
        .filter(|e| matches!(e, PromptElem::Ids(_)))
        .count();
    let texts = elems
        .iter()
        .filter(|e| matches!(e, PromptElem::Text(_)))
        .count();
    if lists > 0 && lists < elems.len() {
        return Err(E::custom(
            "prompt mixes lists of token ids with other values",
        ));
    }
    if lists > 0 {
        let mut lists: Vec<Vec<u32>> = elems
            .into_iter()
            .filter_map(|e| match e {
                PromptElem::Ids(l) => Some(l),
                _ => None,
            })
            .collect();
        return Ok(if lists.len() == 1 {
            Prompt::Ids(lists.remove(0))
        } else {
            Prompt::Batch(Vec::new(), lists)
        });
    }
    if texts == elems.len() {
        let mut texts: Vec<Cow<'a, str>> = elems
            .into_iter()
            .filter_map(|e| match e {
                PromptElem::Text(t) => Some(t),
                _ => None,
            })
            .collect();
        return Ok(if texts.len() == 1 {
            Prompt::Text(texts.remove(0))
        } else {
            Prompt::Batch(texts, Vec::new())
        });
    }
    let mut ids = Vec::with_capacity(elems.len());
    for e in elems {
        match e {
            PromptElem::Id(i) => ids.push(i),
            PromptElem::Text(t) => {
                let n = CountVisitor.visit_str::<E>(&t).map_err(|_| {
                    E::custom(format!(
                        "prompt mixes token ids and text: {t:?} is no token id"
                    ))
                })?;
                ids.push(TokenId::of::<E>(n)?.0);
            }
            // Not reached: a list with a list in it was decided above.
            PromptElem::Ids(_) => {
                return Err(E::custom(
                    "prompt mixes lists of token ids with other values",
                ))
            }
        }
    }
    Ok(Prompt::Ids(ids))
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
                let mut elems = Vec::new();
                while let Some(e) = seq.next_element::<PromptElem<'a>>()? {
                    elems.push(e);
                }
                prompt_list(elems)
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
