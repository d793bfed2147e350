//! Ingest and pick-side benchmark of the KV-event path (not a test).
//!
//! ```text
//! cargo run --release -p kvasir-cache-indexer --example ingest_bench [-- --quick]
//! ```
//!
//! Prints one JSON document:
//! * `ingest`: decode + apply throughput on one caller thread (the index's
//!   tree writer thread runs beside it) for realistic batches: one
//!   `BlockStored` of 125 blocks x 16 tokens per batch, vLLM's map layout,
//!   uint64 hashes, chains of two events linked by parent hash; a store-only
//!   phase and a steady-state phase where each batch also evicts an old
//!   chain. Wall-clock blocks/s (until the tree has applied everything) and
//!   blocks per CPU-second of the whole process.
//! * `memory`: RSS growth per indexed block for 8 endpoints x 25k distinct
//!   blocks.
//! * `overlap`: `PoolIndex::overlap` latency (hashing included) for 4k- and
//!   32k-token requests against 8 and 64 endpoints of ~25k blocks each, p50 /
//!   p99 in microseconds.

#[path = "../tests/it/testkit/mod.rs"]
mod testkit;

use kvasir_cache_indexer::events::decode::decode_batch;
use kvasir_cache_indexer::index::PoolIndex;
use kvasir_cache_indexer::types::EndpointId;
use serde_json::json;
use std::time::Instant;
use testkit::{vllm_payload, Rng};

const BS: u32 = testkit::BLOCK_SIZE;
const EVENT_BLOCKS: usize = 125;

/// Token ids of a realistic spread (1-, 2-, 3- and 5-byte msgpack ints).
fn tokens(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| (rng.next() % 151_936) as u32).collect()
}

/// Process CPU time (user + system, all threads) in seconds.
fn cpu_seconds() -> f64 {
    let s = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are the
    // 14th and 15th fields overall.
    let rest = s.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // Linux's USER_HZ is 100 on every mainstream architecture.
    (tick(11) + tick(12)) / 100.0
}

