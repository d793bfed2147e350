//! `kvasirctl compile --output envoyextensionpolicy`: the object the
//! controller applies, byte for byte, with the filter configuration inside
//! exactly as `--output config` prints it; flag mistakes exit 2, invalid
//! input exits 1 with `compile`'s report.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kvasir_api::eep::{self, WasmCode};
use kvasir_api::Options;
use kvasirctl::{choose_target, extension_policy, wasm_code, wasm_file_sha256, Input};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

const URL: &str = "http://kvasir-controller.kvasir-system:8080/kvasir_filter.wasm";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn examples() -> String {
    root().join("crds/examples").to_str().unwrap().to_owned()
}

fn broken() -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/broken.yaml")
        .to_str()
        .unwrap()
        .to_owned()
}

fn sha() -> String {
    "0123456789abcdef".repeat(4)
}

fn kvasirctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvasirctl"))
        .args(args)
        .output()
        .expect("run kvasirctl")
}

fn ok(args: &[&str]) -> Vec<u8> {
    let out = kvasirctl(args);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stderr.is_empty());
    out.stdout
}

fn eep_args<'a>(ex: &'a str, sha: &'a str) -> Vec<&'a str> {
    vec![
        "compile",
        ex,
        "--output",
        "envoyextensionpolicy",
        "--wasm-url",
        URL,
        "--wasm-sha256",
        sha,
    ]
}

/// A module as small as wasm allows: the header and nothing else.
fn wasm_file(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&p, b"\0asm\x01\0\0\0").unwrap();
    p
}

#[derive(Deserialize)]
struct Object<'a> {
    #[serde(borrow)]
    spec: Spec<'a>,
}

#[derive(Deserialize)]
struct Spec<'a> {
    #[serde(borrow)]
    wasm: Vec<Wasm<'a>>,
}

#[derive(Deserialize)]
struct Wasm<'a> {
    #[serde(borrow)]
    config: &'a RawValue,
}

