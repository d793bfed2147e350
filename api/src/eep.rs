//! The `EnvoyExtensionPolicy` that carries the filter to one target: the
//! object the controller applies (server-side apply, field manager
//! [`FIELD_MANAGER`]) and `kvasirctl compile --output
//! envoyextensionpolicy` prints, byte for byte the same for the same input.
//!
//! The controller owns the whole object: Envoy Gateway's `spec.wasm` is an
//! atomic list, so a manager that owned only `config` would still take
//! the list (and its `code`) over. Nothing here depends on a live cluster
//! (no UIDs, no owner references): the controller deletes the policies of
//! targets that are gone itself, found by [`MANAGED_BY_LABEL`].

use serde::Serialize;
use serde_json::value::RawValue;

use crate::types::{TargetKind, TargetRef, GATEWAY_GROUP};

/// The field manager of every server-side apply the controller makes.
pub const FIELD_MANAGER: &str = "kvasir-controller";
/// `app.kubernetes.io/managed-by` on the objects the controller writes.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// Label: the target's kind (`Gateway` or `HTTPRoute`).
pub const TARGET_KIND_LABEL: &str = "kvasir.dev/target-kind";
/// Label: the target's name, as a label value can hold it (see
/// [`target_name_label`]); the whole name is in `spec.targetRefs`.
pub const TARGET_NAME_LABEL: &str = "kvasir.dev/target-name";
/// Annotation: `sha256:<hex>` of the filter configuration inside.
pub const CONFIG_HASH_ANNOTATION: &str = "kvasir.dev/config-sha256";
/// `apiVersion` of Envoy Gateway's `EnvoyExtensionPolicy`.
pub const EEP_API_VERSION: &str = "gateway.envoyproxy.io/v1alpha1";

/// Where Envoy Gateway fetches the filter module from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WasmCode {
    /// HTTP(S) URL of the `.wasm` file (the controller serves it).
    pub url: String,
    /// Hex SHA-256 of the module; Envoy Gateway refuses another.
    pub sha256: String,
}

/// In a module URL given to the controller or `kvasirctl` (`--wasm-url`),
/// stands for the module's hex SHA-256: a content-addressed URL, so that a
/// new module is a new URL (caches keyed by URL never serve an old one).
pub const SHA256_PLACEHOLDER: &str = "{sha256}";

/// The file name under which the controller serves its module, content
/// addressed: `kvasir_filter-<sha256>.wasm`.
pub fn module_file_name(sha256: &str) -> String {
    format!("kvasir_filter-{sha256}.wasm")
}

impl WasmCode {
    /// The module at `url`, where every [`SHA256_PLACEHOLDER`] is replaced
    /// by `sha256` (a URL without one is used as it is).
    pub fn new(url: &str, sha256: &str) -> WasmCode {
        WasmCode {
            url: url.replace(SHA256_PLACEHOLDER, sha256),
            sha256: sha256.to_owned(),
        }
    }
}

/// The value of [`TARGET_NAME_LABEL`] for a target name. A label value
/// holds at most 63 characters while a Gateway's or HTTPRoute's name may
/// have 253: a longer name keeps its first 50 characters and gets `-` and
/// 12 hex digits of its SHA-256, so distinct names keep distinct labels
/// and the value stays a valid label (names are DNS subdomains: letters,
/// digits, `-` and `.`).
pub fn target_name_label(name: &str) -> String {
    if name.len() <= 63 {
        return name.to_owned();
    }
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(name.as_bytes());
    let hex: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
    let head = name[..floor_char_boundary(name, 50)]
        .trim_end_matches(|c: char| !c.is_ascii_alphanumeric());
    format!("{head}-{hex}")
}

