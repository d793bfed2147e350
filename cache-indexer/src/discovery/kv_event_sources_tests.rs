use super::*;

/// What vLLM 0.34 writes for one rank: every field of `KVEventsConfig`, as
/// `ZmqEventPublisher` resolved it (ports offset by the rank), the rank as
/// a string key.
fn vllm_rank(endpoint: &str, replay: Option<&str>, topic: &str) -> serde_json::Value {
    serde_json::json!({
        "enable_kv_cache_events": true,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": replay,
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": topic,
    })
}

fn body(v: &serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap()
}

#[test]
fn one_rank_with_replay_and_wildcard_host() {
    let b = body(&serde_json::json!({
        "0": vllm_rank("tcp://*:5557", Some("tcp://*:5558"), "kv")
    }));
    let ranks = parse_kv_event_sources(&b).unwrap();
    assert_eq!(
        ranks,
        [RankSource {
            rank: 0,
            publisher: "zmq".into(),
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: Some("tcp://*:5558".into()),
            topic: "kv".into(),
        }]
    );
    let r = resolve_source(&ranks, "10.0.0.7").unwrap();
    assert_eq!(r.kv_events, "tcp://10.0.0.7:5557");
    assert_eq!(r.replay.as_deref(), Some("tcp://10.0.0.7:5558"));
    assert_eq!(
        (r.rank, r.ranks.clone(), r.topic.as_str()),
        (0, vec![0], "kv")
    );
}

#[test]
fn vllm_defaults_have_no_replay_and_an_empty_topic() {
    let b = br#"{"0": {"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": "tcp://*:5557", "replay_endpoint": null, "buffer_steps": 10000,
        "hwm": 100000, "max_queue_size": 100000, "topic": ""}}"#;
    let r = resolve_source(&parse_kv_event_sources(b).unwrap(), "10.0.0.7").unwrap();
    assert_eq!(r.kv_events, "tcp://10.0.0.7:5557");
    assert_eq!((r.replay, r.topic.as_str()), (None, ""));
}

#[test]
fn data_parallel_ranks_follow_the_lowest() {
    // vLLM offsets each rank's ports by the rank before advertising them;
    // keys arrive in any order and "10" sorts after "2" numerically.
    let b = body(&serde_json::json!({
        "10": vllm_rank("tcp://*:5567", Some("tcp://*:5578"), ""),
        "2": vllm_rank("tcp://*:5559", Some("tcp://*:5570"), ""),
        "0": vllm_rank("tcp://*:5557", Some("tcp://*:5568"), ""),
        "1": vllm_rank("tcp://*:5558", Some("tcp://*:5569"), ""),
    }));
    let ranks = parse_kv_event_sources(&b).unwrap();
    let order: Vec<u32> = ranks.iter().map(|r| r.rank).collect();
    assert_eq!(order, [0, 1, 2, 10]);
    let r = resolve_source(&ranks, "10.0.0.7").unwrap();
    assert_eq!((r.rank, r.ranks), (0, vec![0, 1, 2, 10]));
    assert_eq!(r.kv_events, "tcp://10.0.0.7:5557");
    assert_eq!(r.replay.as_deref(), Some("tcp://10.0.0.7:5568"));
}

#[test]
fn an_external_lb_server_advertises_only_its_own_rank() {
    let b = body(&serde_json::json!({ "3": vllm_rank("tcp://*:5560", None, "") }));
    let r = resolve_source(&parse_kv_event_sources(&b).unwrap(), "10.0.0.9").unwrap();
    assert_eq!((r.rank, r.kv_events.as_str()), (3, "tcp://10.0.0.9:5560"));
}

#[test]
fn events_disabled_is_an_empty_object() {
    let ranks = parse_kv_event_sources(b"{}").unwrap();
    assert!(ranks.is_empty());
    assert_eq!(
        resolve_source(&ranks, "10.0.0.7"),
        Err(ResolveError::Disabled)
    );
}

#[test]
fn wildcard_hosts_map_to_the_engine_and_others_are_kept() {
    for wild in [
        "tcp://*:5557",
        "tcp://0.0.0.0:5557",
        "tcp://[::]:5557",
        "tcp://:::5557",
    ] {
        assert_eq!(
            subscribe_address(wild, "10.1.2.3").as_deref(),
            Ok("tcp://10.1.2.3:5557"),
            "{wild}"
        );
        assert_eq!(
            subscribe_address(wild, "fd00::5").as_deref(),
            Ok("tcp://[fd00::5]:5557"),
            "{wild}"
        );
    }
    // `tcp://*:0` is advertised as the node IP and the bound port: kept.
    assert_eq!(
        subscribe_address("tcp://10.9.9.9:41234", "10.1.2.3").as_deref(),
        Ok("tcp://10.9.9.9:41234")
    );
    assert_eq!(
        subscribe_address("tcp://[fd00::9]:5557", "10.1.2.3").as_deref(),
        Ok("tcp://[fd00::9]:5557")
    );
}

