//! Stage 1 of a pick: the prompt from the request, validated and taken by
//! value (a 32k-token chat is ~128 KB of text, not worth copying on the
//! hot path), and what the later stages need of the rest of the request.

use std::time::Instant;

use kvasir_proto::v1 as pb;
use kvasir_tokenizer::ChatMessage;

use crate::pool::{invalid, ServiceError};
use crate::tokenize::PromptInput;

/// A Pick's prompt, owned (moved out of the request).
pub(crate) enum OwnedPrompt {
    Chat(Vec<ChatMessage>),
    Text(String),
    TokenIds(Vec<u32>),
}

impl OwnedPrompt {
    pub(crate) fn input(&self) -> PromptInput<'_> {
        match self {
            OwnedPrompt::Chat(m) => PromptInput::Chat(m),
            OwnedPrompt::Text(t) => PromptInput::Text(t),
            OwnedPrompt::TokenIds(ids) => PromptInput::TokenIds(ids),
        }
    }
}

/// A pick's request without its prompt.
pub(crate) struct Call {
    pub(crate) request_id: String,
    pub(crate) tenant: String,
    /// A `cache_salt` hint: never matched nor recorded (KV events do not
    /// carry the salt, so the index cannot tell which blocks it may reuse).
    pub(crate) salted: bool,
    pub(crate) max_endpoints: u32,
    /// The tenant's budget, when its policy gives it one.
    pub(crate) budget: Option<pb::Budget>,
    /// How long the caller waits in a flow-control queue, ms (0: it does
    /// not wait).
    pub(crate) max_wait_ms: u32,
    /// The tenant's fair-share weight (at least 1).
    pub(crate) weight: u32,
    /// The flow-control band (vLLM's `priority`: lower is more urgent).
    pub(crate) priority: i32,
    /// `Hints.expected_output_tokens` (the request's `max_tokens`; 0:
    /// unknown): its output estimate in the flow-control fair share.
    pub(crate) expected_output_tokens: u32,
    /// When the pick began: the clock of every load view and record.
    pub(crate) started: Instant,
    /// The only endpoints it may choose from, when the caller says (the
    /// gateway's subset hint).
    pub(crate) subset: Option<Vec<String>>,
}

/// Splits a request into its call and its prompt; refuses a missing or
/// empty prompt and chat messages without a role.
pub(crate) fn from_request(
    req: pb::PickRequest,
    started: Instant,
) -> Result<(Call, OwnedPrompt), ServiceError> {
    let pb::PickRequest {
        request_id,
        prompt,
        hints,
        max_endpoints,
        tenant,
        budget,
        max_wait_ms,
        weight,
        subset,
        ..
    } = req;
    check_budget(&request_id, budget.as_ref())?;
    let prompt =
        prompt.ok_or_else(|| invalid("prompt", "one of chat, text or token_ids is required"))?;
    let owned = match prompt {
        pb::pick_request::Prompt::Chat(chat) => {
            if chat.messages.is_empty() {
                return Err(invalid("chat.messages", "must not be empty"));
            }
            if let Some((i, _)) = chat
                .messages
                .iter()
                .enumerate()
                .find(|(_, m)| m.role.is_empty())
            {
                return Err(invalid("chat.messages", format!("message {i} has no role")));
            }
            OwnedPrompt::Chat(
                chat.messages
                    .into_iter()
                    .map(|m| ChatMessage::new(m.role, m.content))
                    .collect(),
            )
        }
        pb::pick_request::Prompt::Text(t) => {
            if t.is_empty() {
                return Err(invalid("text", "must not be empty"));
            }
            OwnedPrompt::Text(t)
        }
        pb::pick_request::Prompt::TokenIds(ids) => {
            if ids.ids.is_empty() {
                return Err(invalid("token_ids.ids", "must not be empty"));
            }
            OwnedPrompt::TokenIds(ids.ids)
        }
    };
    let salted = hints.as_ref().is_some_and(|h| !h.cache_salt.is_empty());
    let priority = hints.as_ref().map_or(0, |h| h.priority);
    let expected_output_tokens = hints.as_ref().map_or(0, |h| h.expected_output_tokens);
    let call = Call {
        request_id,
        tenant,
        salted,
        max_endpoints,
        budget,
        max_wait_ms,
        weight: weight.max(1),
        priority,
        expected_output_tokens,
        started,
        subset: subset.map(|s| s.addresses),
    };
    Ok((call, owned))
}

/// The call of a pick bound to a stored response, and its prompt's length
/// estimated from its bytes (4 per token, as the `approx` mode counts):
/// such a pick is not tokenized (the engine holding the response renders
/// the stored conversation too, which the caller does not send), so its
/// budget reservation is an estimate the reports settle.
pub(crate) fn bound_call(
    req: &pb::PickRequest,
    started: Instant,
) -> Result<(Call, u32), ServiceError> {
    check_budget(&req.request_id, req.budget.as_ref())?;
    let bytes = match &req.prompt {
        Some(pb::pick_request::Prompt::Chat(c)) => c
            .messages
            .iter()
            .map(|m| m.role.len() + m.content.len())
            .sum(),
        Some(pb::pick_request::Prompt::Text(t)) => t.len(),
        Some(pb::pick_request::Prompt::TokenIds(ids)) => ids.ids.len() * 4,
        None => 0,
    };
    let hints = req.hints.as_ref();
    let call = Call {
        request_id: req.request_id.clone(),
        tenant: req.tenant.clone(),
        salted: hints.is_some_and(|h| !h.cache_salt.is_empty()),
        max_endpoints: req.max_endpoints,
        budget: req.budget.clone(),
        max_wait_ms: req.max_wait_ms,
        weight: req.weight.max(1),
        priority: hints.map_or(0, |h| h.priority),
        expected_output_tokens: hints.map_or(0, |h| h.expected_output_tokens),
        started,
        subset: req.subset.as_ref().map(|s| s.addresses.clone()),
    };
    Ok((call, u32::try_from(bytes.div_ceil(4)).unwrap_or(u32::MAX)))
}

/// Refuses a budget a reservation could not be settled by: no key, or no
/// request id.
pub(crate) fn check_budget(
    request_id: &str,
    budget: Option<&pb::Budget>,
) -> Result<(), ServiceError> {
    let Some(b) = budget else {
        return Ok(());
    };
    if b.key.is_empty() {
        return Err(invalid("budget.key", "must not be empty"));
    }
    if request_id.is_empty() {
        return Err(invalid(
            "request_id",
            "required with a budget (reports settle the reservation by it)",
        ));
    }
    Ok(())
}
