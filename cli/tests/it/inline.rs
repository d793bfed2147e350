//! kvasirctl's library on inline inputs: JSON files, header and JWT
//! tenants, the PII rule in explanations, duplicates.

use kvasir_api::Options;
use kvasirctl::explain::{explain, Sample};
use kvasirctl::{choose_target, compile, validate, Input};

const SETTINGS_JWT: &str = r#"
apiVersion: kvasir.dev/v1alpha1
kind: InferenceSettings
metadata: {name: s}
spec:
  targetRefs: [{kind: HTTPRoute, name: chat}]
  tenantSource: {jwtClaim: {claim: org, payloadInMetadata: auth0}}
  defaultAction: {provider: {provider: ext}}
---
apiVersion: kvasir.dev/v1alpha1
kind: InferenceTenant
metadata: {name: acme}
spec: {identity: {jwtClaimValue: org-123, headerValue: ignored}}
---
apiVersion: kvasir.dev/v1alpha1
kind: InferenceProvider
metadata: {name: ext, annotations: {kvasir.dev/cluster: provider_ext}}
spec: {backendRef: {name: ext}, auth: {header: x-api-key, secretRef: {name: ext, key: k}}}
---
apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: main, annotations: {kvasir.dev/models: "m1, m2"}}
spec: {}
---
apiVersion: kvasir.dev/v1alpha1
kind: InferencePolicy
metadata: {name: burst}
spec:
  precedence: 1
  targetRefs: [{kind: HTTPRoute, name: chat}]
  match: {models: [m1]}
  action: {provider: {provider: ext}}
---
apiVersion: kvasir.dev/v1alpha1
kind: InferencePolicy
metadata: {name: guard}
spec:
  precedence: 2
  targetRefs: [{kind: HTTPRoute, name: chat}]
  piiGuard: true
  action: {route: {pool: main}}
"#;

fn input(files: &[(&str, &str)]) -> Input {
    let mut i = Input::default();
    for (name, text) in files {
        i.add_text(name, text, "team");
    }
    i
}

#[test]
fn jwt_tenant_and_pii_skip_are_explained() {
    let i = input(&[("a.yaml", SETTINGS_JWT)]);
    let report = validate(&i, &Options::default());
    // The provider policy ahead of the guard is legal; validation says why.
    assert!(report.valid, "{}", report.text());
    assert!(
        report
            .warnings
            .iter()
            .any(|w| w.name.as_deref() == Some("burst")),
        "{}",
        report.text()
    );
    let t = choose_target(&i, None, None).unwrap();
    assert_eq!(t.to_string(), "team/HTTPRoute/chat");
    let c = compile(&i, &t, &Options::default()).unwrap();
    assert_eq!(c.config.providers()[0].cluster, "provider_ext");
    let text = String::from_utf8(c.bytes.clone()).unwrap();
    assert!(
        !text.contains("x-api-key"),
        "no credential material: {text}"
    );
    let sample = Sample {
        jwt_claim: Some("org-123".into()),
        model: Some("m1".into()),
        body: Some(
            serde_json::json!({"messages": [{"role": "user", "content": "IBAN DE89370400440532013000"}]}),
        ),
        ..Sample::default()
    };
    let e = explain(&t.to_string(), &c, &sample).unwrap();
    assert_eq!(e.request["tenant"], "acme");
    assert_eq!(e.request["tenantVia"], "jwtClaim");
    assert_eq!(e.policies[0].result, "skippedForPii");
    assert_eq!(e.policy.as_deref(), Some("guard"));
    assert_eq!(e.decision["action"], "route");
    assert!(e.text().contains("matched, skipped"), "{}", e.text());
    // Without PII the provider policy decides.
    let clean = Sample {
        body: Some(serde_json::json!({"messages": [{"role": "user", "content": "hello"}]})),
        ..sample
    };
    let e = explain(&t.to_string(), &c, &clean).unwrap();
    assert_eq!(e.policy.as_deref(), Some("burst"));
    assert_eq!(e.decision["cluster"], "provider_ext");
}

#[test]
fn json_files_have_positions_too() {
    let json = "{\n  \"apiVersion\": \"kvasir.dev/v1alpha1\",\n  \"kind\": \"InferenceTenant\",\n  \"metadata\": {\"name\": \"x\"},\n  \"spec\": {\"clas\": \"gold\"}\n}\n";
    let i = input(&[("t.json", json)]);
    let d = &i.diagnostics[0];
    assert_eq!(
        (d.file.as_deref(), d.line, d.column),
        (Some("t.json"), Some(5), Some(12))
    );
    assert_eq!(d.path, "spec.clas");
}

