//! `endpoints_for`: the pure InferencePool + pods -> endpoints rules.

use k8s_openapi::api::core::v1::Pod;
use kvasir_cache_indexer::discovery::{
    endpoints_for, DiscoveryDefaults, DiscoveryError, InferencePool, SkipKind, SkipReason,
};
use kvasir_cache_indexer::types::EndpointSpec;
use serde_json::{json, Value};

fn pool(match_labels: Value, ports: &[i32]) -> InferencePool {
    let ports: Vec<Value> = ports.iter().map(|n| json!({ "number": n })).collect();
    serde_json::from_value(json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": { "name": "p", "namespace": "default" },
        "spec": { "selector": { "matchLabels": match_labels }, "targetPorts": ports }
    }))
    .expect("pool json")
}

fn default_pool() -> InferencePool {
    pool(json!({ "app": "vllm" }), &[8000])
}

/// A pod as the API server shows it, Ready unless changed by `edit`.
fn pod(name: &str, ip: &str, edit: impl FnOnce(&mut Value)) -> Pod {
    let mut v = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "default",
            "labels": { "app": "vllm", "pod-template-hash": "abc" },
            "resourceVersion": "1"
        },
        "spec": { "containers": [{ "name": "vllm", "image": "vllm/vllm-openai" }] },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [
                { "type": "Initialized", "status": "True" },
                { "type": "Ready", "status": "True" },
                { "type": "ContainersReady", "status": "True" }
            ]
        }
    });
    edit(&mut v);
    serde_json::from_value(v).expect("pod json")
}

fn ready(name: &str, ip: &str) -> Pod {
    pod(name, ip, |_| {})
}

fn annotated(name: &str, ip: &str, annotations: Value) -> Pod {
    pod(name, ip, |v| v["metadata"]["annotations"] = annotations)
}

fn ep(address: &str, kv_events: &str, replay: Option<&str>, topic: &str) -> EndpointSpec {
    EndpointSpec {
        address: address.to_string(),
        kv_events: kv_events.to_string(),
        replay: replay.map(str::to_string),
        metrics_url: None,
        topic: topic.to_string(),
    }
}

/// The pool-wide port convention (events on 5557, no replay), the engines
/// not asked: what most tests here check.
fn port_convention() -> DiscoveryDefaults {
    DiscoveryDefaults {
        kv_event_sources: false,
        ..DiscoveryDefaults::default()
    }
}

fn skip(pod: &str, kind: SkipKind) -> SkipReason {
    SkipReason {
        pod: pod.to_string(),
        kind,
    }
}

#[test]
fn ready_pods_become_endpoints_with_defaults() {
    let pods = [ready("a", "10.0.0.5"), ready("b", "10.0.0.6")];
    let (eps, skipped) = endpoints_for(&default_pool(), &pods, &port_convention());
    assert_eq!(
        eps,
        vec![
            ep("10.0.0.5:8000", "tcp://10.0.0.5:5557", None, ""),
            ep("10.0.0.6:8000", "tcp://10.0.0.6:5557", None, ""),
        ]
    );
    assert!(skipped.is_empty());
    // metrics default to the HTTP address.
    assert_eq!(eps[0].metrics_url(), "http://10.0.0.5:8000/metrics");
}

#[test]
fn pool_defaults_apply_when_pods_say_nothing() {
    let defaults = DiscoveryDefaults {
        kv_event_sources: false,
        events_port: 6000,
        replay_port: Some(6001),
        topic: "kv".to_string(),
    };
    let (eps, _) = endpoints_for(&default_pool(), &[ready("a", "10.0.0.5")], &defaults);
    assert_eq!(
        eps,
        vec![ep(
            "10.0.0.5:8000",
            "tcp://10.0.0.5:6000",
            Some("tcp://10.0.0.5:6001"),
            "kv"
        )]
    );
}

