//! The filter's body rewriter, on bodies the parser accepted (all five
//! APIs): the output is JSON that parses again for the same API, with the
//! new model, the engine priority and `stream_options.include_usage` as
//! asked.
#![no_main]

use kvasir_filter::request::parse_body;
use kvasir_filter::rewrite::{rewrite_body, Rewrite};
use kvasir_policy::ApiKind;
use libfuzzer_sys::fuzz_target;
use serde::de::IgnoredAny;
use serde_json::Value;

const APIS: [ApiKind; 5] = [
    ApiKind::Chat,
    ApiKind::Completions,
    ApiKind::AnthropicMessages,
    ApiKind::AnthropicCountTokens,
    ApiKind::Responses,
];

/// Models with characters a splice must escape.
const MODELS: [&str; 4] = ["m", "llama-3-8b\u{e9}", "q\"uote\\d", "tab\there\n"];

fuzz_target!(|data: &[u8]| {
    let [sel, flags, body @ ..] = data else {
        return;
    };
    let api = APIS[usize::from(*sel) % APIS.len()];
    if parse_body(api, body).is_err() {
        return;
    }
    let rw = Rewrite {
        model: (flags & 1 != 0).then(|| MODELS[usize::from(flags >> 1) % MODELS.len()]),
        include_usage: flags & 8 != 0,
        priority: (flags & 16 != 0).then(|| i32::from(*sel as i8) * 1000),
    };
    let out = rewrite_body(body, &rw).expect("an accepted body is rewritten");
    let text = String::from_utf8_lossy(&out);
    if let Err(e) = serde_json::from_slice::<IgnoredAny>(&out) {
        panic!("rewrite output is not JSON ({e}): {text}");
    }
    // A number beyond f64 (`1e999`) is JSON that the parser skips and the
    // splice keeps as sent, but that a DOM cannot hold: such bodies are
    // checked through the parser alone.
    if let Ok(v) = serde_json::from_slice::<Value>(&out) {
        let o = v.as_object().expect("the output is an object");
        if let Some(m) = rw.model {
            assert_eq!(o.get("model").and_then(Value::as_str), Some(m), "{text}");
        }
        if let Some(p) = rw.priority {
            let got = o.get("priority").and_then(Value::as_i64);
            assert_eq!(got, Some(i64::from(p)), "{text}");
        }
        if rw.include_usage {
            let so = o.get("stream_options").and_then(Value::as_object);
            let usage = so.and_then(|s| s.get("include_usage"));
            assert_eq!(usage, Some(&Value::Bool(true)), "{text}");
        }
    }
    let again = parse_body(api, &out)
        .unwrap_or_else(|e| panic!("rewritten body refused ({}): {text}", e.message));
    if let Some(m) = rw.model {
        assert_eq!(again.model, m);
    }
});