/// The name of the policy for `target`: `kvasir-gateway-<name>` or
/// `kvasir-httproute-<name>`, so a Gateway and a route of the same name
/// do not collide. Over 253 characters the end is a hash of the name.
pub fn name(target: &TargetRef) -> String {
    let kind = match target.kind {
        TargetKind::Gateway => "gateway",
        TargetKind::HttpRoute => "httproute",
    };
    let full = format!("kvasir-{kind}-{}", target.name);
    if full.len() <= 253 {
        return full;
    }
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(target.name.as_bytes());
    let hex: String = digest[..6].iter().map(|b| format!("{b:02x}")).collect();
    format!("{}-{hex}", &full[..floor_char_boundary(&full, 240)])
}

/// The largest char boundary of `s` at or below `i` (a name read from a
/// file offline is not guaranteed to be ASCII).
fn floor_char_boundary(s: &str, i: usize) -> usize {
    (0..=i.min(s.len()))
        .rev()
        .find(|&j| s.is_char_boundary(j))
        .unwrap_or(0)
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Object<'a> {
    api_version: &'static str,
    kind: &'static str,
    metadata: Metadata<'a>,
    spec: Spec<'a>,
}

#[derive(Serialize)]
struct Metadata<'a> {
    name: String,
    namespace: &'a str,
    labels: Labels,
    annotations: Annotations,
}

#[derive(Serialize)]
struct Labels {
    #[serde(rename = "app.kubernetes.io/managed-by")]
    managed_by: &'static str,
    #[serde(rename = "kvasir.dev/target-kind")]
    target_kind: &'static str,
    #[serde(rename = "kvasir.dev/target-name")]
    target_name: String,
}

#[derive(Serialize)]
struct Annotations {
    #[serde(rename = "kvasir.dev/config-sha256")]
    config_sha256: String,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Spec<'a> {
    target_refs: [Target<'a>; 1],
    wasm: [Wasm<'a>; 1],
}

#[derive(Serialize)]
struct Target<'a> {
    group: &'static str,
    kind: &'static str,
    name: &'a str,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Wasm<'a> {
    name: &'static str,
    #[serde(rename = "rootID")]
    root_id: &'static str,
    code: Code<'a>,
    fail_open: bool,
    config: &'a RawValue,
}

#[derive(Serialize)]
struct Code<'a> {
    #[serde(rename = "type")]
    type_: &'static str,
    http: Http<'a>,
}

#[derive(Serialize)]
struct Http<'a> {
    url: &'a str,
    sha256: &'a str,
}

/// The policy's JSON: `config` holds `config_json` (the compiled
/// `kvasir.filter/v1` bytes) verbatim. `failOpen` is always false: a
/// gateway whose filter cannot load must not pass requests unauthenticated
/// (gateway-api/README.md explains).
pub fn to_json(
    namespace: &str,
    target: &TargetRef,
    config_json: &[u8],
    code: &WasmCode,
) -> Result<Vec<u8>, serde_json::Error> {
    let text = std::str::from_utf8(config_json).map_err(serde::ser::Error::custom)?;
    let config: &RawValue = serde_json::from_str(text)?;
    let obj = Object {
        api_version: EEP_API_VERSION,
        kind: "EnvoyExtensionPolicy",
        metadata: Metadata {
            name: name(target),
            namespace,
            labels: Labels {
                managed_by: FIELD_MANAGER,
                target_kind: target.kind.as_str(),
                target_name: target_name_label(&target.name),
            },
            annotations: Annotations {
                config_sha256: sha256_hex(config_json),
            },
        },
        spec: Spec {
            target_refs: [Target {
                group: GATEWAY_GROUP,
                kind: target.kind.as_str(),
                name: &target.name,
            }],
            wasm: [Wasm {
                name: "kvasir",
                root_id: "kvasir",
                code: Code {
                    type_: "HTTP",
                    http: Http {
                        url: &code.url,
                        sha256: &code.sha256,
                    },
                },
                fail_open: false,
                config,
            }],
        },
    };
    serde_json::to_vec(&obj)
}

