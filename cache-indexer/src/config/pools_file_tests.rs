//! The pools file: paths, merging, and errors naming the file.

use super::*;
use std::sync::{Arc, Mutex};

use crate::config::{load_file, Args, TokenizerSource};

/// A directory under the temp dir, unique to one test, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(test: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        let dir = std::env::temp_dir().join(format!(
            "kvasir-pools-file-{test}-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const MAIN: &str = r#"
grpcAddr: 127.0.0.1:50051
poolsFile: pools/pools.yaml
pools:
  - name: inline
    tokenizer: approx
    endpoints:
      - { address: "127.0.0.1:8001", events: "tcp://127.0.0.1:5557" }
"#;

const POOLS: &str = r#"
pools:
  - name: main
    model: llama-3.1-8b-instruct
    blockSize: 32
    tokenizer: render
    discovery: { namespace: serving, inferencePool: main, eventsPort: 6000, replayPort: 6001, topic: kv }
  - name: small
    discovery: { namespace: serving, inferencePool: small-pool }
"#;

fn setup(test: &str, pools: Option<&str>) -> (TempDir, PathBuf) {
    let dir = TempDir::new(test);
    std::fs::create_dir_all(dir.0.join("pools")).unwrap();
    if let Some(text) = pools {
        dir.write("pools/pools.yaml", text);
    }
    let main = dir.write("indexer.yaml", MAIN);
    (dir, main)
}

fn from_file(path: &Path) -> Result<Config, ConfigError> {
    Config::from_args(&Args {
        config: Some(path.to_path_buf()),
        ..Args::default()
    })
}

#[test]
fn pools_file_pools_are_added_after_the_inline_ones() {
    let (_dir, main) = setup("merge", Some(POOLS));
    let cfg = from_file(&main).unwrap();
    let names: Vec<&str> = cfg.pools.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["inline", "main", "small"]);
    assert_eq!(cfg.pools[1].block_size, 32);
    assert_eq!(cfg.pools[1].tokenizer, TokenizerSource::Render);
    let d = cfg.pools[1].discovery.as_ref().unwrap();
    assert_eq!((d.events_port, d.replay_port), (Some(6000), Some(6001)));
    assert!(!d.reads_engine_sources(), "ports written down are honoured");
    assert_eq!(d.topic, "kv");
    let d = cfg.pools[2].discovery.as_ref().unwrap();
    assert_eq!(d.inference_pool, "small-pool");
    assert_eq!((d.events_port, d.replay_port), (None, None));
    assert!(d.reads_engine_sources(), "no port given: the engines say");
    assert_eq!(d.defaults().events_port, 5557);
    assert_eq!(cfg.pools[2].block_size, 16);
}

#[test]
fn absolute_and_relative_paths() {
    let rel = resolve(
        Path::new("/etc/kvasir/indexer.yaml"),
        Path::new("p/pools.yaml"),
    );
    assert_eq!(rel, Path::new("/etc/kvasir/p/pools.yaml"));
    let abs = resolve(
        Path::new("/etc/kvasir/indexer.yaml"),
        Path::new("/x/pools.yaml"),
    );
    assert_eq!(abs, Path::new("/x/pools.yaml"));
    assert_eq!(
        resolve(Path::new("indexer.yaml"), Path::new("pools.yaml")),
        Path::new("pools.yaml")
    );

    let (dir, _) = setup("absolute", None);
    let pools = dir.write("elsewhere.yaml", POOLS);
    let main = dir.write(
        "abs.yaml",
        &MAIN.replace("pools/pools.yaml", &pools.display().to_string()),
    );
    assert_eq!(from_file(&main).unwrap().pools.len(), 3);
}

#[test]
fn a_name_in_both_files_is_an_error_naming_both_places() {
    let (dir, main) = setup("dup", Some(&POOLS.replace("name: small", "name: inline")));
    let e = from_file(&main).unwrap_err().to_string();
    let pools = dir.0.join("pools/pools.yaml");
    assert_eq!(
            e,
            format!(
                "{}: pools[1].name: pool `inline` is also in {} at pools[0]; a name may be in one file only",
                pools.display(),
                main.display()
            )
        );

    let (dir, main) = setup(
        "dup-in-file",
        Some(&POOLS.replace("name: small", "name: main")),
    );
    let e = from_file(&main).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "{}: pools[1].name: duplicate pool name `main` (also pools[0])",
            dir.0.join("pools/pools.yaml").display()
        )
    );
}

/// Log lines, captured for one test.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_missing_pools_file_starts_with_the_inline_pools_and_a_warning() {
    let (_dir, main) = setup("missing", None);
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let cfg = tracing::subscriber::with_default(subscriber, || from_file(&main)).unwrap();
    assert_eq!(cfg.pools.len(), 1);
    assert_eq!(cfg.pools[0].name, "inline");
    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(
        text.contains("WARN")
            && text.contains("poolsFile not found")
            && text.contains("pools.yaml"),
        "{text}"
    );

    // With no inline pools the indexer still starts: the controller's
    // file (or its roll) brings the pools.
    let (dir, _) = setup("missing-no-inline", None);
    let main = dir.write("bare.yaml", "poolsFile: pools/pools.yaml\n");
    assert!(from_file(&main).unwrap().pools.is_empty());
    let empty = dir.write("pools/pools.yaml", "");
    assert!(from_file(&main).unwrap().pools.is_empty(), "{empty:?}");
    dir.write("pools/pools.yaml", "pools: []\n");
    assert!(from_file(&main).unwrap().pools.is_empty());
    // Without a poolsFile, no pools is still an error.
    let none = dir.write("none.yaml", "grpcAddr: 127.0.0.1:1\n");
    assert!(from_file(&none)
        .unwrap_err()
        .to_string()
        .starts_with("pools: no pools configured"));
}

#[test]
fn a_bad_pools_file_is_an_error_with_the_file_and_field() {
    let (dir, main) = setup("bad", Some(&POOLS.replace("blockSize: 32", "blockSize: 0")));
    let pools = dir.0.join("pools/pools.yaml");
    assert_eq!(
        from_file(&main).unwrap_err().to_string(),
        format!("{}: pools[0].blockSize: must be 1..=1024", pools.display())
    );

    dir.write(
        "pools/pools.yaml",
        &POOLS.replace("eventsPort: 6000", "eventsPort: x"),
    );
    let e = from_file(&main).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("parsing config file {}:", pools.display()))
            && e.contains("pools[0].discovery.eventsPort")
            && e.contains("line 7"),
        "{e}"
    );
    dir.write("pools/pools.yaml", "pool: []\n");
    let e = from_file(&main).unwrap_err().to_string();
    assert!(e.contains("unknown field `pool`"), "{e}");

    // Unreadable: a directory where the file should be.
    std::fs::remove_file(&pools).unwrap();
    std::fs::create_dir(&pools).unwrap();
    let e = from_file(&main).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("reading config file {}:", pools.display())),
        "{e}"
    );
}

#[test]
fn load_file_adds_the_pools_without_validating_the_rest() {
    let (_dir, main) = setup("load", Some(POOLS));
    let cfg = load_file(&main).unwrap();
    assert_eq!(cfg.pools.len(), 3);
    assert_eq!(
        cfg.pools_file.as_deref(),
        Some(Path::new("pools/pools.yaml"))
    );
}
