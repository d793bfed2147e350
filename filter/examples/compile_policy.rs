//! Compiles a policy set (JSON, file argument or stdin) into the filter's
//! plugin configuration and prints it: `{"policy": <kvasir.filter/v1
//! document>, "filter": <settings>}`. Settings come from a second JSON
//! argument (default `{}`). The e2e tests and `envoy/render.py` use it
//! until `kvasirctl compile` exists; the output is checked by the same
//! loader the filter runs in `on_configure`.
//!
//! ```sh
//! cargo run --release -p kvasir-filter --example compile_policy -- policy.json '{"maxEndpoints":2}'
//! ```

use std::io::Read;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let input = match args.first().map(String::as_str) {
        None | Some("-") => {
            let mut s = String::new();
            if let Err(e) = std::io::stdin().read_to_string(&mut s) {
                eprintln!("compile_policy: reading stdin: {e}");
                return ExitCode::from(2);
            }
            s
        }
        Some(path) => match std::fs::read_to_string(path) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("compile_policy: reading {path}: {e}");
                return ExitCode::from(2);
            }
        },
    };
    let settings: serde_json::Value = match args.get(1).map(|s| serde_json::from_str(s)) {
        None => serde_json::json!({}),
        Some(Ok(v)) => v,
        Some(Err(e)) => {
            eprintln!("compile_policy: settings are not JSON: {e}");
            return ExitCode::from(2);
        }
    };
    let set = match kvasir_policy::parse_json(&input) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("compile_policy: {e}");
            return ExitCode::FAILURE;
        }
    };
    let cfg = match kvasir_policy::compile(&set) {
        Ok(c) => c,
        Err(errs) => {
            for e in errs {
                eprintln!("compile_policy: {e}");
            }
            return ExitCode::FAILURE;
        }
    };
    let doc: serde_json::Value = match serde_json::from_slice(&cfg.to_json()) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("compile_policy: {e}");
            return ExitCode::FAILURE;
        }
    };
    let out = serde_json::json!({"policy": doc, "filter": settings});
    let bytes = out.to_string();
    if let Err(e) = kvasir_filter::settings::PluginConfig::from_bytes(bytes.as_bytes()) {
        eprintln!("compile_policy: the filter refuses the result: {e}");
        return ExitCode::FAILURE;
    }
    println!("{bytes}");
    ExitCode::SUCCESS
}
