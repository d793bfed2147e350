//! The model's own Jinja chat template, rendered with minijinja set up the
//! way Hugging Face transformers' `apply_chat_template` sets up Jinja2
//! (which is what vLLM calls): `trim_blocks`, `lstrip_blocks`, loop
//! controls, `raise_exception`, and Python string methods via pycompat.

use minijinja::{Environment, ErrorKind, Value};
use serde::Deserialize;

use crate::{ChatMessage, TokenizerError};

const NAME: &str = "chat_template";

#[derive(Deserialize)]
pub(crate) struct ConfigFile {
    #[serde(default)]
    chat_template: Option<TemplateField>,
    #[serde(default)]
    pub(crate) eos_token: Option<TokenField>,
    #[serde(default)]
    bos_token: Option<TokenField>,
    #[serde(default)]
    pad_token: Option<TokenField>,
    #[serde(default)]
    unk_token: Option<TokenField>,
}

/// A single template, or (older multi-template configs) a list of named
/// ones of which `default` is the chat template.
#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateField {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

/// Special tokens are plain strings or `{"content": ...}` objects.
#[derive(Deserialize)]
#[serde(untagged)]
pub(crate) enum TokenField {
    Plain(String),
    Object { content: String },
}

impl TokenField {
    pub(crate) fn as_str(&self) -> &str {
        match self {
            TokenField::Plain(s) | TokenField::Object { content: s } => s,
        }
    }
}

impl ConfigFile {
    pub(crate) fn parse(json: &str) -> Result<Self, TokenizerError> {
        serde_json::from_str(json).map_err(|source| TokenizerError::Json {
            what: "tokenizer_config.json",
            source,
        })
    }

    /// The template source, if the config carries one.
    pub(crate) fn template(&self) -> Option<&str> {
        match self.chat_template.as_ref()? {
            TemplateField::One(s) => Some(s),
            TemplateField::Named(list) => list
                .iter()
                .find(|t| t.name == "default")
                .map(|t| t.template.as_str()),
        }
    }
}

pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    /// Passed to the template like transformers' `special_tokens_map`.
    specials: Vec<(&'static str, String)>,
}

fn raise_exception(msg: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    pub(crate) fn new(source: String, config: &ConfigFile) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        // Compiled once here; rendering only looks it up.
        env.add_template_owned(NAME, source)?;
        let specials = [
            ("bos_token", &config.bos_token),
            ("eos_token", &config.eos_token),
            ("pad_token", &config.pad_token),
            ("unk_token", &config.unk_token),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| (k, v.as_str().to_string())))
        .collect();
        Ok(ChatTemplate { env, specials })
    }

    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        let template = self.env.get_template(NAME)?;
        let mut ctx: Vec<(&str, Value)> = Vec::with_capacity(4 + self.specials.len());
        ctx.push(("messages", Value::from_serialize(messages)));
        ctx.push(("add_generation_prompt", Value::from(add_generation_prompt)));
        // transformers passes these explicitly as None.
        ctx.push(("tools", Value::from(())));
        ctx.push(("documents", Value::from(())));
        for (k, v) in &self.specials {
            ctx.push((k, Value::from(v.as_str())));
        }
        let ctx: Value = ctx.into_iter().collect();
        Ok(template.render(ctx)?)
    }
}
