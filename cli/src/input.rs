//! Reading `FILE|DIR...` into per-namespace [`Resources`], and turning
//! every problem into a [`Diagnostic`] with file, line, column and path.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvasir_api::routes::HttpRoute;
use kvasir_api::{Document, DocumentError, Finding, ObjectRef, Resources};
use kvasir_policy::Severity;
use serde::Serialize;

use crate::yaml::{self, Doc};

/// One problem, located. The `--output json` shape (see the README).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Diagnostic {
    /// The file, as given on the command line (joined with the directory
    /// walked); `null` for a problem of a target that no file holds.
    pub file: Option<String>,
    /// 1-based line (`null` with `file`).
    pub line: Option<usize>,
    /// 1-based column.
    pub column: Option<usize>,
    /// 1-based index of the YAML document in its file.
    pub document: Option<usize>,
    /// The resource's kind, when known.
    pub kind: Option<String>,
    /// The resource's `metadata.name`, when known.
    pub name: Option<String>,
    /// The resource's namespace, when known.
    pub namespace: Option<String>,
    /// The field, e.g. `spec.match.models[0]`; empty for the whole resource.
    pub path: String,
    /// Why.
    pub message: String,
    /// `error` or `warning`.
    pub severity: Severity,
}

impl Diagnostic {
    /// A problem that no file holds (a target's, or a finding on a
    /// resource the files do not name).
    pub fn unlocated(
        namespace: Option<String>,
        path: String,
        message: String,
        severity: Severity,
    ) -> Diagnostic {
        Diagnostic {
            file: None,
            line: None,
            column: None,
            document: None,
            kind: None,
            name: None,
            namespace,
            path,
            message,
            severity,
        }
    }
}

impl std::fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(file) = &self.file {
            write!(
                f,
                "{file}:{}:{}: ",
                self.line.unwrap_or(1),
                self.column.unwrap_or(1)
            )?;
        }
        f.write_str(if self.severity == Severity::Error {
            "error"
        } else {
            "warning"
        })?;
        if let (Some(k), Some(n)) = (&self.kind, &self.name) {
            write!(f, ": {k}/{n}")?;
        }
        if !self.path.is_empty() {
            write!(f, ": {}", self.path)?;
        }
        write!(f, ": {}", self.message)
    }
}

/// An I/O or usage problem (exit status 2).
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// A path could not be read.
    #[error("{path}: {error}")]
    Io {
        /// The path.
        path: String,
        /// Why.
        error: std::io::Error,
    },
    /// A directory held no YAML or JSON file.
    #[error("{0}: no .yaml, .yml or .json file")]
    Empty(String),
}

/// Where a resource was read.
#[derive(Debug, Clone)]
struct Source {
    file: String,
    doc: Doc,
}

/// Everything read from the inputs.
#[derive(Debug, Default)]
pub struct Input {
    /// Resources by namespace.
    pub namespaces: BTreeMap<String, Resources>,
    /// The Gateway API `HTTPRoute`s (any namespace), for the cross-check of
    /// their `x-kvasir-cluster` rules against the compiled destinations.
    pub routes: Vec<HttpRoute>,
    /// The Gateway API `Gateway`s, as `(namespace, name)`.
    pub gateways: std::collections::BTreeSet<(String, String)>,
    /// Problems found while reading (syntax, shape).
    pub diagnostics: Vec<Diagnostic>,
    sources: BTreeMap<(String, String, String), Source>,
}

/// The Gateway API kinds `kvasirctl` reads besides its own: the targets
/// and the routes that turn the filter's choice into a backend.
fn gateway_kind(doc: &Doc) -> Option<&'static str> {
    let api = doc.value.get("apiVersion")?.as_str()?;
    if !api.starts_with("gateway.networking.k8s.io/") {
        return None;
    }
    match doc.value.get("kind")?.as_str()? {
        "HTTPRoute" => Some("HTTPRoute"),
        "Gateway" => Some("Gateway"),
        _ => None,
    }
}

fn files_of(arg: &Path) -> Result<Vec<PathBuf>, InputError> {
    let io = |error| InputError::Io {
        path: arg.display().to_string(),
        error,
    };
    let meta = std::fs::metadata(arg).map_err(io)?;
    if !meta.is_dir() {
        return Ok(vec![arg.to_owned()]);
    }
    let mut out = Vec::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(arg)
        .map_err(io)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()
        .map_err(io)?;
    entries.sort();
    for p in entries {
        if p.is_dir() {
            out.extend(files_of(&p)?);
        } else if matches!(
            p.extension().and_then(|e| e.to_str()),
            Some("yaml" | "yml" | "json")
        ) {
            out.push(p);
        }
    }
    if out.is_empty() {
        return Err(InputError::Empty(arg.display().to_string()));
    }
    Ok(out)
}

fn diag(file: &str, doc: Option<&Doc>, path: &str, message: String) -> Diagnostic {
    let pos = doc.map(|d| d.position(path));
    Diagnostic {
        file: Some(file.to_owned()),
        line: pos.map(|p| p.line),
        column: pos.map(|p| p.column),
        document: doc.map(|d| d.index),
        kind: doc.and_then(|d| d.value.get("kind")?.as_str().map(str::to_owned)),
        name: doc.and_then(|d| {
            d.value
                .get("metadata")?
                .get("name")?
                .as_str()
                .map(str::to_owned)
        }),
        namespace: doc.and_then(|d| {
            d.value
                .get("metadata")?
                .get("namespace")?
                .as_str()
                .map(str::to_owned)
        }),
        path: path.to_owned(),
        message,
        severity: Severity::Error,
    }
}

