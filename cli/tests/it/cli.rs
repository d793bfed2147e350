//! kvasirctl end to end: the built binary on the examples and on a broken
//! fixture (exit codes, file:line:column, the JSON shape), and the compile
//! bytes against the library call.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn examples() -> PathBuf {
    root().join("crds/examples")
}

fn broken() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/broken.yaml")
}

fn kvasirctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvasirctl"))
        .args(args)
        .output()
        .expect("run kvasirctl")
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn examples_are_valid() {
    let out = kvasirctl(&["validate", p(&examples())]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = kvasirctl(&["validate", "--output", "json", p(&examples())]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["valid"], true);
    assert_eq!(v["errors"], serde_json::json!([]));
    assert_eq!(
        v["targets"],
        serde_json::json!(["serving/Gateway/inference-gateway"])
    );
}

#[test]
fn broken_fixture_has_file_line_column_and_path() {
    let out = kvasirctl(&["validate", p(&broken())]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8(out.stdout).unwrap();
    let b = broken();
    let file = p(&b);
    assert!(
        text.contains(&format!(
            "{file}:17:5: error: InferencePolicy/typo: spec.match.modle: unknown field `modle`"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("{file}:34:7: error: InferencePolicy/wrong-pool: spec.action.route.pool: unknown pool `mian`")),
        "{text}"
    );

    let out = kvasirctl(&["validate", "-o", "json", p(&broken())]);
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["valid"], false);
    let errors = v["errors"].as_array().unwrap();
    assert_eq!(errors.len(), 2, "{v:#}");
    let e = &errors[0];
    for key in [
        "file",
        "line",
        "column",
        "document",
        "kind",
        "name",
        "namespace",
        "path",
        "message",
        "severity",
    ] {
        assert!(e.get(key).is_some(), "missing {key}: {e}");
    }
    assert_eq!(e["file"], file);
    assert_eq!(
        (e["line"].as_u64(), e["column"].as_u64()),
        (Some(17), Some(5))
    );
    assert_eq!(e["document"], 1);
    assert_eq!(e["kind"], "InferencePolicy");
    assert_eq!(e["name"], "typo");
    assert_eq!(e["namespace"], "serving");
    assert_eq!(e["path"], "spec.match.modle");
    assert_eq!(e["severity"], "error");
    assert_eq!(errors[1]["document"], 2);
    assert_eq!(errors[1]["path"], "spec.action.route.pool");
}

#[test]
fn usage_and_io_errors_exit_2() {
    assert_eq!(
        kvasirctl(&["validate", "/nonexistent/x.yaml"])
            .status
            .code(),
        Some(2)
    );
    assert_eq!(kvasirctl(&["validate"]).status.code(), Some(2));
    let out = kvasirctl(&["compile", "--target", "Service/x", p(&examples())]);
    assert_eq!(out.status.code(), Some(2));
    let out = kvasirctl(&["compile", "--target", "Gateway/nope", p(&examples())]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("serving/Gateway/inference-gateway"));
}

#[test]
fn compile_of_broken_input_exits_1() {
    let out = kvasirctl(&["compile", p(&broken())]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty());
    assert!(String::from_utf8_lossy(&out.stderr).contains("spec.match.modle"));
}

/// The bytes `kvasirctl compile` prints are the bytes the library (the
/// controller's path) returns for the same resources, read here by a
/// different YAML parser (serde_yaml).
#[test]
fn compile_bytes_equal_the_library_call() {
    let out = kvasirctl(&[
        "compile",
        "--target",
        "Gateway/inference-gateway",
        p(&examples()),
    ]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut res = kvasir_api::Resources {
        namespace: "serving".into(),
        ..Default::default()
    };
    let mut files: Vec<_> = std::fs::read_dir(examples())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for d in serde_yaml::Deserializer::from_str(&text) {
            let v: Value = serde::Deserialize::deserialize(d).unwrap();
            res.insert(kvasir_api::document::parse(v).unwrap());
        }
    }
    let target = kvasir_api::TargetRef::new(kvasir_api::TargetKind::Gateway, "inference-gateway");
    let lib = kvasir_api::compile(&res, &target, &kvasir_api::Options::default()).unwrap();
    assert_eq!(out.stdout, lib.bytes);
    // And the filter reads them.
    kvasir_policy::FilterConfig::from_json(&out.stdout).unwrap();
}

#[test]
fn crds_prints_the_generated_crds() {
    let out = kvasirctl(&["crds"]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        kvasir_api::crds::yaml().unwrap()
    );
}

fn explain(args: &[&str]) -> Value {
    let mut a = vec!["explain", "-o", "json"];
    a.extend_from_slice(args);
    let ex = examples();
    a.push(p(&ex));
    let out = kvasirctl(&a);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn explain_the_four_example_policies() {
    let m = ["--model", "llama-3.1-8b-instruct"];
    // Easy prompt: the cheaper model, the PII guard said why not.
    let v = explain(
        &[
            &m[..],
            &["--api-key", "sk-acme-example-1", "--prompt", "hi"],
        ]
        .concat(),
    );
    assert_eq!(v["policy"], "cheaper-model-for-easy-prompts");
    assert_eq!(v["decision"]["rewriteModel"], "llama-3.2-1b-instruct");
    assert_eq!(v["policies"][0]["failed"], serde_json::json!(["pii"]));
    // Batch tenant while the pool is busy: shed.
    let v = explain(
        &[
            &m[..],
            &["--tenant", "nightly-eval", "--saturation", "main=0.6"],
        ]
        .concat(),
    );
    assert_eq!(v["policy"], "batch-waits");
    assert_eq!(v["policies"][1]["failed"], serde_json::json!(["poolState"]));
    assert_eq!(v["decision"]["action"], "shed");
    // Saturated, long prompt: the provider.
    let long = "word ".repeat(1000);
    let v = explain(
        &[
            &m[..],
            &[
                "--tenant",
                "acme",
                "--prompt",
                &long,
                "--saturation",
                "main=0.9",
            ],
        ]
        .concat(),
    );
    assert_eq!(v["decision"]["action"], "provider");
    assert_eq!(v["decision"]["cluster"], "kvasir/serving/provider/openai");
    // Same with an e-mail address: PII stays inside.
    let pii = format!("{long} mail bob@example.com");
    let v = explain(
        &[
            &m[..],
            &[
                "--tenant",
                "acme",
                "--prompt",
                &pii,
                "--saturation",
                "main=0.9",
            ],
        ]
        .concat(),
    );
    assert_eq!(v["policy"], "pii-stays-inside");
    assert_eq!(v["decision"]["pool"], "main");
    // What the pick carries: acme's class weight, main's flow-control wait.
    assert_eq!(v["decision"]["hints"]["weight"], 4);
    assert_eq!(v["decision"]["hints"]["maxQueueWaitMs"], 5000);
    assert_eq!(v["request"]["pii"], serde_json::json!(["email"]));
    // A wrong key: tenant identification rejects before any policy.
    let v = explain(&[&m[..], &["--api-key", "nope"]].concat());
    assert_eq!(v["decidedBy"], "tenant");
    assert_eq!(v["decision"]["status"], 401);
}

#[test]
fn explain_reads_a_responses_body_prompt() {
    // A Responses API body: its `instructions` and `input` items are the
    // prompt, so a long one goes to the provider like a long chat does.
    let long = "word ".repeat(1000);
    let body = serde_json::json!({
        "model": "llama-3.1-8b-instruct",
        "instructions": long,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "and a question"}]}],
    });
    let path =
        std::env::temp_dir().join(format!("kvasirctl-responses-{}.json", std::process::id()));
    std::fs::write(&path, body.to_string()).unwrap();
    let v = explain(&[
        "--api",
        "responses",
        "--tenant",
        "acme",
        "--body",
        path.to_str().unwrap(),
        "--saturation",
        "main=0.9",
    ]);
    let _ = std::fs::remove_file(&path);
    assert_eq!(v["request"]["api"], "responses");
    assert!(
        v["request"]["estimatedPromptTokens"].as_u64().unwrap() > 900,
        "{v}"
    );
    assert_eq!(v["decision"]["action"], "provider");
}
