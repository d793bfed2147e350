//! Parsing, validation and flags of the main configuration file.

use std::path::Path;

use super::schema::default_grpc_addr;
use super::*;
use crate::scoring::Weights;
use crate::types::IndexSource;

fn parse_ok(text: &str) -> Config {
    parse(text, Path::new("test.yaml")).unwrap()
}

fn err(cfg: &Config) -> String {
    cfg.validate().unwrap_err().to_string()
}

const BASIC: &str = r#"
pools:
  - name: a
    tokenizer: approx
    endpoints:
      - { address: "127.0.0.1:8001", events: "tcp://127.0.0.1:5557", replay: "tcp://127.0.0.1:5558" }
  - name: b
    tokenizer: render
    block_size: 32
    discovery: { namespace: ns, inferencePool: p, eventsPort: 6000 }
    scrape: { intervalMs: 500, timeoutMs: 100 }
    scoring: { prefill: 2.0, maxQueueSkew: 262144 }
"#;

#[test]
fn parses_yaml_with_defaults_and_aliases() {
    let cfg = parse_ok(BASIC);
    cfg.validate().unwrap();
    assert_eq!(cfg.grpc_addr, default_grpc_addr());
    assert_eq!(cfg.pools[0].block_size, 16);
    assert_eq!(cfg.pools[0].tokenizer, TokenizerSource::Approx);
    assert_eq!(cfg.pools[0].scrape.interval_ms, 250);
    assert_eq!(cfg.pools[1].block_size, 32);
    assert_eq!(cfg.pools[1].scoring.prefill, 2.0);
    assert_eq!(cfg.pools[1].scoring.decode, Weights::default().decode);
    assert_eq!(cfg.pools[0].scoring.max_queue_skew, None);
    assert_eq!(cfg.pools[1].scoring.max_queue_skew, Some(262_144.0));
    let d = cfg.pools[1].discovery.as_ref().unwrap();
    assert_eq!(d.defaults().events_port, 6000);
    assert_eq!(d.defaults().replay_port, None);
    assert!(
        !d.defaults().kv_event_sources,
        "eventsPort given: not asked"
    );
    let spec = cfg.pools[0].endpoints[0].to_spec();
    assert_eq!(spec.metrics_url(), "http://127.0.0.1:8001/metrics");
}

#[test]
fn parses_json_too() {
    let cfg = parse_ok(
        r#"{"grpcAddr":"0.0.0.0:1","pools":[{"name":"x","tokenizer":"approx",
               "endpoints":[{"address":"10.0.0.1:8000","kvEvents":"tcp://10.0.0.1:5557"}]}]}"#,
    );
    cfg.validate().unwrap();
    assert_eq!(cfg.grpc_addr.port(), 1);
}

#[test]
fn unknown_keys_are_rejected_with_location() {
    let e = parse(
        "pools:\n  - name: a\n    blokSize: 3\n",
        Path::new("f.yaml"),
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("blokSize") && msg.contains("line"), "{msg}");
}

#[test]
fn validation_errors_name_the_place() {
    let mut cfg = parse_ok(BASIC);
    cfg.pools[1].discovery = None;
    cfg.pools[1].endpoints.push(EndpointConfig {
        address: "localhost".into(),
        events: Some("tcp://127.0.0.1:1".into()),
        replay: None,
        metrics: None,
        topic: String::new(),
    });
    assert_eq!(
        err(&cfg),
        "pools[1].endpoints[0].address: not ip:port: `localhost`"
    );
    cfg.pools[1].endpoints[0].address = "127.0.0.1:9".into();
    cfg.pools[1].endpoints[0].events = Some("127.0.0.1:1".into());
    assert!(err(&cfg).starts_with("pools[1].endpoints[0].events: not a tcp://"));
    cfg.pools[1].endpoints[0].events = Some("tcp://127.0.0.1:1".into());
    cfg.pools[1].scrape.interval_ms = 50;
    assert!(err(&cfg).starts_with("pools[1].scrape.intervalMs: must be 100..=1000"));
    cfg.pools[1].scrape.interval_ms = 500;
    cfg.pools[1].name = "a".into();
    assert_eq!(err(&cfg), "pools[1].name: duplicate pool name `a`");
    cfg.pools[1].name = "b".into();
    cfg.pools[1].scoring.decode = -1.0;
    assert!(
        err(&cfg).starts_with("pools[1].scoring.decode:"),
        "{}",
        err(&cfg)
    );
    cfg.pools[1].scoring = Weights::default();
    cfg.pools[1].scoring.max_queue_skew = Some(-1.0);
    assert!(
        err(&cfg).starts_with("pools[1].scoring.maxQueueSkew:"),
        "{}",
        err(&cfg)
    );
    cfg.pools[1].scoring = Weights::default();
    cfg.pools[1].tokenizer = TokenizerSource::Dir("/nonexistent".into());
    assert!(
        err(&cfg).starts_with("pools[1].tokenizer: `/nonexistent` is not a tokenizer directory")
    );
    cfg.pools[1].tokenizer = TokenizerSource::Render;
    cfg.validate().unwrap();
    cfg.pools[0].discovery = cfg.pools[0].discovery.clone().or(Some(DiscoveryConfig {
        namespace: "n".into(),
        inference_pool: "p".into(),
        kv_event_sources: None,
        events_port: Some(1),
        replay_port: None,
        topic: String::new(),
    }));
    assert_eq!(
        err(&cfg),
        "pools[0]: give either endpoints or discovery, not both"
    );
}

