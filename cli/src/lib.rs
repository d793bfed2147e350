//! # kvasirctl
//!
//! Validate, compile and explain Kvasir resources offline: no cluster, no
//! network. The commands are plain functions returning what to print and
//! the exit status, so tests call them directly; `main.rs` is only clap.
//!
//! Exit statuses: 0 valid (warnings allowed), 1 invalid, 2 usage or I/O
//! error. `validate --allow-missing-secrets` turns a tenant's missing key
//! Secret into a warning (exit 0) instead of an error (exit 1).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod commands;
pub mod explain;
pub mod input;
pub mod yaml;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use kvasir_api::eep::WasmCode;
use kvasir_api::routes;
use kvasir_api::{Compiled, Finding, ObjectRef, Options, Resources, TargetKind, TargetRef};
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

/// What `validate` checks beyond the documents themselves.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Checks {
    /// A tenant's key Secret that is not among the inputs is a warning,
    /// not an error, and the tenant is checked with a stand-in key (for a
    /// GitOps repository that keeps Secrets elsewhere).
    pub allow_missing_secrets: bool,
}

/// The Secrets tenants of `res` name that the inputs do not hold.
fn missing_secrets(res: &Resources) -> BTreeSet<String> {
    res.secret_names()
        .into_iter()
        .filter(|n| !res.secrets.contains_key(n))
        .collect()
}

/// `res` with a stand-in for every missing key Secret (one distinct value
/// per Secret and key, so no two tenants share a key), and a warning on
/// each tenant that names one. The stand-ins are never written anywhere:
/// `compile` does not take this path.
fn with_stand_in_secrets(res: &Resources) -> (Resources, Vec<Finding>) {
    let missing = missing_secrets(res);
    let mut out = res.clone();
    let mut warnings = Vec::new();
    for t in &res.tenants {
        let Some(keys) = &t.spec.identity.api_keys else {
            continue;
        };
        let sel = &keys.secret_ref;
        if !missing.contains(&sel.name) {
            continue;
        }
        let key = sel.key.clone().unwrap_or_else(|| "stand-in".to_owned());
        let value = format!("kvasirctl-stand-in/{}/{}/{key}", res.namespace, sel.name);
        out.secrets
            .entry(sel.name.clone())
            .or_default()
            .insert(key, value.into_bytes());
        warnings.push(Finding {
            object: Some(ObjectRef {
                kind: "InferenceTenant",
                name: t.metadata.name.clone().unwrap_or_default(),
            }),
            path: "spec.identity.apiKeys.secretRef.name".into(),
            message: format!(
                "Secret `{}` is not in the inputs (--allow-missing-secrets): checked with a stand-in key; namespace `{}` must hold it",
                sel.name, res.namespace
            ),
            severity: Severity::Warning,
        });
    }
    (out, warnings)
}

/// The objects that name `target` through `spec.targetRefs`, with the
/// path of that reference.
fn naming(res: &Resources, target: &TargetRef) -> Vec<(ObjectRef, String)> {
    let mut out = Vec::new();
    let mut add = |kind: &'static str, name: &Option<String>, refs: &[TargetRef]| {
        for (i, r) in refs.iter().enumerate() {
            if r.kind == target.kind && r.name == target.name {
                out.push((
                    ObjectRef {
                        kind,
                        name: name.clone().unwrap_or_default(),
                    },
                    format!("spec.targetRefs[{i}].name"),
                ));
            }
        }
    };
    for s in &res.settings {
        add("InferenceSettings", &s.metadata.name, &s.spec.target_refs);
    }
    for p in &res.policies {
        add("InferencePolicy", &p.metadata.name, &p.spec.target_refs);
    }
    out
}

/// A target the inputs do not define, where they define others of its
/// kind in its namespace (with none, the inputs are not the whole
/// namespace and nothing can be said): an error on each object naming it.
fn missing_target(input: &Input, t: &Scoped) -> Vec<Finding> {
    let ns = &t.namespace;
    let known: Vec<String> = match t.target.kind {
        TargetKind::Gateway => input
            .gateways
            .iter()
            .filter(|(n, _)| n == ns)
            .map(|(_, name)| name.clone())
            .collect(),
        TargetKind::HttpRoute => input
            .routes
            .iter()
            .filter(|r| r.metadata.namespace.as_deref() == Some(ns.as_str()))
            .filter_map(|r| r.metadata.name.clone())
            .collect(),
    };
    if known.is_empty() || known.contains(&t.target.name) {
        return Vec::new();
    }
    naming(&input.namespaces[ns], &t.target)
        .into_iter()
        .map(|(object, path)| Finding {
            object: Some(object),
            path,
            message: format!(
                "{} is not in the inputs, which define {} {} in namespace `{ns}`: a misspelt target is never programmed",
                t.target,
                t.target.kind.as_str(),
                known.join(", ")
            ),
            severity: Severity::Error,
        })
        .collect()
}

/// Locates a route finding in the file of the route it names (routes may
/// live in another namespace than the target).
fn locate_route_finding(input: &Input, target_ns: &str, f: &Finding) -> Diagnostic {
    let ns = f
        .object
        .as_ref()
        .filter(|o| o.kind == "HTTPRoute")
        .and_then(|o| {
            let mine = input.routes.iter().find(|r| {
                r.metadata.name.as_deref() == Some(o.name.as_str())
                    && r.metadata.namespace.as_deref() == Some(target_ns)
            });
            let any = input
                .routes
                .iter()
                .find(|r| r.metadata.name.as_deref() == Some(o.name.as_str()));
            mine.or(any)?.metadata.namespace.clone()
        })
        .unwrap_or_else(|| target_ns.to_owned());
    input.locate(&ns, f)
}

/// Validates every document and compiles every target.
pub fn validate(input: &Input, opts: &Options) -> Report {
    validate_with(input, opts, Checks::default())
}

/// [`validate`], and for each target that compiles: the target exists
/// among the inputs (when they define its kind in its namespace), and the
/// HTTPRoutes that carry its traffic have a rule for every destination
/// its configuration can name ([`routes::check_routes`]).
pub fn validate_with(input: &Input, opts: &Options, checks: Checks) -> Report {
    let mut all: Vec<Diagnostic> = input.diagnostics.clone();
    let targets = all_targets(input);
    let mut stand_ins: BTreeMap<&String, (Resources, Vec<Finding>)> = BTreeMap::new();
    if checks.allow_missing_secrets {
        for (ns, res) in &input.namespaces {
            if !missing_secrets(res).is_empty() {
                stand_ins.insert(ns, with_stand_in_secrets(res));
            }
        }
        for (ns, (_, warnings)) in &stand_ins {
            all.extend(warnings.iter().map(|f| input.locate(ns, f)));
        }
    }
    for t in &targets {
        let res = stand_ins
            .get(&t.namespace)
            .map_or(&input.namespaces[&t.namespace], |(r, _)| r);
        let findings = match kvasir_api::compile(res, &t.target, opts) {
            Ok(c) => {
                let mut f = c.warnings.clone();
                let missing = missing_target(input, t);
                if missing.is_empty() {
                    let carrying = routes::routes_of(&t.namespace, &t.target, &input.routes);
                    for rf in routes::check_routes(&t.target, &c, &carrying) {
                        all.push(locate_route_finding(input, &t.namespace, &rf));
                    }
                }
                f.extend(missing);
                f
            }
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
/// form Envoy Gateway compares). `{sha256}` in `url` stands for the digest,
/// as in the controller's `--wasm-url`.
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
    Ok(WasmCode::new(url, sha256))
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
