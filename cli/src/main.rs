//! `kvasirctl`: validate, compile and explain Kvasir resources offline.
#![forbid(unsafe_code)]

use std::io::Write;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use kvasir_api::eep::WasmCode;
use kvasir_api::Options;
use kvasir_policy::ApiKind;
use kvasirctl::commands;
use kvasirctl::explain::Sample;
use kvasirctl::{wasm_code, wasm_file_sha256, Checks, Input, Outcome, EXIT_OK, EXIT_USAGE};

/// Validate, compile and explain Kvasir policy resources (kvasir.dev/v1alpha1)
/// offline: no cluster, no network.
///
/// Inputs are YAML or JSON files or directories (read recursively, *.yaml,
/// *.yml, *.json), every document of every file, as one set of resources per
/// namespace. Tenants' API keys come from `v1` Secret documents in the same
/// inputs; only their SHA-256 is kept.
///
/// Exit status: 0 valid (warnings allowed), 1 invalid, 2 usage or I/O
/// error.
#[derive(Parser, Debug)]
#[command(
    name = "kvasirctl",
    version,
    after_help = "Examples:\n  \
    kvasirctl validate crds/examples/\n  \
    kvasirctl validate -o json policies/ | jq '.errors[] | \"\\(.file):\\(.line): \\(.path): \\(.message)\"'\n  \
    kvasirctl compile crds/examples/ --target Gateway/inference-gateway > policy.json\n  \
    kvasirctl compile crds/examples/ -o envoyextensionpolicy --format yaml \\\n      \
    --wasm-url http://kvasir-controller.kvasir-system.svc.cluster.local:8080/kvasir_filter.wasm \\\n      \
    --wasm-file target/wasm32-wasip1/wasm-release/kvasir_filter.wasm\n  \
    kvasirctl explain crds/examples/ --api-key sk-acme-example-1 -m llama-3.1-8b-instruct --prompt hi --saturation main=0.9\n  \
    kvasirctl crds | kubectl apply -f -\n\n\
    The README's kvasirctl section documents the JSON shapes."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Debug)]
struct Common {
    /// Files or directories to read.
    #[arg(required = true, value_name = "FILE|DIR")]
    inputs: Vec<PathBuf>,
    /// Namespace of resources that set none; with `compile`/`explain` also
    /// selects the target's namespace.
    #[arg(short, long)]
    namespace: Option<String>,
    /// The Envoy cluster of the cache-indexer's gRPC service.
    #[arg(long, default_value = "kvasir-indexer")]
    indexer_cluster: String,
}

#[derive(Copy, Clone, Debug, ValueEnum)]
enum Format {
    /// For people.
    Text,
    /// A stable JSON object (see the README's kvasirctl section).
    Json,
}

/// What `compile` prints.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum CompileOutput {
    /// The filter's configuration (kvasir.filter/v1 JSON).
    Config,
    /// The whole Envoy Gateway EnvoyExtensionPolicy the controller applies:
    /// the configuration embedded verbatim, plus where to fetch the module
    /// (needs --wasm-url and --wasm-sha256 or --wasm-file). `eep` for short.
    #[value(name = "envoyextensionpolicy", alias = "eep")]
    EnvoyExtensionPolicy,
}

/// How `compile --output envoyextensionpolicy` is written.
#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
enum Encoding {
    /// The controller's exact bytes.
    Json,
    /// The same object as YAML, for review.
    Yaml,
}

/// Where Envoy Gateway fetches the filter module from.
#[derive(clap::Args, Debug)]
#[command(next_help_heading = "With --output envoyextensionpolicy")]
struct WasmArgs {
    /// The http:// or https:// URL of the filter's .wasm: the controller's
    /// own --wasm-url. `{sha256}` in it stands for the module's digest (the
    /// controller serves its module at /kvasir_filter-<sha256>.wasm).
    #[arg(long, value_name = "URL")]
    wasm_url: Option<String>,
    /// The module's SHA-256: 64 lowercase hex digits, as `sha256sum` prints.
    #[arg(long, value_name = "HEX", conflicts_with = "wasm_file")]
    wasm_sha256: Option<String>,
    /// A built module to take the SHA-256 from, instead of --wasm-sha256
    /// (as the controller does with its --wasm-file).
    #[arg(long, value_name = "PATH")]
    wasm_file: Option<PathBuf>,
}

#[derive(Copy, Clone, Debug, ValueEnum)]
enum Api {
    Chat,
    Completions,
    AnthropicMessages,
    AnthropicCountTokens,
    Responses,
}

