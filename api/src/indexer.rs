//! The cache-indexer's pool list, generated from a namespace's
//! `InferencePool`s: what the controller writes to the ConfigMap
//! [`POOLS_CONFIG_MAP`] (key [`POOLS_KEY`]) and the indexer reads through
//! its `poolsFile` setting.
//!
//! Every `InferencePool` with a `kvasir.dev/models` annotation is one
//! indexer pool whose endpoints come from discovery of that pool. The other
//! settings come from annotations on the pool, each with the default the
//! deployed example uses:
//!
//! | annotation | indexer key | default |
//! | --- | --- | --- |
//! | `kvasir.dev/indexer-pool` | `name` | `metadata.name` |
//! | `kvasir.dev/models` (first name) | `model` | (required) |
//! | `kvasir.dev/block-size` | `blockSize` | 16 |
//! | `kvasir.dev/tokenizer` | `tokenizer` | `render` |
//! | `kvasir.dev/kv-events-port` | `discovery.eventsPort` | see below |
//! | `kvasir.dev/kv-replay-port` | `discovery.replayPort` | see below (`none`: no replay) |
//! | `kvasir.dev/kv-events-topic` | `discovery.topic` | see below |
//! | `kvasir.dev/flow-control*` | `flowControl` | none written: off |
//!
//! Without any of the three KV-event annotations the file names no port
//! and no topic: the indexer then reads each engine's sockets from its own
//! `GET /kv_event_sources` (vLLM 0.34), which knows its data-parallel
//! offsets and whether replay runs. With any of them, the ports are fixed
//! for every pod of the pool: the one given, else 5557 for events and 5558
//! for replay, and the topic given (else empty).
//!
//! With any flow-control annotation ([`crate::flow`]) the pool's
//! `flowControl` is written whole, every default filled in, from the same
//! section the filter's `maxQueueWaitMs` is compiled from; without one it
//! is not written (the indexer's default: off), so pools that do not use
//! it keep the bytes, and the hash, they had.
//!
//! The keys and ranges are the indexer's own (`PoolConfig` and
//! `DiscoveryConfig` in `cache-indexer/src/config.rs`): a file generated
//! without findings is one the indexer accepts, so a bad annotation shows up
//! on the `InferencePool` instead of as an indexer that does not start.

use std::collections::BTreeMap;

use kube_core::ResourceExt;
use kvasir_policy::flow::{check_flow_control, resolve, FlowControlConfig};
use kvasir_policy::Severity;
use serde::{Deserialize, Serialize};

use crate::assemble::{Finding, ObjectRef, Resources};
use crate::flow::FLOW_CONTROL_ANNOTATION;
use crate::types::{InferencePool, INDEXER_POOL_ANNOTATION, MODELS_ANNOTATION};

/// Annotation on an `InferencePool`: tokens per KV block; must equal the
/// engines' vLLM `--block-size`.
pub const BLOCK_SIZE_ANNOTATION: &str = "kvasir.dev/block-size";
/// Annotation on an `InferencePool`: the indexer's tokenizer for the pool,
/// `render`, `approx` or a tokenizer directory inside the indexer's pod.
pub const TOKENIZER_ANNOTATION: &str = "kvasir.dev/tokenizer";
/// Annotation on an `InferencePool`: the engines' KV-events port.
pub const KV_EVENTS_PORT_ANNOTATION: &str = "kvasir.dev/kv-events-port";
/// Annotation on an `InferencePool`: the engines' KV-events replay port,
/// or `none` when the engines run without one.
pub const KV_REPLAY_PORT_ANNOTATION: &str = "kvasir.dev/kv-replay-port";
/// Annotation on an `InferencePool`: the engines' KV-events topic.
pub const KV_EVENTS_TOPIC_ANNOTATION: &str = "kvasir.dev/kv-events-topic";

/// The ConfigMap the controller writes the pools file to.
pub const POOLS_CONFIG_MAP: &str = "kvasir-indexer-pools";
/// The ConfigMap key holding [`IndexerPools::to_yaml`].
pub const POOLS_KEY: &str = "pools.yaml";

/// Block size without an annotation (vLLM's default).
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// Largest block size the indexer accepts.
pub const MAX_BLOCK_SIZE: u32 = 1024;
/// Tokenizer without an annotation: ask an engine, so the indexer's pod
/// needs no model files.
pub const DEFAULT_TOKENIZER: &str = "render";
/// KV-events port without an annotation.
pub const DEFAULT_EVENTS_PORT: u16 = 5557;
/// Replay port without an annotation.
pub const DEFAULT_REPLAY_PORT: u16 = 5558;

