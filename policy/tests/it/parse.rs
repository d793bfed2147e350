//! Parse errors carry the path, line and column.

use kvasir_policy::*;

const MINIMAL: &str = r#"{
  "tenantSource": {"header": "x-tenant"},
  "pools": [{"name": "main", "models": ["m"], "cluster": "c", "indexerCluster": "i"}],
  "policies": [
    {"name": "a", "match": {"models": ["m"]}, "action": {"route": {"pool": "main"}}},
    {"name": "b", "match": {"modle": ["m"]}, "action": {"route": {"pool": "main"}}}
  ],
  "defaultAction": {"reject": {"status": 404}}
}"#;

#[test]
fn unknown_field_has_a_path() {
    let e = parse_json(MINIMAL).unwrap_err();
    assert_eq!(e.path, "policies[1].match.modle");
    assert_eq!((e.line, e.column), (6, 35), "just after the key");
    assert!(
        e.message
            .starts_with("unknown field `modle`, expected one of `tenants`"),
        "{}",
        e.message
    );
    assert!(
        e.to_string()
            .starts_with("policies[1].match.modle: unknown field `modle`"),
        "{e}"
    );
    assert!(e.to_string().ends_with("(line 6, column 35)"), "{e}");
}

#[test]
fn wrong_types_and_variants() {
    let e = parse_json(
        &MINIMAL
            .replace(r#""modle""#, r#""models""#)
            .replace(r#""status": 404"#, r#""status": "404""#),
    )
    .unwrap_err();
    assert_eq!(e.path, "defaultAction.reject.status");
    assert_eq!(e.message, "invalid type: string \"404\", expected u16");
    let e = parse_json(&MINIMAL.replace(r#""modle""#, r#""models""#).replace(
        r#"{"route": {"pool": "main"}}}
  ]"#,
        r#"{"forward": {"pool": "main"}}}
  ]"#,
    ))
    .unwrap_err();
    assert_eq!(e.path, "policies[1].action");
    assert_eq!(
        e.message,
        "unknown variant `forward`, expected one of `route`, `reject`, `provider`, `shed`"
    );
    let e = parse_json(&MINIMAL.replace(r#""modle""#, r#""apis""#).replace(
        r#"["m"]}, "action": {"route": {"pool": "main"}}}
  ]"#,
        r#"["chat", "embeddings"]}, "action": {"route": {"pool": "main"}}}
  ]"#,
    ))
    .unwrap_err();
    assert_eq!(e.path, "policies[1].match.apis[1]");
    assert_eq!(
        e.message,
        "unknown variant `embeddings`, expected one of `chat`, `completions`, `anthropicMessages`, `anthropicCountTokens`, `responses`"
    );
}

#[test]
fn missing_fields_and_syntax() {
    let e = parse_json(r#"{"tenantSource": {"header": "x"}, "pools": []}"#).unwrap_err();
    assert_eq!(
        (e.path.as_str(), e.message.as_str()),
        ("", "missing field `defaultAction`")
    );
    let e = parse_json(r#"{"pools": [{"name": "p"}]}"#).unwrap_err();
    assert_eq!(e.path, "pools[0]");
    assert_eq!(e.message, "missing field `models`");
    let e = parse_json("{\n  \"pools\": [,]\n}").unwrap_err();
    assert_eq!((e.path.as_str(), e.line, e.column), ("pools[0]", 2, 13));
    let e = parse_json(&format!(
        "{} trailing",
        MINIMAL.replace(r#""modle""#, r#""models""#)
    ))
    .unwrap_err();
    assert_eq!(
        (e.path.as_str(), e.message.as_str()),
        ("", "trailing characters")
    );
}

#[test]
fn any_deserializer_gets_paths() {
    // The CLI reads YAML through the same entry point; a Value stands in here.
    let v: serde_json::Value = serde_json::from_str(&MINIMAL.replace("modle", "models")).unwrap();
    assert!(deserialize_with_path(v).is_ok());
    let v: serde_json::Value = serde_json::from_str(MINIMAL).unwrap();
    let e = deserialize_with_path(v).unwrap_err();
    assert_eq!(e.path, "policies[1].match.modle");
    assert!(e
        .to_string()
        .starts_with("policies[1].match.modle: unknown field `modle`"));
}

#[test]
fn policy_sets_round_trip_through_serde() {
    for ex in [
        include_str!("../../examples/multi-tenant-pii.json"),
        include_str!("../../examples/saturation-burst.json"),
        include_str!("../../examples/jwt-models.json"),
    ] {
        let set = parse_json(ex).unwrap();
        let text = serde_json::to_string(&set).unwrap();
        assert_eq!(parse_json(&text).unwrap(), set);
        assert!(!text.contains("null"), "unset fields are left out: {text}");
    }
}