/// The sample request of `explain`.
#[derive(clap::Args, Debug)]
struct RequestArgs {
    /// The tenant by name (skips identification).
    #[arg(long, conflicts_with = "api_key")]
    tenant: Option<String>,
    /// An API key, sent as `authorization: Bearer KEY`.
    #[arg(long)]
    api_key: Option<String>,
    /// A request header, `name: value` (repeatable).
    #[arg(short = 'H', long = "header")]
    headers: Vec<String>,
    /// A verified JWT claim value (`payloadInMetadata` tenant source).
    #[arg(long)]
    jwt_claim: Option<String>,
    /// The model (default: the body's `model`).
    #[arg(short, long)]
    model: Option<String>,
    /// The API.
    #[arg(long, value_enum, default_value = "chat")]
    api: Api,
    /// A JSON request body file.
    #[arg(long)]
    body: Option<PathBuf>,
    /// A prompt text (a one-message chat body), instead of --body.
    #[arg(long, conflicts_with = "body")]
    prompt: Option<String>,
    /// A pool's saturation, POOL=0..1 (repeatable); unset pools are unknown.
    #[arg(long = "saturation", value_name = "POOL=VALUE")]
    saturation: Vec<String>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Check every document and compile every target; each problem with
    /// file:line:column, resource and field path. Where the inputs hold
    /// Gateways and HTTPRoutes, also that each target exists and that the
    /// routes carrying it have a rule matching `x-kvasir-cluster` for
    /// every pool and provider its configuration can name.
    ///
    /// Exit status: 0 valid (warnings allowed), 1 invalid, 2 usage or I/O
    /// error.
    Validate {
        #[command(flatten)]
        common: Common,
        /// Output format.
        #[arg(short, long, value_enum, default_value = "text")]
        output: Format,
        /// A key Secret a tenant names that is not among the inputs is a
        /// warning, not an error (the tenant is checked with a stand-in
        /// key): for repositories that keep Secrets out of Git.
        #[arg(long)]
        allow_missing_secrets: bool,
    },
    /// Print the compiled filter configuration (kvasir.filter/v1) of one
    /// target, or the whole EnvoyExtensionPolicy that carries it: exactly the
    /// bytes the controller writes.
    ///
    /// JSON is printed with no trailing newline (the bytes are the
    /// controller's); YAML ends with one.
    Compile {
        #[command(flatten)]
        common: Common,
        /// The target: Gateway/NAME or HTTPRoute/NAME (needed when the inputs
        /// have several).
        #[arg(short, long)]
        target: Option<String>,
        /// What to print.
        #[arg(short, long, value_enum, default_value = "config")]
        output: CompileOutput,
        /// How to write --output envoyextensionpolicy (config is always JSON:
        /// the filter reads JSON).
        #[arg(long, value_enum, default_value = "json")]
        format: Encoding,
        /// Write to this file instead of stdout.
        #[arg(short = 'O', long)]
        out: Option<PathBuf>,
        #[command(flatten)]
        wasm: WasmArgs,
    },
    /// Explain what the filter would do with a sample request: which policy
    /// matched, why each earlier one did not, and the action.
    Explain {
        #[command(flatten)]
        common: Common,
        /// The target: Gateway/NAME or HTTPRoute/NAME.
        #[arg(short, long)]
        target: Option<String>,
        #[command(flatten)]
        request: RequestArgs,
        /// Output format.
        #[arg(short, long, value_enum, default_value = "text")]
        output: Format,
    },
    /// Print the CustomResourceDefinitions (YAML), or write one file per CRD.
    Crds {
        /// Write `kvasir.dev_<plural>.yaml` files into this directory.
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

fn read(c: &Common) -> Result<(Input, Options), Outcome> {
    let ns = c.namespace.as_deref().unwrap_or("default");
    let input = Input::read(&c.inputs, ns).map_err(Outcome::usage)?;
    let opts = Options {
        indexer_cluster: c.indexer_cluster.clone(),
    };
    Ok((input, opts))
}

fn format_of(f: Format) -> commands::Format {
    match f {
        Format::Text => commands::Format::Text,
        Format::Json => commands::Format::Json,
    }
}

fn run_validate(common: &Common, output: Format, checks: Checks) -> Result<Outcome, Outcome> {
    let (input, opts) = read(common)?;
    Ok(commands::validate(&input, &opts, checks, format_of(output)))
}

struct CompileArgs<'a> {
    target: Option<&'a str>,
    output: CompileOutput,
    format: Encoding,
    out: Option<&'a PathBuf>,
    wasm: &'a WasmArgs,
}

/// The module location for `--output envoyextensionpolicy`, `None` for
/// `config`. Checked before the inputs are read, so a flag mistake is a
/// usage error (exit 2) whatever the inputs hold.
fn wasm_of(a: &CompileArgs<'_>) -> Result<Option<WasmCode>, Outcome> {
    let w = a.wasm;
    if a.output == CompileOutput::Config {
        let stray = [
            (w.wasm_url.is_some(), "--wasm-url"),
            (w.wasm_sha256.is_some(), "--wasm-sha256"),
            (w.wasm_file.is_some(), "--wasm-file"),
            (a.format != Encoding::Json, "--format yaml"),
        ];
        return match stray.iter().find(|(set, _)| *set) {
            Some((_, flag)) => Err(Outcome::usage(format!(
                "{flag} applies to --output envoyextensionpolicy only (--output config prints the filter's JSON)"
            ))),
            None => Ok(None),
        };
    }
    let url = w.wasm_url.as_deref().ok_or_else(|| {
        Outcome::usage("--output envoyextensionpolicy needs --wasm-url URL (where Envoy Gateway fetches the filter module)")
    })?;
    let sha256 = match (&w.wasm_sha256, &w.wasm_file) {
        (Some(hex), _) => hex.clone(),
        (None, Some(path)) => wasm_file_sha256(path).map_err(Outcome::usage)?,
        (None, None) => {
            return Err(Outcome::usage(
                "--output envoyextensionpolicy needs --wasm-sha256 HEX or --wasm-file PATH (the module's digest)",
            ))
        }
    };
    wasm_code(url, &sha256).map(Some).map_err(Outcome::usage)
}

fn run_compile(common: &Common, a: CompileArgs<'_>) -> Result<Outcome, Outcome> {
    let code = wasm_of(&a)?;
    let (input, opts) = read(common)?;
    let mut out = commands::compile(
        &input,
        &opts,
        common.namespace.as_deref(),
        a.target,
        code.as_ref(),
        a.format == Encoding::Yaml,
    );
    if let (EXIT_OK, Some(path)) = (out.code, a.out) {
        std::fs::write(path, &out.stdout)
            .map_err(|e| Outcome::usage(format!("{}: {e}", path.display())))?;
        out.stdout.clear();
    }
    Ok(out)
}

struct ExplainArgs<'a> {
    target: Option<&'a str>,
    sample: Sample,
    output: Format,
}