const PICKS: &str = r#"
pools:
  - name: a
    index: picks
    pickHistoryBlocks: 1000
    tokenizer: render
    endpoints:
      - { address: "127.0.0.1:8001" }
      - { address: "127.0.0.1:8002", events: "tcp://127.0.0.1:5557" }
  - name: b
    index: events
    pick_history_blocks: 7
    endpoints:
      - { address: "127.0.0.1:8003", events: "tcp://127.0.0.1:5559" }
  - name: c
    index: picks
    discovery: { namespace: ns, inferencePool: p }
"#;

#[test]
fn index_source_and_pick_history_blocks() {
    let basic = parse_ok(BASIC);
    assert_eq!(basic.pools[0].index, IndexSource::Events, "default");
    assert_eq!(basic.pools[0].pick_history_blocks, 25_000);
    let cfg = parse_ok(PICKS);
    cfg.validate().unwrap();
    assert_eq!(cfg.pools[0].index, IndexSource::Picks);
    assert_eq!(cfg.pools[0].pick_history_blocks, 1000);
    assert_eq!(cfg.pools[1].index, IndexSource::Events);
    assert_eq!(cfg.pools[1].pick_history_blocks, 7, "snake_case accepted");
    assert_eq!(cfg.pools[2].index, IndexSource::Picks);
    assert_eq!(cfg.pools[0].endpoints[0].events, None);
    let spec = cfg.pools[0].endpoints[0].to_spec();
    assert_eq!(spec.kv_events, "");
    assert_eq!(spec.metrics_url(), "http://127.0.0.1:8001/metrics");

    // Without events (index events) the engine is asked; a replay or
    // topic written next to no events would never be used. Events are
    // checked for form when given with picks.
    let mut asked = cfg.clone();
    asked.pools[1].endpoints[0].events = None;
    asked.pools[1].endpoints[0].replay = None;
    asked.validate().unwrap();
    let mut bad = asked.clone();
    bad.pools[1].endpoints[0].replay = Some("tcp://127.0.0.1:1".into());
    assert_eq!(
        err(&bad),
        "pools[1].endpoints[0].replay: needs events: without an events address the engine's own /kv_event_sources gives its events, replay and topic"
    );
    let mut bad = asked.clone();
    bad.pools[1].endpoints[0].topic = "kv".into();
    assert!(err(&bad).starts_with("pools[1].endpoints[0].topic: needs events"));
    let mut bad = cfg.clone();
    bad.pools[0].endpoints[0].events = Some("127.0.0.1:1".into());
    assert!(err(&bad).starts_with("pools[0].endpoints[0].events: not a tcp://"));
    let mut bad = cfg.clone();
    bad.pools[0].endpoints[0].replay = Some("nope".into());
    assert!(err(&bad).starts_with("pools[0].endpoints[0].replay: not a tcp://"));
    let mut bad = cfg.clone();
    bad.pools[1].pick_history_blocks = 0;
    assert_eq!(err(&bad), "pools[1].pickHistoryBlocks: must be at least 1");

    // An unknown source is a parse error naming the key and the line.
    let e = parse("pools:\n  - name: a\n    index: kv\n", Path::new("f.yaml"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("pools[0].index") && e.contains("`events` or `picks`") && e.contains("line 3"),
        "{e}"
    );
    // Round trip.
    let text = serde_yaml::to_string(&cfg).unwrap();
    assert!(text.contains("index: picks"), "{text}");
    assert_eq!(parse_ok(&text), cfg);
}

#[test]
fn index_flags_apply_to_flag_pools() {
    let args = Args {
        endpoints: vec![
            "pool=p,address=127.0.0.1:8001".into(),
            "pool=p,address=127.0.0.1:8002,events=tcp://127.0.0.1:5559".into(),
        ],
        tokenizer: Some("approx".into()),
        index: Some("picks".into()),
        pick_history_blocks: Some(500),
        ..Default::default()
    };
    let cfg = Config::from_args(&args).unwrap();
    assert_eq!(cfg.pools[0].index, IndexSource::Picks);
    assert_eq!(cfg.pools[0].pick_history_blocks, 500);
    assert_eq!(cfg.pools[0].endpoints[0].events, None);
    assert_eq!(
        cfg.pools[0].endpoints[1].events.as_deref(),
        Some("tcp://127.0.0.1:5559")
    );

    // With index events, an endpoint without events asks its engine.
    let no_events = Args {
        index: None,
        ..args.clone()
    };
    let cfg = Config::from_args(&no_events).unwrap();
    assert_eq!(cfg.pools[0].index, IndexSource::Events);
    assert_eq!(cfg.pools[0].endpoints[0].to_spec().kv_events, "");
    let bad = Args {
        index: Some("kv".into()),
        ..args.clone()
    };
    assert_eq!(
        Config::from_args(&bad).unwrap_err().to_string(),
        "--index: `kv` is not an index source (expected events or picks)"
    );
    let zero = Args {
        pick_history_blocks: Some(0),
        ..args.clone()
    };
    assert_eq!(
        Config::from_args(&zero).unwrap_err().to_string(),
        "--pick-history-blocks: must be at least 1"
    );

    // The flags shape only pools the flags create; an endpoint added to
    // a file's pool follows that pool's index.
    let mut file = parse_ok(PICKS);
    let add = Args {
        endpoints: vec![
            "pool=a,address=127.0.0.1:8009".into(),
            "pool=b,address=127.0.0.1:8010".into(),
        ],
        index: Some("events".into()),
        ..Default::default()
    };
    file.apply_args(&add).unwrap();
    assert_eq!(file.pools[0].index, IndexSource::Picks);
    assert_eq!(file.pools[0].endpoints.len(), 3);
    assert_eq!(file.pools[1].index, IndexSource::Events);
    assert_eq!(file.pools[1].endpoints.last().unwrap().events, None);
}

#[test]
fn endpoint_flags_make_pools() {
    let args = Args {
        endpoints: vec![
            "pool=p,address=127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558"
                .into(),
            "pool=p,address=127.0.0.1:8002,events=tcp://127.0.0.1:5559".into(),
        ],
        tokenizer: Some("approx".into()),
        grpc_addr: Some("127.0.0.1:1234".parse().unwrap()),
        ..Default::default()
    };
    let cfg = Config::from_args(&args).unwrap();
    assert_eq!(cfg.grpc_addr.port(), 1234);
    assert_eq!(cfg.pools.len(), 1);
    assert_eq!(cfg.pools[0].endpoints.len(), 2);
    assert_eq!(
        cfg.pools[0].endpoints[0].replay.as_deref(),
        Some("tcp://127.0.0.1:5558")
    );
    assert_eq!(cfg.pools[0].tokenizer, TokenizerSource::Approx);

    let bad = Args {
        endpoints: vec!["pool=p,adress=1".into()],
        ..Default::default()
    };
    let e = Config::from_args(&bad).unwrap_err().to_string();
    assert!(
        e.starts_with("--endpoint[0] `pool=p,adress=1`: unknown key `adress`"),
        "{e}"
    );
    let none = Config::from_args(&Args::default()).unwrap_err().to_string();
    assert!(none.starts_with("pools: no pools configured"), "{none}");
}

#[test]
fn discovery_reads_engine_sources_unless_a_port_is_given() {
    let pool = |d: &str| {
        format!("pools:\n  - name: p\n    discovery: {{ namespace: n, inferencePool: p{d} }}\n")
    };
    let discovery = |text: &str| {
        let cfg = parse_ok(text);
        cfg.validate()
            .map(|()| cfg.pools[0].discovery.clone().unwrap())
    };
    let d = discovery(&pool("")).unwrap();
    assert!(d.reads_engine_sources(), "default: the engines say");
    assert_eq!(
        d.defaults().events_port,
        5557,
        "the fallback when not asked"
    );
    for given in [
        ", eventsPort: 6000",
        ", replayPort: 6001",
        ", kvEventSources: false",
    ] {
        let d = discovery(&pool(given)).unwrap();
        assert!(!d.reads_engine_sources(), "{given}");
    }
    let d = discovery(&pool(", kv_event_sources: false, eventsPort: 6000")).unwrap();
    assert_eq!(d.defaults().events_port, 6000);
    assert!(discovery(&pool(", kvEventSources: true"))
        .unwrap()
        .reads_engine_sources());
    // Set both ways, the ports would never be used: refused by name.
    for (given, key) in [
        (", kvEventSources: true, eventsPort: 6000", "eventsPort"),
        (", kvEventSources: true, replayPort: 6001", "replayPort"),
        (", kvEventSources: true, topic: kv", "topic"),
    ] {
        let e = discovery(&pool(given)).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "pools[0].discovery.{key}: unused with kvEventSources: true"
            )),
            "{e}"
        );
    }
    let e = discovery(&pool(", eventsPort: 0")).unwrap_err().to_string();
    assert_eq!(e, "pools[0].discovery.eventsPort: must be 1..=65535");
}
