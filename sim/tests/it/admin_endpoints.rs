//! The admin endpoints that change the engine at run time (`/sim/faults`,
//! `/sim/clear-cache`, `/sim/restart-events`) exist only with
//! `--enable-sim-admin`: without it they are 404 as any unknown path, so a
//! simulator started without the flag cannot be made to fail or stall by
//! whoever reaches its port. Two servers on 127.0.0.1 ports the kernel
//! chooses, with the Qwen3 tokenizer of `.tools/`.

use clap::Parser;
use std::path::PathBuf;
use std::time::{Duration, Instant};

async fn start(extra: &[&str]) -> String {
    let tok = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.tools/tokenizers/qwen3");
    let mut argv = vec![
        "vllm-sim",
        "--tokenizer",
        tok.to_str().expect("utf-8 path"),
        "--kv-events-config",
        r#"{"enable_kv_cache_events": false}"#,
        "--profile",
        "zero",
        "--time-scale",
        "0",
    ];
    argv.extend_from_slice(extra);
    let args = vllm_sim::config::Args::parse_from(argv);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        if let Err(e) = vllm_sim::serve_on(args, listener).await {
            panic!("vllm-sim failed: {e:#}");
        }
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(r) = reqwest::get(format!("{base}/health")).await {
            if r.status().is_success() {
                return base;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("vllm-sim did not come up in 20 s");
}

async fn status(method: &str, url: String) -> u16 {
    let c = reqwest::Client::new();
    let req = match method {
        "GET" => c.get(&url),
        _ => c
            .post(&url)
            .header("content-type", "application/json")
            .body(r#"{"fail_rate": 0.0}"#),
    };
    req.send().await.expect("request").status().as_u16()
}

const ADMIN: [(&str, &str); 4] = [
    ("GET", "/sim/faults"),
    ("POST", "/sim/faults"),
    ("POST", "/sim/clear-cache"),
    ("POST", "/sim/restart-events"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_need_the_flag() {
    let plain = start(&[]).await;
    let admin = start(&["--enable-sim-admin"]).await;
    for (method, path) in ADMIN {
        assert_eq!(
            status(method, format!("{plain}{path}")).await,
            404,
            "{method} {path} without --enable-sim-admin"
        );
        assert_eq!(
            status(method, format!("{admin}{path}")).await,
            200,
            "{method} {path} with --enable-sim-admin"
        );
    }
    // What only reads stays: the socket addresses, vLLM's own routes.
    for base in [&plain, &admin] {
        assert_eq!(status("GET", format!("{base}/sim/info")).await, 200);
        assert_eq!(status("GET", format!("{base}/v1/models")).await, 200);
    }
}