fn sample_of(r: RequestArgs) -> Result<Sample, Outcome> {
    let api = match r.api {
        Api::Chat => ApiKind::Chat,
        Api::Completions => ApiKind::Completions,
        Api::AnthropicMessages => ApiKind::AnthropicMessages,
        Api::AnthropicCountTokens => ApiKind::AnthropicCountTokens,
        Api::Responses => ApiKind::Responses,
    };
    let args = commands::RequestArgs {
        tenant: r.tenant,
        api_key: r.api_key,
        headers: r.headers,
        jwt_claim: r.jwt_claim,
        model: r.model,
        api: Some(api),
        body: r.body.map(|p| p.display().to_string()),
        prompt: r.prompt,
        saturation: r.saturation,
    };
    let read_body = |p: &str| std::fs::read(p).map_err(|e| format!("{p}: {e}"));
    commands::sample(args, &read_body).map_err(Outcome::usage)
}

fn run_explain(common: &Common, a: ExplainArgs<'_>) -> Result<Outcome, Outcome> {
    let (input, opts) = read(common)?;
    Ok(commands::explain_request(
        &input,
        &opts,
        common.namespace.as_deref(),
        a.target,
        &a.sample,
        format_of(a.output),
    ))
}

fn run_crds(dir: Option<&PathBuf>) -> Result<Outcome, Outcome> {
    let err = |e: &dyn std::fmt::Display| Outcome::usage(e);
    match dir {
        None => {
            let y = kvasir_api::crds::yaml().map_err(|e| err(&e))?;
            Ok(Outcome {
                stdout: y.into_bytes(),
                stderr: String::new(),
                code: EXIT_OK,
            })
        }
        Some(d) => {
            std::fs::create_dir_all(d).map_err(|e| err(&e))?;
            for (name, text) in kvasir_api::crds::files().map_err(|e| err(&e))? {
                std::fs::write(d.join(&name), text).map_err(|e| err(&format!("{name}: {e}")))?;
            }
            Ok(Outcome {
                stdout: Vec::new(),
                stderr: String::new(),
                code: EXIT_OK,
            })
        }
    }
}

fn run(cli: Cli) -> Outcome {
    let r = match cli.command {
        Command::Validate {
            common,
            output,
            allow_missing_secrets,
        } => run_validate(
            &common,
            output,
            Checks {
                allow_missing_secrets,
            },
        ),
        Command::Compile {
            common,
            target,
            output,
            format,
            out,
            wasm,
        } => run_compile(
            &common,
            CompileArgs {
                target: target.as_deref(),
                output,
                format,
                out: out.as_ref(),
                wasm: &wasm,
            },
        ),
        Command::Explain {
            common,
            target,
            request,
            output,
        } => sample_of(request).and_then(|sample| {
            run_explain(
                &common,
                ExplainArgs {
                    target: target.as_deref(),
                    sample,
                    output,
                },
            )
        }),
        Command::Crds { dir } => run_crds(dir.as_ref()),
    };
    r.unwrap_or_else(|o| o)
}

fn main() {
    let cli = Cli::parse();
    let out = run(cli);
    let mut so = std::io::stdout().lock();
    let wrote = so.write_all(&out.stdout).and_then(|()| so.flush());
    eprint!("{}", out.stderr);
    if let Err(e) = wrote {
        eprintln!("kvasirctl: stdout: {e}");
        std::process::exit(EXIT_USAGE);
    }
    std::process::exit(out.code);
}
