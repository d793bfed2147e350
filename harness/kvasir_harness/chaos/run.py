"""Runs fault scenarios one after another and writes their results:
`summary.json` (every check, count and figure) and `summary.md` (one table
row per scenario, then each scenario's checks) under the output folder,
with the conditions of the run (machine load, cores, quick or full)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from ..paths import RESULTS
from .result import Result

Scenario = Callable[[Path, bool], Result]


def scenarios() -> dict[str, Scenario]:
    from .controller import controller_faults
    from .engines import engine_killed, kv_events
    from .indexers import network_cut, replica_killed, stalled_and_slowed
    from .shared_store import redis_faults
    return {
        "indexer_replica_killed": replica_killed,
        "engine_killed": engine_killed,
        "kv_events": kv_events,
        "indexer_stalled_slowed": stalled_and_slowed,
        "redis_faults": redis_faults,
        "controller_faults": controller_faults,
        "indexer_network_cut": network_cut,
    }


OUT = RESULTS / "chaos"


def conditions(quick: bool) -> dict[str, Any]:
    load1, load5, load15 = os.getloadavg()
    return {"quick": quick, "cores": os.cpu_count(), "loadavg_at_start": [round(load1, 2), round(load5, 2), round(load15, 2)],
            "machine": platform.machine(), "kernel": platform.release(),
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def run(names: list[str], quick: bool, out: Path | None = OUT, keep_logs: bool = False) -> list[Result]:
    table = scenarios()
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; known: {', '.join(table)}")
    logdir = Path(tempfile.mkdtemp(prefix="kvasir-chaos-"))
    cond = conditions(quick)
    results: list[Result] = []
    try:
        for n in names:
            t0 = time.monotonic()
            print(f"chaos: {n} ...", flush=True)
            try:
                res = table[n](logdir, quick)
            except Exception as e:  # noqa: BLE001 - reported as the scenario's error, the others still run
                res = Result(n, n, f"make chaos SCENARIOS={n}")
                res.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
            res.wall_s = time.monotonic() - t0
            results.append(res)
            print(one_line(res), flush=True)
            for c in res.checks:
                if c.get("known_bug") and not c["held"]:
                    print(f"   known bug: {c['what']}: measured {c['measured']}, bound {c['bound']}: {c['known_bug']}",
                          flush=True)
                elif c.get("known_bug"):
                    print(f"   {c['what']} held this time (a known bug that shows in some runs)", flush=True)
                elif not c["held"]:
                    print(f"   FAILED: {c['what']}: measured {c['measured']}, bound {c['bound']}", flush=True)
            if res.error:
                print(f"   ERROR: {res.error}", flush=True)
    finally:
        cond["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        cond["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if out is not None and results:
            write(out, results, cond)
        if keep_logs or any(not r.ok for r in results):
            print(f"chaos: logs kept in {logdir}", flush=True)
        else:
            shutil.rmtree(logdir, ignore_errors=True)
    return results


def one_line(r: Result) -> str:
    l = r.load
    return (f"chaos: {r.name}: {'ok' if r.ok else 'FAILED'} in {r.wall_s:.0f} s; requests sent {l.get('sent', 0)}, "
            f"succeeded {l.get('succeeded', 0)}, failed {l.get('failed', 0)} {l.get('failed_by_reason', {}) or ''}, "
            f"retried by Envoy {r.figures.get('retries_total', '-')}, time to recover "
            f"{r.figures.get('time_to_recover_s', '-')} s")


def write(out: Path, results: list[Result], cond: dict[str, Any]) -> None:
    """Writes the results, replacing the same scenarios' earlier results in
    `out` and keeping the others (each with the conditions of its run)."""
    out.mkdir(parents=True, exist_ok=True)
    order = list(scenarios())
    kept: dict[str, dict[str, Any]] = {}
    old = out / "summary.json"
    if old.exists():
        try:
            prev = json.loads(old.read_text())
            for s in prev.get("scenarios", []):
                kept[s["name"]] = {"conditions": prev.get("conditions"), **s}
        except (ValueError, KeyError):
            kept = {}
    for r in results:
        kept[r.name] = {**r.as_dict(), "conditions": cond}
    ranked = sorted(kept.values(), key=lambda s: order.index(s["name"]) if s["name"] in order else len(order))
    doc = {"conditions": cond, "scenarios": ranked}
    (out / "summary.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (out / "summary.md").write_text(markdown(doc))


def markdown(doc: dict[str, Any]) -> str:
    lines = ["# Fault suite results", "",
             "Written by `make chaos` (bench/chaos.py); each scenario's run, its durations (quick or full) and "
             "the machine's load average (other builds shared its 2 cores) are in its row.", "",
             "| scenario | held | sent | succeeded | failed (why) | retried by Envoy | time to recover s | wall s | run (UTC), durations, load average start / end |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in doc["scenarios"]:
        l = s["load"]
        c = s.get("conditions") or doc["conditions"]
        why = ", ".join(f"{k} {v}" for k, v in (l.get("failed_by_reason") or {}).items())
        known = sum(1 for ch in s["checks"] if ch.get("known_bug") and not ch["held"])
        held = ("yes" if s["ok"] else "NO") + (f", {known} known bug" if known else "")
        lines.append(f"| {s['name']} | {held} | {l.get('sent', 0)} | {l.get('succeeded', 0)} | "
                     f"{l.get('failed', 0)}{f' ({why})' if why else ''} | {s['figures'].get('retries_total', '-')} | "
                     f"{s['figures'].get('time_to_recover_s', '-')} | {s['wall_s']} | {c['started_utc']}, {'quick' if c['quick'] else 'full'}, "
                     f"{c['loadavg_at_start'][0]} / {c.get('loadavg_at_end', ['?'])[0]} |")
    for s in doc["scenarios"]:
        lines += ["", f"## {s['name']}: {s['fault']}", "", f"`{s['command']}`", ""]
        if s.get("error"):
            lines += ["```", s["error"], "```", ""]
        lines += ["| check | held | measured | bound |", "| --- | --- | --- | --- |"]
        for ch in s["checks"]:
            held = "yes" if ch["held"] else "NO"
            if ch.get("known_bug"):
                held += f" (known bug: {ch['known_bug']})"
            lines.append(f"| {ch['what']} | {held} | {ch['measured']} | {ch['bound']} |")
        lines += ["", "Figures: `" + json.dumps(s["figures"], default=str) + "`", "",
                  "Memory (RSS MiB): `" + json.dumps(s["memory"], default=str) + "`"]
        for n in s.get("notes", []):
            lines += ["", n]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="Kvasir's fault suite under load")
    ap.add_argument("scenarios", nargs="*", help=f"which (default all): {', '.join(scenarios())}")
    ap.add_argument("--quick", action="store_true", help="the short durations make test runs")
    ap.add_argument("--out", type=Path, default=OUT, help="results folder (default bench/results/chaos)")
    ap.add_argument("--no-write", action="store_true", help="write no results")
    ap.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    a = ap.parse_args(argv)
    names = a.scenarios or list(scenarios())
    results = run(names, a.quick, None if a.no_write else a.out, a.keep_logs)
    return 0 if all(r.ok for r in results) else 1
