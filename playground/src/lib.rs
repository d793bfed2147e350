//! # kvasir-playground
//!
//! `kvasirctl validate`, `compile` and `explain` for the browser: the page
//! in `playground/web/` hands this module the texts of its editor and a
//! sample request, and gets back what `kvasirctl` would print for the same
//! files, byte for byte, because it calls the same library functions
//! (`kvasirctl::commands`) on the same [`Input`]. Nothing else runs: no
//! network, no storage.
//!
//! Each exported function takes one JSON object (see [`Call`]) and returns
//! one (see [`Answer`]), so the JavaScript side needs no generated types.
#![warn(missing_docs)]

use kvasir_api::Options;
use kvasir_policy::ApiKind;
use kvasirctl::commands::{self, Format, RequestArgs};
use kvasirctl::{Checks, Input, Outcome};
use serde::{Deserialize, Serialize};
use wasm_bindgen::prelude::wasm_bindgen;

/// One editor tab: a file's name (the path kvasirctl would be given) and
/// its text.
#[derive(Debug, Clone, Deserialize)]
pub struct File {
    /// The name diagnostics carry (`crds/examples/base.yaml`).
    pub name: String,
    /// Every document of the file.
    pub text: String,
}

/// The sample request of `explain`: kvasirctl's flags, as fields.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct Request {
    /// `--tenant`.
    pub tenant: Option<String>,
    /// `--api-key`.
    pub api_key: Option<String>,
    /// `-H`, each `name: value`.
    pub headers: Vec<String>,
    /// `--jwt-claim`.
    pub jwt_claim: Option<String>,
    /// `--model`.
    pub model: Option<String>,
    /// `--api`: `chat`, `completions`, `anthropic-messages`,
    /// `anthropic-count-tokens`, `responses` (kvasirctl's values).
    pub api: Option<String>,
    /// The text of `--body FILE` (JSON).
    pub body: Option<String>,
    /// `--prompt`.
    pub prompt: Option<String>,
    /// `--saturation`, each `POOL=VALUE`.
    pub saturation: Vec<String>,
}

/// What every call takes.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct Call {
    /// The inputs, in the order kvasirctl would read them.
    pub files: Vec<File>,
    /// `--namespace`.
    pub namespace: Option<String>,
    /// `--indexer-cluster` (default `kvasir-indexer`).
    pub indexer_cluster: Option<String>,
    /// `validate --allow-missing-secrets`.
    pub allow_missing_secrets: bool,
    /// `--output`: `text` (default) or `json` for validate and explain.
    pub output: Option<String>,
    /// `--target` of compile and explain.
    pub target: Option<String>,
    /// explain's sample request.
    pub request: Request,
}

/// What every call returns: kvasirctl's stdout, stderr and exit status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Answer {
    /// 0 valid, 1 invalid, 2 usage error.
    pub code: i32,
    /// What kvasirctl prints on stdout (UTF-8: it prints JSON, YAML or text).
    pub stdout: String,
    /// What it prints on stderr.
    pub stderr: String,
}

impl From<Outcome> for Answer {
    fn from(o: Outcome) -> Answer {
        Answer {
            code: o.code,
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: o.stderr,
        }
    }
}

/// The name `--body` gets in messages about it.
pub const BODY_NAME: &str = "body.json";

/// kvasirctl's `--api` value as the API kind.
pub fn api_kind(name: &str) -> Option<ApiKind> {
    Some(match name {
        "chat" => ApiKind::Chat,
        "completions" => ApiKind::Completions,
        "anthropic-messages" => ApiKind::AnthropicMessages,
        "anthropic-count-tokens" => ApiKind::AnthropicCountTokens,
        "responses" => ApiKind::Responses,
        _ => return None,
    })
}

struct Prepared {
    input: Input,
    opts: Options,
    format: Format,
}

fn prepare(call: &Call) -> Result<Prepared, Outcome> {
    let ns = call.namespace.as_deref().unwrap_or("default");
    let mut input = Input::default();
    for f in &call.files {
        input.add_text(&f.name, &f.text, ns);
    }
    let opts = Options {
        indexer_cluster: call
            .indexer_cluster
            .clone()
            .unwrap_or_else(|| "kvasir-indexer".into()),
    };
    let format = match call.output.as_deref() {
        None | Some("text") => Format::Text,
        Some("json") => Format::Json,
        Some(o) => return Err(Outcome::usage(format!("--output `{o}`: text or json"))),
    };
    Ok(Prepared {
        input,
        opts,
        format,
    })
}

fn answer(call: &str, run: impl FnOnce(Call) -> Outcome) -> String {
    let out = match serde_json::from_str::<Call>(call) {
        Ok(c) => run(c),
        Err(e) => Outcome::usage(format!("playground call: {e}")),
    };
    serde_json::to_string(&Answer::from(out)).unwrap_or_default()
}

