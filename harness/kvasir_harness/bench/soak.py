"""Soaks: long runs at a fixed load, judged on errors and on whether each
process's memory stays steady (`soak_stats` says what steady means).
Not tests; `make bench` runs both (shortened by `SOAK_SECONDS`).

* `streams`: 1,000 streamed chat requests held at once (closed loop:
  each client sends its next request when the last one ends) through one
  Envoy with the Kvasir filter, for 10 minutes. Behind it: one
  cache-indexer keeping budgets, shared load and stored responses in a
  redis-server (as deployed), and vllm-sims whose batches hold all the
  streams (4 x 256 sequences). Both tenants have a budget far above what
  the run spends, so every pick reserves and settles through Redis and
  none is refused. Expected: every request answered 200 and read to its
  end, no pick failed open, memory steady.
* `indexer`: one cache-indexer alone under 10,000 KV events/s (fake
  engines publishing vLLM's format over ZMQ, a full cache evicting as it
  stores) plus 2,000 picks/s over gRPC, each answered pick followed by its
  report, for 10 minutes (`cache-indexer/examples/soak_load.rs`). The
  engines' HTTP side (scraped for load) are idle vllm-sims. Measured: the
  rates reached, pick latency per window, the indexer's RSS.

    .tools/venv/bin/python bench/soak.py streams                  # 600 s, 1,000 streams
    .tools/venv/bin/python bench/soak.py indexer --seconds 120
    .tools/venv/bin/python bench/soak.py all --seconds 60

Results: bench/results/soak/summary.json (one key per soak) and report.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from kvasir_harness import (KEYS, MODEL, POLICY, SETTINGS, Processes, compile_plugin, indexer_for,
                            start_envoy, start_redis, start_sim, wait_envoy, wait_sim, wait_until)
from kvasir_harness.envoy import secrets_for, wasm_failures
from kvasir_harness.paths import BENCH_BIN, INDEXER_BIN, RESULTS, TARGET
from kvasir_harness.procs import Proc, machine_busy_seconds, request

from . import soak_stats as S
from .soak_report import write_report

OUT = RESULTS / "soak"
LOAD_BIN = TARGET / "release" / "examples" / "soak_load"

# The streams soak's defaults (the target: 1,000 streams for 10 minutes).
STREAMS = 1000
SIMS = 4
MAX_NUM_SEQS = 256
# With about 250 sequences in each engine's batch, 256 completion tokens
# take 12-24 s in real time (the h100-8b profile), so 1,000 clients hold
# 1,000 streams at about 80 requests/s: streams held, not a request flood.
MAX_TOKENS = 256
PROMPT_WORDS = 200
# The most a budget may be, far above what a run spends (about 2M tokens a
# minute): every pick reserves through Redis, none is refused.
BUDGET_TOKENS_PER_MINUTE = 10**9


# The indexer's own sizes, sampled beside its RSS: what it holds should be
# flat when its memory is.
INDEXER_GAUGES = ["indexed_blocks", "in_flight_unconfirmed", "endpoint_in_flight", "responses_entries",
                  "budget_open_reservations"]


def log(msg: str) -> None:
    print(f"[soak] {msg}", file=sys.stderr, flush=True)


def envoy_stat_sum(e, pattern: str, suffix: str) -> float:
    """Sum of Envoy's stats matching `pattern` (admin regex) that end with `suffix`."""
    _, _, b = request("GET", e.admin, f"/stats?format=json&filter={pattern}", timeout=5)
    return float(sum(s.get("value", 0) for s in json.loads(b)["stats"] if s["name"].endswith(suffix)))


def envoy_memory(e, field: str) -> float:
    """A field of Envoy's admin /memory, in MiB."""
    _, _, b = request("GET", e.admin, "/memory", timeout=5)
    return round(int(json.loads(b)[field]) / 2**20, 2)


def filter_counters(e) -> dict[str, int]:
    """The filter's pool counters (picks answered, failed open and why)."""
    out = {}
    for k, v in e.stats().items():
        if k.startswith("wasmcustom.kvasir.pool.main.") and v:
            out[k.removeprefix("wasmcustom.kvasir.pool.main.")] = int(v)
    return out


