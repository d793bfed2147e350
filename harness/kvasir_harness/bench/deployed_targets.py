"""The deployed-shape targets checked on a deployed-like routing run
(`bench/routing.py --deployment deployed`), each miss with how much and
why, from the yardsticks the report already computes: the pooled-cache
bound, the FCFS prefill-queue model on the engines a mode chose and
perfectly balanced (`unqueued` in summary.json), and where the trace's
missing hits went (`bench/hit_gap.py`).

- kvasir's TTFT p90 at least 20% below approx-prefix's, and its p50 at
  least 10% below, at trace loads 1.0 and 1.5 (those run);
- kvasir's trace hit rate within 95% of the pooled-cache bound at 1.0;
- kvasir's mean TTFT (answered requests) within 1.3x of perfect balance
  at its own reuse, on every workload and load up to 1.5.

One run checks each once; `bench/repeats.py` says whether a difference is
beyond run-to-run noise. Writes `targets-deployed.json` and puts the table
into the folder's `report.md` (between markers, so a rerun replaces it);
`scripts/bench_report.py` adds the rows to the README's table.

Usage: `.tools/venv/bin/python bench/deployed_targets.py RESULTS_DIR`.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

from kvasir_harness.paths import BENCH_BIN as BENCH, TRACE

from . import hit_gap as gap

P90_BELOW, P50_BELOW, HIT_SHARE, BALANCE = 0.20, 0.10, 0.95, 1.3
TARGET_LOADS = (1.0, 1.5)
START, END = "<!-- targets-deployed:start -->", "<!-- targets-deployed:end -->"
KVASIR = "kvasir"
# The replay's oracle that holds requests in one central queue and
# releases the quickest first to an engine with under 2048 uncached tokens
# in prefill.
CENTRAL = "central:quickest:0.5:2048"


def ms(v: float) -> str:
    if v is None or not math.isfinite(v):
        return "∞"
    return f"{v / 1e3:.2f} s" if v >= 10_000 else f"{v:.0f} ms"


def answered_mean(d: Path, workload: str, load: float, mode: str) -> float | None:
    f = d / f"{workload}-{load:.2f}-{mode}.csv"
    if not f.exists():
        return None
    v = [float(r["ttft_ms"]) for r in csv.DictReader(f.open()) if r["outcome"] == "ok" and r["ttft_ms"]]
    return statistics.mean(v) if v else None


class Run:
    """A results folder's runs and yardsticks."""

    def __init__(self, d: Path):
        self.d = d
        self.s = json.loads((d / "summary.json").read_text())
        self.runs = {(r["workload"], r["load"], r["mode"]): r for r in self.s["runs"]}
        self.unq = {(u["workload"], u["load"], u["mode"]): u for u in self.s.get("unqueued", [])}

    def ttft(self, w: str, load: float, mode: str, q: str) -> float | None:
        r = self.runs.get((w, load, mode))
        return float(r["summary"]["ttft"][q]) if r else None

    def hit(self, w: str, load: float, mode: str) -> float | None:
        r = self.runs.get((w, load, mode))
        return float(r["summary"]["cache_hit_rate"]) if r else None

    def model(self, w: str, load: float, mode: str, kind: str, q: str) -> float | None:
        u = self.unq.get((w, load, mode), {})
        return u[kind][q] if kind in u else None