/// CPU time of the calling thread only, in seconds.
fn thread_cpu_seconds() -> f64 {
    let s = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    let rest = s.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Pre-encodes `chains` two-event chains spread over 8 endpoints; with
/// `evict_after = Some(w)`, chain `c`'s two batches also remove the blocks of
/// chain `c - w` (a full cache evicting as it stores).
fn workload(
    rng: &mut Rng,
    chains: usize,
    evict_after: Option<usize>,
) -> Vec<(u64, Vec<u8>, usize)> {
    let mut out = Vec::with_capacity(chains * 2);
    let mut history: Vec<Vec<u64>> = Vec::new();
    for c in 0..chains {
        let ep = (c % 8) as u64;
        let hashes: Vec<u64> = (0..2 * EVENT_BLOCKS).map(|_| rng.next()).collect();
        let toks = tokens(rng, 2 * EVENT_BLOCKS * BS as usize);
        let split = EVENT_BLOCKS * BS as usize;
        let evict = evict_after
            .filter(|w| c >= *w)
            .map(|w| history[c - w].clone());
        let (a, b) = evict
            .as_ref()
            .map(|e| (Some(&e[..EVENT_BLOCKS]), Some(&e[EVENT_BLOCKS..])))
            .unwrap_or((None, None));
        out.push((
            ep,
            vllm_payload(Some((&hashes[..EVENT_BLOCKS], None, &toks[..split])), a),
            EVENT_BLOCKS,
        ));
        out.push((
            ep,
            vllm_payload(
                Some((
                    &hashes[EVENT_BLOCKS..],
                    Some(hashes[EVENT_BLOCKS - 1]),
                    &toks[split..],
                )),
                b,
            ),
            EVENT_BLOCKS,
        ));
        history.push(hashes);
    }
    out
}

fn ingest(name: &str, work: &[(u64, Vec<u8>, usize)]) -> serde_json::Value {
    let index = PoolIndex::new(BS);
    let blocks: usize = work.iter().map(|w| w.2).sum();
    let bytes: usize = work.iter().map(|w| w.1.len()).sum();

    // Decode alone.
    let t = Instant::now();
    let mut n = 0usize;
    for (_, p, _) in work {
        n += decode_batch(p).map(|b| b.events.len()).unwrap_or(0);
    }
    let decode_s = t.elapsed().as_secs_f64();
    assert!(n >= work.len());

    // Decode + apply, then wait for the tree to have applied everything.
    let cpu0 = cpu_seconds();
    let caller_cpu0 = thread_cpu_seconds();
    let t = Instant::now();
    for (ep, p, _) in work {
        match decode_batch(p) {
            Ok(b) => {
                index.apply(EndpointId(*ep), &b);
            }
            Err(e) => panic!("bench payload did not decode: {e}"),
        }
    }
    let caller_s = t.elapsed().as_secs_f64();
    let caller_cpu_s = thread_cpu_seconds() - caller_cpu0;
    index.flush_blocking();
    let total_s = t.elapsed().as_secs_f64();
    let cpu_s = cpu_seconds() - cpu0;
    json!({
        "phase": name,
        "batches": work.len(),
        "blocks": blocks,
        "payload_mb": bytes as f64 / 1e6,
        "decode_only_blocks_per_s": (blocks as f64 / decode_s).round(),
        "decode_apply_caller_blocks_per_s": (blocks as f64 / caller_s).round(),
        "decode_apply_visible_blocks_per_s": (blocks as f64 / total_s).round(),
        "blocks_per_cpu_second": if cpu_s > 0.0 { (blocks as f64 / cpu_s).round() } else { 0.0 },
        "cpu_seconds": cpu_s,
        "caller_thread_cpu_seconds": caller_cpu_s,
        "caller_thread_blocks_per_cpu_second": if caller_cpu_s > 0.0 { (blocks as f64 / caller_cpu_s).round() } else { 0.0 },
        "wall_seconds": total_s,
        "indexed_blocks_after": index.total_blocks(),
    })
}

fn memory(rng: &mut Rng, endpoints: usize, per_endpoint: usize) -> serde_json::Value {
    let before = rss_bytes();
    let index = PoolIndex::new(BS);
    let chains = per_endpoint / (2 * EVENT_BLOCKS);
    for e in 0..endpoints as u64 {
        for _ in 0..chains {
            let hashes: Vec<u64> = (0..2 * EVENT_BLOCKS).map(|_| rng.next()).collect();
            let toks = tokens(rng, 2 * EVENT_BLOCKS * BS as usize);
            let split = EVENT_BLOCKS * BS as usize;
            let p1 = vllm_payload(Some((&hashes[..EVENT_BLOCKS], None, &toks[..split])), None);
            let p2 = vllm_payload(
                Some((
                    &hashes[EVENT_BLOCKS..],
                    Some(hashes[EVENT_BLOCKS - 1]),
                    &toks[split..],
                )),
                None,
            );
            for p in [p1, p2] {
                if let Ok(b) = decode_batch(&p) {
                    index.apply(EndpointId(e), &b);
                }
            }
        }
        // Keep the writer's queue short so queued events are not counted.
        index.flush_blocking();
    }
    index.flush_blocking();
    let after = rss_bytes();
    let blocks = index.total_blocks();
    let r = json!({
        "endpoints": endpoints,
        "blocks": blocks,
        "rss_delta_mb": (after.saturating_sub(before)) as f64 / 1e6,
        "bytes_per_block": (after.saturating_sub(before)) as f64 / blocks.max(1) as f64,
    });
    drop(index);
    r
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

/// `endpoints` endpoints of ~25k blocks each: each holds 12 of `docs`
/// 2,048-block documents (32k tokens), so documents are shared between
/// endpoints as system prompts and long contexts are.
fn overlap_bench(rng: &mut Rng, endpoints: usize, queries: usize) -> serde_json::Value {
    const DOC_BLOCKS: usize = 2048;
    const DOCS_PER_EP: usize = 12;
    let docs_n = 24;
    let index = PoolIndex::new(BS);
    let docs: Vec<(Vec<u32>, Vec<u64>)> = (0..docs_n)
        .map(|_| {
            (
                tokens(rng, DOC_BLOCKS * BS as usize),
                (0..DOC_BLOCKS).map(|_| rng.next()).collect(),
            )
        })
        .collect();
    for e in 0..endpoints {
        for k in 0..DOCS_PER_EP {
            let (toks, hashes) = &docs[(e * 5 + k) % docs_n];
            // Stored as vLLM reports a long prefill: 125-block events.
            let mut parent = None;
            for (c, hs) in hashes.chunks(EVENT_BLOCKS).enumerate() {
                let start = c * EVENT_BLOCKS * BS as usize;
                let t = &toks[start..start + hs.len() * BS as usize];
                let p = vllm_payload(Some((hs, parent, t)), None);
                if let Ok(b) = decode_batch(&p) {
                    index.apply(EndpointId(e as u64), &b);
                }
                parent = hs.last().copied();
            }
        }
        index.flush_blocking();
    }
    index.flush_blocking();
    let mut out = serde_json::Map::new();
    for (label, req_tokens) in [("4k", 4096usize), ("32k", 32768)] {
        let mut lat = Vec::with_capacity(queries);
        let mut matched_sum = 0usize;
        for q in 0..queries {
            let (toks, _) = &docs[(rng.next() as usize) % docs_n];
            let mut req = toks[..req_tokens.min(toks.len())].to_vec();
            // One in four requests diverges halfway (a new user turn).
            if q % 4 == 0 {
                let half = req.len() / 2;
                for t in &mut req[half..] {
                    *t = (rng.next() % 151_936) as u32;
                }
            }
            let t = Instant::now();
            let o = index.overlap(&req);
            lat.push(t.elapsed().as_secs_f64() * 1e6);
            matched_sum += o.matched.values().max().copied().unwrap_or(0);
        }
        lat.sort_by(|a, b| a.total_cmp(b));
        out.insert(
            label.to_string(),
            json!({
                "request_tokens": req_tokens,
                "queries": queries,
                "p50_us": (percentile(&lat, 0.5) * 10.0).round() / 10.0,
                "p99_us": (percentile(&lat, 0.99) * 10.0).round() / 10.0,
                "mean_best_matched_blocks": matched_sum as f64 / queries as f64,
            }),
        );
    }
    json!({
        "endpoints": endpoints,
        "blocks_per_endpoint": index.total_blocks() / endpoints,
        "total_blocks": index.total_blocks(),
        "latency": out,
    })
}

/// Runs the memory measurement in a fresh process: RSS in a process that has
/// already freed other phases' memory would hide the growth.
fn memory_in_child(quick: bool) -> serde_json::Value {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return json!({"error": e.to_string()}),
    };
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("--memory-child");
    if quick {
        cmd.arg("--quick");
    }
    match cmd.output() {
        Ok(o) => serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| json!({"error": format!("child output: {e}")})),
        Err(e) => json!({"error": e.to_string()}),
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let mut rng = Rng(0x1234_5678_9abc_def1);
    if std::env::args().any(|a| a == "--memory-child") {
        let m = memory(&mut rng, 8, if quick { 5_000 } else { 25_000 });
        println!("{m}");
        return;
    }
    let mem = memory_in_child(quick);
    let chains = if quick { 400 } else { 4000 };
    let store_only = workload(&mut rng, chains, None);
    let steady = workload(&mut rng, chains, Some(chains / 4));
    let ingest_store = ingest("store_only", &store_only);
    let ingest_steady = ingest("store_and_evict", &steady);
    drop((store_only, steady));
    let queries = if quick { 200 } else { 2000 };
    let o8 = overlap_bench(&mut rng, 8, queries);
    let o64 = overlap_bench(&mut rng, if quick { 16 } else { 64 }, queries);
    let report = json!({
        "block_size": BS,
        "event_blocks": EVENT_BLOCKS,
        "threads": "1 caller (decode + re-hash + bookkeeping) + 1 index writer (dynamo tree)",
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "ingest": [ingest_store, ingest_steady],
        "memory": mem,
        "overlap": [o8, o64],
    });
    println!(
        "{}",
        serde_json::to_string_pretty(&report).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    );
}