#[test]
fn unready_terminating_and_ipless_pods_are_skipped() {
    let pods = [
        ready("ok", "10.0.0.1"),
        pod("unready", "10.0.0.2", |v| {
            v["status"]["conditions"][1]["status"] = json!("False");
        }),
        pod("unknown", "10.0.0.3", |v| {
            v["status"]["conditions"][1]["status"] = json!("Unknown");
        }),
        pod("no-conditions", "10.0.0.4", |v| {
            v["status"]["conditions"] = json!([]);
        }),
        pod("no-status", "10.0.0.5", |v| {
            v.as_object_mut().map(|o| o.remove("status"));
        }),
        pod("terminating", "10.0.0.6", |v| {
            v["metadata"]["deletionTimestamp"] = json!("2026-01-12T10:00:00Z");
            v["metadata"]["deletionGracePeriodSeconds"] = json!(30);
        }),
        pod("no-ip", "", |v| {
            v["status"].as_object_mut().map(|o| o.remove("podIP"));
        }),
        pod("empty-ip", "", |_| {}),
        pod("bad-ip", "not-an-ip", |_| {}),
    ];
    let (eps, skipped) = endpoints_for(&default_pool(), &pods, &port_convention());
    assert_eq!(
        eps,
        vec![ep("10.0.0.1:8000", "tcp://10.0.0.1:5557", None, "")]
    );
    assert_eq!(
        skipped,
        vec![
            skip("bad-ip", SkipKind::BadPodIp("not-an-ip".to_string())),
            skip("empty-ip", SkipKind::NoPodIp),
            skip("no-conditions", SkipKind::NotReady),
            skip("no-ip", SkipKind::NoPodIp),
            skip("no-status", SkipKind::NotReady),
            skip("terminating", SkipKind::Terminating),
            skip("unknown", SkipKind::NotReady),
            skip("unready", SkipKind::NotReady),
        ]
    );
    assert!(
        skipped
            .iter()
            .filter(|s| s.kind.is_misconfiguration())
            .count()
            == 1
    );
}

#[test]
fn each_target_port_is_an_endpoint_with_its_own_event_port() {
    let pool = pool(json!({ "app": "vllm" }), &[8000, 8001, 8000]);
    let pods = [annotated(
        "a",
        "10.0.0.5",
        json!({ "kvasir.io/kv-events-port": "5557", "kvasir.io/kv-events-replay-port": "5600" }),
    )];
    let (eps, skipped) = endpoints_for(&pool, &pods, &port_convention());
    // The duplicate 8000 (which the CRD forbids anyway) yields nothing twice.
    assert_eq!(
        eps,
        vec![
            ep(
                "10.0.0.5:8000",
                "tcp://10.0.0.5:5557",
                Some("tcp://10.0.0.5:5600"),
                ""
            ),
            ep(
                "10.0.0.5:8001",
                "tcp://10.0.0.5:5558",
                Some("tcp://10.0.0.5:5601"),
                ""
            ),
        ]
    );
    assert!(skipped.is_empty());
}

#[test]
fn annotations_override_defaults() {
    let defaults = DiscoveryDefaults {
        kv_event_sources: false,
        events_port: 5557,
        replay_port: Some(5558),
        topic: "default-topic".to_string(),
    };
    let pods = [
        annotated(
            "a",
            "10.0.0.5",
            json!({
                "kvasir.io/kv-events-port": "7000",
                "kvasir.io/kv-events-replay-port": " 7001 ",
                "kvasir.io/kv-events-topic": "kv-events"
            }),
        ),
        // Only the topic is overridden; ports stay pool defaults.
        annotated("b", "10.0.0.6", json!({ "kvasir.io/kv-events-topic": "" })),
    ];
    let (eps, skipped) = endpoints_for(&default_pool(), &pods, &defaults);
    assert_eq!(
        eps,
        vec![
            ep(
                "10.0.0.5:8000",
                "tcp://10.0.0.5:7000",
                Some("tcp://10.0.0.5:7001"),
                "kv-events"
            ),
            ep(
                "10.0.0.6:8000",
                "tcp://10.0.0.6:5557",
                Some("tcp://10.0.0.6:5558"),
                ""
            ),
        ]
    );
    assert!(skipped.is_empty());
}

#[test]
fn bad_annotations_skip_only_that_pod() {
    let pods = [
        ready("good", "10.0.0.1"),
        annotated(
            "word",
            "10.0.0.2",
            json!({ "kvasir.io/kv-events-port": "zmq" }),
        ),
        annotated(
            "zero",
            "10.0.0.3",
            json!({ "kvasir.io/kv-events-port": "0" }),
        ),
        annotated(
            "big",
            "10.0.0.4",
            json!({ "kvasir.io/kv-events-port": "70000" }),
        ),
        annotated(
            "neg",
            "10.0.0.5",
            json!({ "kvasir.io/kv-events-port": "-1" }),
        ),
        annotated(
            "url",
            "10.0.0.6",
            json!({ "kvasir.io/kv-events-port": "tcp://*:5557" }),
        ),
        annotated(
            "replay",
            "10.0.0.7",
            json!({ "kvasir.io/kv-events-replay-port": "" }),
        ),
    ];
    let (eps, skipped) = endpoints_for(&default_pool(), &pods, &port_convention());
    assert_eq!(
        eps,
        vec![ep("10.0.0.1:8000", "tcp://10.0.0.1:5557", None, "")]
    );
    let bad = |pod: &str, key: &str, value: &str| {
        skip(
            pod,
            SkipKind::BadAnnotation {
                key: key.to_string(),
                value: value.to_string(),
            },
        )
    };
    let ev = "kvasir.io/kv-events-port";
    assert_eq!(
        skipped,
        vec![
            bad("big", ev, "70000"),
            bad("neg", ev, "-1"),
            bad("replay", "kvasir.io/kv-events-replay-port", ""),
            bad("url", ev, "tcp://*:5557"),
            bad("word", ev, "zmq"),
            bad("zero", ev, "0"),
        ]
    );
    assert!(skipped.iter().all(|s| s.kind.is_misconfiguration()));
    // The message names the pod, the key and the value.
    let msg = skipped[4].to_string();
    assert!(
        msg.contains("word") && msg.contains(ev) && msg.contains("zmq"),
        "{msg}"
    );
}