def below_why(r: Run, load: float, q: str, goal_ms: float, k: str = KVASIR) -> str:
    """Why kvasir's (mode `k`'s) statistic `q` is not far enough below
    approx-prefix's: how much the reuse it gains buys at perfect balance,
    and how far its own placement is from that balance (the queue model's
    figures)."""
    a = "approx-prefix"
    hk, ha = r.hit("trace", load, k), r.hit("trace", load, a)
    bound = (r.s.get("bound") or {}).get("hit_rate")
    parts = [f"hit rate {100 * hk:.1f}% against approx-prefix's {100 * ha:.1f}%"
             + (f" (pooled bound {100 * bound:.1f}%)" if bound else "")]
    bk, ba = r.model("trace", load, k, "balanced", q), r.model("trace", load, a, "balanced", q)
    best = r.model("trace", load, k, "balanced_best", q)
    if bk is not None and ba is not None:
        parts.append(
            f"with the queue model (each prefill in an FCFS queue from its arrival), perfectly balanced engines give "
            f"a {q} of {ms(bk)} at {k}'s reuse, {ms(ba)} at approx-prefix's"
            + (f" and {ms(best)} at the pooled cache's" if best is not None else "")
            + f": {k}'s reuse moves the balanced {q} by {100 * (bk / ba - 1):+.1f}% against approx-prefix's; "
            + (f"perfect balance at {k}'s reuse would meet the target ({ms(goal_ms)})" if goal_ms >= bk else
               f"the target ({ms(goal_ms)}) is below even perfect balance at {k}'s reuse: only more reuse meets it"
               if best is None or goal_ms >= best else
               f"the target ({ms(goal_ms)}) is below even perfect balance at the pooled cache's reuse: no router "
               "meets it on this run's engines"))
    ok, oa = r.model("trace", load, k, "queued_own", q), r.model("trace", load, a, "queued_own", q)
    if ok is not None and oa is not None:
        parts.append(f"on the engines each mode chose the model gives {k} {ms(ok)} and approx-prefix {ms(oa)} "
                     f"(measured {ms(r.ttft('trace', load, k, q))} and {ms(r.ttft('trace', load, a, q))}): what is "
                     "left is placement, balance given up for hits")
    replay = replay_below_why(r.d, load, q, k)
    if replay:
        parts.append(replay)
    return "; ".join(parts)


def below_rows(r: Run, mode: str = KVASIR) -> list[dict]:
    out = []
    for load in TARGET_LOADS:
        for q, share in (("p90", P90_BELOW), ("p50", P50_BELOW)):
            k, a = r.ttft("trace", load, mode, q), r.ttft("trace", load, "approx-prefix", q)
            target = f"trace @{load}: {mode} TTFT {q} >= {share:.0%} below approx-prefix's"
            if k is None or a is None:
                out.append({"target": target, "measured": "runs missing", "met": None, "why": ""})
                continue
            below = 1 - k / a if math.isfinite(a) and a > 0 else math.nan
            met = below >= share
            out.append({"target": target, "measured": f"{ms(k)} vs {ms(a)}: {100 * below:.1f}% below",
                        "met": met, "why": "" if met else below_why(r, load, q, a * (1 - share), mode)})
    return out


def hit_row(r: Run, mode: str = KVASIR) -> dict:
    target = f"trace @1.0: {mode} hit rate >= {HIT_SHARE:.0%} of the pooled-cache bound"
    hk, bound = r.hit("trace", 1.0, mode), (r.s.get("bound") or {}).get("hit_rate")
    if hk is None or not bound:
        return {"target": target, "measured": "runs missing", "met": None, "why": ""}
    share = hk / bound
    met = share >= HIT_SHARE
    measured = f"{100 * hk:.1f}% vs bound {100 * bound:.1f}%: {100 * share:.1f}%"
    why = ""
    if not met:
        try:
            b, hashes = gap.folder(r.d, r.s)
        except gap.NoWindow as e:
            # An older folder: the replay cannot line its requests up with
            # the trace, so the row says so instead of stopping the report.
            return {"target": target, "measured": measured, "met": met,
                    "why": f"no breakdown of the shortfall: {e}"}
        c = gap.run_causes(r.d, r.s, b, hashes, r.runs[("trace", 1.0, mode)])
        short = sum(c["lost"].values())
        causes = ", ".join(f"{k} {100 * c['lost'][k] / short:.0f}% ({c['count'][k]} requests)"
                           for k in gap.CAUSES if c["lost"][k]) if short else "none"
        why = (f"the bound is one LRU cache with no load; of the {short / 1e3:.0f}k prompt tokens {mode}'s answered "
               f"requests got from cache short of it ({c['beyond'] / 1e3:.0f}k beyond it elsewhere): {causes} "
               "(bench/hit_gap.py: in prefill = no earlier request sharing the prefix had its first token yet; sent "
               "elsewhere = one had, on another engine; evicted = on the same engine, dropped under pressure)")
        elsewhere = gap.elsewhere_why(c)
        if elsewhere:
            why += f"; {elsewhere}"
    return {"target": target, "measured": measured, "met": met, "why": why}


