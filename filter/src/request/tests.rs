//! Tests of [`super`]: body parsing.

use super::*;

#[test]
fn paths() {
    assert_eq!(api_for_path("/v1/chat/completions"), Some(ApiKind::Chat));
    assert_eq!(
        api_for_path("/v1/chat/completions?x=1"),
        Some(ApiKind::Chat)
    );
    assert_eq!(api_for_path("/v1/completions"), Some(ApiKind::Completions));
    // Exact paths only, as vLLM's router matches them.
    for inexact in [
        "/v1/completions/",
        "/v1/chat/completions/",
        "/v1/chat/completions//",
        "/v1/messages/",
        "/v1/messages/count_tokens/",
        "/v1/responses/",
        "/v1/responses/?x=1",
        "/V1/chat/completions",
        "/v1/chat/completionsx",
        "v1/chat/completions",
    ] {
        assert_eq!(api_for_path(inexact), None, "{inexact}");
    }
    assert_eq!(
        api_for_path("/v1/messages"),
        Some(ApiKind::AnthropicMessages)
    );
    assert_eq!(
        api_for_path("/v1/messages/count_tokens"),
        Some(ApiKind::AnthropicCountTokens)
    );
    assert_eq!(api_for_path("/v1/responses"), Some(ApiKind::Responses));
    assert_eq!(api_for_path("/v1/responses/resp_1"), None);
    assert_eq!(api_for_path("/v1/messages/render"), None);
    assert_eq!(api_for_path("/v1/models"), None);
    assert_eq!(api_for_path("/v1/chat/completions/render"), None);
    assert_eq!(api_for_path(""), None);
}

