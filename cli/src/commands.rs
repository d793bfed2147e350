//! The commands on inputs already read: what `kvasirctl validate`,
//! `compile` and `explain` print and how they exit, as library calls.
//! `main.rs` reads the files and parses the flags, then calls these; the
//! browser playground (`playground/`) calls the same functions on the
//! texts of its editor, so both give the same answer byte for byte.

use std::collections::BTreeMap;

use kvasir_api::eep::WasmCode;
use kvasir_api::Options;
use kvasir_policy::ApiKind;

use crate::explain::{explain, Sample};
use crate::{
    choose_target, extension_policy, parse_target, validate_with, Checks, Input, Outcome, Scoped,
    EXIT_OK,
};

/// How `validate` and `explain` print.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// For people.
    Text,
    /// A stable JSON object (docs/kvasirctl.md).
    Json,
}

/// Pretty JSON and a newline, as `--output json` prints.
pub fn json_line<T: serde::Serialize>(v: &T) -> Vec<u8> {
    let mut b = serde_json::to_vec_pretty(v).unwrap_or_default();
    b.push(b'\n');
    b
}

/// `validate`: every document checked, every target compiled.
pub fn validate(input: &Input, opts: &Options, checks: Checks, format: Format) -> Outcome {
    let report = validate_with(input, opts, checks);
    let stdout = match format {
        Format::Json => json_line(&report),
        Format::Text => report.text().into_bytes(),
    };
    Outcome {
        stdout,
        stderr: String::new(),
        code: report.code(),
    }
}

/// The target `--target` names (`Gateway/NAME`, in `namespace` if given),
/// or the only one there is.
pub fn target_of(
    input: &Input,
    namespace: Option<&str>,
    target: Option<&str>,
) -> Result<Scoped, Outcome> {
    let t = target
        .map(parse_target)
        .transpose()
        .map_err(Outcome::usage)?;
    choose_target(input, t.as_ref(), namespace).map_err(Outcome::usage)
}

/// The JSON object as YAML, in the same key order: serde_yaml's `Value`
/// keeps insertion order where serde_json's sorts.
pub fn yaml_of(json: &[u8]) -> Result<Vec<u8>, Outcome> {
    use serde::Deserialize;
    let mut de = serde_json::Deserializer::from_slice(json);
    serde_yaml::Value::deserialize(&mut de)
        .and_then(|v| serde_yaml::to_string(&v).map_err(serde::de::Error::custom))
        .map(String::into_bytes)
        .map_err(|e| Outcome::usage(format!("cannot write YAML: {e}")))
}

/// `compile`: the target's filter configuration, or with `code` the whole
/// EnvoyExtensionPolicy (as YAML with `yaml`).
pub fn compile(
    input: &Input,
    opts: &Options,
    namespace: Option<&str>,
    target: Option<&str>,
    code: Option<&WasmCode>,
    yaml: bool,
) -> Outcome {
    let scoped = match target_of(input, namespace, target) {
        Ok(s) => s,
        Err(o) => return o,
    };
    let built = match code {
        None => crate::compile(input, &scoped, opts).map(|c| c.bytes),
        Some(code) => extension_policy(input, &scoped, opts, code),
    };
    let bytes = match built {
        Ok(b) if yaml => match yaml_of(&b) {
            Ok(y) => y,
            Err(o) => return o,
        },
        Ok(b) => b,
        Err(report) => {
            return Outcome {
                stdout: Vec::new(),
                stderr: report.text(),
                code: report.code().max(1),
            }
        }
    };
    Outcome {
        stdout: bytes,
        stderr: String::new(),
        code: EXIT_OK,
    }
}

/// The sample request of `explain`, as its flags give it.
#[derive(Debug, Clone, Default)]
pub struct RequestArgs {
    /// `--tenant`.
    pub tenant: Option<String>,
    /// `--api-key`.
    pub api_key: Option<String>,
    /// `-H 'name: value'`, each.
    pub headers: Vec<String>,
    /// `--jwt-claim`.
    pub jwt_claim: Option<String>,
    /// `--model`.
    pub model: Option<String>,
    /// `--api` (default chat).
    pub api: Option<ApiKind>,
    /// `--body FILE`: the name, read by the reader given to [`sample`].
    pub body: Option<String>,
    /// `--prompt`.
    pub prompt: Option<String>,
    /// `--saturation POOL=VALUE`, each.
    pub saturation: Vec<String>,
}

/// The [`Sample`] the flags describe; `read_body` reads `--body`'s file
/// (an error is its message). A mistake is a usage error's message.
pub fn sample(
    r: RequestArgs,
    read_body: &dyn Fn(&str) -> Result<Vec<u8>, String>,
) -> Result<Sample, String> {
    let mut hs = Vec::new();
    for h in &r.headers {
        let (k, v) = h
            .split_once(':')
            .ok_or_else(|| format!("--header `{h}`: expected `name: value`"))?;
        hs.push((k.trim().to_ascii_lowercase(), v.trim().to_owned()));
    }
    if let Some(k) = r.api_key {
        hs.push(("authorization".into(), format!("Bearer {k}")));
    }
    let body = match (&r.body, r.prompt) {
        (Some(p), _) => {
            let text = read_body(p)?;
            Some(serde_json::from_slice(&text).map_err(|e| format!("{p}: not JSON: {e}"))?)
        }
        (None, Some(t)) => Some(serde_json::json!({"messages": [{"role": "user", "content": t}]})),
        (None, None) => None,
    };
    let mut sat = BTreeMap::new();
    for s in &r.saturation {
        let parsed = s
            .split_once('=')
            .and_then(|(p, v)| Some((p.to_owned(), v.parse::<f64>().ok()?)));
        match parsed {
            Some((p, v)) if (0.0..=1.0).contains(&v) => {
                sat.insert(p, v);
            }
            _ => {
                return Err(format!(
                    "--saturation `{s}`: expected POOL=VALUE with VALUE in 0..1"
                ))
            }
        }
    }
    Ok(Sample {
        tenant: r.tenant,
        headers: hs,
        jwt_claim: r.jwt_claim,
        api: Some(r.api.unwrap_or(ApiKind::Chat)),
        model: r.model,
        body,
        saturation: sat,
    })
}

/// `explain`: the target compiled, then the sample request through the
/// filter's matcher.
pub fn explain_request(
    input: &Input,
    opts: &Options,
    namespace: Option<&str>,
    target: Option<&str>,
    sample: &Sample,
    format: Format,
) -> Outcome {
    let scoped = match target_of(input, namespace, target) {
        Ok(s) => s,
        Err(o) => return o,
    };
    let c = match crate::compile(input, &scoped, opts) {
        Ok(c) => c,
        Err(report) => {
            return Outcome {
                stdout: Vec::new(),
                stderr: report.text(),
                code: report.code().max(1),
            }
        }
    };
    let e = match explain(&scoped.to_string(), &c, sample) {
        Ok(e) => e,
        Err(msg) => return Outcome::usage(msg),
    };
    let stdout = match format {
        Format::Json => json_line(&e),
        Format::Text => e.text().into_bytes(),
    };
    Outcome {
        stdout,
        stderr: String::new(),
        code: EXIT_OK,
    }
}