def run_scoring(d: Path) -> str:
    """The replay's placement for kvasir's ranking at the run's scoring
    weights (the deployment record's `late_binding_scoring`)."""
    try:
        summary = json.loads((d / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    scoring = (summary.get("deployment") or {}).get("late_binding_scoring") or {}
    return "kvasir" + (":" + ",".join(f"{k}={v}" for k, v in scoring.items()) if scoring else "")


def replay_stats(d: Path, workload: str, load: float, mode: str, placements: list[str],
                 q: str = "mean") -> dict[str, float] | None:
    """Statistic `q` (mean, p50, p90, p99) of a run replayed on vllm-sim's
    own engines (`kvasir-bench replay`) under each of `placements`. None
    when the replay cannot run (no binary, no trace file, no cache size in
    the folder's deployment record, no requests)."""
    rows = _replayed_rows(d, workload, load, mode, tuple(placements))
    out = {p: (rows or {}).get(p, {}).get(q) for p in placements}
    return out if all(v is not None for v in out.values()) else None


@functools.lru_cache(maxsize=None)
def _replayed_rows(d: Path, workload: str, load: float, mode: str,
                   placements: tuple[str, ...]) -> dict[str, dict] | None:
    """The replay's rows by placement (one run of the binary, whichever of
    their statistics the caller reads: a p50 and a p90 miss share it)."""
    if not BENCH.exists() or (workload == "trace" and not TRACE.exists()):
        return None
    args = [str(BENCH), "replay", "--dir", str(d), "--workload", workload, "--mode", mode, "--load", str(load),
            "--placements", ";".join(placements), "--json"]
    if workload == "trace":
        args += ["--trace", str(TRACE)]
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=600)
        return {x["placement"]: x for x in json.loads(r.stdout)} if r.returncode == 0 else None
    except (OSError, ValueError, KeyError, TypeError, subprocess.TimeoutExpired):
        return None


def replayed(d: Path, load: float, mode: str) -> dict[str, float] | None:
    """Mean TTFT of a chat run replayed on vllm-sim's own engines: its own
    placements (`own`), kvasir's ranking with state never stale, at the
    run's scoring (`fresh`), and the queue model's best oracle rule
    (`central`); None when the replay cannot run."""
    fresh = run_scoring(d)
    rows = replay_stats(d, "chat", load, mode, ["own", fresh, CENTRAL])
    return None if rows is None else {"own": rows["own"], "fresh": rows[fresh], "central": rows[CENTRAL]}


def replay_below_why(d: Path, load: float, q: str, k: str) -> str:
    """What the replay on the simulator's own engines says of a trace
    statistic not far enough below approx-prefix's: the two modes'
    placements replayed, and the lowest `q` of the routers tried there."""
    fresh = run_scoring(d)
    tried = [fresh, "kvasir:queuedPrefill=1", CENTRAL]
    mine = replay_stats(d, "trace", load, k, ["own", *tried], q)
    theirs = replay_stats(d, "trace", load, "approx-prefix", ["own"], q)
    if mine is None or theirs is None or not theirs["own"]:
        return ""
    lowest = min(mine[p] for p in tried)
    return (f"replayed on vllm-sim's own engines (`kvasir-bench replay`: batching, decode steps, eviction), the two "
            f"modes' placements give {ms(mine['own'])} and {ms(theirs['own'])}, and the lowest {q} of the routers "
            f"tried there (kvasir's ranking with state never stale at this run's weights or at `queuedPrefill` 1, a "
            f"central queue releasing quickest first) is {ms(lowest)}, {100 * (1 - lowest / theirs['own']):.1f}% below "
            "approx-prefix's replayed placements")


def replay_why(rep: dict[str, float] | None, balanced: float) -> str:
    """What the replay on the simulator's own engines says of a chat miss."""
    if rep is None or not balanced:
        return ""
    fresh, central = rep["fresh"], rep["central"]
    out = (f"; replayed on vllm-sim's own engines (`kvasir-bench replay`: batching, decode steps, eviction), this "
           f"run's placements give {ms(rep['own'])}, kvasir's ranking with state never stale {ms(fresh)} "
           f"({fresh / balanced:.2f}x perfect balance), a central queue releasing quickest first to engines with "
           f"under 2048 uncached tokens in prefill {ms(central)} ({central / balanced:.2f}x)")
    best = min(fresh, central)
    return out + (", so no router found there meets the target" if best / balanced > BALANCE
                  else ", so one router found there meets the target")


def balance_rows(r: Run, kvasir: str = KVASIR) -> list[dict]:
    out = []
    for (w, load, mode) in sorted(r.runs):
        if mode != kvasir or load > 1.5 + 1e-9:
            continue
        m, b = answered_mean(r.d, w, load, mode), r.model(w, load, mode, "balanced", "mean")
        target = f"{w} @{load}: {mode} mean TTFT (answered) <= {BALANCE}x perfect balance at its own reuse"
        if m is None or b is None:
            out.append({"target": target, "measured": "yardstick missing", "met": None, "why": ""})
            continue
        x = m / b
        met = x <= BALANCE
        why = ""
        if not met:
            own = r.model(w, load, mode, "queued_own", "mean")
            why = (f"on the engines {mode} chose the queue model gives {ms(own)} (measured {ms(m)}), perfectly "
                   f"balanced {ms(b)}: {ms(own - b)} of the mean is balance given up for cache hits"
                   if own is not None else "")
            if own is not None and abs(own - m) > 0.25 * m:
                why += f" (the model is {100 * abs(own - m) / m:.0f}% off the measured mean here, so only roughly)"
            if w == "chat":
                why += replay_why(replayed(r.d, load, mode), b)
        out.append({"target": target, "measured": f"{ms(m)} vs {ms(b)}: {x:.2f}x", "met": met, "why": why})
    return out


def met_word(met: bool | None) -> str:
    """A target's `met` as the tables write it."""
    return {True: "yes", False: "**no**", None: "not run"}[met]


def table(rows: list[dict]) -> str:
    lines = ["| deployed-shape target | measured | met | why (for a miss) |", "| --- | --- | --- | --- |"]
    for t in rows:
        lines.append(f"| {t['target']} | {t['measured']} | {met_word(t['met'])} | "
                     f"{t['why'] if t['met'] is False else ''} |")
    return "\n".join(lines) + "\n"


def kvasir_modes(r: Run) -> list[str]:
    """kvasir, then its variants (`kvasir-NAME`, routing.py's `--variants`)
    that ran, each checked against the same targets."""
    variants = sorted({m for (_, _, m) in r.runs if m.startswith(KVASIR + "-")})
    return [KVASIR, *variants]


def rows_of(d: Path) -> list[dict]:
    """Every target's row for a results folder: kvasir's, then each
    variant's (their targets name the variant)."""
    # Replays are shared within one reading of the folder, not across them
    # (the folder may have changed since).
    _replayed_rows.cache_clear()
    r = Run(d)
    return [row for k in kvasir_modes(r) for row in below_rows(r, k) + [hit_row(r, k)] + balance_rows(r, k)]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    d = Path(argv[0])
    rows = rows_of(d)
    (d / "targets-deployed.json").write_text(json.dumps(rows, indent=2))
    section = (f"{START}\n## The deployed-shape targets (one run; `bench/repeats.py` says what is beyond noise)\n\n"
               f"{table(rows)}{END}\n")
    report = d / "report.md"
    text = report.read_text() if report.exists() else ""
    if START in text and END in text:
        pre, _, rest = text.partition(START)
        text = pre + section + rest.partition(END)[2].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    report.write_text(text)
    print(table(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
