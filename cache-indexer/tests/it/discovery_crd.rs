//! The InferencePool fixtures (and what our type serializes) conform to the
//! upstream CRD's structural schema, so the mock-server tests exercise the
//! objects a real API server would return.
//!
//! A small OpenAPI v3 checker, enough for this CRD: type, required,
//! properties (unknown fields are errors: the API server would have pruned
//! them), additionalProperties, enum, bounds, lengths, patterns, item and
//! property counts, and "as served" defaults (a field with a `default`
//! must be present, since the API server fills it in before answering).
//! `x-kubernetes-validations` CEL rules are skipped by the checker; the two
//! this CRD has that matter here are checked by hand below.

use kvasir_cache_indexer::discovery::{InferencePool, API_VERSION, KIND, PLURAL};
use regex::Regex;
use serde_json::{json, Value};
use std::path::PathBuf;

const CRD_FILE: &str = "upstream-crds/inference.networking.k8s.io_inferencepools.yaml";

/// shared/ lies beside the repository checkout (CI and sessions), or where
/// `KVASIR_SHARED_DIR` says.
fn crd_path() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut candidates = Vec::new();
    if let Some(dir) = std::env::var_os("KVASIR_SHARED_DIR") {
        candidates.push(PathBuf::from(dir).join(CRD_FILE));
    }
    candidates.push(manifest.join("../../shared").join(CRD_FILE));
    candidates.push(manifest.join("../shared").join(CRD_FILE));
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!("upstream CRD not found; looked at {candidates:?} (set KVASIR_SHARED_DIR)")
        })
}

fn crd() -> Value {
    let path = crd_path();
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"))
}

/// The served v1 schema.
fn v1_schema(crd: &Value) -> Value {
    let versions = crd["spec"]["versions"].as_array().expect("spec.versions");
    let v1 = versions
        .iter()
        .find(|v| v["name"] == "v1")
        .expect("a v1 version");
    assert_eq!(v1["served"], true);
    v1["schema"]["openAPIV3Schema"].clone()
}

