//! The indexer parses exactly what the controller writes: kvasir-api's
//! `indexer_pools(..).to_yaml()` as the `poolsFile` of a main config.

use std::path::PathBuf;

use kvasir_api::indexer::{
    indexer_pools, BLOCK_SIZE_ANNOTATION, KV_EVENTS_PORT_ANNOTATION, KV_EVENTS_TOPIC_ANNOTATION,
    KV_REPLAY_PORT_ANNOTATION, POOLS_KEY,
};
use kvasir_api::{InferencePool, Resources, INDEXER_POOL_ANNOTATION, MODELS_ANNOTATION};
use kvasir_cache_indexer::config::{Args, Config, TokenizerSource};

/// A directory of its own under the temp dir, removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn the_indexer_loads_the_pools_kvasir_api_writes() {
    let res = Resources {
        namespace: "serving".into(),
        pools: vec![
            InferencePool::annotated(
                "small",
                &[
                    (MODELS_ANNOTATION, "llama-3.2-1b-instruct"),
                    (BLOCK_SIZE_ANNOTATION, "32"),
                    (KV_EVENTS_PORT_ANNOTATION, "6000"),
                    (KV_REPLAY_PORT_ANNOTATION, "none"),
                    (KV_EVENTS_TOPIC_ANNOTATION, "kv"),
                ],
            ),
            InferencePool::annotated(
                "main-pool",
                &[
                    (MODELS_ANNOTATION, "llama-3.1-8b-instruct,llama-3.1-8b"),
                    (INDEXER_POOL_ANNOTATION, "main"),
                ],
            ),
        ],
        ..Resources::default()
    };
    let yaml = indexer_pools(&res).unwrap().to_yaml();

    let dir = TempDir(std::env::temp_dir().join(format!(
        "kvasir-config-pools-file-{}-{:?}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
    )));
    // The layout of the Deployment: the pools ConfigMap mounted in a
    // directory next to the main file.
    std::fs::create_dir_all(dir.0.join("pools")).unwrap();
    std::fs::write(dir.0.join("pools").join(POOLS_KEY), &yaml).unwrap();
    let main = dir.0.join("indexer.yaml");
    std::fs::write(
        &main,
        format!("grpcAddr: 127.0.0.1:50051\npoolsFile: pools/{POOLS_KEY}\n"),
    )
    .unwrap();

    let cfg = Config::from_args(&Args {
        config: Some(main),
        ..Args::default()
    })
    .unwrap();
    assert_eq!(cfg.pools.len(), 2, "{yaml}");

    let main = &cfg.pools[0];
    assert_eq!(main.name, "main");
    assert_eq!(main.model, "llama-3.1-8b-instruct");
    assert_eq!(main.block_size, 16);
    assert_eq!(main.tokenizer, TokenizerSource::Render);
    assert!(main.endpoints.is_empty());
    let d = main.discovery.as_ref().unwrap();
    assert_eq!(d.namespace, "serving");
    assert_eq!(d.inference_pool, "main-pool");
    // No KV-event annotation: no ports written, the engines' own
    // /kv_event_sources tells.
    assert_eq!((d.events_port, d.replay_port), (None, None));
    assert_eq!(d.topic, "");
    assert!(d.reads_engine_sources());

    let small = &cfg.pools[1];
    assert_eq!(small.name, "small");
    assert_eq!(small.model, "llama-3.2-1b-instruct");
    assert_eq!(small.block_size, 32);
    assert_eq!(small.tokenizer, TokenizerSource::Render);
    let d = small.discovery.as_ref().unwrap();
    assert_eq!(d.namespace, "serving");
    assert_eq!(d.inference_pool, "small");
    assert_eq!((d.events_port, d.replay_port), (Some(6000), None));
    assert_eq!(d.topic, "kv");
    assert!(!d.reads_engine_sources());
}
