//! Fair share and flow control from Kubernetes resources: tenants'
//! `spec.weight` and the settings' `classWeights` into the compiled
//! filter config; a pool's `kvasir.dev/flow-control*` annotations into
//! both the filter's `maxQueueWaitMs` and the indexer's pools file, which
//! must agree; errors on the field or annotation that caused them.

use kube_core::ResourceExt;
use kvasir_api::document::{parse, Document};
use kvasir_api::flow::*;
use kvasir_api::indexer::indexer_pools;
use kvasir_api::{compile, Compiled, Finding, Options, Resources, TargetKind, TargetRef};

const EXAMPLES: &[&str] = &[
    include_str!("../../../crds/examples/base.yaml"),
    include_str!("../../../crds/examples/pii-stays-inside.yaml"),
    include_str!("../../../crds/examples/cheaper-model-for-easy-prompts.yaml"),
    include_str!("../../../crds/examples/batch-when-idle.yaml"),
    include_str!("../../../crds/examples/burst-to-provider.yaml"),
];

fn load() -> Resources {
    let mut res = Resources {
        namespace: "serving".into(),
        ..Resources::default()
    };
    for text in EXAMPLES {
        for d in serde_yaml::Deserializer::from_str(text) {
            let v: serde_json::Value = serde::Deserialize::deserialize(d).unwrap();
            let doc: Document = parse(v).unwrap();
            res.insert(doc);
        }
    }
    res
}

fn gateway() -> TargetRef {
    TargetRef::new(TargetKind::Gateway, "inference-gateway")
}

fn compiled(res: &Resources) -> Compiled {
    compile(res, &gateway(), &Options::default()).unwrap_or_else(|e| panic!("{e:?}"))
}

fn weight(c: &Compiled, tenant: &str) -> u32 {
    let i = c.config.tenant_index(tenant).unwrap();
    c.config.tenants()[i].weight
}

/// The filter's maxQueueWaitMs and the indexer's flowControl of each pool
/// the target uses, by the filter's pool name.
fn both_sides(
    res: &Resources,
) -> Vec<(String, u32, Option<kvasir_policy::flow::FlowControlConfig>)> {
    let c = compiled(res);
    let pools = indexer_pools(res).unwrap_or_else(|e| panic!("{e:?}"));
    c.config
        .pools()
        .iter()
        .map(|p| {
            let ix = pools
                .pools
                .iter()
                .find(|x| x.name == p.indexer_pool)
                .unwrap();
            (p.name.clone(), p.max_queue_wait_ms, ix.flow_control.clone())
        })
        .collect()
}

fn set_annotation(res: &mut Resources, pool: &str, key: &str, value: &str) {
    let p = res.pools.iter_mut().find(|p| p.name_any() == pool).unwrap();
    p.annotations_mut().insert(key.to_owned(), value.to_owned());
}

#[test]
fn weights_compile_from_the_tenant_and_its_class() {
    let mut res = load();
    let c = compiled(&res);
    // acme is gold (classWeights: gold 4); nightly-eval has no weight.
    assert_eq!(weight(&c, "acme"), 4);
    assert_eq!(weight(&c, "nightly-eval"), 1);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    // A tenant's own weight replaces its class's; the class's is unused.
    let acme = res.tenants.iter_mut().find(|t| t.name_any() == "acme");
    acme.unwrap().spec.weight = Some(9);
    let c = compiled(&res);
    assert_eq!(weight(&c, "acme"), 9);
    let w: Vec<String> = c.warnings.iter().map(ToString::to_string).collect();
    assert_eq!(
        w,
        ["warning: InferenceSettings/inference-gateway: spec.classWeights[0].class: unused: no tenant of class `gold` goes without a weight of its own"]
    );
}

#[test]
fn weight_errors_map_to_resource_fields() {
    let mut res = load();
    let eval = res
        .tenants
        .iter_mut()
        .find(|t| t.name_any() == "nightly-eval");
    eval.unwrap().spec.weight = Some(0);
    let classes = res.settings[0].spec.class_weights.as_mut().unwrap();
    classes[0].weight = 1001;
    let errs = compile(&res, &gateway(), &Options::default()).unwrap_err();
    let got: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert_eq!(
        got,
        [
            "InferenceTenant/nightly-eval: spec.weight: must be between 1 and 1000, got 0",
            "InferenceSettings/inference-gateway: spec.classWeights[0].weight: must be between 1 and 1000, got 1001",
        ]
    );
}