/// The pools file: the indexer's `poolsFile` schema.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IndexerPools {
    /// One pool per annotated `InferencePool`, sorted by name.
    pub pools: Vec<IndexerPool>,
}

/// One indexer pool (the indexer's `PoolConfig`, the keys it needs; the
/// rest keep the indexer's defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IndexerPool {
    /// The name the filter's picks carry (`PickRequest.pool`).
    pub name: String,
    /// The model, sent to the engines' render endpoint.
    pub model: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// `render`, `approx` or a tokenizer directory.
    pub tokenizer: String,
    /// Endpoints from the `InferencePool`.
    pub discovery: IndexerDiscovery,
    /// The pool's flow control, from its `kvasir.dev/flow-control*`
    /// annotations; none: the indexer's default (off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flow_control: Option<FlowControlConfig>,
}

/// Where a pool's endpoints come from (the indexer's `DiscoveryConfig`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IndexerDiscovery {
    /// Namespace of the `InferencePool` and its pods.
    pub namespace: String,
    /// The `InferencePool`'s `metadata.name`.
    pub inference_pool: String,
    /// KV-events port of pods without their own annotation; none: each
    /// engine's `/kv_event_sources` tells.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events_port: Option<u16>,
    /// Replay port of pods without their own annotation; none: no replay,
    /// or, with no events port either, what the engine advertises.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_port: Option<u16>,
    /// Event topic of pods without their own annotation (empty: vLLM's
    /// default, or the engine's own with no events port).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub topic: String,
}

impl IndexerPools {
    /// The file's text; the same pools give the same bytes.
    pub fn to_yaml(&self) -> String {
        // Only strings, numbers, booleans and sequences: serde_yaml has no
        // way to fail on them.
        serde_yaml::to_string(self).expect("plain values serialize to YAML")
    }

    /// `sha256:<hex>` of [`IndexerPools::to_yaml`]: the controller puts it on
    /// the indexer's pod template so a change rolls the Deployment.
    pub fn sha256(&self) -> String {
        crate::eep::sha256_hex(self.to_yaml().as_bytes())
    }
}

/// The indexer's pools for every `InferencePool` of `res` that carries the
/// `kvasir.dev/models` annotation, sorted by name; a bad annotation, or
/// two pools with one indexer name, is an error finding on the pool.
pub fn indexer_pools(res: &Resources) -> Result<IndexerPools, Vec<Finding>> {
    let mut findings = Vec::new();
    if res.namespace.is_empty() {
        findings.push(Finding {
            object: None,
            path: String::new(),
            message: "no namespace: the indexer's discovery needs the InferencePools' namespace"
                .into(),
            severity: Severity::Error,
        });
    }
    // Indexer name -> (metadata.name, the field the name came from, pool);
    // a BTreeMap so the file is sorted whatever order the pools came in.
    let mut by_name: BTreeMap<String, (String, String, IndexerPool)> = BTreeMap::new();
    let mut annotated: Vec<&InferencePool> = res
        .pools
        .iter()
        .filter(|p| p.annotations().contains_key(MODELS_ANNOTATION))
        .collect();
    // Of two pools with one indexer name, the later by metadata.name gets
    // the finding, whatever order the pools came in.
    annotated.sort_by_key(|p| p.name_any());
    for pool in annotated {
        let Some(p) = indexer_pool(&res.namespace, pool, &mut findings) else {
            continue;
        };
        let source = match pool.annotations().contains_key(INDEXER_POOL_ANNOTATION) {
            true => annotation_path(INDEXER_POOL_ANNOTATION),
            false => "metadata.name".to_owned(),
        };
        if let Some((first, _, _)) = by_name.get(&p.name) {
            findings.push(error(
                pool,
                source,
                format!(
                    "indexer pool `{}` is also InferencePool/{first}'s: each pool needs its own indexer pool name (set `{INDEXER_POOL_ANNOTATION}`)",
                    p.name
                ),
            ));
            continue;
        }
        by_name.insert(p.name.clone(), (pool.name_any(), source, p));
    }
    if !findings.is_empty() {
        findings.sort();
        findings.dedup();
        return Err(findings);
    }
    Ok(IndexerPools {
        pools: by_name.into_values().map(|(_, _, p)| p).collect(),
    })
}

