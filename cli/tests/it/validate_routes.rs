//! `kvasirctl validate` beyond the kvasir.dev documents: the HTTPRoute
//! rules that turn the filter's `x-kvasir-cluster` into a backend are
//! cross-checked against the destinations each target compiles to, a
//! misspelt target is an error where the inputs define its kind, and
//! `--allow-missing-secrets` makes a tenant's absent key Secret a warning.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn examples() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crds/examples")
}

/// A directory under the target dir, unique to this test, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(test: &str) -> Dir {
        let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("validate-routes-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        Dir(d)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).expect("write");
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn kvasirctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvasirctl"))
        .args(args)
        .output()
        .expect("run kvasirctl")
}

fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

fn json(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn messages(v: &Value, key: &str) -> Vec<String> {
    v[key]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|d| d["message"].as_str().unwrap_or("").to_owned())
                .collect()
        })
        .unwrap_or_default()
}

const GATEWAY: &str = r#"
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: inference-gateway, namespace: serving}
spec:
  gatewayClassName: eg
  listeners: [{name: http, protocol: HTTP, port: 80}]
"#;

/// The examples compile to three destinations: pools `main` and `small`,
/// provider `openai`. `rules` replaces the route's rules.
fn route(rules: &str) -> String {
    format!(
        r#"
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: inference, namespace: serving}}
spec:
  parentRefs: [{{name: inference-gateway}}]
  rules:
{rules}
"#
    )
}

fn rule(value: &str) -> String {
    format!(
        r#"    - matches:
        - path: {{type: Exact, value: /v1/chat/completions}}
          method: POST
          headers: [{{type: Exact, name: x-kvasir-cluster, value: "{value}"}}]
        - path: {{type: Exact, value: /v1/messages}}
          method: POST
          headers: [{{type: Exact, name: x-kvasir-cluster, value: "{value}"}}]
      backendRefs: [{{name: backend, port: 8000}}]
"#
    )
}

const BEFORE_FILTER: &str = r#"    - matches:
        - path: {type: Exact, value: /v1/chat/completions}
          method: POST
      backendRefs: [{name: unavailable, port: 8000}]
"#;

fn all_rules() -> String {
    [
        rule("kvasir/serving/pool/main"),
        rule("kvasir/serving/pool/small"),
        rule("kvasir/serving/provider/openai"),
        BEFORE_FILTER.to_owned(),
    ]
    .concat()
}

#[test]
fn a_route_with_a_rule_for_every_destination_is_valid() {
    let d = Dir::new("complete");
    d.write(
        "gateway.yaml",
        &format!("{GATEWAY}---{}", route(&all_rules())),
    );
    let out = kvasirctl(&[
        "validate",
        "-o",
        "json",
        p(&examples()),
        p(&d.0.join("gateway.yaml")),
    ]);
    let v = json(&out);
    assert_eq!(out.status.code(), Some(0), "{v:#}");
    assert_eq!(v["valid"], true);
    let warnings = messages(&v, "warnings");
    assert!(
        !warnings.iter().any(|m| m.contains("x-kvasir-cluster")),
        "{warnings:#?}"
    );
}

#[test]
fn a_destination_without_a_rule_is_an_error_on_the_route() {
    let d = Dir::new("missing");
    let rules = [
        rule("kvasir/serving/pool/main"),
        // `small` has no rule: the filter's choice of it would be served by
        // the rule without the header.
        rule("kvasir/serving/provider/openai"),
        BEFORE_FILTER.to_owned(),
    ]
    .concat();
    let f = d.write("gateway.yaml", &format!("{GATEWAY}---{}", route(&rules)));
    let out = kvasirctl(&["validate", p(&examples()), p(&f)]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("{}:", p(&f)))
            && text.contains("error: HTTPRoute/inference: spec.rules: no rule matches `x-kvasir-cluster: kvasir/serving/pool/small`")
            && text.contains("InferencePool/small"),
        "{text}"
    );
    let v = json(&kvasirctl(&[
        "validate",
        "-o",
        "json",
        p(&examples()),
        p(&f),
    ]));
    let errors = v["errors"].as_array().expect("errors");
    assert_eq!(errors.len(), 1, "{v:#}");
    assert_eq!(errors[0]["kind"], "HTTPRoute");
    assert_eq!(errors[0]["name"], "inference");
    assert_eq!(errors[0]["path"], "spec.rules");
    assert_eq!(errors[0]["line"], 14, "{v:#}");
}

#[test]
fn a_typo_in_a_header_value_is_an_error_and_a_dead_rule() {
    let d = Dir::new("typo");
    let rules = [
        rule("kvasir/serving/pool/main"),
        rule("kvasir/serving/pool/smal"),
        rule("kvasir/serving/provider/openai"),
    ]
    .concat();
    let f = d.write("gateway.yaml", &format!("{GATEWAY}---{}", route(&rules)));
    let out = kvasirctl(&["validate", "-o", "json", p(&examples()), p(&f)]);
    assert_eq!(out.status.code(), Some(1));
    let v = json(&out);
    assert!(messages(&v, "errors")
        .iter()
        .any(|m| m.contains("kvasir/serving/pool/small")));
    let dead: Vec<&Value> = v["warnings"]
        .as_array()
        .expect("warnings")
        .iter()
        .filter(|w| {
            w["message"]
                .as_str()
                .is_some_and(|m| m.contains("kvasir/serving/pool/smal` is never set"))
        })
        .collect();
    assert_eq!(dead.len(), 2, "{v:#}");
    assert_eq!(dead[0]["path"], "spec.rules[1].matches[0].headers[0].value");
}