#[test]
fn the_config_inside_is_compile_output_config_byte_for_byte() {
    let ex = examples();
    let sha = sha();
    let config = ok(&["compile", &ex, "--output", "config"]);
    // `config` stays the default and stays today's bytes.
    assert_eq!(ok(&["compile", &ex]), config);
    let config = String::from_utf8(config).unwrap();

    let policy = ok(&eep_args(&ex, &sha));
    let text = std::str::from_utf8(&policy).unwrap();
    let raw: Object<'_> = serde_json::from_str(text).unwrap();
    assert_eq!(raw.spec.wasm.len(), 1);
    assert_eq!(raw.spec.wasm[0].config.get(), config);
    assert!(text.contains(&format!(r#""config":{config}"#)), "{text}");
    // Same convention as `config`: the bytes and nothing after them.
    assert!(!config.ends_with('\n'));
    assert!(text.ends_with('}'));

    let v: Value = serde_json::from_slice(&policy).unwrap();
    assert_eq!(v["apiVersion"], eep::EEP_API_VERSION);
    assert_eq!(v["kind"], "EnvoyExtensionPolicy");
    assert_eq!(v["metadata"]["name"], "kvasir-gateway-inference-gateway");
    assert_eq!(v["metadata"]["namespace"], "serving");
    assert_eq!(
        v["metadata"]["annotations"][eep::CONFIG_HASH_ANNOTATION],
        eep::sha256_hex(config.as_bytes())
    );
    assert_eq!(v["spec"]["targetRefs"][0]["name"], "inference-gateway");
    assert_eq!(v["spec"]["wasm"][0]["code"]["http"]["url"], URL);
    assert_eq!(v["spec"]["wasm"][0]["code"]["http"]["sha256"], sha);
    assert_eq!(v["spec"]["wasm"][0]["failOpen"], false);
}

/// The controller's path (`eep::to_json` of the compiled bytes), the
/// library call its tests use, and the binary give the same bytes.
#[test]
fn the_binary_the_library_and_the_controllers_path_agree() {
    let ex = examples();
    let sha = sha();
    let printed = ok(&eep_args(&ex, &sha));
    // `eep` is the short name Envoy Gateway's CRD gives the kind.
    let mut short = eep_args(&ex, &sha);
    short[3] = "eep";
    assert_eq!(ok(&short), printed);

    let input = Input::read(&[root().join("crds/examples")], "default").unwrap();
    let opts = Options::default();
    let scoped = choose_target(&input, None, None).unwrap();
    let code = WasmCode {
        url: URL.into(),
        sha256: sha.clone(),
    };
    let lib = extension_policy(&input, &scoped, &opts, &code).unwrap();
    assert_eq!(lib, printed);
    let compiled = kvasirctl::compile(&input, &scoped, &opts).unwrap();
    let controller =
        eep::to_json(&scoped.namespace, &scoped.target, &compiled.bytes, &code).unwrap();
    assert_eq!(controller, printed);
}

#[test]
fn wasm_file_gives_the_digest_and_out_writes_the_same_bytes() {
    let ex = examples();
    let module = wasm_file("eep-module.wasm");
    let m = module.to_str().unwrap();
    let expect = eep::sha256_hex(b"\0asm\x01\0\0\0");
    let expect = expect.strip_prefix("sha256:").unwrap();
    assert_eq!(wasm_file_sha256(&module).unwrap(), expect);

    let args = [
        "compile",
        &ex,
        "-o",
        "envoyextensionpolicy",
        "--wasm-url",
        URL,
        "--wasm-file",
        m,
    ];
    let from_file = ok(&args);
    assert_eq!(from_file, ok(&eep_args(&ex, expect)));

    let dest = Path::new(env!("CARGO_TARGET_TMPDIR")).join("eep-out.json");
    let dest_s = dest.to_str().unwrap();
    let mut to_file = args.to_vec();
    to_file.extend(["--out", dest_s]);
    assert!(ok(&to_file).is_empty());
    assert_eq!(std::fs::read(&dest).unwrap(), from_file);
}

#[test]
fn yaml_is_the_same_object() {
    let ex = examples();
    let sha = sha();
    let json: Value = serde_json::from_slice(&ok(&eep_args(&ex, &sha))).unwrap();
    let mut args = eep_args(&ex, &sha);
    args.extend(["--format", "yaml"]);
    let yaml = String::from_utf8(ok(&args)).unwrap();
    assert!(yaml.starts_with("apiVersion: "), "{yaml}");
    assert!(yaml.ends_with('\n'));
    let back: Value = serde_yaml::from_str(&yaml).unwrap();
    assert_eq!(back, json);
}

#[test]
fn flag_mistakes_are_usage_errors() {
    let ex = examples();
    let sha = sha();
    let module = wasm_file("eep-usage.wasm");
    let m = module.to_str().unwrap();
    let not_wasm = Path::new(env!("CARGO_TARGET_TMPDIR")).join("eep-not.wasm");
    std::fs::write(&not_wasm, "(module)").unwrap();
    let nw = not_wasm.to_str().unwrap();
    let eep = ["compile", &ex, "-o", "envoyextensionpolicy"];
    fn plus<'a>(head: &[&'a str], more: &[&'a str]) -> Vec<&'a str> {
        [head, more].concat()
    }
    let upper = sha.to_uppercase();
    let short = &sha[..63];
    let tagged = format!("sha256:{sha}");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (plus(&eep, &["--wasm-sha256", &sha]), "--wasm-url"),
        (
            plus(&eep, &["--wasm-url", URL]),
            "--wasm-sha256 HEX or --wasm-file",
        ),
        (
            plus(
                &eep,
                &["--wasm-url", URL, "--wasm-sha256", &sha, "--wasm-file", m],
            ),
            "--wasm-file",
        ),
        (
            plus(&eep, &["--wasm-url", URL, "--wasm-sha256", &upper]),
            "lowercase",
        ),
        (
            plus(&eep, &["--wasm-url", URL, "--wasm-sha256", short]),
            "64",
        ),
        (
            plus(&eep, &["--wasm-url", URL, "--wasm-sha256", &tagged]),
            "64",
        ),
        (
            plus(&eep, &["--wasm-url", "oci://x/y", "--wasm-sha256", &sha]),
            "http://",
        ),
        (
            plus(&eep, &["--wasm-url", "http://", "--wasm-sha256", &sha]),
            "http://",
        ),
        (
            plus(
                &eep,
                &["--wasm-url", URL, "--wasm-file", "/nonexistent/f.wasm"],
            ),
            "/nonexistent/f.wasm",
        ),
        (
            plus(&eep, &["--wasm-url", URL, "--wasm-file", nw]),
            "not a WebAssembly module",
        ),
        (
            vec!["compile", &ex, "--wasm-url", URL, "--wasm-sha256", &sha],
            "--output envoyextensionpolicy",
        ),
        (
            vec!["compile", &ex, "--format", "yaml"],
            "--output envoyextensionpolicy",
        ),
        (vec!["compile", &ex, "-o", "policy.json"], "config"),
        (
            plus(&eep, &["--wasm-sha256", &sha, "--format", "toml"]),
            "yaml",
        ),
    ];
    for (args, says) in cases {
        let out = kvasirctl(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
        assert!(err.contains(says), "{args:?}: `{says}` not in {err}");
    }
    // A flag mistake wins over broken input: the flags are checked first.
    let b = broken();
    let out = kvasirctl(&["compile", &b, "-o", "eep", "--wasm-sha256", &sha]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn invalid_input_exits_1_with_compiles_report() {
    let b = broken();
    let sha = sha();
    let plain = kvasirctl(&["compile", &b]);
    assert_eq!(plain.status.code(), Some(1));
    for format in ["json", "yaml"] {
        let mut args = eep_args(&b, &sha);
        args.extend(["--format", format]);
        let out = kvasirctl(&args);
        assert_eq!(out.status.code(), Some(1), "{format}");
        assert!(out.stdout.is_empty());
        assert_eq!(out.stderr, plain.stderr, "{format}");
    }
    assert!(String::from_utf8_lossy(&plain.stderr).contains("spec.match.modle"));
}

#[test]
fn wasm_code_checks_what_people_type() {
    let sha = sha();
    assert_eq!(
        wasm_code(URL, &sha).unwrap(),
        WasmCode {
            url: URL.into(),
            sha256: sha.clone()
        }
    );
    assert!(wasm_code("https://h/f.wasm", &sha).is_ok());
    for url in ["", "http://", "ftp://h/f.wasm", "http://h/a b.wasm", "h/f"] {
        assert!(wasm_code(url, &sha).is_err(), "{url:?}");
    }
    for hex in ["", "g".repeat(64).as_str(), &sha.to_uppercase(), &sha[1..]] {
        assert!(wasm_code(URL, hex).is_err(), "{hex:?}");
    }
    // Not even multi-byte input panics.
    assert!(wasm_code("http://ü", &"é".repeat(32)).is_err());
}