/// `kvasirctl validate [--allow-missing-secrets] [-o json] FILES`.
pub fn validate_call(call: Call) -> Outcome {
    match prepare(&call) {
        Ok(p) => commands::validate(
            &p.input,
            &p.opts,
            Checks {
                allow_missing_secrets: call.allow_missing_secrets,
            },
            p.format,
        ),
        Err(o) => o,
    }
}

/// `kvasirctl compile [--target T] FILES`: the filter's configuration.
pub fn compile_call(call: Call) -> Outcome {
    match prepare(&call) {
        Ok(p) => commands::compile(
            &p.input,
            &p.opts,
            call.namespace.as_deref(),
            call.target.as_deref(),
            None,
            false,
        ),
        Err(o) => o,
    }
}

/// `kvasirctl explain [--target T] [request flags] [-o json] FILES`.
pub fn explain_call(call: Call) -> Outcome {
    let p = match prepare(&call) {
        Ok(p) => p,
        Err(o) => return o,
    };
    let r = call.request;
    let api = match r.api.as_deref() {
        None => None,
        Some(a) => match api_kind(a) {
            Some(k) => Some(k),
            None => return Outcome::usage(format!("--api `{a}`: unknown API")),
        },
    };
    if r.tenant.is_some() && r.api_key.is_some() {
        return Outcome::usage("--tenant and --api-key: give one of them");
    }
    if r.body.is_some() && r.prompt.is_some() {
        return Outcome::usage("--body and --prompt: give one of them");
    }
    let body = r.body.clone();
    let args = RequestArgs {
        tenant: r.tenant,
        api_key: r.api_key,
        headers: r.headers,
        jwt_claim: r.jwt_claim,
        model: r.model,
        api,
        body: body.as_ref().map(|_| BODY_NAME.to_owned()),
        prompt: r.prompt,
        saturation: r.saturation,
    };
    let read_body = |_: &str| Ok(body.clone().unwrap_or_default().into_bytes());
    match commands::sample(args, &read_body) {
        Ok(sample) => commands::explain_request(
            &p.input,
            &p.opts,
            call.namespace.as_deref(),
            call.target.as_deref(),
            &sample,
            p.format,
        ),
        Err(msg) => Outcome::usage(msg),
    }
}

/// Validate: a JSON [`Call`] in, a JSON [`Answer`] out.
#[wasm_bindgen]
pub fn validate(call: &str) -> String {
    answer(call, validate_call)
}

/// Compile: a JSON [`Call`] in, a JSON [`Answer`] out (stdout: the
/// kvasir.filter/v1 configuration).
#[wasm_bindgen]
pub fn compile(call: &str) -> String {
    answer(call, compile_call)
}

/// Explain: a JSON [`Call`] in, a JSON [`Answer`] out.
#[wasm_bindgen]
pub fn explain(call: &str) -> String {
    answer(call, explain_call)
}

/// The crate's version (the workspace's).
#[wasm_bindgen]
pub fn version() -> String {
    env!("CARGO_PKG_VERSION").to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn call(v: Value) -> Call {
        serde_json::from_value(v).unwrap()
    }

    const BROKEN: &str = "apiVersion: kvasir.dev/v1alpha1\nkind: InferencePolicy\nmetadata: {name: p, namespace: ns}\nspec:\n  targetRefs: [{kind: Gateway, name: gw}]\n  match:\n    modle: x\n  action: {reject: {status: 403}}\n";

    #[test]
    fn a_broken_file_is_reported_at_its_line() {
        let out = validate_call(call(json!({"files": [{"name": "p.yaml", "text": BROKEN}]})));
        assert_eq!(out.code, 1);
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            text.starts_with(
                "p.yaml:7:5: error: InferencePolicy/p: spec.match.modle: unknown field `modle`"
            ),
            "{text}"
        );
    }

    #[test]
    fn bad_calls_are_usage_errors() {
        let a: Answer = serde_json::from_str(&validate("{\"filez\": []}"))
            .map(|v: Value| Answer {
                code: v["code"].as_i64().unwrap() as i32,
                stdout: v["stdout"].as_str().unwrap().into(),
                stderr: v["stderr"].as_str().unwrap().into(),
            })
            .unwrap();
        assert_eq!(a.code, 2);
        assert!(
            a.stderr
                .starts_with("kvasirctl: playground call: unknown field `filez`"),
            "{}",
            a.stderr
        );
        let out = explain_call(call(json!({"files": [], "request": {"api": "grpc"}})));
        assert_eq!(
            (out.code, out.stderr.as_str()),
            (2, "kvasirctl: --api `grpc`: unknown API\n")
        );
    }

    #[test]
    fn the_body_is_read_as_body_json() {
        let out = explain_call(call(json!({"files": [], "request": {"body": "{"}})));
        assert_eq!(out.code, 2);
        assert!(
            out.stderr.starts_with("kvasirctl: body.json: not JSON:"),
            "{}",
            out.stderr
        );
    }
}