#[test]
fn event_port_overflow_is_a_skip_not_a_panic() {
    let pool = pool(json!({ "app": "vllm" }), &[8000, 8001]);
    let pods = [annotated(
        "a",
        "10.0.0.5",
        json!({ "kvasir.io/kv-events-port": "65535" }),
    )];
    let (eps, skipped) = endpoints_for(&pool, &pods, &port_convention());
    assert!(eps.is_empty());
    assert_eq!(
        skipped,
        vec![skip(
            "a",
            SkipKind::PortOutOfRange {
                base: 65535,
                offset: 1
            }
        )]
    );
}

#[test]
fn selector_requires_every_match_label_and_the_namespace() {
    let pool = pool(json!({ "app": "vllm", "model": "qwen3" }), &[8000]);
    let with_labels =
        |name: &str, ip: &str, labels: Value| pod(name, ip, |v| v["metadata"]["labels"] = labels);
    let pods = [
        with_labels(
            "both",
            "10.0.0.1",
            json!({ "app": "vllm", "model": "qwen3", "x": "y" }),
        ),
        with_labels("one", "10.0.0.2", json!({ "app": "vllm" })),
        with_labels(
            "wrong-value",
            "10.0.0.3",
            json!({ "app": "vllm", "model": "llama" }),
        ),
        pod("no-labels", "10.0.0.4", |v| {
            v["metadata"].as_object_mut().map(|o| o.remove("labels"));
        }),
        pod("other-ns", "10.0.0.5", |v| {
            v["metadata"]["labels"] = json!({ "app": "vllm", "model": "qwen3" });
            v["metadata"]["namespace"] = json!("prod");
        }),
    ];
    let (eps, skipped) = endpoints_for(&pool, &pods, &port_convention());
    assert_eq!(
        eps,
        vec![ep("10.0.0.1:8000", "tcp://10.0.0.1:5557", None, "")]
    );
    // Pods outside the pool are not "skipped": they were never in it.
    assert!(skipped.is_empty());

    // An empty selector selects nothing, and is reported by validate().
    let empty = self::pool(json!({}), &[8000]);
    let (eps, _) = endpoints_for(&empty, &pods, &port_convention());
    assert!(eps.is_empty());
    assert!(matches!(
        empty.validate(),
        Err(DiscoveryError::BadSelector { .. })
    ));
}

#[test]
fn output_is_sorted_and_independent_of_pod_order() {
    let mut pods = vec![
        ready("c", "10.0.0.10"),
        ready("a", "10.0.0.9"),
        ready("b", "10.0.1.1"),
        pod("z-unready", "10.0.0.1", |v| {
            v["status"]["conditions"][1]["status"] = json!("False");
        }),
        pod("m-unready", "10.0.0.2", |v| {
            v["status"]["conditions"][1]["status"] = json!("False");
        }),
    ];
    let defaults = port_convention();
    let first = endpoints_for(&default_pool(), &pods, &defaults);
    pods.reverse();
    let second = endpoints_for(&default_pool(), &pods, &defaults);
    assert_eq!(first, second);
    let addrs: Vec<&str> = first.0.iter().map(|e| e.address.as_str()).collect();
    // Numeric address order, not string order ("10.0.0.10" > "10.0.0.9").
    assert_eq!(addrs, ["10.0.0.9:8000", "10.0.0.10:8000", "10.0.1.1:8000"]);
    let names: Vec<&str> = first.1.iter().map(|s| s.pod.as_str()).collect();
    assert_eq!(names, ["m-unready", "z-unready"]);
}

