//! `kvasir-bench streams`: held streams through a proxy
//! ([`kvasir_bench::streams`]), summed up as JSON.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use kvasir_bench::streams::{self, StreamsConfig};

#[derive(Args)]
pub(crate) struct StreamsArgs {
    /// Base URL of the proxy.
    #[arg(long, default_value = "http://127.0.0.1:10000")]
    url: String,
    /// Model to ask for.
    #[arg(long, default_value = "Qwen/Qwen3-8B")]
    model: String,
    /// An API key (repeatable): the clients take them in turn.
    #[arg(long = "key", required = true)]
    keys: Vec<String>,
    /// Clients, each holding one stream at a time.
    #[arg(long)]
    concurrency: usize,
    /// Seconds the clients keep sending.
    #[arg(long, default_value_t = 30.0)]
    duration_s: f64,
    /// Completion tokens per request.
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Words of each request's prompt.
    #[arg(long, default_value_t = 200)]
    prompt_words: usize,
    /// Seconds after which a request counts as timed out.
    #[arg(long, default_value_t = 120.0)]
    timeout_s: f64,
    /// Where the summary goes (JSON); also printed.
    #[arg(long)]
    out: Option<PathBuf>,
}

pub(crate) async fn streams_cmd(a: StreamsArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.concurrency > 0, "--concurrency must be at least 1");
    let summary = streams::run(StreamsConfig {
        url: a.url,
        model: a.model,
        keys: a.keys,
        concurrency: a.concurrency,
        duration: Duration::from_secs_f64(a.duration_s.max(0.0)),
        max_tokens: a.max_tokens,
        prompt_words: a.prompt_words,
        request_timeout: Duration::from_secs_f64(a.timeout_s.max(0.1)),
    })
    .await?;
    let text = serde_json::to_string_pretty(&summary)?;
    if let Some(p) = &a.out {
        std::fs::write(p, &text)?;
    }
    println!("{text}");
    Ok(())
}
