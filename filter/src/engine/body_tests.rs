//! The body rules (no personal data leaks through any field) through the real [`Flow`] and the fake Envoy of
//! `engine_tests`: the PII guard sees every string that would leave
//! (property-tested over generated bodies of every API), and parsing and
//! usage accounting are as strict as the engine.

use proptest::prelude::*;
use serde_json::{json, Map, Value};

use super::*;

/// A pool saturated past the burst threshold: clean traffic bursts to the
/// provider, PII traffic of tenant `acme` must stay in the pool.
fn burst_config() -> Rc<Shared> {
    let set = json!({
        "tenantSource": {"header": "x-tenant"},
        "tenants": [{"name": "acme"}],
        "pools": [{"name": "main", "models": ["qwen"], "cluster": "pool", "indexerCluster": "indexer"}],
        "providers": [{"name": "ext", "cluster": "ext-cluster", "authority": "api.example.com"}],
        "policies": [
            {"name": "burst", "match": {"poolState": {"pool": "main", "saturationAbove": 0.8}},
             "action": {"provider": {"provider": "ext"}}},
            {"name": "keep-pii", "piiGuard": true, "match": {"tenants": ["acme"]},
             "action": {"route": {"pool": "main"}}}
        ],
        "defaultAction": {"route": {"pool": "main"}}
    });
    let set = kvasir_policy::parse_json(&set.to_string()).unwrap();
    let doc: Value =
        serde_json::from_slice(&kvasir_policy::compile(&set).unwrap().to_json()).unwrap();
    let bytes = serde_json::to_vec(&json!({"policy": doc, "filter": {}})).unwrap();
    let cfg = PluginConfig::from_bytes(&bytes).unwrap();
    let shared = Rc::new(Shared::new(cfg, Rc::new(MemStats::default())));
    // The fake's clock starts at 1 s: a fresh sample.
    shared.learn_saturation(0, 0.95, 1_000_000_000);
    shared
}

/// Where a request went: the route header's cluster, or the local reply's
/// status.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Went {
    Cluster(String),
    Reply(u16),
    Nowhere,
}

fn send(shared: &Rc<Shared>, path: &str, extra: &[(&str, &str)], body_bytes: &[u8]) -> Went {
    let mut flow = Flow::new(Rc::clone(shared));
    let mut h = Fake::new(path, &[("x-tenant", "acme")], "");
    h.headers
        .extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    h.body = body_bytes.to_vec();
    h.headers.retain(|(k, _)| k != "content-length");
    h.headers
        .push(("content-length".into(), h.body.len().to_string()));
    if headers(&mut flow, &mut h) == Verdict::Pause && h.replied.is_none() {
        body(&mut flow, &mut h);
    }
    if let Some(r) = &h.replied {
        return Went::Reply(r.status);
    }
    match h.header("x-kvasir-cluster") {
        Some(c) => Went::Cluster(c.to_string()),
        None => Went::Nowhere,
    }
}

fn provider() -> Went {
    Went::Cluster("ext-cluster".into())
}

fn pool() -> Went {
    Went::Cluster("pool".into())
}

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const MESSAGES: &str = "/v1/messages";
const EMAIL: &str = "jane.doe@example.com";

/// The fields that could leak, one by one, each with a clean twin
/// that does burst (so the body is accepted and the policy applies).
#[test]
fn pii_in_each_field_that_leaked_stays_inside() {
    let shared = burst_config();
    let cases: Vec<(&str, &str, Value)> = vec![
        (
            "tool-call arguments",
            CHAT,
            json!({"model": "qwen", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
              "function": {"name": "lookup", "arguments": "{\"who\":\"@@\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}),
        ),
        (
            "message name",
            CHAT,
            json!({"model": "qwen", "messages": [
            {"role": "user", "name": "@@", "content": "hi"}]}),
        ),
        (
            "tool description",
            CHAT,
            json!({"model": "qwen", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "description": "mail @@",
              "parameters": {"type": "object", "properties": {}}}}]}),
        ),
        (
            "top-level user",
            CHAT,
            json!({"model": "qwen", "user": "@@",
            "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "input_text part",
            CHAT,
            json!({"model": "qwen", "messages": [{"role": "user",
            "content": [{"type": "input_text", "text": "@@"}]}]}),
        ),
        (
            "response_format schema key",
            CHAT,
            json!({"model": "qwen", "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "s",
              "schema": {"type": "object", "properties": {"@@": {"type": "string"}}}}}}),
        ),
        (
            "completions suffix",
            COMPLETIONS,
            json!({"model": "qwen", "prompt": "hi", "suffix": "@@"}),
        ),
        (
            "anthropic tool_use input",
            MESSAGES,
            json!({"model": "qwen", "max_tokens": 8, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup",
              "input": {"who": {"nested": ["@@"]}}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}]}),
        ),
        (
            "anthropic tool_result",
            MESSAGES,
            json!({"model": "qwen", "max_tokens": 8, "messages": [
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
              "content": [{"type": "text", "text": "@@"}]}]}]}),
        ),
        (
            "anthropic metadata",
            MESSAGES,
            json!({"model": "qwen", "max_tokens": 8,
            "metadata": {"user_id": "@@"}, "messages": [{"role": "user", "content": "hi"}]}),
        ),
    ];
    for (what, path, v) in cases {
        let text = v.to_string();
        let clean = text.replace("@@", "nobody");
        assert_eq!(
            send(&shared, path, &[], clean.as_bytes()),
            provider(),
            "{what}: clean twin"
        );
        let pii = text.replace("@@", EMAIL);
        assert_eq!(send(&shared, path, &[], pii.as_bytes()), pool(), "{what}");
        // Escaped in the JSON text, as some encoders write it.
        let escaped = pii.replace('@', "\\u0040");
        assert_eq!(
            send(&shared, path, &[], escaped.as_bytes()),
            pool(),
            "{what}, escaped"
        );
    }
}