#[test]
fn chat_fields_borrow_and_skip_the_rest() {
    let body = br#"{"model":"m","messages":[{"role":"system","content":"be terse"},
        {"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"there"}]},
        {"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}],
        "stream":true,"stream_options":{"include_usage":false},"max_tokens":7,"temperature":0.2,
        "tools":[{"deep":[[[[1]]]]}]}"#;
    let r = parse_body(ApiKind::Chat, body).unwrap();
    assert_eq!(r.model, "m");
    assert!(matches!(r.model, Cow::Borrowed(_)));
    assert!(r.stream);
    assert_eq!(r.include_usage, Some(false));
    assert!(r.has_stream_options);
    assert_eq!(r.max_tokens, 7);
    let RequestPrompt::Chat(ms) = &r.prompt else {
        panic!()
    };
    assert_eq!(ms.len(), 3);
    assert_eq!(ms[1].content.flattened(), "hi\nthere");
    assert_eq!(ms[2].content.parts.len(), 0);
    assert_eq!(
        r.estimated_prompt_tokens(),
        kvasir_policy::estimate_tokens(8 + 2 + 5)
    );
    let mut seen = Vec::new();
    let _ = r.visit(&mut |s| {
        seen.push(s.to_string());
        ControlFlow::Continue(())
    });
    assert_eq!(seen, ["be terse", "hi", "there"]);
}

#[test]
fn escaped_strings_are_owned_but_right() {
    let r = parse_body(
        ApiKind::Chat,
        br#"{"model":"a\"b","messages":[{"role":"user","content":"x\ny"}]}"#,
    )
    .unwrap();
    assert_eq!(r.model, "a\"b");
    let RequestPrompt::Chat(ms) = &r.prompt else {
        panic!()
    };
    assert_eq!(ms[0].content.flattened(), "x\ny");
}

#[test]
fn completions_prompt_forms() {
    fn p(s: &'static str) -> Result<Prompt<'static>, &'static str> {
        match parse_body(ApiKind::Completions, s.as_bytes()).map(|r| r.prompt) {
            Ok(RequestPrompt::Completion(p)) => Ok(p),
            Ok(_) => panic!(),
            Err(e) => Err(e.code),
        }
    }
    assert_eq!(
        p(r#"{"model":"m","prompt":"hi"}"#),
        Ok(Prompt::Text("hi".into()))
    );
    assert_eq!(
        p(r#"{"model":"m","prompt":["hi"]}"#),
        Ok(Prompt::Text("hi".into()))
    );
    assert_eq!(
        p(r#"{"model":"m","prompt":[1,2,3]}"#),
        Ok(Prompt::Ids(vec![1, 2, 3]))
    );
    assert_eq!(
        p(r#"{"model":"m","prompt":[[4,5]]}"#),
        Ok(Prompt::Ids(vec![4, 5]))
    );
    assert!(matches!(
        p(r#"{"model":"m","prompt":["a","b"]}"#),
        Ok(Prompt::Batch(..))
    ));
    assert_eq!(p(r#"{"model":"m","prompt":[1,"a"]}"#), Err("invalid_type"));
    // vLLM's union: not all strings, so every element is a lax token id.
    assert_eq!(
        p(r#"{"model":"m","prompt":[1,"2",true," 3 "]}"#),
        Ok(Prompt::Ids(vec![1, 2, 1, 3]))
    );
    assert_eq!(
        p(r#"{"model":"m","prompt":[["1_0"],[false]]}"#),
        Ok(Prompt::Batch(vec![], vec![vec![10], vec![0]]))
    );
    assert_eq!(
        p(r#"{"model":"m","prompt":[[1],"2"]}"#),
        Err("invalid_type")
    );
    assert_eq!(p(r#"{"model":"m","prompt":[1,[2]]}"#), Err("invalid_type"));
    assert_eq!(p(r#"{"model":"m","prompt":[null]}"#), Err("invalid_type"));
    assert_eq!(
        p(r#"{"model":"m","prompt":["1","2"]}"#),
        Ok(Prompt::Batch(vec!["1".into(), "2".into()], vec![]))
    );
    assert_eq!(p(r#"{"model":"m","prompt":[-1]}"#), Err("invalid_type"));
    assert_eq!(p(r#"{"model":"m","prompt":[]}"#), Err("missing_prompt"));
    assert_eq!(p(r#"{"model":"m"}"#), Err("missing_prompt"));
    assert_eq!(p(r#"{"model":"m","prompt":7}"#), Err("invalid_type"));
}

#[test]
fn anthropic_system_goes_first() {
    let r = parse_body(
        ApiKind::AnthropicMessages,
        br#"{"model":"claude","max_tokens":5,"system":[{"type":"text","text":"sys"}],
             "messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#,
    )
    .unwrap();
    let RequestPrompt::Chat(ms) = &r.prompt else {
        panic!()
    };
    assert_eq!(ms[0].role, "system");
    assert_eq!(ms[0].content.flattened(), "sys");
    assert_eq!(r.max_tokens, 5);
}

#[test]
fn bad_bodies() {
    let code = |api, s: &[u8]| parse_body(api, s).unwrap_err();
    assert_eq!(code(ApiKind::Chat, b"").code, "invalid_json");
    assert_eq!(code(ApiKind::Chat, b"  \n").code, "invalid_json");
    assert_eq!(code(ApiKind::Chat, b"{").code, "invalid_json");
    assert_eq!(
        code(ApiKind::Chat, b"\xff\xfe\x00garbage").code,
        "invalid_json"
    );
    assert_eq!(code(ApiKind::Chat, b"[1,2]").code, "invalid_type");
    let trailing = br#"{"model":"m","messages":[{"role":"user","content":"x"}]}}"#;
    assert_eq!(code(ApiKind::Chat, trailing).code, "invalid_json");
    assert_eq!(code(ApiKind::Chat, b"\"str\"").code, "invalid_type");
    assert_eq!(
        code(
            ApiKind::Chat,
            br#"{"messages":[{"role":"user","content":"x"}]}"#
        )
        .code,
        "missing_model"
    );
    assert_eq!(
        code(
            ApiKind::Chat,
            br#"{"model":"","messages":[{"role":"user","content":"x"}]}"#
        )
        .code,
        "missing_model"
    );
    assert_eq!(
        code(ApiKind::Chat, br#"{"model":"m"}"#).code,
        "missing_messages"
    );
    assert_eq!(
        code(ApiKind::Chat, br#"{"model":"m","messages":[]}"#).code,
        "missing_messages"
    );
    let e = code(
        ApiKind::Chat,
        br#"{"model":5,"messages":[{"role":"user","content":"x"}]}"#,
    );
    assert_eq!((e.code, e.param), ("invalid_type", Some("model")));
    let e = code(
        ApiKind::Chat,
        br#"{"model":"m","stream":"yes","messages":[{"role":"user","content":"x"}]}"#,
    );
    assert_eq!((e.code, e.param), ("invalid_type", Some("stream")));
    assert_eq!(
        code(
            ApiKind::Chat,
            br#"{"model":"m","messages":[{"content":"x"}]}"#
        )
        .code,
        "invalid_type"
    );
    assert_eq!(
        code(
            ApiKind::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":5}]}"#
        )
        .code,
        "invalid_type"
    );
    // Duplicate keys: the filter and the engine must never disagree on the model.
    let e = code(
        ApiKind::Chat,
        br#"{"model":"a","model":"b","messages":[{"role":"user","content":"x"}]}"#,
    );
    assert!(e.message.contains("duplicate"), "{}", e.message);
}

#[test]
fn deep_nesting_never_crashes() {
    // Skipped fields are skipped without recursion: valid, accepted.
    let mut s = String::from(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"extra":"#);
    s.push_str(&"[".repeat(100_000));
    s.push_str(&"]".repeat(100_000));
    s.push('}');
    assert!(parse_body(ApiKind::Chat, s.as_bytes()).is_ok());
    // Unbalanced: a syntax error.
    let e = parse_body(ApiKind::Chat, &s.as_bytes()[..s.len() - 50]).unwrap_err();
    assert_eq!(e.code, "invalid_json");
    // Nesting where a field is read: a type error, from the first level.
    let mut s = String::from(r#"{"model":"m","messages":"#);
    s.push_str(&"[".repeat(100_000));
    s.push_str(&"]".repeat(100_000));
    s.push('}');
    let e = parse_body(ApiKind::Chat, s.as_bytes()).unwrap_err();
    assert_eq!((e.code, e.param), ("invalid_type", Some("messages")));
}

fn err(api: ApiKind, s: &str) -> BodyError {
    parse_body(api, s.as_bytes()).unwrap_err()
}

#[test]
fn stream_options_must_be_an_object_or_null() {
    let body = |so: &str| {
        format!(
            r#"{{"model":"m","stream":true,"stream_options":{so},"messages":[{{"role":"user","content":"x"}}]}}"#
        )
    };
    for bad in ["[]", "[false]", "[true]", "false", "true", "\"x\"", "1"] {
        for api in [ApiKind::Chat, ApiKind::Completions] {
            let b = body(bad).replace(
                r#""messages":[{"role":"user","content":"x"}]"#,
                if api == ApiKind::Chat {
                    r#""messages":[{"role":"user","content":"x"}]"#
                } else {
                    r#""prompt":"x""#
                },
            );
            let e = err(api, &b);
            assert_eq!(
                (e.code, e.param),
                ("invalid_type", Some("stream_options")),
                "{bad}: {}",
                e.message
            );
        }
    }
    let ok = |so: &str| {
        let b = body(so);
        let r = parse_body(ApiKind::Chat, b.as_bytes()).unwrap();
        (r.include_usage, r.has_stream_options)
    };
    assert_eq!(ok("null"), (None, false));
    assert_eq!(ok("{}"), (None, true));
    assert_eq!(
        ok(r#"{"include_usage":null,"continuous_usage_stats":true}"#),
        (None, true)
    );
    assert_eq!(ok(r#"{"include_usage":true}"#), (Some(true), true));
    let e = err(ApiKind::Chat, &body(r#"{"include_usage":"yes"}"#));
    assert_eq!(e.param, Some("stream_options"));
}

#[test]
fn messages_and_parts_must_be_objects() {
    for messages in [r#"[["user","hi"]]"#, r#"["hi"]"#, "[1]", "[null]"] {
        let b = format!(r#"{{"model":"m","messages":{messages}}}"#);
        let e = err(ApiKind::Chat, &b);
        assert_eq!(
            (e.code, e.param),
            ("invalid_type", Some("messages")),
            "{messages}"
        );
        let b = format!(r#"{{"model":"m","max_tokens":5,"messages":{messages}}}"#);
        let e = err(ApiKind::AnthropicMessages, &b);
        assert_eq!((e.code, e.param), ("invalid_type", Some("messages")));
    }
    let e = err(
        ApiKind::Chat,
        r#"{"model":"m","messages":[{"role":"user","content":[["text","hi"]]}]}"#,
    );
    assert_eq!((e.code, e.param), ("invalid_type", Some("messages")));
}

#[test]
fn text_parts_are_vllms() {
    let r = parse_body(
        ApiKind::Chat,
        br#"{"model":"m","messages":[{"role":"user","content":["bare",
            {"type":"input_text","text":"in"},{"type":"output_text","text":"out"},
            {"type":"refusal","refusal":"no"},{"type":"thinking","thinking":"hmm"},
            {"text":"untyped"},{"type":"image_url","image_url":{"url":"u"},"text":"not text"}]}]}"#,
    )
    .unwrap();
    let RequestPrompt::Chat(ms) = &r.prompt else {
        panic!()
    };
    assert_eq!(
        ms[0].content.parts,
        ["bare", "in", "out", "no", "hmm", "untyped"]
    );
}

#[test]
fn integers_as_vllm_reads_them() {
    let chat = |mt: &str| {
        parse_body(
            ApiKind::Chat,
            format!(
                r#"{{"model":"m","max_tokens":{mt},"messages":[{{"role":"user","content":"x"}}]}}"#
            )
            .as_bytes(),
        )
        .map(|r| r.max_tokens)
        .map_err(|e| (e.code, e.param))
    };
    assert_eq!(chat("1e2"), Ok(100));
    assert_eq!(chat("100.0"), Ok(100));
    assert_eq!(chat("1E+2"), Ok(100));
    assert_eq!(chat("7"), Ok(7));
    assert_eq!(chat("null"), Ok(0));
    assert_eq!(chat("\"100\""), Ok(100));
    assert_eq!(chat("\" 1_000.00\\n\""), Ok(1000));
    assert_eq!(chat("true"), Ok(1));
    // 1e20 is a float past 2^63 (pydantic refuses it); a negative limit
    // pydantic reads and vLLM then refuses.
    for bad in ["1.5", "-1", "-1e2", "1e20", "\"1e2\"", "\"-3\"", "[5]"] {
        assert_eq!(
            chat(bad),
            Err(("invalid_type", Some("max_tokens"))),
            "{bad}"
        );
    }
    // Past f64 (Python reads inf, which no int accepts): still a 400.
    assert_eq!(chat("1e400"), Err(("invalid_json", None)));
    let r = parse_body(
        ApiKind::Completions,
        br#"{"model":"m","max_tokens":2e1,"prompt":[1e2,2.0]}"#,
    )
    .unwrap();
    assert_eq!(r.max_tokens, 20);
    assert_eq!(
        r.prompt,
        RequestPrompt::Completion(Prompt::Ids(vec![100, 2]))
    );
    let r = parse_body(ApiKind::Completions, br#"{"model":"m","prompt":[[1e1]]}"#).unwrap();
    assert_eq!(r.prompt, RequestPrompt::Completion(Prompt::Ids(vec![10])));
    let e = err(ApiKind::Completions, r#"{"model":"m","prompt":[1.5]}"#);
    assert_eq!(e.param, Some("prompt"));
    let r = parse_body(
        ApiKind::AnthropicMessages,
        br#"{"model":"m","max_tokens":1e3,"messages":[{"role":"user","content":"x"}]}"#,
    )
    .unwrap();
    assert_eq!(r.max_tokens, 1000);
}

#[test]
fn invalid_utf8_anywhere_is_refused() {
    let mut b = br#"{"model":"m","messages":[{"role":"user","content":"x"}],"extra":""#.to_vec();
    b.extend_from_slice(b"\xff\xfe\"}");
    let e = parse_body(ApiKind::Chat, &b).unwrap_err();
    assert_eq!(e.code, "invalid_json");
    assert!(e.message.contains("UTF-8"), "{}", e.message);
    // A truncated multi-byte character in a key.
    let b = b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"k\xc3\":1}";
    assert_eq!(
        parse_body(ApiKind::Chat, b).unwrap_err().code,
        "invalid_json"
    );
}

#[test]
fn content_encodings() {
    for plain in [
        None,
        Some(""),
        Some("identity"),
        Some(" Identity "),
        Some("identity, identity"),
    ] {
        assert_eq!(content_encoding_error(plain), None, "{plain:?}");
    }
    for coded in ["gzip", "br", "deflate", "zstd", "gzip, identity", "x-gzip"] {
        let e = content_encoding_error(Some(coded)).unwrap();
        assert_eq!(e.code, "unsupported_content_encoding");
        assert!(e.message.contains(coded), "{}", e.message);
    }
}

#[test]
fn visit_strings_reads_the_whole_body_and_refuses_token_ids() {
    let body = br#"{"model":"m","user":"u@example.com","messages":[{"role":"user","content":"hi","name":"n"}],
        "tools":[{"type":"function","function":{"name":"f","description":"d","parameters":{"k\u0065y":{}}}}]}"#;
    let r = parse_body(ApiKind::Chat, body).unwrap();
    let mut seen = Vec::new();
    let done = r.visit_strings(&mut |s| {
        seen.push(s.to_string());
        ControlFlow::Continue(())
    });
    assert_eq!(done, Ok(ControlFlow::Continue(())));
    for s in ["u@example.com", "n", "d", "key", "hi", "model"] {
        assert!(seen.iter().any(|x| x == s), "{s} in {seen:?}");
    }
    // The prompt view is unchanged: message contents only.
    let mut prompt = Vec::new();
    let _ = r.visit(&mut |s| {
        prompt.push(s.to_string());
        ControlFlow::Continue(())
    });
    assert_eq!(prompt, ["hi"]);
    for ids in [r#"[1,2]"#, r#"[[1,2]]"#, r#"[[1],[2]]"#] {
        let b = format!(r#"{{"model":"m","prompt":{ids}}}"#);
        let r = parse_body(ApiKind::Completions, b.as_bytes()).unwrap();
        assert_eq!(
            r.visit_strings(&mut |_| ControlFlow::Continue(())),
            Err(Unscannable),
            "{ids}"
        );
    }
    let r = parse_body(ApiKind::Completions, br#"{"model":"m","prompt":["a","b"]}"#).unwrap();
    assert!(r.visit_strings(&mut |_| ControlFlow::Continue(())).is_ok());
}

/// The shared table (tests/vectors/lax_int.json, made with pydantic): the
/// filter reads every integer vLLM reads, as vLLM reads it, and refuses
/// what pydantic refuses. It uses only non-negative integers up to u64, so
/// it also refuses the negative ones and those past u64 (vLLM refuses them
/// later, as a limit below 1 or past the context length).
#[test]
fn lax_int_vectors_match_pydantic() {
    let table: serde_json::Value =
        serde_json::from_str(include_str!("../../../tests/vectors/lax_int.json")).unwrap();
    let mut checked = 0;
    for v in table["ints"].as_array().unwrap() {
        let text = v["json"].as_str().unwrap();
        if text == "null" {
            // The filter's fields are `int | None`: null is no limit.
            continue;
        }
        let want: Option<u64> = v["value"].as_str().and_then(|n| n.parse().ok());
        let body = format!(
            r#"{{"model":"m","max_tokens":{text},"messages":[{{"role":"user","content":"x"}}]}}"#
        );
        let got = parse_body(ApiKind::Chat, body.as_bytes());
        match want {
            Some(n) => assert_eq!(got.map(|r| r.max_tokens), Ok(n), "max_tokens: {text}"),
            None => assert_eq!(
                got.map_err(|e| (e.code, e.param)).unwrap_err(),
                ("invalid_type", Some("max_tokens")),
                "max_tokens: {text}"
            ),
        }
        // As a token id next to another one.
        let body = format!(r#"{{"model":"m","prompt":[0,{text}]}}"#);
        let got = parse_body(ApiKind::Completions, body.as_bytes()).map(|r| r.prompt);
        match want.and_then(|n| u32::try_from(n).ok()) {
            Some(n) => assert_eq!(
                got,
                Ok(RequestPrompt::Completion(Prompt::Ids(vec![0, n]))),
                "prompt: {text}"
            ),
            None => assert!(got.is_err(), "prompt: {text}: {got:?}"),
        }
        checked += 1;
    }
    assert!(checked > 50, "{checked}");
    // Whole completions bodies: the prompt vLLM reads, or a refusal.
    for b in table["bodies"].as_array().unwrap() {
        if b["api"] != "completions" {
            continue;
        }
        let text = b["body"]
            .as_str()
            .unwrap()
            .replacen('{', r#"{"model":"m","#, 1);
        let got = parse_body(ApiKind::Completions, text.as_bytes()).map(|r| r.prompt);
        let ids = |v: &serde_json::Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_str().unwrap().parse().unwrap())
                .collect()
        };
        match b.get("accepted").map(|a| &a["prompt"]) {
            Some(p) => {
                let items = p.as_array().unwrap();
                let want = if items.iter().all(|i| i.is_array()) {
                    let lists: Vec<Vec<u32>> = items.iter().map(ids).collect();
                    if lists.len() == 1 {
                        Prompt::Ids(lists[0].clone())
                    } else {
                        Prompt::Batch(vec![], lists)
                    }
                } else if b["body"].as_str().unwrap().contains("[\"") {
                    let texts = items.iter().map(|t| t.as_str().unwrap().to_string().into());
                    Prompt::Batch(texts.collect(), vec![])
                } else {
                    Prompt::Ids(ids(p))
                };
                assert_eq!(got, Ok(RequestPrompt::Completion(want)), "{text}");
            }
            None if b["param"].as_str().unwrap().starts_with("body.prompt") => {
                assert!(got.is_err(), "{text}: {got:?}");
            }
            None => {}
        }
    }
}