#[test]
fn flow_control_annotations_reach_the_filter_and_the_indexer_alike() {
    let res = load();
    let d = kvasir_policy::flow::FlowControlConfig::default();
    let got = both_sides(&res);
    assert_eq!(
        got,
        [
            (
                "main".to_owned(),
                5000,
                Some(kvasir_policy::flow::FlowControlConfig {
                    enabled: true,
                    max_wait_ms: 5000,
                    ..d.clone()
                })
            ),
            ("small".to_owned(), 0, None),
        ]
    );
    let yaml = indexer_pools(&res).unwrap().to_yaml();
    assert!(yaml.contains("flowControl:\n    enabled: true\n"), "{yaml}");
}

#[test]
fn the_filter_wait_equals_the_indexer_wait_for_every_setting() {
    // Whatever the annotations say, the filter waits exactly as long as
    // the indexer may hold the pick when flow control is on, and not at
    // all when it is off.
    for enabled in [None, Some("true"), Some("false")] {
        for wait in [None, Some("0"), Some("1"), Some("750"), Some("600000")] {
            let mut res = load();
            let p = res
                .pools
                .iter_mut()
                .find(|p| p.name_any() == "main")
                .unwrap();
            let ann = p.annotations_mut();
            ann.remove(FLOW_CONTROL_ANNOTATION);
            ann.remove(FLOW_CONTROL_MAX_WAIT_MS_ANNOTATION);
            if let Some(e) = enabled {
                ann.insert(FLOW_CONTROL_ANNOTATION.into(), e.into());
            }
            if let Some(w) = wait {
                ann.insert(FLOW_CONTROL_MAX_WAIT_MS_ANNOTATION.into(), w.into());
            }
            for (pool, filter_wait, indexer) in both_sides(&res) {
                let want = match indexer {
                    Some(fc) if fc.enabled => fc.max_wait_ms,
                    _ => 0,
                };
                assert_eq!(
                    u64::from(filter_wait),
                    want,
                    "{pool}: enabled {enabled:?}, wait {wait:?}"
                );
            }
        }
    }
}

fn strings(f: &[Finding]) -> Vec<String> {
    f.iter().map(ToString::to_string).collect()
}

#[test]
fn flow_control_errors_name_the_annotation_in_both_outputs() {
    let mut res = load();
    set_annotation(&mut res, "main", FLOW_CONTROL_THRESHOLD_ANNOTATION, "0");
    let want = "InferencePool/main: metadata.annotations[\"kvasir.dev/flow-control-threshold\"]: must be a number > 0, got 0";
    let errs = compile(&res, &gateway(), &Options::default()).unwrap_err();
    assert_eq!(strings(&errs), [want]);
    assert_eq!(strings(&indexer_pools(&res).unwrap_err()), [want]);

    let mut res = load();
    set_annotation(&mut res, "main", FLOW_CONTROL_MAX_QUEUED_ANNOTATION, "many");
    let want = "InferencePool/main: metadata.annotations[\"kvasir.dev/flow-control-max-queued\"]: `many` is not a whole number";
    let errs = compile(&res, &gateway(), &Options::default()).unwrap_err();
    assert_eq!(strings(&errs), [want]);
    assert_eq!(strings(&indexer_pools(&res).unwrap_err()), [want]);

    // Tuning without `true`: a warning on the on/off annotation, nothing
    // queued on either side.
    let mut res = load();
    set_annotation(&mut res, "main", FLOW_CONTROL_ANNOTATION, "false");
    let c = compiled(&res);
    assert_eq!(
        strings(&c.warnings),
        ["warning: InferencePool/main: metadata.annotations[\"kvasir.dev/flow-control\"]: flow control is off (`enabled` is not true): these settings never apply"]
    );
    let main = &both_sides(&res)[0];
    assert_eq!(
        (main.1, main.2.as_ref().map(|f| f.enabled)),
        (0, Some(false))
    );
}