#[test]
fn what_cannot_be_scanned_stays_inside() {
    let shared = burst_config();
    // Token ids cannot be read as text.
    for prompt in ["[1,2,3]", "[[1,2],[3]]"] {
        let b = format!(r#"{{"model":"qwen","prompt":{prompt}}}"#);
        assert_eq!(
            send(&shared, COMPLETIONS, &[], b.as_bytes()),
            pool(),
            "{prompt}"
        );
    }
    // A card number sent as a JSON number is still a card number.
    let b = r#"{"model":"qwen","prompt":"hi","seed":4111111111111111}"#;
    assert_eq!(send(&shared, COMPLETIONS, &[], b.as_bytes()), pool());
    let b = r#"{"model":"qwen","prompt":"hi","seed":1234}"#;
    assert_eq!(send(&shared, COMPLETIONS, &[], b.as_bytes()), provider());
}

#[test]
fn compressed_bodies_get_415_in_the_apis_shape() {
    let shared = burst_config();
    let b = br#"{"model":"qwen","messages":[{"role":"user","content":"hi"}]}"#;
    for (path, anthropic) in [(CHAT, false), (MESSAGES, true)] {
        let mut flow = Flow::new(Rc::clone(&shared));
        let mut h = Fake::new(
            path,
            &[("x-tenant", "acme"), ("content-encoding", "gzip")],
            "x",
        );
        h.body = b.to_vec();
        assert_eq!(headers(&mut flow, &mut h), Verdict::Pause);
        let (status, v) = reply_json(&h);
        assert_eq!(status, 415);
        if anthropic {
            assert_eq!(v["type"], "error");
            assert_eq!(v["error"]["type"], "invalid_request_error");
        } else {
            assert_eq!(v["error"]["code"], "unsupported_content_encoding");
        }
    }
    let identity = [("content-encoding", "identity")];
    assert_eq!(send(&shared, CHAT, &identity, b), provider());
    // Not an inference path: passed through untouched, whatever it carries.
    let mut flow = Flow::new(shared);
    let mut h = Fake::new(
        "/v1/models",
        &[("x-tenant", "acme"), ("content-encoding", "gzip")],
        "",
    );
    assert_eq!(headers(&mut flow, &mut h), Verdict::Continue);
    assert!(h.replied.is_none());
}

#[test]
fn strict_bodies_get_400_before_any_decision() {
    let shared = burst_config();
    let bad: [&[u8]; 5] = [
        br#"{"model":"qwen","stream":true,"stream_options":[],"messages":[{"role":"user","content":"hi"}]}"#,
        br#"{"model":"qwen","stream":true,"stream_options":[false],"messages":[{"role":"user","content":"hi"}]}"#,
        br#"{"model":"qwen","messages":[["user","hi"]]}"#,
        b"{\"model\":\"qwen\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"user\":\"\xff\"}",
        br#"{"model":"qwen","max_tokens":1.5,"messages":[{"role":"user","content":"hi"}]}"#,
    ];
    for b in bad {
        assert_eq!(
            send(&shared, CHAT, &[], b),
            Went::Reply(400),
            "{}",
            String::from_utf8_lossy(b)
        );
    }
    let ok = br#"{"model":"qwen","max_tokens":1e2,"messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(send(&shared, CHAT, &[], ok), provider());
}

/// Usage is injected whenever a streaming body does not already ask for it
/// and the policy wants it: a client can only turn it off where the
/// policy's `includeUsage` is off.
#[test]
fn usage_is_injected_unless_already_asked_for() {
    let (shared, _) = config(api_key(), json!({}));
    for so in [
        None,
        Some(json!(null)),
        Some(json!({})),
        Some(json!({"include_usage": false})),
        Some(json!({"include_usage": null, "continuous_usage_stats": true})),
    ] {
        let mut v = json!({"model": "alias", "stream": true,
                           "messages": [{"role": "user", "content": "hi"}]});
        if let Some(so) = &so {
            v["stream_options"] = so.clone();
        }
        let mut flow = Flow::new(Rc::clone(&shared));
        let mut h = Fake::new(
            CHAT,
            &[("authorization", "Bearer key-acme")],
            &v.to_string(),
        );
        headers(&mut flow, &mut h);
        body(&mut flow, &mut h);
        assert!(h.replied.is_none(), "{so:?}");
        assert_eq!(
            h.body_json()["stream_options"]["include_usage"],
            true,
            "{so:?}"
        );
    }
}

// ---- The property: PII in any string of any accepted body shape never
// reaches a provider cluster.

/// Text no PII detector can fire on (lower-case words).
fn word() -> impl Strategy<Value = String> {
    "[a-z]{1,8}( [a-z]{1,8}){0,2}"
}

fn obj(pairs: Vec<(String, Value)>) -> Value {
    Value::Object(pairs.into_iter().collect::<Map<_, _>>())
}

/// A small free-form JSON object (tool inputs, schemas, metadata).
fn free() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        word().prop_map(Value::String),
        any::<u16>().prop_map(Value::from),
        Just(Value::Null)
    ];
    let tree = leaf.prop_recursive(3, 12, 3, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            prop::collection::vec((word(), inner), 0..3).prop_map(obj),
        ]
    });
    prop::collection::vec((word(), tree), 1..3).prop_map(obj)
}