/// One pool's settings; `None` (with findings) when an annotation is bad.
fn indexer_pool(
    namespace: &str,
    pool: &InferencePool,
    findings: &mut Vec<Finding>,
) -> Option<IndexerPool> {
    let ann = pool.annotations();
    let get = |key: &str| ann.get(key).map(String::as_str);
    let before = findings.len();
    let mut bad = |key: &str, message: String| {
        findings.push(error(pool, annotation_path(key), message));
    };

    let model = ann
        .get(MODELS_ANNOTATION)
        .and_then(|m| m.split(',').map(str::trim).find(|s| !s.is_empty()))
        .unwrap_or_default()
        .to_owned();
    if model.is_empty() {
        bad(
            MODELS_ANNOTATION,
            "no model name: the model names this pool serves, comma separated (the first is the indexer's model)".into(),
        );
    }
    // Verbatim, not trimmed: it must equal what the filter sends, which is
    // the annotation as written.
    let name = ann
        .get(INDEXER_POOL_ANNOTATION)
        .cloned()
        .unwrap_or_else(|| pool.name_any());
    if name.trim().is_empty() {
        bad(INDEXER_POOL_ANNOTATION, "must not be empty".into());
    }
    let block_size = number(
        get(BLOCK_SIZE_ANNOTATION),
        DEFAULT_BLOCK_SIZE,
        1,
        MAX_BLOCK_SIZE.into(),
    )
    .unwrap_or_else(|m| {
        bad(
            BLOCK_SIZE_ANNOTATION,
            format!("{m} (it must equal the engines' vLLM --block-size)"),
        );
        DEFAULT_BLOCK_SIZE
    });
    let tokenizer = match ann.get(TOKENIZER_ANNOTATION).map(|t| t.trim()) {
        None => DEFAULT_TOKENIZER.to_owned(),
        Some("") => {
            bad(
                TOKENIZER_ANNOTATION,
                "must not be empty: `render`, `approx` or a tokenizer directory in the indexer's pod".into(),
            );
            String::new()
        }
        Some(t) => t.to_owned(),
    };
    // No KV-event annotation: the engines advertise their own sockets.
    let fixed = [
        KV_EVENTS_PORT_ANNOTATION,
        KV_REPLAY_PORT_ANNOTATION,
        KV_EVENTS_TOPIC_ANNOTATION,
    ]
    .iter()
    .any(|k| ann.contains_key(*k));
    let events_port = fixed.then(|| {
        number(
            get(KV_EVENTS_PORT_ANNOTATION),
            DEFAULT_EVENTS_PORT,
            1,
            65535,
        )
        .unwrap_or_else(|m| {
            bad(KV_EVENTS_PORT_ANNOTATION, m);
            DEFAULT_EVENTS_PORT
        })
    });
    let replay_port = match ann.get(KV_REPLAY_PORT_ANNOTATION).map(|r| r.trim()) {
        _ if !fixed => None,
        Some("none") => None,
        raw => Some(
            number(raw, DEFAULT_REPLAY_PORT, 1, 65535).unwrap_or_else(|m| {
                bad(KV_REPLAY_PORT_ANNOTATION, format!("{m}, or `none`"));
                DEFAULT_REPLAY_PORT
            }),
        ),
    };
    let topic = ann
        .get(KV_EVENTS_TOPIC_ANNOTATION)
        .cloned()
        .unwrap_or_default();
    let flow_control = flow_control(pool, &mut bad);

    if findings.len() > before {
        return None;
    }
    Some(IndexerPool {
        name,
        model,
        block_size,
        tokenizer,
        discovery: IndexerDiscovery {
            namespace: namespace.to_owned(),
            inference_pool: pool.name_any(),
            events_port,
            replay_port,
            topic,
        },
        flow_control,
    })
}

/// The pool's `flowControl` from its annotations, checked with the
/// policy's rules (errors only: warnings show when a target is compiled).
fn flow_control(
    pool: &InferencePool,
    bad: &mut impl FnMut(&str, String),
) -> Option<FlowControlConfig> {
    let fc = match crate::flow::flow_control(pool) {
        Ok(fc) => fc?,
        Err(errs) => {
            errs.into_iter().for_each(|(key, m)| bad(key, m));
            return None;
        }
    };
    let mut ok = true;
    for e in check_flow_control("", &fc) {
        if e.severity == Severity::Error {
            let field = e.path.rsplit('.').next().unwrap_or("");
            let key = crate::flow::annotation_of(field).unwrap_or(FLOW_CONTROL_ANNOTATION);
            bad(key, e.message);
            ok = false;
        }
    }
    ok.then(|| resolve(&fc))
}

