//! # kvasirctl
//!
//! Validate, compile and explain Kvasir resources offline: no cluster, no
//! network. The commands are plain functions returning what to print and
//! the exit status, so tests call them directly; `main.rs` is only clap.
//!
//! Exit statuses: 0 valid (warnings allowed), 1 invalid, 2 usage or I/O
//! error.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod explain;
pub mod input;
pub mod yaml;

use std::collections::BTreeSet;
use std::path::Path;

use kvasir_api::eep::WasmCode;
use kvasir_api::{Compiled, Options, TargetKind, TargetRef};
use kvasir_policy::Severity;
use serde::Serialize;

pub use input::{Diagnostic, Input, InputError};

/// Exit status: valid.
pub const EXIT_OK: i32 = 0;
/// Exit status: the input is invalid.
pub const EXIT_INVALID: i32 = 1;
/// Exit status: usage or I/O error.
pub const EXIT_USAGE: i32 = 2;

/// What a command prints and how it exits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Bytes for stdout.
    pub stdout: Vec<u8>,
    /// Text for stderr.
    pub stderr: String,
    /// Exit status.
    pub code: i32,
}

impl Outcome {
    /// A usage error.
    pub fn usage(msg: impl std::fmt::Display) -> Outcome {
        Outcome {
            stdout: Vec::new(),
            stderr: format!("kvasirctl: {msg}\n"),
            code: EXIT_USAGE,
        }
    }
}

/// A target in a namespace: `serving/Gateway/inference-gateway`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Scoped {
    /// The namespace.
    pub namespace: String,
    /// The target.
    pub target: TargetRef,
}

impl std::fmt::Display for Scoped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.target)
    }
}

/// Parses `Gateway/NAME` or `HTTPRoute/NAME`.
pub fn parse_target(s: &str) -> Result<TargetRef, String> {
    let (kind, name) = s
        .split_once('/')
        .ok_or_else(|| format!("`{s}`: expected Gateway/NAME or HTTPRoute/NAME"))?;
    let kind = match kind {
        "Gateway" | "gateway" => TargetKind::Gateway,
        "HTTPRoute" | "httproute" => TargetKind::HttpRoute,
        _ => return Err(format!("`{kind}`: a target is a Gateway or an HTTPRoute")),
    };
    if name.is_empty() {
        return Err(format!("`{s}`: the target's name is empty"));
    }
    Ok(TargetRef::new(kind, name))
}

/// Every target of every namespace.
pub fn all_targets(input: &Input) -> Vec<Scoped> {
    input
        .namespaces
        .iter()
        .flat_map(|(ns, res)| {
            kvasir_api::targets(res)
                .into_iter()
                .map(move |target| Scoped {
                    namespace: ns.clone(),
                    target,
                })
        })
        .collect()
}

/// Validation of everything read: each target compiled.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// No errors.
    pub valid: bool,
    /// Errors, by file, line and column.
    pub errors: Vec<Diagnostic>,
    /// Warnings, same order.
    pub warnings: Vec<Diagnostic>,
    /// The targets compiled (`namespace/Kind/name`).
    pub targets: Vec<String>,
}

/// Validates every document and compiles every target.
pub fn validate(input: &Input, opts: &Options) -> Report {
    let mut all: Vec<Diagnostic> = input.diagnostics.clone();
    let targets = all_targets(input);
    for t in &targets {
        let res = &input.namespaces[&t.namespace];
        let findings = match kvasir_api::compile(res, &t.target, opts) {
            Ok(c) => c.warnings,
            Err(f) => f,
        };
        all.extend(findings.iter().map(|f| input.locate(&t.namespace, f)));
    }
    let key = |d: &Diagnostic| {
        (
            d.file.clone(),
            d.line,
            d.column,
            d.path.clone(),
            d.message.clone(),
        )
    };
    all.sort_by_key(key);
    let mut seen = BTreeSet::new();
    all.retain(|d| seen.insert(key(d)));
    let (errors, warnings): (Vec<_>, Vec<_>) =
        all.into_iter().partition(|d| d.severity == Severity::Error);
    Report {
        valid: errors.is_empty(),
        errors,
        warnings,
        targets: targets.iter().map(ToString::to_string).collect(),
    }
}

impl Report {
    /// The report for people.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for d in self.errors.iter().chain(&self.warnings) {
            out.push_str(&format!("{d}\n"));
        }
        if self.valid {
            out.push_str(&format!(
                "valid: {} target(s){}{}\n",
                self.targets.len(),
                if self.targets.is_empty() { "" } else { ": " },
                self.targets.join(", ")
            ));
        } else {
            out.push_str(&format!(
                "invalid: {} error(s), {} warning(s)\n",
                self.errors.len(),
                self.warnings.len()
            ));
        }
        out
    }

    /// The exit status.
    pub fn code(&self) -> i32 {
        if self.valid {
            EXIT_OK
        } else {
            EXIT_INVALID
        }
    }
}

