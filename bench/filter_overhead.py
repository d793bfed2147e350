#!/usr/bin/env python3
"""The latency the Kvasir filter plus the indexer pick adds over the same
Envoy route without the filter. Not a test.

Starts three zero-latency vllm-sims, the cache-indexer and two Envoys on
the same sims: one rendered from envoy/envoy.yaml with the filter, one with
`--without-filter` (the identical bootstrap minus the wasm filter). For each
rate, `kvasir-bench overhead` sends ~8k-token chat bodies open-loop
(fixed inter-arrival times) to both Envoys in alternating half-second
blocks, from one client thread, and records every request's wall latency;
the added latency is the difference of the two distributions' percentiles.
Alternating blocks put the shared machine's drift on both paths alike.
Also reports the .wasm size and Envoy's RSS with and without the filter.

    .tools/venv/bin/python bench/filter_overhead.py --seconds 10 --out bench/results/filter.json
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import statistics
import sys
import tempfile
from pathlib import Path

import kvasir_harness as h  # harness/kvasir_harness: processes, ports, bounded waits, the launchers

REPO = Path(__file__).resolve().parents[1]

BENCH_BIN = h.TARGET / "release" / "kvasir-bench"

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


def where_time_goes(indexer: h.Indexer, envoy: h.Envoy) -> dict[str, float]:
    """Running totals for the per-rate split: the indexer's own pick and
    tokenization time, and the filter's pick round trip (Envoy's
    `pick_us` histogram, its detailed buckets)."""
    out = {}
    for m in ("pick", "tokenize"):
        out[f"{m}_sum"] = indexer.metric(f"kvasir_indexer_{m}_duration_seconds_sum")
        out[f"{m}_count"] = indexer.metric(f"kvasir_indexer_{m}_duration_seconds_count")
    _, _, b = h.request("GET", envoy.admin, "/stats?format=json&filter=pick_us&histogram_buckets=detailed")
    out["pick_us_raw"] = json.loads(b)
    return out


def detailed_buckets(raw: dict) -> dict[float, int]:
    out: dict[float, int] = {}
    for st in raw.get("stats", []):
        for d in (st.get("histograms") or {}).get("details", []):
            for b in d.get("totals", []):
                out[b["lower_bound"]] = out.get(b["lower_bound"], 0) + b["count"]
    return out


def time_split(before: dict, after: dict) -> dict:
    """Per rate: the indexer's mean pick and tokenization time, and the
    filter's pick round trip (p50 / p99 from the difference of Envoy's
    detailed histogram buckets; Envoy merges them at its stats flush, so
    the last seconds of a rate may be missing)."""
    d = {}
    for m in ("pick", "tokenize"):
        n = after[f"{m}_count"] - before[f"{m}_count"]
        d[f"indexer_{m}_mean_ms"] = (after[f"{m}_sum"] - before[f"{m}_sum"]) / n * 1e3 if n else float("nan")
    a, b = detailed_buckets(after["pick_us_raw"]), detailed_buckets(before["pick_us_raw"])
    diff = sorted((k, a[k] - b.get(k, 0)) for k in a if a[k] > b.get(k, 0))
    total = sum(c for _, c in diff)
    d["pick_round_trip_n"] = total
    for q in (0.5, 0.99):
        acc, val = 0, float("nan")
        for k, c in diff:
            acc += c
            if acc >= q * total:
                val = k / 1e3
                break
        d[f"pick_round_trip_p{int(q * 100)}_ms"] = val
    return d


def one_round(a, indexer, envoys, names, bodies_file: Path, logdir: Path, rate: float, k: int, warm_up: bool) -> dict:
    raw = logdir / f"overhead-{rate:.0f}-{k}.json"
    cmd = [str(BENCH_BIN), "overhead", "--bodies", str(bodies_file),
           "--header", f"authorization: Bearer {h.KEYS['acme']}",
           "--rates", str(rate), "--seconds", str(a.seconds), "--out", str(raw),
           # Warm-up (tokenizer caches, connections, the index holding the system prompt) once.
           "--warmup-s", "2" if warm_up else "0"]
    for n in names:
        cmd += ["--url", f"http://127.0.0.1:{envoys[n].port}/v1/chat/completions", "--name", n]
    before = where_time_goes(indexer, envoys["with_filter"])
    # Bounded: warm-up plus both paths, plus the timeouts.
    subprocess.run(cmd, check=True, timeout=60 + 6 * a.seconds)
    after = where_time_goes(indexer, envoys["with_filter"])
    [r] = json.loads(raw.read_text())
    paths = {p["name"]: p for p in r["paths"]}
    row = {}
    for n in names:
        p = paths[n]
        row[n] = {key: p[key] for key in ("n", "errors", "p50_ms", "p90_ms", "p99_ms", "mean_ms")}
    row["added_p50_ms"] = row["with_filter"]["p50_ms"] - row["without_filter"]["p50_ms"]
    row["added_p99_ms"] = row["with_filter"]["p99_ms"] - row["without_filter"]["p99_ms"]
    row["client_send_lateness_p99_ms"] = r["send_lateness_p99_ms"]
    row["where"] = time_split(before, after)
    print(f"{rate:5.0f} rps round {k}: added p50 {row['added_p50_ms']:.3f} ms, p99 {row['added_p99_ms']:.3f} ms", file=sys.stderr)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5, help="seconds per path, rate and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per rate (the added latency is their median)")
    ap.add_argument("--rates", default="100,500")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "filter.json"))
    a = ap.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="kvasir-bench-filter-"))
    procs = h.Processes()
    try:
        sims = [h.start_sim(logdir, f"sim{i}") for i in range(3)]
        provider = h.start_sim(logdir, "provider", model=h.PROVIDER_MODEL)
        for x in sims + [provider]:
            procs.add(x)
        indexer = procs.add(h.indexer_for(sims, logdir, scrape_interval_ms=250))
        plugin = h.compile_plugin(h.POLICY, {"bodyLimitBytes": 1048575})
        envoys = {}
        for name, without in (("with_filter", False), ("without_filter", True)):
            e = h.start_envoy(logdir, plugin, [s.address for s in sims], indexer.address, provider.address,
                              name=name, without_filter=without, concurrency=1, log_level="warning")
            procs.add(e)
            envoys[name] = e
        for s in sims + [provider]:
            h.wait_sim(s)
        indexer.start()
        for e in envoys.values():
            h.wait_envoy(e, [s.address for s in sims])
        rng = random.Random(1)
        bodies = [body(rng, i) for i in range(200)]
        bodies_file = logdir / "bodies.jsonl"
        bodies_file.write_bytes(b"\n".join(bodies) + b"\n")
        names = list(envoys)
        results = {"rates": [], "body_bytes": len(bodies[0]),
                   "prompt_tokens": json.loads(h.request("POST", sims[0].port, "/tokenize",
                                                         json.dumps({"messages": json.loads(bodies[0])["messages"]}))[2])["count"]}
        rates = [float(r) for r in a.rates.split(",")]
        rounds: dict[float, list[dict]] = {r: [] for r in rates}
        # Rounds interleave the rates, so a slow minute of the shared
        # machine lands on one round of each, not on one rate.
        for k in range(a.rounds):
            for rate in rates:
                first = k == 0 and rate == rates[0]
                rounds[rate].append(one_round(a, indexer, envoys, names, bodies_file, logdir, rate, k, first))
        for rate in rates:
            rs = rounds[rate]
            row = {"rate_rps": rate, "rounds": rs}
            for key in ("added_p50_ms", "added_p99_ms"):
                row[key] = statistics.median(r[key] for r in rs)
                row[key.replace("_ms", "_range_ms")] = [min(r[key] for r in rs), max(r[key] for r in rs)]
            # The round whose added p50 is the median, for the table's absolute columns.
            mid = sorted(rs, key=lambda r: r["added_p50_ms"])[len(rs) // 2]
            for n in names:
                row[n] = mid[n]
            row["where"] = mid["where"]
            results["rates"].append(row)
        results["wasm_bytes"] = h.WASM.stat().st_size
        results["envoy_rss_mib"] = {n: rss_kib(e.proc.p.pid) / 1024 for n, e in envoys.items()}
        # One worker (--concurrency 1) plus the main thread each hold a VM.
        results["filter_rss_per_vm_mib"] = (results["envoy_rss_mib"]["with_filter"] - results["envoy_rss_mib"]["without_filter"]) / 2
        results["rounds"] = a.rounds
        results["seconds_per_round"] = a.seconds
        results["notes"] = (f"kvasir-bench overhead (one-thread Rust open-loop client, both Envoys in alternating "
                            f"0.5 s blocks; {a.rounds} rounds of {a.seconds:g} s per path and rate, the added latency is "
                            f"their median) on the same 2-core machine; 1 Envoy worker; zero-latency simulators, "
                            f"max_tokens 1; latency from the send to the answer's last byte.")
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(results, indent=2))
        return 0
    finally:
        procs.stop_all()


if __name__ == "__main__":
    sys.exit(main())