#[test]
fn duplicates_syntax_and_foreign_kinds() {
    let tenant =
        "apiVersion: kvasir.dev/v1alpha1\nkind: InferenceTenant\nmetadata: {name: x}\nspec: {}\n";
    let i = input(&[
        ("a.yaml", tenant),
        ("b.yaml", tenant),
        ("c.yaml", "a: [1,\n"),
        (
            "d.yaml",
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\n",
        ),
        (
            "e.yaml",
            "apiVersion: kvasir.dev/v1alpha1\nkind: InferenceRoute\nmetadata: {name: r}\n",
        ),
    ]);
    let r = validate(&i, &Options::default());
    assert!(!r.valid);
    let msgs: Vec<String> = r.errors.iter().map(ToString::to_string).collect();
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("b.yaml:3:") && m.contains("also defined in a.yaml")),
        "{msgs:?}"
    );
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("c.yaml:") && m.contains("not valid YAML")),
        "{msgs:?}"
    );
    assert!(
        msgs.iter()
            .any(|m| m.starts_with("e.yaml:2:1") && m.contains("unknown kind `InferenceRoute`")),
        "{msgs:?}"
    );
    assert_eq!(
        r.warnings.len(),
        1,
        "the Deployment is skipped with a warning"
    );
}

#[test]
fn header_tenants_use_header_value() {
    let docs = r#"
apiVersion: kvasir.dev/v1alpha1
kind: InferenceSettings
metadata: {name: s}
spec:
  targetRefs: [{kind: Gateway, name: g}]
  tenantSource: {header: x-team}
  defaultAction: {reject: {status: 403}}
---
apiVersion: kvasir.dev/v1alpha1
kind: InferenceTenant
metadata: {name: blue}
spec: {identity: {headerValue: Blue Team}}
"#;
    let i = input(&[("a.yaml", docs)]);
    let t = choose_target(&i, None, None).unwrap();
    let c = compile(&i, &t, &Options::default()).unwrap();
    let sample = Sample {
        headers: vec![("x-team".into(), "Blue Team".into())],
        model: Some("m".into()),
        ..Sample::default()
    };
    let e = explain(&t.to_string(), &c, &sample).unwrap();
    assert_eq!(e.request["tenant"], "blue");
    assert_eq!(e.decided_by, "default");
    assert_eq!(e.decision["status"], 403);
}

#[test]
fn each_target_compiles_its_own_policies() {
    let docs = r#"
apiVersion: kvasir.dev/v1alpha1
kind: InferenceSettings
metadata: {name: s}
spec:
  targetRefs: [{kind: Gateway, name: edge}, {kind: HTTPRoute, name: chat}]
  tenantSource: {header: x-team}
  defaultAction: {reject: {status: 403}}
---
apiVersion: kvasir.dev/v1alpha1
kind: InferenceTenant
metadata: {name: blue}
spec: {}
---
apiVersion: kvasir.dev/v1alpha1
kind: InferencePolicy
metadata: {name: both}
spec:
  precedence: 5
  targetRefs: [{kind: Gateway, name: edge}, {kind: HTTPRoute, name: chat}]
  match: {tenants: [blue]}
  action: {reject: {status: 418}}
---
apiVersion: kvasir.dev/v1alpha1
kind: InferencePolicy
metadata: {name: chat-only}
spec:
  precedence: 5
  targetRefs: [{kind: HTTPRoute, name: chat}]
  action: {shed: {retryAfterS: 1}}
"#;
    let i = input(&[("a.yaml", docs)]);
    // `both` and `chat-only` share precedence 5 on HTTPRoute/chat only.
    let r = validate(&i, &Options::default());
    assert_eq!(r.targets, ["team/Gateway/edge", "team/HTTPRoute/chat"]);
    assert_eq!(r.errors.len(), 1, "{}", r.text());
    assert_eq!(r.errors[0].path, "spec.precedence");
    assert!(
        r.errors[0].message.contains("on HTTPRoute/chat"),
        "{}",
        r.text()
    );
    let err = choose_target(&i, None, None).unwrap_err();
    assert!(err.contains("several targets"), "{err}");
    let edge = kvasirctl::parse_target("Gateway/edge").unwrap();
    let t = choose_target(&i, Some(&edge), None).unwrap();
    let c = kvasir_api::compile(&i.namespaces["team"], &t.target, &Options::default()).unwrap();
    let names: Vec<_> = c
        .config
        .policies()
        .iter()
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(names, ["both"]);
}