fn fixture(name: &str) -> Value {
    let path = format!("{}/tests/fixtures/k8s/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Check `v` against `schema`; every violation as "path: what".
fn check(schema: &Value, v: &Value, path: &str, errs: &mut Vec<String>) {
    macro_rules! err {
        ($what:expr) => {
            errs.push(format!("{path}: {}", $what))
        };
    }
    if let Some(t) = schema["type"].as_str() {
        let ok = match t {
            "object" => v.is_object(),
            "array" => v.is_array(),
            "string" => v.is_string(),
            "integer" => v.is_i64() || v.is_u64(),
            "number" => v.is_number(),
            "boolean" => v.is_boolean(),
            _ => true,
        };
        if !ok {
            err!(format!("expected {t}, got {v}"));
            return;
        }
    }
    if let Some(options) = schema["enum"].as_array() {
        if !options.contains(v) {
            err!(format!("{v} not in {options:?}"));
        }
    }
    if let (Some(n), Some(min)) = (v.as_f64(), schema["minimum"].as_f64()) {
        if n < min {
            err!(format!("{n} < minimum {min}"));
        }
    }
    if let (Some(n), Some(max)) = (v.as_f64(), schema["maximum"].as_f64()) {
        if n > max {
            err!(format!("{n} > maximum {max}"));
        }
    }
    if let Some(s) = v.as_str() {
        let len = s.chars().count() as u64;
        if schema["minLength"].as_u64().is_some_and(|m| len < m) {
            err!(format!("{s:?} shorter than minLength"));
        }
        if schema["maxLength"].as_u64().is_some_and(|m| len > m) {
            err!(format!("{s:?} longer than maxLength"));
        }
        if let Some(p) = schema["pattern"].as_str() {
            match Regex::new(p) {
                Ok(re) if !re.is_match(s) => err!(format!("{s:?} does not match {p}")),
                Ok(_) => {}
                Err(e) => err!(format!("pattern {p} did not compile: {e}")),
            }
        }
    }
    if let Some(items) = v.as_array() {
        let n = items.len() as u64;
        if schema["minItems"].as_u64().is_some_and(|m| n < m) {
            err!(format!("{n} items < minItems"));
        }
        if schema["maxItems"].as_u64().is_some_and(|m| n > m) {
            err!(format!("{n} items > maxItems"));
        }
        for (i, item) in items.iter().enumerate() {
            check(&schema["items"], item, &format!("{path}[{i}]"), errs);
        }
        return;
    }
    let Some(obj) = v.as_object() else { return };
    let n = obj.len() as u64;
    if schema["minProperties"].as_u64().is_some_and(|m| n < m) {
        err!(format!("{n} properties < minProperties"));
    }
    if schema["maxProperties"].as_u64().is_some_and(|m| n > m) {
        err!(format!("{n} properties > maxProperties"));
    }
    for req in schema["required"].as_array().into_iter().flatten() {
        if let Some(key) = req.as_str() {
            if !obj.contains_key(key) {
                err!(format!("missing required {key:?}"));
            }
        }
    }
    if let Some(props) = schema["properties"].as_object() {
        for (key, sub) in props {
            if sub.get("default").is_some() && !obj.contains_key(key) {
                err!(format!(
                    "missing {key:?}, which the API server defaults to {}",
                    sub["default"]
                ));
            }
        }
        for (key, value) in obj {
            match props.get(key) {
                Some(sub) => check(sub, value, &format!("{path}.{key}"), errs),
                None if schema["x-kubernetes-preserve-unknown-fields"] == true => {}
                None => err!(format!("unknown field {key:?} (would be pruned)")),
            }
        }
    } else if let Some(sub) = schema.get("additionalProperties").filter(|s| s.is_object()) {
        for (key, value) in obj {
            check(sub, value, &format!("{path}.{key}"), errs);
        }
    }
}

fn violations(schema: &Value, v: &Value) -> Vec<String> {
    let mut errs = Vec::new();
    check(schema, v, "", &mut errs);
    errs
}

/// The CEL rules this CRD carries for the fields discovery reads.
fn cel_by_hand(pool: &Value) -> Vec<String> {
    let mut errs = Vec::new();
    let ports: Vec<&Value> = pool["spec"]["targetPorts"]
        .as_array()
        .map(|a| a.iter().map(|p| &p["number"]).collect())
        .unwrap_or_default();
    for (i, p) in ports.iter().enumerate() {
        if ports[..i].contains(p) {
            errs.push(format!("targetPorts: port number must be unique ({p})"));
        }
    }
    let epp = &pool["spec"]["endpointPickerRef"];
    if epp.is_object() {
        let kind = epp["kind"].as_str().unwrap_or("Service");
        if kind == "Service" && epp.get("port").is_none() {
            errs.push("endpointPickerRef: port is required when kind is 'Service'".to_string());
        }
    }
    errs
}

#[test]
fn crd_is_the_one_our_type_talks_to() {
    let crd = crd();
    assert_eq!(crd["spec"]["group"], "inference.networking.k8s.io");
    assert_eq!(crd["spec"]["names"]["kind"], KIND);
    assert_eq!(crd["spec"]["names"]["plural"], PLURAL);
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    assert_eq!(
        format!("{}/v1", crd["spec"]["group"].as_str().unwrap_or("")),
        API_VERSION
    );
    // v1's selector is matchLabels only: no matchExpressions to translate.
    let schema = v1_schema(&crd);
    let selector = &schema["properties"]["spec"]["properties"]["selector"]["properties"];
    let keys: Vec<&String> = selector
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default();
    assert_eq!(keys, ["matchLabels"]);
}

#[test]
fn pool_fixtures_conform_to_the_crd() {
    let schema = v1_schema(&crd());
    let pool = fixture("inferencepool.json");
    assert_eq!(violations(&schema, &pool), Vec::<String>::new());
    assert_eq!(cel_by_hand(&pool), Vec::<String>::new());

    let list = fixture("inferencepoollist.json");
    assert_eq!(list["kind"], "InferencePoolList");
    assert!(list["metadata"]["resourceVersion"].is_string());
    let items = list["items"].as_array().expect("items");
    assert!(!items.is_empty());
    for item in items {
        assert_eq!(item["apiVersion"], API_VERSION);
        assert_eq!(item["kind"], KIND);
        assert_eq!(violations(&schema, item), Vec::<String>::new());
    }

    // The variants the mock-server test sends are valid pools too.
    let mut two_ports = pool.clone();
    two_ports["spec"]["targetPorts"] = json!([{ "number": 8000 }, { "number": 8001 }]);
    let mut narrower = pool.clone();
    narrower["spec"]["selector"]["matchLabels"]["pod-template-hash"] = json!("7d9f8b6c5");
    for v in [two_ports, narrower] {
        assert_eq!(violations(&schema, &v), Vec::<String>::new());
        assert_eq!(cel_by_hand(&v), Vec::<String>::new());
    }
}

#[test]
fn our_type_reads_the_fixture_and_writes_schema_valid_spec() {
    let schema = v1_schema(&crd());
    let pool: InferencePool =
        serde_json::from_value(fixture("inferencepool.json")).expect("decode fixture");
    assert_eq!(pool.metadata.name.as_deref(), Some("vllm-qwen3"));
    assert_eq!(
        pool.label_selector().ok().as_deref(),
        Some("app=vllm-qwen3")
    );
    assert_eq!(pool.target_ports().ok(), Some(vec![8000]));
    let epp = pool
        .spec
        .endpoint_picker_ref
        .as_ref()
        .expect("endpointPickerRef");
    assert_eq!(epp.name, "kvasir-epp");
    assert_eq!(epp.port.map(|p| p.number), Some(9002));

    // Serialized back, the spec uses the CRD's field names and shapes.
    let spec = serde_json::to_value(&pool.spec).expect("encode spec");
    let spec_schema = &schema["properties"]["spec"];
    assert_eq!(violations(spec_schema, &spec), Vec::<String>::new());
}

/// A change to a valid pool that makes it invalid.
type Edit = Box<dyn Fn(&mut Value)>;

#[test]
fn the_checker_catches_what_the_api_server_would_reject() {
    let schema = v1_schema(&crd());
    let base = fixture("inferencepool.json");
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "no targetPorts",
            Box::new(|v| {
                v["spec"].as_object_mut().map(|o| o.remove("targetPorts"));
            }),
            "missing required \"targetPorts\"",
        ),
        (
            "empty matchLabels",
            Box::new(|v| v["spec"]["selector"]["matchLabels"] = json!({})),
            "minProperties",
        ),
        (
            "port 0",
            Box::new(|v| v["spec"]["targetPorts"] = json!([{ "number": 0 }])),
            "minimum",
        ),
        (
            "nine ports",
            Box::new(|v| {
                v["spec"]["targetPorts"] = json!((1..=9)
                    .map(|n| json!({ "number": 8000 + n }))
                    .collect::<Vec<_>>())
            }),
            "maxItems",
        ),
        (
            "matchExpressions",
            Box::new(|v| v["spec"]["selector"]["matchExpressions"] = json!([])),
            "unknown field \"matchExpressions\"",
        ),
        (
            "bad label value",
            Box::new(|v| v["spec"]["selector"]["matchLabels"]["app"] = json!("a b")),
            "does not match",
        ),
        (
            "bad failureMode",
            Box::new(|v| v["spec"]["endpointPickerRef"]["failureMode"] = json!("Open")),
            "not in",
        ),
        (
            "undefaulted appProtocol",
            Box::new(|v| {
                v["spec"].as_object_mut().map(|o| o.remove("appProtocol"));
            }),
            "defaults to",
        ),
    ];
    for (name, edit, expect) in cases {
        let mut v = base.clone();
        edit(&mut v);
        let errs = violations(&schema, &v);
        assert!(errs.iter().any(|e| e.contains(expect)), "{name}: {errs:?}");
    }
    let mut dup = base.clone();
    dup["spec"]["targetPorts"] = json!([{ "number": 8000 }, { "number": 8000 }]);
    assert_eq!(cel_by_hand(&dup).len(), 1);
    let mut no_port = base;
    no_port["spec"]["endpointPickerRef"]
        .as_object_mut()
        .map(|o| o.remove("port"));
    assert_eq!(cel_by_hand(&no_port).len(), 1);
}