/// The target an EnvoyExtensionPolicy written by [`to_json`] carries: its
/// `spec.targetRefs[0]` (the whole name; the label may be shortened).
pub fn target_of(policy: &serde_json::Value) -> Option<TargetRef> {
    let t = policy.get("spec")?.get("targetRefs")?.get(0)?;
    let kind = match t.get("kind")?.as_str()? {
        "Gateway" => TargetKind::Gateway,
        "HTTPRoute" => TargetKind::HttpRoute,
        _ => return None,
    };
    Some(TargetRef::new(kind, t.get("name")?.as_str()?))
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let d = Sha256::digest(bytes);
    let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code() -> WasmCode {
        WasmCode {
            url: "http://c:8080/kvasir_filter.wasm".into(),
            sha256: "ab".repeat(32),
        }
    }

    #[test]
    fn the_config_is_embedded_verbatim() {
        let t = TargetRef::new(TargetKind::Gateway, "gw");
        let cfg = br#"{"version":"kvasir.filter/v1","z":1,"a":[2]}"#;
        let bytes = to_json("serving", &t, cfg, &code()).unwrap();
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.contains(r#""config":{"version":"kvasir.filter/v1","z":1,"a":[2]}"#));
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(v["metadata"]["name"], "kvasir-gateway-gw");
        assert_eq!(v["spec"]["targetRefs"][0]["kind"], "Gateway");
        assert_eq!(v["spec"]["wasm"][0]["failOpen"], false);
        assert_eq!(v["spec"]["wasm"][0]["rootID"], "kvasir");
        assert_eq!(
            v["metadata"]["annotations"][CONFIG_HASH_ANNOTATION],
            sha256_hex(cfg)
        );
    }

    #[test]
    fn names_do_not_collide_and_stay_short() {
        let g = name(&TargetRef::new(TargetKind::Gateway, "x"));
        let r = name(&TargetRef::new(TargetKind::HttpRoute, "x"));
        assert_ne!(g, r);
        let long = name(&TargetRef::new(TargetKind::HttpRoute, "y".repeat(253)));
        assert!(long.len() <= 253, "{}", long.len());
    }

    #[test]
    fn long_target_names_get_a_valid_distinct_label() {
        assert_eq!(target_name_label("inference-gateway"), "inference-gateway");
        let a = format!("{}a", "x".repeat(100));
        let b = format!("{}b", "x".repeat(100));
        let (la, lb) = (target_name_label(&a), target_name_label(&b));
        assert_ne!(la, lb);
        for l in [&la, &lb] {
            assert!(l.len() <= 63, "{l}");
            assert!(l.starts_with(&"x".repeat(50)), "{l}");
        }
        // Never ends a label head in `-` or `.`: `name-.-<hash>` is invalid.
        let dotted = format!("{}.{}", "y".repeat(49), "z".repeat(30));
        let l = target_name_label(&dotted);
        assert!(l.starts_with(&format!("{}-", "y".repeat(49))), "{l}");
        let t = TargetRef::new(TargetKind::HttpRoute, a.clone());
        let v: serde_json::Value =
            serde_json::from_slice(&to_json("ns", &t, b"{}", &code()).unwrap()).unwrap();
        assert_eq!(v["metadata"]["labels"][TARGET_NAME_LABEL], la);
        assert_eq!(target_of(&v), Some(t));
    }

    #[test]
    fn a_url_template_names_the_module_by_its_digest() {
        let sha = "ab".repeat(32);
        let c = WasmCode::new("http://c:8080/kvasir_filter-{sha256}.wasm", &sha);
        assert_eq!(c.url, format!("http://c:8080/{}", module_file_name(&sha)));
        let plain = WasmCode::new("http://c:8080/kvasir_filter.wasm", &sha);
        assert_eq!(plain.url, "http://c:8080/kvasir_filter.wasm");
    }

    #[test]
    fn bad_config_bytes_are_an_error_not_a_panic() {
        let t = TargetRef::new(TargetKind::Gateway, "gw");
        assert!(to_json("ns", &t, b"{not json", &code()).is_err());
    }
}
