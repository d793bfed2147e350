#!/usr/bin/env python3
"""The latency the Kvasir filter plus the indexer pick adds over the same
Envoy route without the filter (issue 4, part 7). Not a test.

Starts three zero-latency vllm-sims, the cache-indexer and two Envoys on
the same sims: one rendered from envoy/envoy.yaml with the filter, one with
`--without-filter` (the identical bootstrap minus the wasm filter). For each
rate it sends ~8k-token chat bodies open-loop (fixed inter-arrival times)
through each Envoy in turn and records every request's wall latency; the
added latency is the difference of the two distributions' percentiles.
Also reports the .wasm size and Envoy's RSS with and without the filter.

    .tools/venv/bin/python bench/filter_overhead.py --seconds 10 --out bench/results/filter.json
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import sys
import threading
import time
from http.client import HTTPConnection
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
import stack as h  # noqa: E402  (tests/e2e/stack.py: processes, ports, bounded waits)

WORDS = "cache prefix token router engine latency batch queue tenant policy model request stream block".split()


def body(rng: random.Random, i: int) -> bytes:
    # ~8k tokens: a shared 6k-word system prompt and a fresh 2k-word question.
    system = " ".join(WORDS[(j * 7) % len(WORDS)] for j in range(6000))
    user = f"request {i}: " + " ".join(rng.choice(WORDS) for _ in range(2000))
    return json.dumps({"model": h.MODEL, "max_tokens": 1,
                       "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}).encode()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def run_rate(port: int, rate: float, seconds: float, bodies: list[bytes], key: str) -> list[float]:
    """Open loop: request i is due at t0 + i/rate; workers take due requests
    off a queue, so a slow answer does not delay later arrivals."""
    lat: list[float] = []
    errors = [0]
    lock = threading.Lock()
    q: queue.Queue = queue.Queue()
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}

    def worker():
        c = HTTPConnection("127.0.0.1", port, timeout=10)
        while True:
            item = q.get()
            if item is None:
                c.close()
                return
            due, b = item
            try:
                c.request("POST", "/v1/chat/completions", body=b, headers=headers)
                r = c.getresponse()
                r.read()
                ok = r.status == 200
            except OSError:
                c.close()
                c = HTTPConnection("127.0.0.1", port, timeout=10)
                ok = False
            # Latency from the scheduled arrival: queueing in the client counts.
            dt = time.perf_counter() - due
            with lock:
                if ok:
                    lat.append(dt)
                else:
                    errors[0] += 1

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(16)]
    for t in threads:
        t.start()
    n = int(rate * seconds)
    t0 = time.perf_counter() + 0.1
    for i in range(n):
        due = t0 + i / rate
        d = due - time.perf_counter()
        if d > 0:
            time.sleep(d)
        q.put((due, bodies[i % len(bodies)]))
    for _ in threads:
        q.put(None)
    for t in threads:
        t.join(timeout=30)
    if errors[0]:
        print(f"  {errors[0]} errors", file=sys.stderr)
    return lat


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * (len(s) - 1)))] * 1e3 if s else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--rates", default="100,500")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "filter.json"))
    a = ap.parse_args()
    logdir = Path(__import__("tempfile").mkdtemp(prefix="kvasir-bench-filter-"))
    procs: list[h.Proc] = []
    indexer = None
    try:
        sims = [h.start_sim(logdir, f"sim{i}") for i in range(3)]
        provider = h.start_sim(logdir, "provider", model=h.PROVIDER_MODEL)
        procs += [s.proc for s in sims] + [provider.proc]
        indexer = h.indexer_for(sims, logdir, scrape_interval_ms=250)
        plugin = h.compile_plugin(h.POLICY, {"bodyLimitBytes": 1048575})
        envoys = {}
        for name, without in (("with_filter", False), ("without_filter", True)):
            e = h.start_envoy(logdir, plugin, [s.address for s in sims], indexer.address, provider.address,
                              name=name, without_filter=without, concurrency=1, log_level="warning")
            procs.append(e.proc)
            envoys[name] = e
        for s in sims + [provider]:
            h.wait_sim(s)
        indexer.start()
        for e in envoys.values():
            h.wait_envoy(e, [s.address for s in sims])
        rng = random.Random(1)
        bodies = [body(rng, i) for i in range(200)]
        key = h.KEYS["acme"]
        # Warm-up: tokenizer caches, connections, the index holding the system prompt.
        for e in envoys.values():
            run_rate(e.port, 50, 2, bodies, key)
        results = {"rates": [], "body_bytes": len(bodies[0]),
                   "prompt_tokens": json.loads(h.request("POST", sims[0].port, "/tokenize",
                                                         json.dumps({"messages": json.loads(bodies[0])["messages"]}))[2])["count"]}
        for rate in [float(r) for r in a.rates.split(",")]:
            row = {"rate_rps": rate}
            for name, e in envoys.items():
                lat = run_rate(e.port, rate, a.seconds, bodies, key)
                row[name] = {"n": len(lat), "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99)}
                print(f"{rate:5.0f} rps {name:15} n={len(lat):5} p50 {row[name]['p50_ms']:.3f} ms  p99 {row[name]['p99_ms']:.3f} ms", file=sys.stderr)
            row["added_p50_ms"] = row["with_filter"]["p50_ms"] - row["without_filter"]["p50_ms"]
            row["added_p99_ms"] = row["with_filter"]["p99_ms"] - row["without_filter"]["p99_ms"]
            results["rates"].append(row)
        results["wasm_bytes"] = h.WASM.stat().st_size
        results["envoy_rss_mib"] = {n: rss_kib(e.proc.p.pid) / 1024 for n, e in envoys.items()}
        # One worker (--concurrency 1) plus the main thread each hold a VM.
        results["filter_rss_per_vm_mib"] = (results["envoy_rss_mib"]["with_filter"] - results["envoy_rss_mib"]["without_filter"]) / 2
        results["notes"] = ("Python open-loop client on the same 2-core machine; 1 Envoy worker; zero-latency "
                            "simulators, max_tokens 1; latency measured from each request's scheduled arrival.")
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(results, indent=2))
        return 0
    finally:
        if indexer is not None:
            indexer.stop()
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    sys.exit(main())