/// An annotation's number in `lo..=hi`, or `default` when it is absent.
fn number<T>(raw: Option<&str>, default: T, lo: u64, hi: u64) -> Result<T, String>
where
    T: TryFrom<u64>,
{
    let Some(raw) = raw else {
        return Ok(default);
    };
    let v: u64 = raw
        .trim()
        .parse()
        .map_err(|_| format!("`{raw}` is not a number ({lo}..={hi})"))?;
    if !(lo..=hi).contains(&v) {
        return Err(format!("must be {lo}..={hi}, got {v}"));
    }
    T::try_from(v).map_err(|_| format!("must be {lo}..={hi}, got {v}"))
}

fn annotation_path(key: &str) -> String {
    format!("metadata.annotations[\"{key}\"]")
}

fn error(pool: &InferencePool, path: String, message: String) -> Finding {
    Finding {
        object: Some(ObjectRef {
            kind: "InferencePool",
            name: pool.name_any(),
        }),
        path,
        message,
        severity: Severity::Error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(pools: Vec<InferencePool>) -> Resources {
        Resources {
            namespace: "serving".into(),
            pools,
            ..Resources::default()
        }
    }

    fn findings(pools: Vec<InferencePool>) -> Vec<Finding> {
        indexer_pools(&res(pools)).unwrap_err()
    }

    #[test]
    fn defaults_match_the_deployed_example() {
        let out = indexer_pools(&res(vec![InferencePool::annotated(
            "main",
            &[(MODELS_ANNOTATION, "llama-3.1-8b-instruct, llama-3.1-8b")],
        )]))
        .unwrap();
        assert_eq!(
            out.pools,
            vec![IndexerPool {
                name: "main".into(),
                model: "llama-3.1-8b-instruct".into(),
                block_size: 16,
                tokenizer: "render".into(),
                discovery: IndexerDiscovery {
                    namespace: "serving".into(),
                    inference_pool: "main".into(),
                    events_port: None,
                    replay_port: None,
                    topic: String::new(),
                },
                flow_control: None,
            }]
        );
        assert_eq!(
            out.to_yaml(),
            "pools:\n\
             - name: main\n  \
               model: llama-3.1-8b-instruct\n  \
               blockSize: 16\n  \
               tokenizer: render\n  \
               discovery:\n    \
                 namespace: serving\n    \
                 inferencePool: main\n"
        );
    }

    #[test]
    fn any_kv_event_annotation_fixes_the_ports_with_their_defaults() {
        let out = indexer_pools(&res(vec![InferencePool::annotated(
            "p",
            &[(MODELS_ANNOTATION, "m"), (KV_EVENTS_TOPIC_ANNOTATION, "kv")],
        )]))
        .unwrap();
        let d = &out.pools[0].discovery;
        assert_eq!(
            (d.events_port, d.replay_port, d.topic.as_str()),
            (Some(5557), Some(5558), "kv")
        );
    }

    #[test]
    fn every_annotation_is_applied() {
        let out = indexer_pools(&res(vec![InferencePool::annotated(
            "qwen-pool",
            &[
                (MODELS_ANNOTATION, "Qwen/Qwen3-8B"),
                (INDEXER_POOL_ANNOTATION, "qwen"),
                (BLOCK_SIZE_ANNOTATION, "32"),
                (TOKENIZER_ANNOTATION, "/models/qwen3"),
                (KV_EVENTS_PORT_ANNOTATION, "6000"),
                (KV_REPLAY_PORT_ANNOTATION, "6001"),
                (KV_EVENTS_TOPIC_ANNOTATION, "kv"),
            ],
        )]))
        .unwrap();
        let p = &out.pools[0];
        assert_eq!(p.name, "qwen");
        assert_eq!(p.model, "Qwen/Qwen3-8B");
        assert_eq!(p.block_size, 32);
        assert_eq!(p.tokenizer, "/models/qwen3");
        assert_eq!(p.discovery.inference_pool, "qwen-pool");
        assert_eq!(p.discovery.events_port, Some(6000));
        assert_eq!(p.discovery.replay_port, Some(6001));
        assert_eq!(p.discovery.topic, "kv");

        let none = indexer_pools(&res(vec![InferencePool::annotated(
            "p",
            &[
                (MODELS_ANNOTATION, "m"),
                (KV_REPLAY_PORT_ANNOTATION, "none"),
            ],
        )]))
        .unwrap();
        assert_eq!(none.pools[0].discovery.replay_port, None);
        assert!(!none.to_yaml().contains("replayPort"), "{}", none.to_yaml());
    }

    #[test]
    fn a_bad_annotation_is_a_finding_on_its_path() {
        let errs = findings(vec![
            InferencePool::annotated(
                "a",
                &[(MODELS_ANNOTATION, "m"), (BLOCK_SIZE_ANNOTATION, "sixteen")],
            ),
            InferencePool::annotated(
                "b",
                &[(MODELS_ANNOTATION, "m"), (BLOCK_SIZE_ANNOTATION, "0")],
            ),
            InferencePool::annotated(
                "c",
                &[
                    (MODELS_ANNOTATION, "m"),
                    (KV_EVENTS_PORT_ANNOTATION, "70000"),
                ],
            ),
            InferencePool::annotated(
                "d",
                &[(MODELS_ANNOTATION, "m"), (KV_REPLAY_PORT_ANNOTATION, "0")],
            ),
            InferencePool::annotated("e", &[(MODELS_ANNOTATION, " , ")]),
            InferencePool::annotated(
                "f",
                &[(MODELS_ANNOTATION, "m"), (TOKENIZER_ANNOTATION, " ")],
            ),
            InferencePool::annotated(
                "g",
                &[(MODELS_ANNOTATION, "m"), (INDEXER_POOL_ANNOTATION, "")],
            ),
        ]);
        let got: Vec<(String, String)> = errs
            .iter()
            .map(|f| {
                assert_eq!(f.severity, Severity::Error);
                let o = f.object.as_ref().unwrap();
                assert_eq!(o.kind, "InferencePool");
                (o.name.clone(), f.path.clone())
            })
            .collect();
        let want = [
            ("a", BLOCK_SIZE_ANNOTATION),
            ("b", BLOCK_SIZE_ANNOTATION),
            ("c", KV_EVENTS_PORT_ANNOTATION),
            ("d", KV_REPLAY_PORT_ANNOTATION),
            ("e", MODELS_ANNOTATION),
            ("f", TOKENIZER_ANNOTATION),
            ("g", INDEXER_POOL_ANNOTATION),
        ]
        .map(|(n, k)| (n.to_owned(), format!("metadata.annotations[\"{k}\"]")));
        assert_eq!(got, want);
        assert_eq!(
            errs[0].to_string(),
            "InferencePool/a: metadata.annotations[\"kvasir.dev/block-size\"]: `sixteen` is not a number (1..=1024) (it must equal the engines' vLLM --block-size)"
        );
        assert!(errs[2].message.contains("must be 1..=65535, got 70000"));
    }

    #[test]
    fn two_pools_with_one_indexer_name_are_a_finding() {
        let errs = findings(vec![
            InferencePool::annotated(
                "z",
                &[(MODELS_ANNOTATION, "m"), (INDEXER_POOL_ANNOTATION, "a")],
            ),
            InferencePool::annotated("a", &[(MODELS_ANNOTATION, "m")]),
        ]);
        assert_eq!(errs.len(), 1);
        assert_eq!(
            errs[0].to_string(),
            "InferencePool/z: metadata.annotations[\"kvasir.dev/indexer-pool\"]: indexer pool `a` is also InferencePool/a's: each pool needs its own indexer pool name (set `kvasir.dev/indexer-pool`)"
        );
        let errs = findings(vec![
            InferencePool::annotated("a", &[(MODELS_ANNOTATION, "m")]),
            InferencePool::annotated(
                "b",
                &[(MODELS_ANNOTATION, "m"), (INDEXER_POOL_ANNOTATION, "x")],
            ),
            InferencePool::annotated(
                "c",
                &[(MODELS_ANNOTATION, "m"), (INDEXER_POOL_ANNOTATION, "x")],
            ),
        ]);
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].object.as_ref().unwrap().name, "c");
    }

    #[test]
    fn sorted_and_deterministic_and_unannotated_pools_skipped() {
        let pools = vec![
            InferencePool::annotated("c", &[(MODELS_ANNOTATION, "m3")]),
            InferencePool::annotated("no-models", &[(BLOCK_SIZE_ANNOTATION, "bad")]),
            InferencePool::annotated(
                "a",
                &[(MODELS_ANNOTATION, "m1"), (INDEXER_POOL_ANNOTATION, "y")],
            ),
            InferencePool::annotated(
                "b",
                &[(MODELS_ANNOTATION, "m2"), (INDEXER_POOL_ANNOTATION, "x")],
            ),
        ];
        let mut reversed = pools.clone();
        reversed.reverse();
        let one = indexer_pools(&res(pools)).unwrap();
        let two = indexer_pools(&res(reversed)).unwrap();
        let names: Vec<&str> = one.pools.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["c", "x", "y"]);
        assert_eq!(one.to_yaml(), two.to_yaml());
        assert_eq!(one.sha256(), two.sha256());
        assert!(one.sha256().starts_with("sha256:") && one.sha256().len() == 7 + 64);
        let back: IndexerPools = serde_yaml::from_str(&one.to_yaml()).unwrap();
        assert_eq!(back, one);

        let empty = indexer_pools(&res(vec![InferencePool::annotated("p", &[])])).unwrap();
        assert_eq!(empty.to_yaml(), "pools: []\n");
    }

    #[test]
    fn flow_control_annotations_write_the_whole_section() {
        use crate::flow::*;
        let out = indexer_pools(&res(vec![
            InferencePool::annotated(
                "a",
                &[
                    (MODELS_ANNOTATION, "m"),
                    (FLOW_CONTROL_ANNOTATION, "true"),
                    (FLOW_CONTROL_THRESHOLD_ANNOTATION, "0.9"),
                    (FLOW_CONTROL_MAX_WAIT_MS_ANNOTATION, "2500"),
                ],
            ),
            InferencePool::annotated("b", &[(MODELS_ANNOTATION, "m")]),
        ]))
        .unwrap();
        let d = FlowControlConfig::default();
        assert_eq!(
            out.pools[0].flow_control,
            Some(FlowControlConfig {
                enabled: true,
                threshold: 0.9,
                max_wait_ms: 2500,
                ..d.clone()
            })
        );
        assert_eq!(out.pools[1].flow_control, None);
        let yaml = out.to_yaml();
        let want = format!(
            "  flowControl:\n    \
               enabled: true\n    \
               threshold: 0.9\n    \
               maxQueued: {}\n    \
               maxQueuedPerTenant: {}\n    \
               maxWaitMs: 2500\n",
            d.max_queued, d.max_queued_per_tenant
        );
        assert!(yaml.contains(&want), "{yaml}");
        assert_eq!(yaml.matches("flowControl").count(), 1, "{yaml}");
        let back: IndexerPools = serde_yaml::from_str(&yaml).unwrap();
        assert_eq!(back, out);
    }

    #[test]
    fn bad_flow_control_annotations_are_findings_on_them() {
        use crate::flow::*;
        let errs = findings(vec![
            InferencePool::annotated(
                "a",
                &[(MODELS_ANNOTATION, "m"), (FLOW_CONTROL_ANNOTATION, "on")],
            ),
            InferencePool::annotated(
                "b",
                &[
                    (MODELS_ANNOTATION, "m"),
                    (FLOW_CONTROL_ANNOTATION, "true"),
                    (FLOW_CONTROL_MAX_QUEUED_ANNOTATION, "10"),
                    (FLOW_CONTROL_MAX_QUEUED_PER_TENANT_ANNOTATION, "20"),
                ],
            ),
            InferencePool::annotated(
                "c",
                &[
                    (MODELS_ANNOTATION, "m"),
                    (FLOW_CONTROL_THRESHOLD_ANNOTATION, "0"),
                ],
            ),
            InferencePool::annotated(
                "d",
                &[
                    (MODELS_ANNOTATION, "m"),
                    (FLOW_CONTROL_MAX_WAIT_MS_ANNOTATION, "600001"),
                ],
            ),
        ]);
        let got: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert_eq!(
            got,
            [
                "InferencePool/a: metadata.annotations[\"kvasir.dev/flow-control\"]: `on` must be `true` or `false`",
                "InferencePool/b: metadata.annotations[\"kvasir.dev/flow-control-max-queued-per-tenant\"]: must be at most maxQueued (10), got 20",
                "InferencePool/c: metadata.annotations[\"kvasir.dev/flow-control-threshold\"]: must be a number > 0, got 0",
                "InferencePool/d: metadata.annotations[\"kvasir.dev/flow-control-max-wait-ms\"]: must be at most 600000, got 600001",
            ]
        );
    }

    #[test]
    fn no_namespace_is_a_finding() {
        let r = Resources {
            pools: vec![InferencePool::annotated("a", &[(MODELS_ANNOTATION, "m")])],
            ..Resources::default()
        };
        let errs = indexer_pools(&r).unwrap_err();
        assert_eq!(errs.len(), 1);
        assert_eq!(errs[0].object, None);
    }
}
