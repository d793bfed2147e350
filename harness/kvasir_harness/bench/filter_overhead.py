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

`--paths all` adds the same comparison for the cache-indexer as the
endpoint picker of an Inference Extension gateway (docs/picker.md): the
same indexer also serves a picker for the pool (ext_proc, the same
compiled policy), and three more Envoys, built from
harness/kvasir_harness/picker.py's bootstrap (a static pool cluster with
the override_host load balancer), take turns with the two above: one
asking the picker with full-duplex bodies (the Inference Extension's
mode), one with buffered bodies, and the identical bootstrap without the
ext_proc filter (the picker paths' own baseline). The two baselines are
reported too, so the filter and the picker compare on one machine and one
run. It writes bench/results/filter_overhead/summary.json (percentiles
per path and round, no per-request records) and a markdown table beside it.

    .tools/venv/bin/python bench/filter_overhead.py --seconds 10 --out bench/results/filter.json
    .tools/venv/bin/python bench/filter_overhead.py --paths all --rounds 3 --seconds 5
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
from kvasir_harness import picker as gie  # the Inference Extension gateway's bootstrap

from kvasir_harness.paths import BENCH_BIN, RESULTS


# Each path measured, and the path it adds latency over (the identical
# bootstrap without the filter under test).
BASELINE = {"with_filter": "without_filter",
            "picker_full_duplex": "picker_plain", "picker_buffered": "picker_plain"}

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
    if len(names) > 2:
        # Each path over its own baseline, and over the filter's (the same
        # route, another bootstrap: the two baselines should agree).
        row["added"] = {n: {"over": b, "p50_ms": row[n]["p50_ms"] - row[b]["p50_ms"],
                            "p99_ms": row[n]["p99_ms"] - row[b]["p99_ms"],
                            "p50_over_without_filter_ms": row[n]["p50_ms"] - row["without_filter"]["p50_ms"]}
                        for n, b in BASELINE.items() if n in names}
    row["client_send_lateness_p99_ms"] = r["send_lateness_p99_ms"]
    row["where"] = time_split(before, after)
    line = f"{rate:5.0f} rps round {k}: filter added p50 {row['added_p50_ms']:.3f} ms, p99 {row['added_p99_ms']:.3f} ms"
    for n, a in row.get("added", {}).items():
        if n != "with_filter":
            line += f"; {n} p50 {a['p50_ms']:.3f} ms, p99 {a['p99_ms']:.3f} ms"
    print(line, file=sys.stderr)
    return row


def start_gateway(logdir: Path, name: str, picker: str | None, pool: list[str], request_mode: str = "",
                  response_mode: str = "") -> h.Envoy:
    """An Envoy as an Inference Extension gateway configures it
    (harness/kvasir_harness/picker.py's bootstrap, override_host pool),
    asking the picker at `picker` in the given body modes, or with no
    ext_proc filter at all when `picker` is None; one worker, as the
    filter's Envoys."""
    port, admin = h.free_port(), h.free_port()
    b = gie.bootstrap(port, admin, picker or "127.0.0.1:9", pool, "override_host",
                      request_mode=request_mode or "FULL_DUPLEX_STREAMED",
                      response_mode=response_mode or "FULL_DUPLEX_STREAMED")
    if picker is None:
        hcm = b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
        b["static_resources"]["clusters"] = [c for c in b["static_resources"]["clusters"] if c["name"] != "picker"]
    cfg = logdir / f"{name}.json"
    cfg.write_text(json.dumps(b, indent=1))
    argv = [str(h.ENVOY_BIN), "-c", str(cfg), "--concurrency", "1", "--disable-hot-restart", "-l", "warning"]
    return h.Envoy(h.Proc(name, argv, logdir), port, admin, cfg)


def summary_table(results: dict) -> str:
    """The three-way comparison as a markdown table (docs/picker.md,
    docs/benchmarks.md)."""
    out = ["| rate | plain Envoy p50 / p99 | filter + pick: added p50 / p99 | picker, full duplex: added p50 / p99 "
           "| picker, buffered: added p50 / p99 |",
           "| ---: | ---: | ---: | ---: | ---: |"]
    for r in results["rates"]:
        a = r["added"]

        def cell(n: str) -> str:
            lo, hi = a[n]["p50_range_ms"]
            return f"**{a[n]['p50_ms']:+.2f} / {a[n]['p99_ms']:+.2f} ms** ({lo:.2f} to {hi:.2f})"
        base = r["without_filter"]
        out.append(f"| {r['rate_rps']:.0f} rps | {base['p50_ms']:.2f} / {base['p99_ms']:.2f} ms | {cell('with_filter')} "
                   f"| {cell('picker_full_duplex')} | {cell('picker_buffered')} |")
    out.append("")
    out.append(f"Median of {results['rounds']} interleaved rounds of {results['seconds_per_round']:g} s per path and "
               f"rate (in brackets: the rounds' added p50 range). Each path over its own baseline: the filter over "
               f"the same Envoy bootstrap without it, the picker over the Inference Extension gateway's bootstrap "
               f"without ext_proc (p50 {results['rates'][0]['picker_plain']['p50_ms']:.2f} ms at "
               f"{results['rates'][0]['rate_rps']:.0f} rps). {results['prompt_tokens']}-token chat bodies "
               f"({results['body_bytes']} bytes); one Envoy worker per path; zero-latency simulators; "
               f"one 2-core machine shared by everything.")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5, help="seconds per path, rate and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per rate (the added latency is their median)")
    ap.add_argument("--rates", default="100,500")
    ap.add_argument("--paths", choices=("filter", "all"), default="filter",
                    help="filter: the filter and its baseline; all: also the endpoint picker and its baseline")
    ap.add_argument("--out", help="default bench/results/filter.json, or with --paths all "
                                  "bench/results/filter_overhead/summary.json")
    a = ap.parse_args(argv)
    picker_paths = a.paths == "all"
    out = Path(a.out) if a.out else RESULTS / (
        "filter_overhead/summary.json" if picker_paths else "filter.json")
    logdir = Path(tempfile.mkdtemp(prefix="kvasir-bench-filter-"))
    procs = h.Processes()
    try:
        sims = [h.start_sim(logdir, f"sim{i}") for i in range(3)]
        provider = h.start_sim(logdir, "provider", model=h.PROVIDER_MODEL)
        for x in sims + [provider]:
            procs.add(x)
        plugin = h.compile_plugin(h.POLICY, {"bodyLimitBytes": 1048575})
        extra, picker = [], None
        if picker_paths:
            # The same indexer answers the filter's picks and the picker's
            # exchanges, with the same compiled policy.
            picker = f"127.0.0.1:{h.free_port()}"
            (logdir / "picker-policy.json").write_text(plugin)
            (logdir / "pickers.json").write_text(json.dumps({"pickers": [
                {"addr": picker, "pool": "main", "policyFile": str(logdir / "picker-policy.json")}]}))
            extra = ["--config", str(logdir / "pickers.json")]
        indexer = procs.add(h.indexer_for(sims, logdir, scrape_interval_ms=250, extra=extra))
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
        if picker_paths:
            pool = [s.address for s in sims]
            for name, who, modes in (("picker_full_duplex", picker, ("FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED")),
                                     ("picker_buffered", picker, ("BUFFERED", "STREAMED")),
                                     ("picker_plain", None, ("", ""))):
                e = procs.add(start_gateway(logdir, name, who, pool, *modes))
                h.wait_until(f"{name} ready", lambda e=e: e.proc.alive()
                             and h.request("GET", e.admin, "/ready", timeout=2)[0] == 200)
                envoys[name] = e
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
            if picker_paths:
                row["added"] = {}
                for n, b in BASELINE.items():
                    xs = [r["added"][n] for r in rs]
                    row["added"][n] = {"over": b, **{q: statistics.median(x[q] for x in xs)
                                                     for q in ("p50_ms", "p99_ms", "p50_over_without_filter_ms")},
                                       "p50_range_ms": [min(x["p50_ms"] for x in xs), max(x["p50_ms"] for x in xs)]}
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
        results["notes"] = (f"kvasir-bench overhead (one-thread Rust open-loop client, the {len(names)} Envoys in "
                            f"alternating 0.5 s blocks; {a.rounds} rounds of {a.seconds:g} s per path and rate, the added "
                            f"latency is their median) on the same 2-core machine; 1 Envoy worker; zero-latency "
                            f"simulators, max_tokens 1; latency from the send to the answer's last byte.")
        out.parent.mkdir(parents=True, exist_ok=True)
        if picker_paths:
            # Percentiles per path and round only: the per-request records
            # stay in the run's temporary folder.
            results["paths"] = {"with_filter": "Envoy + the Kvasir filter (wasm) + the indexer's pick over kvasir.v1",
                                "without_filter": "the same Envoy bootstrap without the filter",
                                "picker_full_duplex": "Envoy + ext_proc to the indexer's picker, FULL_DUPLEX_STREAMED "
                                                      "request and response bodies",
                                "picker_buffered": "the same with a BUFFERED request body, STREAMED response",
                                "picker_plain": "the same Envoy bootstrap without ext_proc"}
            (out.parent / "summary.md").write_text(summary_table(results) + "\n")
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(json.dumps(results, indent=2))
        return 0
    finally:
        procs.stop_all()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