#[test]
fn ipv6_pods_are_bracketed() {
    let (eps, _) = endpoints_for(
        &default_pool(),
        &[ready("a", "fd00:10:244::5")],
        &port_convention(),
    );
    assert_eq!(
        eps,
        vec![ep(
            "[fd00:10:244::5]:8000",
            "tcp://[fd00:10:244::5]:5557",
            None,
            ""
        )]
    );
}

#[test]
fn two_pods_on_one_address_keep_the_first_by_name() {
    // Host-network pods on one node share the node IP.
    let pods = [ready("b", "172.18.0.2"), ready("a", "172.18.0.2")];
    let (eps, skipped) = endpoints_for(&default_pool(), &pods, &port_convention());
    assert_eq!(eps.len(), 1);
    assert_eq!(
        skipped,
        vec![skip("b", SkipKind::DuplicateAddress("a".to_string()))]
    );
}

#[test]
fn pool_validation_reports_bad_selectors_and_ports() {
    assert!(default_pool().validate().is_ok());
    assert_eq!(
        default_pool().label_selector().ok().as_deref(),
        Some("app=vllm")
    );
    let two = pool(json!({ "b": "2", "a.example.com/x": "1" }), &[8000]);
    assert_eq!(
        two.label_selector().ok().as_deref(),
        Some("a.example.com/x=1,b=2")
    );

    for labels in [
        json!({}),
        json!({ "app": "a,b" }),
        json!({ "app=x": "y" }),
        json!({ "bad key": "v" }),
        json!({ "-app": "v" }),
        json!({ "Upper.Case/app": "v" }),
        json!({ "app": "x".repeat(64) }),
    ] {
        let p = pool(labels.clone(), &[8000]);
        match p.validate() {
            Err(e @ DiscoveryError::BadSelector { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("default/p"), "{msg}");
            }
            other => panic!("{labels}: expected BadSelector, got {other:?}"),
        }
    }
    for ports in [&[][..], &[0], &[70000], &[-5]] {
        let p = pool(json!({ "app": "vllm" }), ports);
        assert!(
            matches!(p.validate(), Err(DiscoveryError::BadTargetPorts { .. })),
            "{ports:?}"
        );
        assert!(
            endpoints_for(&p, &[ready("a", "10.0.0.1")], &port_convention())
                .0
                .is_empty()
        );
    }
}

#[test]
fn defaults_deserialize_from_config() {
    let d: DiscoveryDefaults =
        serde_json::from_value(json!({ "replay_port": 5558 })).expect("defaults json");
    assert_eq!(
        d,
        DiscoveryDefaults {
            kv_event_sources: true,
            events_port: 5557,
            replay_port: Some(5558),
            topic: String::new()
        }
    );
}

#[test]
fn by_default_pods_without_a_port_annotation_ask_their_engine() {
    let pods = [
        ready("a", "10.0.0.5"),
        // Replay and topic annotations alone do not make a pod explicit:
        // its engine says where it publishes.
        annotated(
            "b",
            "10.0.0.6",
            json!({ "kvasir.io/kv-events-topic": "kv", "kvasir.io/kv-events-replay-port": "5558" }),
        ),
        // The events-port annotation wins over what the engine advertises.
        annotated(
            "c",
            "10.0.0.7",
            json!({ "kvasir.io/kv-events-port": "7000", "kvasir.io/kv-events-topic": "kv" }),
        ),
    ];
    let defaults = DiscoveryDefaults::default();
    assert!(defaults.kv_event_sources);
    let (eps, skipped) = endpoints_for(&default_pool(), &pods, &defaults);
    assert!(skipped.is_empty());
    assert_eq!(
        eps,
        vec![
            ep("10.0.0.5:8000", "", None, ""),
            ep("10.0.0.6:8000", "", None, ""),
            ep("10.0.0.7:8000", "tcp://10.0.0.7:7000", None, "kv"),
        ]
    );
}

#[test]
fn each_target_port_asks_its_own_engine() {
    let pool = pool(json!({ "app": "vllm" }), &[8000, 8001]);
    let (eps, _) = endpoints_for(
        &pool,
        &[ready("a", "10.0.0.5")],
        &DiscoveryDefaults::default(),
    );
    assert_eq!(
        eps,
        vec![
            ep("10.0.0.5:8000", "", None, ""),
            ep("10.0.0.5:8001", "", None, ""),
        ]
    );
    // Still skipped for the usual reasons, and a bad annotation still is
    // one.
    let bad = annotated("b", "10.0.0.6", json!({ "kvasir.io/kv-events-port": "x" }));
    let (eps, skipped) = endpoints_for(&pool, &[bad], &DiscoveryDefaults::default());
    assert!(eps.is_empty());
    assert_eq!(skipped.len(), 1);
}
