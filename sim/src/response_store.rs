//! The Responses API's in-memory store, as vLLM keeps it: off unless
//! `VLLM_ENABLE_RESPONSES_API_STORE` is set; when on, every response with
//! `store: true` and the chat messages it was rendered from are kept in
//! this process's memory, unbounded and never expired (vLLM warns that
//! this leaks), so a follow-up naming it must come back to this engine.

use kvasir_tokenizer::ChatMessage;
use parking_lot::Mutex;
use serde_json::Value;
use std::collections::HashMap;

/// The store; see the module docs.
#[derive(Debug, Default)]
pub struct ResponseStore {
    enabled: bool,
    responses: Mutex<HashMap<String, Value>>,
    messages: Mutex<HashMap<String, Vec<ChatMessage>>>,
}

/// What `cancel` found.
#[derive(Debug, PartialEq)]
pub enum Cancel {
    /// No such response.
    NotFound,
    /// The response is not queued or in progress (vLLM's "synchronous"
    /// response): nothing to cancel.
    NotCancellable,
    /// Marked cancelled; the response as it now stands.
    Cancelled(Value),
}

impl ResponseStore {
    /// A store that keeps responses when `enabled`.
    pub fn new(enabled: bool) -> Self {
        ResponseStore {
            enabled,
            ..Default::default()
        }
    }

    /// Whether the store is on.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Keeps the messages a response's prompt was rendered from (vLLM
    /// stores them when the request starts).
    pub fn put_messages(&self, id: &str, messages: Vec<ChatMessage>) {
        self.messages.lock().insert(id.to_string(), messages);
    }

    /// The messages a stored response was rendered from.
    pub fn messages(&self, id: &str) -> Option<Vec<ChatMessage>> {
        self.messages.lock().get(id).cloned()
    }

    /// Keeps a finished response, unless it was cancelled meanwhile.
    pub fn put_response(&self, response: Value) {
        let Some(id) = response["id"].as_str().map(str::to_string) else {
            return;
        };
        let mut map = self.responses.lock();
        if map.get(&id).is_some_and(|r| r["status"] == "cancelled") {
            return;
        }
        map.insert(id, response);
    }

    /// A stored response.
    pub fn get(&self, id: &str) -> Option<Value> {
        self.responses.lock().get(id).cloned()
    }

    /// vLLM's cancel: only a queued or in-progress response can be.
    pub fn cancel(&self, id: &str) -> Cancel {
        let mut map = self.responses.lock();
        let Some(r) = map.get_mut(id) else {
            return Cancel::NotFound;
        };
        if !matches!(r["status"].as_str(), Some("queued" | "in_progress")) {
            return Cancel::NotCancellable;
        }
        r["status"] = Value::from("cancelled");
        Cancel::Cancelled(r.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn stores_and_cancels_as_vllm() {
        let s = ResponseStore::new(true);
        assert!(s.get("resp_x").is_none());
        assert_eq!(s.cancel("resp_x"), Cancel::NotFound);
        s.put_response(json!({"id": "resp_a", "status": "completed"}));
        assert_eq!(s.get("resp_a").unwrap()["status"], "completed");
        assert_eq!(s.cancel("resp_a"), Cancel::NotCancellable);
        s.put_response(json!({"id": "resp_b", "status": "in_progress"}));
        assert!(matches!(s.cancel("resp_b"), Cancel::Cancelled(_)));
        // A cancelled response is not overwritten by its late completion.
        s.put_response(json!({"id": "resp_b", "status": "completed"}));
        assert_eq!(s.get("resp_b").unwrap()["status"], "cancelled");
        s.put_messages("resp_a", vec![ChatMessage::new("user", "hi")]);
        assert_eq!(s.messages("resp_a").unwrap().len(), 1);
    }
}