#[test]
fn endpoints_the_indexer_cannot_reach_are_refused() {
    assert!(subscribe_address("ipc:///tmp/kv", "h").is_err());
    assert!(subscribe_address("inproc://cache_dp1", "h").is_err());
    assert!(subscribe_address("udp://*:5557", "h").is_err());
    assert!(subscribe_address("tcp://*", "h").is_err());
    assert!(subscribe_address("tcp://*:0", "h").is_err());
    assert!(subscribe_address("tcp://*:99999", "h").is_err());
    let ipc = vec![RankSource {
        rank: 0,
        publisher: "zmq".into(),
        endpoint: "ipc:///tmp/kv".into(),
        replay_endpoint: None,
        topic: String::new(),
    }];
    assert!(matches!(
        resolve_source(&ipc, "h"),
        Err(ResolveError::Endpoint { rank: 0, .. })
    ));
}

#[test]
fn an_unreachable_replay_endpoint_is_dropped_not_fatal() {
    let b = body(&serde_json::json!({
        "0": vllm_rank("tcp://*:5557", Some("ipc:///tmp/replay"), "")
    }));
    let r = resolve_source(&parse_kv_event_sources(&b).unwrap(), "10.0.0.7").unwrap();
    assert_eq!(r.replay, None);
    assert_eq!(r.unusable_replay.as_deref(), Some("ipc:///tmp/replay"));
}

#[test]
fn a_plugin_publisher_is_skipped() {
    let mut other = vllm_rank("tcp://*:6000", None, "");
    other["publisher"] = "custom".into();
    let b = body(&serde_json::json!({ "0": other.clone() }));
    assert_eq!(
        resolve_source(&parse_kv_event_sources(&b).unwrap(), "h"),
        Err(ResolveError::NoZmq("custom".into()))
    );
    let b = body(&serde_json::json!({ "0": other, "1": vllm_rank("tcp://*:5558", None, "") }));
    let r = resolve_source(&parse_kv_event_sources(&b).unwrap(), "h").unwrap();
    assert_eq!((r.rank, r.kv_events.as_str()), (1, "tcp://h:5558"));
}

#[test]
fn malformed_answers_are_errors_not_panics() {
    for bad in [
        &b"not json"[..],
        b"[]",
        b"null",
        b"{\"0\": 5}",
        b"{\"0\": {\"endpoint\": 5}}",
        b"{\"x\": {\"endpoint\": \"tcp://*:1\"}}",
        b"{\"-1\": {\"endpoint\": \"tcp://*:1\"}}",
        b"{\"0\": {\"publisher\": \"zmq\"}}",
        b"{\"0\": {\"endpoint\": \"\"}}",
        b"",
    ] {
        assert!(
            parse_kv_event_sources(bad).is_err(),
            "{}",
            String::from_utf8_lossy(bad)
        );
    }
    // Unknown fields from a newer vLLM are fine.
    let newer = br#"{"0": {"endpoint": "tcp://*:5557", "new_field": [1, 2]}}"#;
    assert_eq!(parse_kv_event_sources(newer).unwrap()[0].publisher, "zmq");
}

#[test]
fn host_of_http_addresses() {
    assert_eq!(host_of("10.0.0.5:8000"), "10.0.0.5");
    assert_eq!(host_of("[fd00::1]:8000"), "fd00::1");
    assert_eq!(host_of("engine-0:8000"), "engine-0");
    assert_eq!(
        subscribe_address("tcp://*:5557", &host_of("[fd00::1]:8000")).as_deref(),
        Ok("tcp://[fd00::1]:5557")
    );
}

#[test]
fn error_kinds_for_metrics() {
    let url = String::from("http://e/kv_event_sources");
    let disabled = SourceError::Unusable {
        url: url.clone(),
        source: ResolveError::Disabled,
    };
    assert_eq!(disabled.kind(), "disabled");
    assert!(disabled.withdraws());
    let down = SourceError::Unreachable {
        url,
        message: "refused".into(),
    };
    assert_eq!(down.kind(), "unreachable");
    assert!(!down.withdraws());
}