def redis_info(port: int) -> dict[str, str]:
    """Redis's `INFO`, field by field."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"INFO\r\n")
        f = conn.makefile("rb")
        size = int(f.readline()[1:])  # a bulk string: $<bytes>\r\n<text>\r\n
        text = f.read(size).decode(errors="replace")
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def redis_keys(port: int) -> dict[str, dict]:
    """Every key in the Redis at the end: its type, length (entries of a
    hash, stream, list, set) and bytes (`MEMORY USAGE`), so a growing
    `used_memory` can be traced to what holds it."""
    cli = shutil.which("redis-cli")
    if cli is None:
        return {}

    def run(*args: str) -> str:
        return subprocess.run([cli, "-p", str(port), *args], capture_output=True, text=True, timeout=10).stdout.strip()

    out = {}
    for key in run("--scan").splitlines()[:100]:
        kind = run("TYPE", key)
        length = {"hash": "HLEN", "stream": "XLEN", "list": "LLEN", "set": "SCARD", "zset": "ZCARD"}.get(kind)
        out[key] = {"type": kind, "entries": int(run(length, key) or 0) if length else None,
                    "bytes": int(run("MEMORY", "USAGE", key) or 0)}
    return out


def soak_policy() -> dict:
    p = copy.deepcopy(POLICY)
    for t in p["tenants"]:
        t["budget"] = {"tokensPerMinute": BUDGET_TOKENS_PER_MINUTE}
    return p


def run_streams(a, logdir: Path) -> dict:
    """The held-streams soak; returns its summary."""
    logdir.mkdir(parents=True, exist_ok=True)
    with Processes() as ps:
        redis = ps.add(start_redis(logdir))
        sims = [ps.add(start_sim(logdir, f"sim{i}", profile="h100-8b", time_scale=a.time_scale,
                                 extra=["--max-num-seqs", str(a.max_num_seqs)])) for i in range(a.sims)]
        cfg = {
            "responses": {"store": "redis", "redisUrl": redis.url},
            "sharedLoad": {"redisUrl": redis.url, "replicaId": "indexer-0"},
            "budgets": {"store": "redis", "redisUrl": redis.url},
        }
        cfg_path = logdir / "indexer.json"
        cfg_path.write_text(json.dumps(cfg))
        ix = indexer_for(sims, logdir, extra=["--config", str(cfg_path)])
        plugin = compile_plugin(soak_policy(), SETTINGS)
        e = ps.add(start_envoy(logdir, plugin, [s.address for s in sims], ix.address, sims[0].address,
                               concurrency=a.envoy_workers, log_level="warning"))
        for s in sims:
            wait_sim(s)
        ix.start()
        ps.add(ix)
        wait_envoy(e, [s.address for s in sims])
        wait_until("indexer healthy in envoy", lambda: e.healthy("kvasir_indexer", [ix.address]))
        out = logdir / "streams.json"
        argv = [str(BENCH_BIN), "streams", "--url", f"http://127.0.0.1:{e.port}", "--model", MODEL,
                "--key", KEYS["acme"], "--key", KEYS["beta"], "--concurrency", str(a.streams),
                "--duration-s", str(a.seconds), "--max-tokens", str(a.max_tokens),
                "--prompt-words", str(a.prompt_words), "--timeout-s", str(a.request_timeout_s), "--out", str(out)]
        before = filter_counters(e)
        busy0 = machine_busy_seconds()
        gen = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(logdir / "streams.log", "wb"))
        pids = {"envoy": e.proc.p.pid, "indexer": ix.proc.p.pid, "redis": redis.proc.p.pid,
                **{f"sim{i}": s.proc.p.pid for i, s in enumerate(sims)}, "load_generator": gen.pid}
        probes = {
            "envoy_active_requests": lambda: envoy_stat_sum(e, r"^http\..*downstream_rq_active$", "downstream_rq_active"),
            "redis_used_memory_mib": lambda: round(int(redis_info(redis.port)["used_memory"]) / 2**20, 2),
            # Envoy's own heap (tcmalloc): live bytes and the heap's size. Its
            # RSS is these plus the filter's Wasm VMs' linear memory and the
            # binary, so a heap that stays flat while RSS grows points there.
            "envoy_heap_allocated_mib": lambda: envoy_memory(e, "allocated"),
            "envoy_heap_size_mib": lambda: envoy_memory(e, "heap_size"),
        }
        log(f"streams: {a.streams} held for {a.seconds:.0f} s, samples every {a.sample_s} s (logs: {logdir})")
        with S.Sampler(pids, a.sample_s, probes) as sampler:
            try:
                gen.wait(timeout=a.seconds + a.request_timeout_s + 120)
            except subprocess.TimeoutExpired:
                gen.kill()
                raise
        busy1 = machine_busy_seconds()
        if gen.returncode != 0:
            raise RuntimeError(f"kvasir-bench streams exited {gen.returncode}: "
                               f"{(logdir / 'streams.log').read_text()[-2000:]}")
        after = filter_counters(e)
        streams = json.loads(out.read_text())
        failures = wasm_failures(e)
        info = redis_info(redis.port)
        keys = redis_keys(redis.port)
        budget_ops = ix.metric_by("kvasir_indexer_budget_requests_total", "decision")
    counters = {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))
                if after.get(k, 0) - before.get(k, 0)}
    ok = streams["by_status"].get("200", 0)
    errors = streams["sent"] - ok
    procs = list(pids)
    rss = {p: S.steadiness(sampler.series(p), a.seconds, streams["sent"]) for p in procs}
    # Between the warm-up and the end of sending (after it the clients only
    # finish what they hold, and the count falls to 0).
    active = sorted(v for t, v in sampler.series("envoy_active_requests")
                    if S.WARMUP_SHARE * a.seconds <= t <= a.seconds)
    return {
        "what": f"{a.streams} concurrent streamed chat requests (closed loop) through one Envoy with the filter, "
                f"{a.seconds:.0f} s",
        "config": {"streams": a.streams, "duration_s": a.seconds, "sims": a.sims, "max_num_seqs": a.max_num_seqs,
                   "sim_profile": "h100-8b", "time_scale": a.time_scale, "max_tokens": a.max_tokens,
                   "prompt_words": a.prompt_words, "envoy_workers": a.envoy_workers, "sample_s": a.sample_s,
                   "redis": "responses, sharedLoad and budgets (both tenants budgeted far above the run's spend)"},
        "requests": streams["sent"],
        "ok": ok,
        "errors": errors,
        "by_status": streams["by_status"],
        "failed": streams["failed"],
        "failures": streams["failures"],
        "requests_per_s": round(streams["sent"] / max(streams["duration_s"], 1e-9), 1),
        "mean_ok_s": round(streams["mean_ok_s"], 2),
        "p99_ok_s": round(streams["p99_ok_s"], 2),
        "peak_open": streams["peak_open"],
        "envoy_active_requests_after_warmup": {"min": min(active, default=0), "max": max(active, default=0),
                                              "p05": active[len(active) // 20] if active else 0,
                                              "median": S.statistics.median(active) if active else 0},
        "filter": counters,
        "failopen": counters.get("failopen", 0),
        "wasm_failures": failures,
        "budget_picks": {k: int(v) for k, v in budget_ops.items()},
        "redis": {"used_memory_mib": round(int(info.get("used_memory", 0)) / 2**20, 2),
                  "keys": info.get("db0", ""), "by_key": keys},
        "machine_busy_share": round((busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1e-9), 3),
        "rss": rss,
        "redis_used_memory": S.steadiness(sampler.series("redis_used_memory_mib"), a.seconds),
        "envoy_heap": {k: S.steadiness(sampler.series(f"envoy_heap_{k}_mib"), a.seconds) for k in ("allocated", "size")},
        "rss_series": {p: S.thin(sampler.series(p)) for p in ("envoy", "indexer", "redis")},
        # A pick failed open still serves its request (routed without the
        # indexer's choice): counted, reported, not an error.
        "pass": errors == 0 and streams["failed"] == 0
        and all(r.get("steady") for n, r in rss.items() if n in ("envoy", "indexer", "redis")),
    }


def run_indexer(a, logdir: Path) -> dict:
    """The indexer-alone soak; returns its summary."""
    logdir.mkdir(parents=True, exist_ok=True)
    with Processes() as ps:
        sims = [ps.add(start_sim(logdir, f"engine{i}")) for i in range(a.engines)]
        token_file = secrets_for(logdir).token_file
        # The load binds its PUB sockets first and names them; the indexer
        # is then started with them as the engines' event sockets.
        ix = indexer_for([], logdir)
        argv = [str(LOAD_BIN), "--grpc", ix.address, "--token-file", str(token_file),
                "--publishers", str(a.engines), "--events-per-s", str(a.events_per_s),
                "--picks-per-s", str(a.picks_per_s), "--duration-s", str(a.seconds), "--window-s", str(a.window_s),
                "--model", MODEL]
        load = ps.add(Proc("soak_load", argv, logdir))

        def line_starting(prefix: str):
            for line in load.log().splitlines():
                if line.startswith(prefix):
                    return json.loads(line)
            if not load.alive():
                raise RuntimeError(f"soak_load exited: {load.log()[-2000:]}")
            return None
        pubs = wait_until("soak_load's publishers", lambda: line_starting('{"publishers"'))["publishers"]
        for s in sims:
            wait_sim(s)
        for s, p in zip(sims, pubs):
            ix.argv += ["--endpoint", f"pool=main,address={s.address},events={p}"]
        ix.start()
        ps.add(ix)
        pids = {"indexer": ix.proc.p.pid, "load_generator": load.p.pid,
                **{f"engine{i}": s.proc.p.pid for i, s in enumerate(sims)}}
        probes = {f"gauge:{g}": (lambda g=g: ix.metric(f"kvasir_indexer_{g}")) for g in INDEXER_GAUGES}
        log(f"indexer: {a.events_per_s:.0f} events/s + {a.picks_per_s:.0f} picks/s for {a.seconds:.0f} s "
            f"(logs: {logdir})")
        # The sampler's clock starts with the load (after its first answered pick).
        wait_until("soak_load's start", lambda: line_starting('{"started"'), timeout=120)
        busy0 = machine_busy_seconds()
        deadline = time.monotonic() + a.seconds + 120
        with S.Sampler(pids, a.sample_s, probes) as sampler:
            while load.alive() and time.monotonic() < deadline:
                time.sleep(0.5)
        busy1 = machine_busy_seconds()
        if load.alive():
            load.stop(signal.SIGKILL)
            raise RuntimeError("soak_load overran its time")
        if load.p.returncode != 0:
            raise RuntimeError(f"soak_load exited {load.p.returncode}: {load.log()[-2000:]}")
        lines = [json.loads(l) for l in load.log().splitlines() if l.startswith("{")]
        applied = ix.metric("kvasir_indexer_events_applied_total")
        skipped = ix.metric("kvasir_indexer_events_skipped_total")
        decisions = ix.metric_by("kvasir_indexer_picks_total", "decision")
    windows = [l["window"] for l in lines if "window" in l]
    summary = next(l["summary"] for l in lines if "summary" in l)
    rss = {p: S.steadiness(sampler.series(p), a.seconds, summary["picks_ok"]) for p in ("indexer", "load_generator")}
    gauges = {g: S.thin(sampler.series(f"gauge:{g}"), 12) for g in INDEXER_GAUGES}
    per_window = [{"t_s": w["t_s"], "events_per_s": w["events_per_s"], "picks_per_s": w["picks_per_s"],
                   "p50_us": w["pick"]["p50_us"], "p99_us": w["pick"]["p99_us"], "max_us": w["pick"]["max_us"],
                   "errors": w["picks_err"] + w["picks_dropped"] + w["reports_err"]} for w in windows]
    return {
        "what": f"one cache-indexer, {a.engines} engines' KV events at {a.events_per_s:.0f}/s plus "
                f"{a.picks_per_s:.0f} picks/s (each with its report), {a.seconds:.0f} s",
        "config": {"engines": a.engines, "target_events_per_s": a.events_per_s, "target_picks_per_s": a.picks_per_s,
                   "blocks_per_event": summary["blocks_per_event"], "capacity_blocks_per_engine":
                   summary["capacity_blocks"], "duration_s": a.seconds, "window_s": a.window_s,
                   "sample_s": a.sample_s},
        "events_sent": summary["events"],
        "events_per_s": summary["events_per_s"],
        "events_applied_by_indexer": int(applied),
        "events_skipped_by_indexer": int(skipped),
        "blocks_stored": summary["blocks_stored"],
        "picks_ok": summary["picks_ok"],
        "picks_per_s": summary["picks_per_s"],
        "picks_err": summary["picks_err"],
        "picks_dropped": summary["picks_dropped"],
        "reports_err": summary["reports_err"],
        "errors": summary["errors"],
        "pick_decisions": {k: int(v) for k, v in decisions.items()},
        "pick_latency_us": summary["pick"],
        "pick_latency_by_window": per_window,
        "machine_busy_share": round((busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1e-9), 3),
        "rss": rss,
        "rss_series": {"indexer": S.thin(sampler.series("indexer"))},
        "indexer_gauges": gauges,
        "reached_target_rates": summary["events_per_s"] >= 0.95 * a.events_per_s
        and summary["picks_per_s"] >= 0.95 * a.picks_per_s,
        "pass": summary["picks_err"] == 0 and summary["reports_err"] == 0 and summary["picks_dropped"] == 0
        and bool(rss["indexer"].get("steady")),
    }


def machine() -> dict:
    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "kernel": platform.release(),
            "loadavg_at_start": [round(x, 2) for x in load],
            "note": "a shared 2-core machine: other builds may have run during the soak (see machine_busy_share)"}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("which", choices=["streams", "indexer", "all"])
    ap.add_argument("--seconds", type=float, default=float(os.environ.get("SOAK_SECONDS", 600)))
    ap.add_argument("--sample-s", type=float, default=None, help="seconds between RSS samples (default: run/150, 1..5)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--streams", type=int, default=STREAMS)
    ap.add_argument("--sims", type=int, default=SIMS)
    ap.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument("--prompt-words", type=int, default=PROMPT_WORDS)
    ap.add_argument("--request-timeout-s", type=float, default=300.0)
    ap.add_argument("--envoy-workers", type=int, default=2)
    ap.add_argument("--engines", type=int, default=4, help="indexer soak: fake engines")
    ap.add_argument("--events-per-s", type=float, default=10_000.0)
    ap.add_argument("--picks-per-s", type=float, default=2_000.0)
    ap.add_argument("--window-s", type=float, default=None, help="indexer soak: seconds per reported window")
    ap.add_argument("--check", action="store_true", help="exit 1 unless every soak run passed (errors, steadiness)")
    a = ap.parse_args(argv)
    if a.sample_s is None:
        a.sample_s = min(5.0, max(1.0, a.seconds / 150))
    if a.window_s is None:
        a.window_s = min(5.0, max(1.0, a.seconds / 60))
    for b in ([BENCH_BIN, INDEXER_BIN] + ([LOAD_BIN] if a.which != "streams" else [])):
        if not b.exists():
            raise SystemExit(f"{b} is not built (cargo build --release --workspace --bins; the indexer soak's load: "
                             "cargo build --release -p kvasir-cache-indexer --example soak_load)")
    logdir = Path(tempfile.mkdtemp(prefix="kvasir-soak-"))
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary["steady_rule"] = S.RULE
    todo = ["streams", "indexer"] if a.which == "all" else [a.which]
    ok = True
    for which in todo:
        started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        m = machine()
        r = (run_streams if which == "streams" else run_indexer)(a, logdir / which)
        r["started"] = started
        r["machine"] = m
        summary[which] = r
        ok = ok and r["pass"]
        log(f"{which}: {'pass' if r['pass'] else 'FAIL'}")
        path.write_text(json.dumps(summary, indent=1) + "\n")
    write_report(summary, a.out / "report.md")
    print(json.dumps({k: {"pass": summary[k]["pass"]} for k in todo}))
    return 0 if ok or not a.check else 1
