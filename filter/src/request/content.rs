//! Chat content as vLLM's chat parser reads it: a string or a list of
//! content parts, of which the text parts count.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;

use super::Str;

/// The line Claude Code starts a system prompt with: its value changes on
/// every request, so vLLM's chat parser drops it from system messages
/// (whatever the API) to keep the prefix cacheable.
pub(crate) const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// Text content: a string, or a list of content parts whose text parts
/// count (images and other parts are skipped). `null` is no content. Text
/// parts are vLLM's: bare strings, `text`, `input_text` and `output_text`
/// (their `text`), `refusal` and `thinking` (the field of that name).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Content<'a> {
    /// The text pieces in order (one for a plain string).
    pub parts: Vec<Cow<'a, str>>,
}

impl Content<'_> {
    /// Total bytes of text.
    pub fn text_len(&self) -> usize {
        self.parts.iter().map(|p| p.len()).sum()
    }

    /// The text as vLLM flattens content parts: text parts joined with "\n".
    pub fn flattened(&self) -> String {
        match self.parts.as_slice() {
            [one] => one.to_string(),
            parts => parts.join("\n"),
        }
    }
}

#[derive(Deserialize)]
struct PartFields<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Str<'a>>,
    #[serde(borrow, default)]
    text: Option<Str<'a>>,
    #[serde(borrow, default)]
    refusal: Option<Str<'a>>,
    #[serde(borrow, default)]
    thinking: Option<Str<'a>>,
}

/// One content part: its text, if it is a text part.
struct Part<'a>(Option<Cow<'a, str>>);

impl<'de: 'a, 'a> Deserialize<'de> for Part<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Part<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a content part (an object or a string)")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Part(Some(Cow::Borrowed(v))))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Part(Some(Cow::Owned(v.to_owned()))))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let p = PartFields::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let text = match p.kind.as_ref().map_or("text", |k| &k.0) {
                    "text" | "input_text" | "output_text" => p.text,
                    "refusal" => p.refusal,
                    "thinking" => p.thinking,
                    _ => None,
                };
                Ok(Part(text.map(|t| t.0)))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Content<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for V<'a> {
            type Value = Content<'a>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a list of content parts, or null")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Content {
                    parts: vec![Cow::Borrowed(v)],
                })
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Content {
                    parts: vec![Cow::Owned(v.to_owned())],
                })
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Content {
                    parts: vec![Cow::Owned(v)],
                })
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Content::default())
            }
            fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Content::default())
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(Part(p)) = seq.next_element::<Part<'a>>()? {
                    parts.extend(p);
                }
                Ok(Content { parts })
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Message<'a> {
    /// `system`, `user`, `assistant`, `tool`, ...
    #[serde(borrow)]
    pub role: Cow<'a, str>,
    /// Its text.
    #[serde(borrow, default)]
    pub content: Content<'a>,
}

/// `stream_options` (only `include_usage` matters here; an object, as
/// vLLM requires).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub struct StreamOptions {
    /// Whether the final SSE chunk carries `usage`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

impl Message<'_> {
    /// The text the chat template sees: [`Content::flattened`], except that
    /// a system message's text parts lose a leading billing-header line
    /// ([`BILLING_HEADER`]), and parts left empty by that are dropped, as
    /// vLLM's chat parser does.
    pub fn template_text(&self) -> String {
        if self.role != "system" {
            return self.content.flattened();
        }
        let parts: Vec<&str> = self
            .content
            .parts
            .iter()
            .filter_map(|p| match p.strip_prefix(BILLING_HEADER) {
                None => Some(p.as_ref()),
                Some(rest) => rest
                    .split_once('\n')
                    .map(|(_, r)| r)
                    .filter(|r| !r.is_empty()),
            })
            .collect();
        parts.join("\n")
    }
}
