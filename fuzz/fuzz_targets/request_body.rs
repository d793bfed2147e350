//! The filter's request body parsers, all five APIs: the first byte picks
//! the API, the rest is the body. A body that parses has a non-empty
//! model and is the input text; the PII walk over it never fails, since
//! it only runs on bodies the parser accepted.
#![no_main]

use std::ops::ControlFlow;

use kvasir_filter::request::{api_for_path, content_encoding_error, parse_body, RequestPrompt};
use kvasir_filter::scan::visit_json_strings;
use kvasir_policy::ApiKind;
use libfuzzer_sys::fuzz_target;

const APIS: [ApiKind; 5] = [
    ApiKind::Chat,
    ApiKind::Completions,
    ApiKind::AnthropicMessages,
    ApiKind::AnthropicCountTokens,
    ApiKind::Responses,
];

fuzz_target!(|data: &[u8]| {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let api = APIS[usize::from(sel) % APIS.len()];
    if let Ok(text) = std::str::from_utf8(body) {
        // The header-side parsers see the same bytes.
        let _ = api_for_path(text);
        let _ = content_encoding_error(Some(text));
    }
    let Ok(req) = parse_body(api, body) else {
        return;
    };
    assert_eq!(req.api, api);
    assert!(!req.model.trim().is_empty(), "accepted an empty model");
    assert_eq!(req.body.as_bytes(), body, "body is the input");
    let _ = req.estimated_prompt_tokens();
    if let RequestPrompt::Chat(messages) = &req.prompt {
        for m in messages {
            let _ = m.content.flattened();
        }
    }
    let mut strings = 0usize;
    let walk = visit_json_strings(req.body, &mut |s| {
        strings += s.len();
        ControlFlow::Continue(())
    });
    assert!(walk.is_ok(), "an accepted body must be scannable");
    assert!(
        strings <= body.len() * 4,
        "unescaping cannot grow text that much"
    );
});