#[test]
fn a_destination_whose_rules_miss_a_path_is_a_warning() {
    let d = Dir::new("paths");
    let narrow = r#"    - matches:
        - path: {type: Exact, value: /v1/chat/completions}
          method: POST
          headers: [{type: Exact, name: x-kvasir-cluster, value: "kvasir/serving/pool/small"}]
      backendRefs: [{name: backend, port: 8000}]
"#;
    let rules = [
        rule("kvasir/serving/pool/main"),
        narrow.to_owned(),
        rule("kvasir/serving/provider/openai"),
    ]
    .concat();
    let f = d.write("gateway.yaml", &format!("{GATEWAY}---{}", route(&rules)));
    let out = kvasirctl(&["validate", "-o", "json", p(&examples()), p(&f)]);
    let v = json(&out);
    assert_eq!(out.status.code(), Some(0), "{v:#}");
    let w = messages(&v, "warnings");
    assert!(
        w.iter()
            .any(|m| m.contains("kvasir/serving/pool/small")
                && m.contains("POST Exact /v1/messages")),
        "{w:#?}"
    );
}

#[test]
fn without_routes_the_check_says_it_did_not_run() {
    let out = kvasirctl(&["validate", "-o", "json", p(&examples())]);
    assert_eq!(out.status.code(), Some(0));
    let w = messages(&json(&out), "warnings");
    assert!(
        w.iter()
            .any(|m| m.contains("no HTTPRoute in the inputs carries Gateway/inference-gateway")),
        "{w:#?}"
    );
}

#[test]
fn a_misspelt_target_is_an_error_where_the_inputs_define_gateways() {
    let d = Dir::new("target");
    let other = GATEWAY.replace("name: inference-gateway", "name: inference-gw");
    let f = d.write("gateway.yaml", &other);
    let out = kvasirctl(&["validate", "-o", "json", p(&examples()), p(&f)]);
    assert_eq!(out.status.code(), Some(1));
    let v = json(&out);
    let errors = v["errors"].as_array().expect("errors");
    let on_settings = errors
        .iter()
        .find(|e| e["kind"] == "InferenceSettings")
        .unwrap_or_else(|| panic!("{v:#}"));
    assert_eq!(on_settings["path"], "spec.targetRefs[0].name");
    let msg = on_settings["message"].as_str().unwrap_or("");
    assert!(
        msg.contains("Gateway/inference-gateway is not in the inputs")
            && msg.contains("inference-gw"),
        "{msg}"
    );
    // Every object naming it says so (the settings and the four policies'
    // five objects).
    assert_eq!(errors.len(), 6, "{v:#}");
}

#[test]
fn missing_secrets_are_errors_unless_allowed() {
    let d = Dir::new("secrets");
    // The examples without their Secret documents, as a GitOps repository
    // that keeps Secrets out of Git holds them.
    let mut text = String::new();
    for entry in std::fs::read_dir(examples()).expect("examples") {
        let path = entry.expect("entry").path();
        let body = std::fs::read_to_string(&path).expect("read");
        let kept: Vec<&str> = body
            .split("\n---")
            .filter(|doc| !doc.contains("\nkind: Secret"))
            .collect();
        text.push_str(&kept.join("\n---"));
        text.push_str("\n---\n");
    }
    let f = d.write("policies.yaml", &text);
    let out = kvasirctl(&["validate", "-o", "json", p(&f)]);
    assert_eq!(out.status.code(), Some(1));
    let errors = messages(&json(&out), "errors");
    assert_eq!(errors.len(), 2, "{errors:#?}");
    assert!(
        errors.iter().all(|m| m.contains("not found")),
        "{errors:#?}"
    );

    let out = kvasirctl(&["validate", "-o", "json", "--allow-missing-secrets", p(&f)]);
    let v = json(&out);
    assert_eq!(out.status.code(), Some(0), "{v:#}");
    assert_eq!(v["valid"], true);
    let w: Vec<&Value> = v["warnings"]
        .as_array()
        .expect("warnings")
        .iter()
        .filter(|w| {
            w["message"]
                .as_str()
                .is_some_and(|m| m.contains("--allow-missing-secrets"))
        })
        .collect();
    assert_eq!(w.len(), 2, "{v:#}");
    assert_eq!(w[0]["path"], "spec.identity.apiKeys.secretRef.name");
    assert_eq!(w[0]["severity"], "warning");
    // Other errors are still errors with the flag.
    let broken = d.write(
        "broken.yaml",
        &text.replace("precedence: 100", "precedence: 10"),
    );
    let out = kvasirctl(&["validate", "--allow-missing-secrets", p(&broken)]);
    assert_eq!(out.status.code(), Some(1));
    // And `compile` has no such flag: a stand-in key must never be written.
    let out = kvasirctl(&["compile", "--allow-missing-secrets", p(&f)]);
    assert_eq!(out.status.code(), Some(2));
}