fn chat_part() -> impl Strategy<Value = Value> {
    prop_oneof![
        word().prop_map(|w| json!({"type": "text", "text": w})),
        word().prop_map(|w| json!({"type": "input_text", "text": w})),
        word().prop_map(|w| json!({"type": "image_url", "image_url": {"url": w}})),
        word().prop_map(|w| json!({"type": "refusal", "refusal": w})),
        word().prop_map(Value::String),
    ]
}

fn chat_message() -> impl Strategy<Value = Value> {
    let content = prop_oneof![
        word().prop_map(Value::String),
        prop::collection::vec(chat_part(), 1..3).prop_map(Value::Array),
    ];
    let call = (word(), word(), free()).prop_map(|(id, name, args)| {
        json!({"id": id, "type": "function",
            "function": {"name": name, "arguments": args.to_string()}})
    });
    (
        prop::sample::select(vec!["system", "user", "assistant", "tool"]),
        content,
        prop::option::of(word()),
        prop::collection::vec(call, 0..2),
    )
        .prop_map(|(role, content, name, calls)| {
            let mut m = json!({"role": role, "content": content});
            if let Some(n) = name {
                m["name"] = n.into();
            }
            if role == "assistant" && !calls.is_empty() {
                m["tool_calls"] = calls.into();
            }
            if role == "tool" {
                m["tool_call_id"] = "c1".into();
            }
            m
        })
}

fn tool() -> impl Strategy<Value = Value> {
    (word(), word(), free()).prop_map(|(name, description, props)| {
        json!({"type": "function", "function": {"name": name, "description": description,
            "parameters": {"type": "object", "properties": props}}})
    })
}

fn chat_body() -> impl Strategy<Value = Value> {
    (
        prop::collection::vec(chat_message(), 1..4),
        prop::collection::vec(tool(), 0..2),
        prop::option::of(word()),
        prop::option::of(free()),
        any::<bool>(),
    )
        .prop_map(|(messages, tools, user, schema, stream)| {
            let mut b =
                json!({"model": "qwen", "messages": messages, "stream": stream, "max_tokens": 16});
            if !tools.is_empty() {
                b["tools"] = tools.into();
            }
            if let Some(u) = user {
                b["user"] = u.into();
            }
            if let Some(s) = schema {
                b["response_format"] =
                    json!({"type": "json_schema", "json_schema": {"name": "s", "schema": s}});
            }
            b
        })
}

fn completions_body() -> impl Strategy<Value = Value> {
    let prompt = prop_oneof![
        word().prop_map(Value::String),
        prop::collection::vec(word(), 1..3).prop_map(|v| json!(v)),
    ];
    (prompt, prop::option::of(word()), prop::option::of(word())).prop_map(|(p, suffix, user)| {
        let mut b = json!({"model": "qwen", "prompt": p, "max_tokens": 16});
        if let Some(s) = suffix {
            b["suffix"] = s.into();
        }
        if let Some(u) = user {
            b["user"] = u.into();
        }
        b
    })
}