/// Picks the target to compile: the given one (in `namespace`, or in the
/// only namespace that has it), else the only one there is.
pub fn choose_target(
    input: &Input,
    target: Option<&TargetRef>,
    namespace: Option<&str>,
) -> Result<Scoped, String> {
    let all = all_targets(input);
    let fits: Vec<&Scoped> = all
        .iter()
        .filter(|s| target.is_none_or(|t| &s.target == t))
        .filter(|s| namespace.is_none_or(|n| s.namespace == n))
        .collect();
    let list = || {
        all.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    match fits.as_slice() {
        [one] => Ok((*one).clone()),
        [] if all.is_empty() => Err(
            "no target: no InferencePolicy or InferenceSettings names a Gateway or HTTPRoute"
                .into(),
        ),
        [] => Err(format!("no such target; the inputs have: {}", list())),
        _ => Err(format!(
            "several targets; choose one with --target KIND/NAME (and --namespace): {}",
            list()
        )),
    }
}

/// Compiles one target to the filter's bytes (exactly what the controller
/// writes), or the report of why not.
pub fn compile(input: &Input, scoped: &Scoped, opts: &Options) -> Result<Compiled, Report> {
    let report = validate(input, opts);
    let res = &input.namespaces[&scoped.namespace];
    match kvasir_api::compile(res, &scoped.target, opts) {
        Ok(c)
            if input
                .diagnostics
                .iter()
                .all(|d| d.severity != Severity::Error) =>
        {
            Ok(c)
        }
        _ => Err(report),
    }
}

/// The whole `EnvoyExtensionPolicy` that carries one target's filter:
/// [`kvasir_api::eep::to_json`] of [`compile`]'s bytes, so exactly what the
/// controller applies for the same resources and `code`. `code` is used
/// as given; [`wasm_code`] checks what people type.
pub fn extension_policy(
    input: &Input,
    scoped: &Scoped,
    opts: &Options,
    code: &WasmCode,
) -> Result<Vec<u8>, Report> {
    let compiled = compile(input, scoped, opts)?;
    kvasir_api::eep::to_json(&scoped.namespace, &scoped.target, &compiled.bytes, code).map_err(
        // Unreachable while `compile` returns JSON; a report keeps it
        // exit status 1 instead of a panic.
        |e| Report {
            valid: false,
            errors: vec![Diagnostic::unlocated(
                Some(scoped.namespace.clone()),
                String::new(),
                format!("{scoped}: cannot build the EnvoyExtensionPolicy: {e}"),
                Severity::Error,
            )],
            warnings: Vec::new(),
            targets: vec![scoped.to_string()],
        },
    )
}

/// Checks a module's location: `url` is `http://` or `https://` (Envoy
/// Gateway fetches nothing else), `sha256` 64 lowercase hex digits (the
/// form Envoy Gateway compares).
pub fn wasm_code(url: &str, sha256: &str) -> Result<WasmCode, String> {
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"));
    match rest {
        Some(r) if !r.is_empty() && !url.chars().any(|c| c.is_whitespace() || c.is_control()) => {}
        _ => {
            return Err(format!(
                "--wasm-url `{url}`: expected an http:// or https:// URL of the filter's .wasm"
            ))
        }
    }
    let hex = |c: char| c.is_ascii_digit() || ('a'..='f').contains(&c);
    if sha256.len() != 64 || !sha256.chars().all(hex) {
        return Err(format!(
            "--wasm-sha256 `{sha256}`: expected 64 lowercase hex digits (`sha256sum FILE`), or --wasm-file FILE"
        ));
    }
    Ok(WasmCode {
        url: url.to_owned(),
        sha256: sha256.to_owned(),
    })
}

/// The hex SHA-256 of a built filter module, for `--wasm-file`. Refuses a
/// file that is not WebAssembly: a digest of the wrong file would only
/// show up later, as a gateway that cannot load its filter.
pub fn wasm_file_sha256(path: &Path) -> Result<String, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("--wasm-file {}: {e}", path.display()))?;
    if !bytes.starts_with(b"\0asm") {
        return Err(format!(
            "--wasm-file {}: not a WebAssembly module (no \\0asm header)",
            path.display()
        ));
    }
    let tagged = kvasir_api::eep::sha256_hex(&bytes);
    Ok(tagged.strip_prefix("sha256:").unwrap_or(&tagged).to_owned())
}