impl Input {
    /// Reads every document of every file under `args`. Resources without
    /// a namespace go to `default_ns`.
    pub fn read(args: &[PathBuf], default_ns: &str) -> Result<Input, InputError> {
        let mut input = Input::default();
        for arg in args {
            for file in files_of(arg)? {
                let text = std::fs::read_to_string(&file).map_err(|error| InputError::Io {
                    path: file.display().to_string(),
                    error,
                })?;
                input.add_text(&file.display().to_string(), &text, default_ns);
            }
        }
        Ok(input)
    }

    /// Adds the documents of one file's text.
    pub fn add_text(&mut self, file: &str, text: &str, default_ns: &str) {
        let docs = match yaml::parse(text) {
            Ok(d) => d,
            Err(e) => {
                let mut d = diag(file, None, "", format!("not valid YAML: {}", e.message));
                d.line = Some(e.pos.line);
                d.column = Some(e.pos.column);
                self.diagnostics.push(d);
                return;
            }
        };
        for doc in docs {
            self.add_doc(file, doc, default_ns);
        }
    }

    /// Registers where `kind/name` of `ns` was read; false (with a
    /// diagnostic) when another document already defined it.
    fn register(&mut self, file: &str, doc: &Doc, ns: &str, kind: &str, name: &str) -> bool {
        let key = (ns.to_owned(), kind.to_owned(), name.to_owned());
        if let Some(prev) = self.sources.get(&key) {
            self.diagnostics.push(diag(
                file,
                Some(doc),
                "metadata.name",
                format!("{kind} `{name}` is also defined in {}", prev.file),
            ));
            return false;
        }
        self.sources.insert(
            key,
            Source {
                file: file.to_owned(),
                doc: doc.clone(),
            },
        );
        true
    }

    fn add_gateway_doc(&mut self, file: &str, doc: Doc, kind: &str, default_ns: &str) {
        let meta = |k: &str| {
            doc.value
                .get("metadata")
                .and_then(|m| m.get(k))
                .and_then(|v| v.as_str())
                .map(str::to_owned)
        };
        let Some(name) = meta("name").filter(|n| !n.is_empty()) else {
            self.diagnostics
                .push(diag(file, Some(&doc), "metadata.name", "required".into()));
            return;
        };
        let ns = meta("namespace").unwrap_or_else(|| default_ns.to_owned());
        if kind == "Gateway" {
            if self.register(file, &doc, &ns, kind, &name) {
                self.gateways.insert((ns, name));
            }
            return;
        }
        match serde_path_to_error::deserialize::<_, HttpRoute>(doc.value.clone()) {
            Ok(mut route) => {
                if self.register(file, &doc, &ns, kind, &name) {
                    route.metadata.namespace = Some(ns);
                    self.routes.push(route);
                }
            }
            Err(e) => {
                let path = e.path().to_string();
                let path = if path == "." { String::new() } else { path };
                self.diagnostics
                    .push(diag(file, Some(&doc), &path, e.into_inner().to_string()));
            }
        }
    }

    fn add_doc(&mut self, file: &str, doc: Doc, default_ns: &str) {
        if let Some(kind) = gateway_kind(&doc) {
            self.add_gateway_doc(file, doc, kind, default_ns);
            return;
        }
        match kvasir_api::document::parse(doc.value.clone()) {
            Ok(d) => {
                let ns = d.namespace().unwrap_or(default_ns).to_owned();
                let (kind, name) = kind_name(&d);
                if !self.register(file, &doc, &ns, kind, &name) {
                    return;
                }
                let res = self
                    .namespaces
                    .entry(ns.clone())
                    .or_insert_with(|| Resources {
                        namespace: ns,
                        ..Resources::default()
                    });
                res.insert(d);
            }
            Err(e @ DocumentError::Unsupported { .. }) => {
                let mut d = diag(file, Some(&doc), "kind", e.to_string());
                d.severity = Severity::Warning;
                self.diagnostics.push(d);
            }
            Err(DocumentError::Invalid { path, message, .. }) => {
                self.diagnostics
                    .push(diag(file, Some(&doc), &path, message));
            }
        }
    }

    /// Locates a compile finding in the files.
    pub fn locate(&self, namespace: &str, f: &Finding) -> Diagnostic {
        let source = f.object.as_ref().and_then(|o: &ObjectRef| {
            self.sources
                .get(&(namespace.to_owned(), o.kind.to_owned(), o.name.clone()))
        });
        let mut d = match source {
            Some(s) => diag(&s.file, Some(&s.doc), &f.path, f.message.clone()),
            None => Diagnostic::unlocated(None, f.path.clone(), f.message.clone(), f.severity),
        };
        if let Some(o) = &f.object {
            d.kind = Some(o.kind.to_owned());
            d.name = Some(o.name.clone());
        }
        d.namespace = Some(namespace.to_owned());
        d.severity = f.severity;
        d
    }
}

fn kind_name(d: &Document) -> (&'static str, String) {
    let (kind, meta) = match d {
        Document::Policy(r) => ("InferencePolicy", &r.metadata),
        Document::Tenant(r) => ("InferenceTenant", &r.metadata),
        Document::Provider(r) => ("InferenceProvider", &r.metadata),
        Document::Settings(r) => ("InferenceSettings", &r.metadata),
        Document::Pool(r) => ("InferencePool", &r.metadata),
        Document::Secret(r) => ("Secret", &r.metadata),
    };
    (kind, meta.name.clone().unwrap_or_default())
}