fn anthropic_block() -> impl Strategy<Value = Value> {
    prop_oneof![
        word().prop_map(|w| json!({"type": "text", "text": w})),
        (word(), word(), free()).prop_map(|(id, name, input)| json!({"type": "tool_use",
            "id": id, "name": name, "input": input})),
        (word(), word())
            .prop_map(|(id, w)| json!({"type": "tool_result", "tool_use_id": id, "content": w})),
        (word(), word()).prop_map(|(id, w)| json!({"type": "tool_result", "tool_use_id": id,
            "content": [{"type": "text", "text": w}]})),
    ]
}

fn anthropic_body() -> impl Strategy<Value = Value> {
    let content = prop_oneof![
        word().prop_map(Value::String),
        prop::collection::vec(anthropic_block(), 1..3).prop_map(Value::Array),
    ];
    let message = (prop::sample::select(vec!["user", "assistant"]), content)
        .prop_map(|(role, content)| json!({"role": role, "content": content}));
    let system = prop_oneof![
        word().prop_map(Value::String),
        word().prop_map(|w| json!([{"type": "text", "text": w}])),
    ];
    let tool = (word(), word(), free()).prop_map(|(name, description, props)| {
        json!({"name": name, "description": description,
               "input_schema": {"type": "object", "properties": props}})
    });
    (
        prop::collection::vec(message, 1..4),
        prop::option::of(system),
        prop::collection::vec(tool, 0..2),
        prop::option::of(word()),
    )
        .prop_map(|(messages, system, tools, user_id)| {
            let mut b = json!({"model": "qwen", "max_tokens": 16, "messages": messages});
            if let Some(s) = system {
                b["system"] = s;
            }
            if !tools.is_empty() {
                b["tools"] = tools.into();
            }
            if let Some(u) = user_id {
                b["metadata"] = json!({"user_id": u});
            }
            b
        })
}

/// Keys the filter reads or that make a body acceptable: renaming them
/// would make a different request, not hide PII.
const STRUCTURAL: [&str; 16] = [
    "model",
    "messages",
    "role",
    "content",
    "type",
    "text",
    "prompt",
    "system",
    "stream",
    "stream_options",
    "include_usage",
    "max_tokens",
    "max_completion_tokens",
    "cache_salt",
    "refusal",
    "thinking",
];

/// How many places PII can go in `v`: every string value, every
/// non-structural key.
fn slots(v: &Value) -> usize {
    match v {
        Value::String(_) => 1,
        Value::Array(a) => a.iter().map(slots).sum(),
        Value::Object(o) => o
            .iter()
            .map(|(k, v)| usize::from(!STRUCTURAL.contains(&k.as_str())) + slots(v))
            .sum(),
        _ => 0,
    }
}

/// Puts `pii` into the `n`th slot of `v` (before a string's text, after a
/// key's: a word, since detectors only start at a word boundary).
fn plant(v: &mut Value, n: &mut usize, pii: &str) -> bool {
    match v {
        Value::String(s) => {
            if *n == 0 {
                *s = format!("{pii} {s}");
                return true;
            }
            *n -= 1;
            false
        }
        Value::Array(a) => a.iter_mut().any(|x| plant(x, n, pii)),
        Value::Object(o) => {
            let keys: Vec<String> = o.keys().cloned().collect();
            for k in keys {
                if !STRUCTURAL.contains(&k.as_str()) {
                    if *n == 0 {
                        let val = o.remove(&k).unwrap_or(Value::Null);
                        o.insert(format!("{k} {pii}"), val);
                        return true;
                    }
                    *n -= 1;
                }
                if o.get_mut(&k).is_some_and(|x| plant(x, n, pii)) {
                    return true;
                }
            }
            false
        }
        _ => false,
    }
}

fn any_body() -> impl Strategy<Value = (&'static str, Value)> {
    prop_oneof![
        chat_body().prop_map(|b| (CHAT, b)),
        completions_body().prop_map(|b| (COMPLETIONS, b)),
        anthropic_body().prop_map(|b| (MESSAGES, b)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn pii_in_any_string_never_reaches_a_provider(
        (path, clean) in any_body(),
        slot in any::<prop::sample::Index>(),
        pii in prop::sample::select(vec![EMAIL, "+44 20 7946 0958", "4111 1111 1111 1111"]),
        escape in any::<bool>(),
    ) {
        let shared = burst_config();
        // The clean twin is accepted and bursts: the policy does apply.
        prop_assert_eq!(send(&shared, path, &[], clean.to_string().as_bytes()), provider());
        let mut v = clean;
        let mut n = slot.index(slots(&v));
        prop_assert!(plant(&mut v, &mut n, pii));
        let mut text = v.to_string();
        if escape {
            // `@` and `+` only occur inside strings here.
            text = text.replace('@', "\\u0040").replace('+', "\\u002b");
        }
        prop_assert_eq!(send(&shared, path, &[], text.as_bytes()), pool(), "{}", text);
    }
}
