"""Picks under held streams: how many fail open, why, and what the pick
costs, at 250, 500 and 1,000 concurrent streams through one Envoy with the
filter, one cache-indexer and three vllm-sims on this machine. Not a test.

Each level: `kvasir-bench streams` holds that many streamed chat requests
(two tenants, one with a concurrency budget) for `--duration-s`, and the
Envoy's own stats are read before and after: picks answered
(`pick.ok`, rate-limited, shed), picks failed open by why (`pick.timeout`,
`pick.unavailable`, ...), the pick's round trip (`pick_us`), and the CPU
each process used. The fail-open share is failed-open picks over all
picks made.

    .tools/venv/bin/python bench/failopen.py                 # 250, 500, 1000
    .tools/venv/bin/python bench/failopen.py --levels 1000 --duration-s 60

Results: bench/results/failopen/summary.json (one entry per --label).
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvasir_harness import (KEYS, MODEL, POLICY, SETTINGS, Processes, compile_plugin, indexer_for, request,
                            start_envoy, start_sim, wait_envoy, wait_sim, wait_until)
from kvasir_harness.paths import BENCH_BIN as BENCH, RESULTS
from kvasir_harness.procs import machine_busy_seconds

OUT = RESULTS / "failopen"
WHY = ["timeout", "unavailable", "dispatch", "grpc_error", "bad_response", "no_endpoints", "unsupported"]
# The filter's Session streams: opened, given up as stalled, closed by the
# other side, answers for picks no longer waiting.
SESSION = ["opened", "stalled", "closed", "open_failed", "unmatched"]


def policy(pick_timeout_ms: int) -> dict:
    p = copy.deepcopy(POLICY)
    p["pools"][0]["indexerTimeoutMs"] = pick_timeout_ms
    for t in p["tenants"]:
        if t["name"] == "beta":
            t["budget"] = {"maxConcurrent": 50}
    return p


def envoy_counters(e) -> dict[str, float]:
    """The pool's pick counters of the filter, summed over Envoy's VMs."""
    stats = e.stats()

    def stat(name: str) -> float:
        return float(stats.get(f"wasmcustom.kvasir.pool.main.{name}", 0))

    out = {"ok": stat("pick.ok"), "rate_limited": stat("pick.rate_limited"), "shed": stat("pick.shed"),
           "failopen": stat("failopen")}
    for w in WHY:
        out[w] = stat(f"pick.{w}")
    for s in SESSION:
        out[f"session.{s}"] = float(stats.get(f"wasmcustom.kvasir.session.{s}", 0))
    return out


def pick_us(e) -> dict[str, float]:
    """The pick round trip's quantiles over the run (µs, Envoy's
    cumulative histogram: the stack is fresh for each level)."""
    _, _, b = request("GET", e.admin, "/stats?filter=pool.main.pick_us$")
    out = {}
    for part in b.decode().split():
        for q in ("P50", "P90", "P99"):
            if part.startswith(q + "("):
                cumulative = part[len(q) + 1:].rstrip(")").split(",")[-1]
                try:
                    out[q.lower()] = round(float(cumulative))
                except ValueError:
                    pass
    return out


def run_level(e, procs: dict, n: int, duration_s: float, logdir: Path) -> dict:
    before = envoy_counters(e)
    cpu0 = {k: p.cpu_seconds() or 0.0 for k, p in procs.items()}
    busy0 = machine_busy_seconds()
    out = logdir / f"streams-{n}.json"
    argv = [str(BENCH), "streams", "--url", f"http://127.0.0.1:{e.port}", "--model", MODEL,
            "--key", KEYS["acme"], "--key", KEYS["beta"], "--concurrency", str(n),
            "--duration-s", str(duration_s), "--max-tokens", "64", "--prompt-words", "200", "--out", str(out)]
    t0 = time.monotonic()
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, timeout=duration_s + 300)
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.monotonic() - t0
    after = envoy_counters(e)
    cpu = {k: (p.cpu_seconds() or 0.0) - cpu0[k] for k, p in procs.items()}
    cpu["load_generator"] = (children1.ru_utime + children1.ru_stime) - (children0.ru_utime + children0.ru_stime)
    busy1 = machine_busy_seconds()
    d = {k: after[k] - before[k] for k in after}
    picks = d["ok"] + d["rate_limited"] + d["shed"] + d["failopen"]
    streams = json.loads(out.read_text())
    return {
        "concurrency": n,
        "wall_s": round(wall, 1),
        "requests": streams["sent"],
        "by_status": streams["by_status"],
        "failed": streams["failed"],
        "failures": streams["failures"],
        "peak_open": streams["peak_open"],
        "mean_ok_s": round(streams["mean_ok_s"], 3),
        "p99_ok_s": round(streams["p99_ok_s"], 3),
        "picks": int(picks),
        "failopen": int(d["failopen"]),
        "failopen_share": round(d["failopen"] / picks, 4) if picks else 0.0,
        "failopen_by_why": {w: int(d[w]) for w in WHY if d[w]},
        "pick_round_trip_us": pick_us(e),
        "session": {s: int(d[f"session.{s}"]) for s in SESSION if d[f"session.{s}"]},
        "cpu_s": {k: round(v, 1) for k, v in cpu.items()},
        "machine_busy_share": round((busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1e-9), 3),
    }


def one_level(a, n: int, logdir: Path) -> dict:
    logdir.mkdir(parents=True)
    with Processes() as ps:
        sims = [ps.add(start_sim(logdir, f"sim{i}", profile="h100-8b", time_scale=1.0)) for i in range(3)]
        ix = indexer_for(sims, logdir, events_from_engine=True)
        plugin = compile_plugin(policy(a.pick_timeout_ms), SETTINGS)
        e = ps.add(start_envoy(logdir, plugin, [s.address for s in sims], ix.address, sims[0].address,
                               concurrency=a.concurrency, log_level="warning", wasm=a.wasm))
        for s in sims:
            wait_sim(s)
        ix.start()
        ps.add(ix)
        wait_envoy(e, [s.address for s in sims])
        wait_until("indexer healthy in envoy", lambda: e.healthy("kvasir_indexer", [ix.address]))
        procs = {"envoy": e.proc, "indexer": ix.proc, **{f"sim{i}": s.proc for i, s in enumerate(sims)}}
        return run_level(e, procs, n, a.duration_s, logdir)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="250,500,1000")
    ap.add_argument("--duration-s", type=float, default=30.0)
    ap.add_argument("--pick-timeout-ms", type=int, default=50,
                    help="the pool's indexerTimeoutMs (the shipped envoy/policy.json's is 50)")
    ap.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--label", default="", help="a name for this configuration in the summary")
    ap.add_argument("--wasm", type=Path, default=None, help="another build of the filter (default: this tree's)")
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.levels.split(",")]
    logdir = Path(tempfile.mkdtemp(prefix="kvasir-failopen-"))
    rows = []
    for n in levels:
        # A fresh stack per level: the histograms and queues start empty.
        r = one_level(a, n, logdir / f"c{n}")
        print(json.dumps(r), flush=True)
        rows.append(r)
    a.out.mkdir(parents=True, exist_ok=True)
    summary_path = a.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    key = a.label or f"pick-timeout-{a.pick_timeout_ms}ms"
    summary[key] = {"pick_timeout_ms": a.pick_timeout_ms, "envoy_workers": a.concurrency,
                    "duration_s": a.duration_s, "levels": rows}
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
