"""Two routing benchmark runs that differ only in their shape (Envoys x
indexer replicas), side by side (the target: "the 2x2 deployment's p90 TTFT
within 5% of a 1x1 run at the same load"); also the setup record and the
replicas' shared-load samples that `bench/routing.py` takes for it.

It reads each results directory's summary.json (its `deployment` record,
which `bench/routing.py` adds after the report) and the per-request CSVs,
refuses two runs whose setups differ in anything but the shape (preset,
caches, load-1.0 rates, restart, direct share, trace window, engines), and
writes a markdown table per workload, load and mode present in both: TTFT
p50 / p90 (unanswered requests counted as infinitely slow, as in the
report), mean TTFT of the answered requests, hit rate, and the picks per
indexer replica. `bench/routing.py --compare-to DIR` appends it to the
run's report; this script does the same for two existing directories.

    .tools/venv/bin/python bench/shapes.py bench/results/routing-deployed-short bench/results/routing-deployed-1x1-short
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import threading
from http.client import HTTPException
from pathlib import Path

from kvasir_harness.paths import REPO

# The target: the larger shape's p90 TTFT at most this much above
# the 1x1 run's.
P90_WITHIN = 0.05
# Rates read back from JSON farther apart than this (relative) are
# another load: a calibrated rate differs from run to run.
RATE_TOLERANCE = 1e-6


def deployment_record(kind: str, preset: str, engines: int, shape: tuple[int, int], direct_share: float,
                      restart: dict | None, workloads: dict[str, dict], preset_settings: dict) -> dict:
    """What routing.py adds to summary.json of a run's setup (`deployment`),
    so that two runs that differ only in their shape can be told from two
    that differ in more: `workloads` maps each workload to its load-1.0
    rate and caches, completed here with its time scale and window."""
    p = preset_settings
    out = {}
    for w, rec in workloads.items():
        rec = {**rec, "time_scale": p[f"{w}_time_scale"]}
        if w == "trace":
            rec.update(from_s=p["trace_from_s"], window_s=p["trace_window_s"])
        else:
            rec.update(duration_s=p["chat_duration_s"])
        out[w] = rec
    return {"kind": kind, "preset": preset, "engines": engines, "proxies": shape[0], "replicas": shape[1],
            "direct_share": direct_share, "restart": restart, "workloads": out}


class SharedLoadSampler:
    """Samples each indexer replica's view of the others while a run goes:
    the indexer exposes the peers' picks still in prefill and their
    in-flight picks only as gauges (it counts no picks that a peer's chain
    decided), which read 0 once the run is over. Polls every `every_s` on a
    thread of its own while the `with` block runs."""

    def __init__(self, indexers: list, every_s: float):
        self.indexers, self.every_s = indexers, every_s
        self.samples: list[list[tuple[float, float]]] = [[] for _ in indexers]
        self.misses = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="shared-load-sampler", daemon=True)

    def _loop(self) -> None:
        from kvasir_harness import prom  # only here: the comparison runs without the harness

        while not self.done.wait(self.every_s):
            for i, ix in enumerate(self.indexers):
                try:
                    text = ix.metrics_text()
                except (OSError, HTTPException):
                    # A busy indexer past the harness's HTTP timeout: a gap, not an error.
                    self.misses += 1
                    continue
                self.samples[i].append((prom.total(text, "kvasir_indexer_shared_load_peer_pending_chains"),
                                        prom.total(text, "kvasir_indexer_shared_load_peer_in_flight")))

    def __enter__(self) -> "SharedLoadSampler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(timeout=10)
        self.final = []
        for ix in self.indexers:
            try:
                self.final.append(ix.metrics_text())
            except (OSError, HTTPException):
                self.final.append(None)

    def notes(self) -> dict:
        """Per replica: the peers' pending chains it held (mean and most
        over the samples) and the peers' in-flight picks it counted (mean)."""
        out: dict = {}
        for i, s in enumerate(self.samples):
            if s:
                out[f"indexer{i} peer pending chains mean"] = round(sum(x[0] for x in s) / len(s), 1)
                out[f"indexer{i} peer pending chains max"] = int(max(x[0] for x in s))
                out[f"indexer{i} peer in-flight mean"] = round(sum(x[1] for x in s) / len(s), 1)
        if self.misses:
            out["shared-load samples missed"] = self.misses
        out.update(self.pick_notes())
        return out

    def pick_notes(self) -> dict:
        """Per replica, read once the run is over: its picks' mean time inside
        the indexer and the 90th percentile by the histogram's buckets (us),
        and the sharing rounds it ran (all results)."""
        from kvasir_harness import prom

        out: dict = {}
        for i, text in enumerate(getattr(self, "final", [])):
            if text is None:
                continue
            n = prom.total(text, "kvasir_indexer_pick_duration_seconds_count")
            if n > 0:
                total = prom.total(text, "kvasir_indexer_pick_duration_seconds_sum")
                out[f"indexer{i} pick mean us"] = round(total / n * 1e6)
                buckets = sorted((float(le), v) for le, v in
                                 prom.by_label(text, "kvasir_indexer_pick_duration_seconds_bucket", "le").items())
                p90 = next((le for le, v in buckets if v >= 0.9 * n), math.inf)
                out[f"indexer{i} pick p90 us (bucket)"] = round(p90 * 1e6) if math.isfinite(p90) else "inf"
            out[f"indexer{i} sharing rounds"] = int(prom.total(text, "kvasir_indexer_shared_load_rounds_total"))
            # Reports that reached a replica that did not answer the pick
            # (unmatched), and what is still counted once every request is
            # over: a pick whose reports went elsewhere stays queued there
            # until the prefill horizon, and the peers count it too.
            by = prom.by_label(text, "kvasir_indexer_reports_total", "matched")
            out[f"indexer{i} reports unmatched"] = int(by.get("false", 0))
            out[f"indexer{i} reports matched"] = int(by.get("true", 0))
            out[f"indexer{i} queued prefill at end"] = int(
                prom.total(text, "kvasir_indexer_endpoint_queued_prefill_tokens"))
            out[f"indexer{i} unconfirmed at end"] = int(prom.total(text, "kvasir_indexer_in_flight_unconfirmed"))
        return out


class Refused(Exception):
    """Two runs that cannot be compared, and why."""


def read_summary(d: Path) -> dict:
    """`d`'s summary.json, which must carry routing.py's `deployment` record."""
    f = d / "summary.json"
    if not f.exists():
        raise Refused(f"{f} missing: not a routing.py results directory")
    s = json.loads(f.read_text())
    if "deployment" not in s:
        raise Refused(f"{f} has no `deployment` record (a run from before `--proxies`/`--replicas`): "
                      "rerun it to compare shapes")
    return s


def shape_name(dep: dict) -> str:
    """`2x2`: Envoys x indexer replicas."""
    return f"{dep['proxies']}x{dep['replicas']}"


def setup_differences(a: dict, b: dict) -> list[str]:
    """What two `deployment` records differ in besides the shape, over the
    workloads both ran; empty when they are comparable."""
    out = []
    for k in sorted((set(a) | set(b)) - {"proxies", "replicas", "workloads"}):
        if a.get(k) != b.get(k):
            out.append(f"{k}: {a.get(k)!r} against {b.get(k)!r}")
    common = sorted(set(a.get("workloads", {})) & set(b.get("workloads", {})))
    if not common:
        out.append(f"workloads: none in common ({sorted(a.get('workloads', {}))} against "
                   f"{sorted(b.get('workloads', {}))})")
    for w in common:
        wa, wb = a["workloads"][w], b["workloads"][w]
        for k in sorted(set(wa) | set(wb)):
            va, vb = wa.get(k), wb.get(k)
            same = (math.isclose(va, vb, rel_tol=RATE_TOLERANCE) if isinstance(va, float) and isinstance(vb, float)
                    else va == vb)
            if not same:
                out.append(f"{w} {k}: {va!r} against {vb!r}")
    return out


def check_comparable(this: dict, other: dict, other_dir: Path) -> None:
    """Raises Refused naming every difference between the two setups."""
    diff = setup_differences(this["deployment"], other["deployment"])
    if diff:
        raise Refused(f"{other_dir} ran another setup, not only another shape: " + "; ".join(diff))


def runs_by_key(summary: dict) -> dict[tuple, dict]:
    return {(r["workload"], float(r["load"]), r["mode"]): r for r in summary["runs"]}


def num(v) -> float:
    """A summary value; the report writes "inf" for percentiles no request reached."""
    return float(v)


def answered_mean_ttft(d: Path, run: dict) -> tuple[float, int]:
    """(mean TTFT of the answered requests in ms, requests not answered)
    from the run's CSV; (nan, failed) without one."""
    f = d / f"{run['workload']}-{float(run['load']):.2f}-{run['mode']}.csv"
    if not f.exists():
        return math.nan, int(run["summary"].get("failed", 0))
    ok, failed = [], 0
    with f.open() as fh:
        for r in csv.DictReader(fh):
            if r["outcome"] == "ok" and r["ttft_ms"]:
                ok.append(float(r["ttft_ms"]))
            else:
                failed += 1
    return (sum(ok) / len(ok) if ok else math.nan), failed


def replica_split(run: dict) -> str:
    """Picks per indexer replica as the run's facts record them ("-" for
    modes without an indexer)."""
    notes = run.get("notes", {})
    picks = [notes[k] for k in sorted(notes) if k.startswith("picks by indexer")]
    return " / ".join(str(int(p)) for p in picks) if picks else "-"


def ms(v: float) -> str:
    if math.isnan(v):
        return "-"
    if math.isinf(v):
        return "unanswered"
    return f"{v / 1000:.2f} s" if v >= 10_000 else f"{v:.0f} ms"


def ratio(a: float, b: float) -> str:
    if not (math.isfinite(a) and math.isfinite(b)) or b <= 0:
        return "-"
    return f"{a / b - 1:+.1%}"


def reference_side(this: dict, other: dict) -> str | None:
    """Which side the target measures against: "other" or "this" when that
    one is 1x1 and the other is not; None otherwise."""
    one = {"this": shape_name(this) == "1x1", "other": shape_name(other) == "1x1"}
    if one["this"] == one["other"]:
        return None
    return "this" if one["this"] else "other"


def shown(d: Path) -> str:
    """`d` as the report names it: relative to the checkout when inside it,
    so committed reports do not carry this machine's paths."""
    root = REPO
    try:
        return str(Path(d).resolve().relative_to(root))
    except ValueError:
        return str(d)


def render(this_dir: Path, this: dict, other_dir: Path, other: dict) -> str:
    """The comparison as markdown (this run first, then the other)."""
    check_comparable(this, other, other_dir)
    tn, on = shape_name(this["deployment"]), shape_name(other["deployment"])
    if tn == on:
        tn, on = f"{tn} (this)", f"{on} (other)"
    a, b = runs_by_key(this), runs_by_key(other)
    keys = sorted(set(a) & set(b))
    lines = [
        f"## Shapes: {tn} against {on}",
        "",
        f"This run (`{shown(this_dir)}`, {tn}: Envoys x indexer replicas) against `{shown(other_dir)}` ({on}), the same "
        "preset, caches, load-1.0 rates, restart and direct share (checked on both runs' `deployment` records). "
        "TTFT p50 and p90 count unanswered requests as infinitely slow; the mean is over the answered ones "
        "(the restart cuts some off). Picks per replica: each indexer replica's picks, from the run's facts.",
        "",
        f"| workload | load | mode | TTFT p50 {tn} / {on} | TTFT p90 {tn} / {on} | p90 {tn} / {on} - 1 | "
        f"mean TTFT {tn} / {on} | hit rate {tn} / {on} | unanswered {tn} / {on} | picks per replica {tn} | "
        f"picks per replica {on} |",
        "| --- | ---: | --- | --- | --- | ---: | --- | --- | --- | --- | --- |",
    ]
    for k in keys:
        ra, rb = a[k], b[k]
        ta, tb = ra["summary"]["ttft"], rb["summary"]["ttft"]
        ma, fa = answered_mean_ttft(this_dir, ra)
        mb, fb = answered_mean_ttft(other_dir, rb)
        lines.append(
            f"| {k[0]} | {k[1]:.1f} | {k[2]} | {ms(num(ta['p50']))} / {ms(num(tb['p50']))} | "
            f"{ms(num(ta['p90']))} / {ms(num(tb['p90']))} | {ratio(num(ta['p90']), num(tb['p90']))} | "
            f"{ms(ma)} / {ms(mb)} | {num(ra['summary']['cache_hit_rate']):.1%} / "
            f"{num(rb['summary']['cache_hit_rate']):.1%} | {fa} / {fb} | {replica_split(ra)} | {replica_split(rb)} |")
    lines += ["", *target_rows(this, other, keys, a, b)]
    return "\n".join(lines) + "\n"


def target_rows(this: dict, other: dict, keys: list[tuple], a: dict, b: dict) -> list[str]:
    """The target per workload and load: kvasir's p90 on the larger
    shape within P90_WITHIN of 1x1's, the other modes for context."""
    ref = reference_side(this["deployment"], other["deployment"])
    if ref is None:
        return ["No target row: the target compares a larger shape against 1x1, and neither or both "
                "of these runs are 1x1."]
    big, one = (a, b) if ref == "other" else (b, a)
    big_name = shape_name((this if ref == "other" else other)["deployment"])
    out = [f"Target: {big_name} p90 TTFT within {P90_WITHIN:.0%} of 1x1 at the same load; kvasir is "
           "the target, the other modes are context. One run each: repeat (bench/repeats.py) before calling a "
           "difference of a few percent.", "",
           f"| workload | load | mode | p90 {big_name} | p90 1x1 | {big_name} / 1x1 - 1 | within {P90_WITHIN:.0%} |",
           "| --- | ---: | --- | ---: | ---: | ---: | --- |"]
    order = sorted(keys, key=lambda k: (k[0], k[1], k[2] != "kvasir", k[2]))
    for k in order:
        pb, p1 = num(big[k]["summary"]["ttft"]["p90"]), num(one[k]["summary"]["ttft"]["p90"])
        if math.isfinite(pb) and math.isfinite(p1) and p1 > 0:
            d = pb / p1 - 1
            met = ("**yes**" if d <= P90_WITHIN else "**no**") if k[2] == "kvasir" else \
                ("yes" if d <= P90_WITHIN else "no")
            change = f"{d:+.1%}"
        else:
            met, change = "-", "-"
        out.append(f"| {k[0]} | {k[1]:.1f} | {k[2]} | {ms(pb)} | {ms(p1)} | {change} | {met} |")
    return out


def render_repeats(this_dirs: list[Path], this: list[dict], other_dirs: list[Path], other: list[dict]) -> str:
    """The target across repeated runs of two shapes (bench/repeats.py
    `--compare-to`): per workload, load and mode run on both, each run's
    p90, the mean p90 of each shape, their ratio, and whether the
    difference is beyond the runs' own spread (the two shapes' ranges do
    not overlap). Every run must share one setup but for the shape."""
    for d, s in zip(this_dirs + other_dirs[1:], this + other[1:]):
        diff = setup_differences(s["deployment"], other[0]["deployment"])
        if diff:
            raise Refused(f"{d} and {other_dirs[0]} ran other setups, not only other shapes (give the rates: "
                          "--trace-rate / --chat-rate, so no run calibrates its own): " + "; ".join(diff))
    shapes_seen = {shape_name(s["deployment"]) for s in this}, {shape_name(s["deployment"]) for s in other}
    if len(shapes_seen[0]) != 1 or len(shapes_seen[1]) != 1:
        raise Refused(f"each side must hold one shape, got {sorted(shapes_seen[0])} and {sorted(shapes_seen[1])}")
    tn, on = shapes_seen[0].pop(), shapes_seen[1].pop()
    a, b = [runs_by_key(s) for s in this], [runs_by_key(s) for s in other]
    keys = sorted(set.intersection(*(set(r) for r in a + b)))
    ref = reference_side(this[0]["deployment"], other[0]["deployment"])
    lines = [f"## Shapes across runs: {tn} ({len(a)} runs) against {on} ({len(b)} runs)", "",
             "p90 TTFT per run (unanswered requests infinitely slow). Beyond noise: the two shapes' ranges of "
             "p90 over their runs do not overlap.", "",
             f"| workload | load | mode | p90 {tn} per run | p90 {on} per run | mean {tn} / mean {on} - 1 | "
             "beyond noise |" + (f" within {P90_WITHIN:.0%} (target, larger shape against 1x1) |" if ref else ""),
             "| --- | ---: | --- | --- | --- | ---: | --- |" + (" --- |" if ref else "")]
    for k in sorted(keys, key=lambda k: (k[0], k[1], k[2] != "kvasir", k[2])):
        pa = [num(r[k]["summary"]["ttft"]["p90"]) for r in a]
        pb = [num(r[k]["summary"]["ttft"]["p90"]) for r in b]
        ma, mb = sum(pa) / len(pa), sum(pb) / len(pb)
        apart = min(pa) > max(pb) or min(pb) > max(pa)
        row = (f"| {k[0]} | {k[1]:.1f} | {k[2]} | {' / '.join(ms(x) for x in pa)} | {' / '.join(ms(x) for x in pb)} "
               f"| {ratio(ma, mb)} | {'yes' if apart else 'no'} |")
        if ref:
            big, one = (ma, mb) if ref == "other" else (mb, ma)
            within = big <= one * (1 + P90_WITHIN) if math.isfinite(big) and math.isfinite(one) else None
            row += " - |" if within is None else f" {'yes' if within else 'no'} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


# The FCFS yardstick of `placement_regret`: the profile's prefill step
# (FACTS.md, h100-8b: ~30 ms + 0.03 ms per uncached token) per chunk of
# the token budget, simulated ms. No batching: a yardstick for where picks
# went, not a TTFT prediction.
STEP_MS, TOKEN_MS, BUDGET = 30.0, 0.03, 8192
# A pick is "late" when the engine it chose had this much more prefill
# queued (by the yardstick) than the least loaded one.
LATE_MS = 250.0


def placement_regret(f: Path) -> dict:
    """Where a run's picks went, priced by one FCFS prefill queue per engine
    (each answered request's uncached tokens, from its send time): the mean
    of, at each send, the chosen engine's queued work over the least loaded
    engine's (regret), the share of picks with more than LATE_MS of it, and
    the mean TTFT those queues give. Two shapes at the same arrivals and hit
    rate that differ here differ in placement, not in execution."""
    rows = []
    if f.exists():
        with f.open() as fh:
            rows = [r for r in csv.DictReader(fh)
                    if r.get("outcome") == "ok" and r.get("endpoint") and r.get("prompt_tokens")]
    rows.sort(key=lambda r: float(r["sent_s"]))
    free = {e: 0.0 for e in {r["endpoint"] for r in rows}}
    regret, model = [], []
    for r in rows:
        t = float(r["sent_s"]) * 1000
        least = min(max(0.0, v - t) for v in free.values())
        e = r["endpoint"]
        regret.append(max(0.0, free[e] - t) - least)
        prompt = int(r["prompt_tokens"])
        todo = max(1, prompt - min(int(r["cached_tokens"]), prompt - 1))
        cost = STEP_MS * math.ceil(todo / BUDGET) + TOKEN_MS * todo
        free[e] = max(free[e], t) + cost
        model.append(free[e] - t)
    if not rows:
        return {"regret": math.nan, "late": math.nan, "fcfs": math.nan}
    return {"regret": sum(regret) / len(regret), "late": sum(x > LATE_MS for x in regret) / len(regret),
            "fcfs": sum(model) / len(model)}


def mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def one_decimal(v: float, unit: str = "") -> str:
    return "-" if math.isnan(v) else f"{v:.1f}{unit}"


def render_ablation(shapes: dict[str, list[Path]]) -> str:
    """Several shapes' repeated runs of one setup side by side (`bench/repeats.py
    --shapes`): per workload, load and mode, each shape's means over its runs
    (per-run values in brackets for p90), the replicas' split, CPU seconds per
    process kind, how busy the machine was, and the placement yardstick
    ([`placement_regret`]); the p90 against the first shape's."""
    loaded = {name: [(d, read_summary(d)) for d in dirs] for name, dirs in shapes.items()}
    first = next(iter(loaded.values()))[0][1]
    for name, runs in loaded.items():
        for d, s in runs:
            check_comparable(first, s, d)
    keys = sorted({k for runs in loaded.values() for _, s in runs for k in runs_by_key(s)})
    lines = ["## Shapes side by side", "",
             "Means over each shape's runs; p90 per run in brackets; `vs first` is the mean p90 over the first "
             "shape's (a variant the first shape did not run: over its plain kvasir). cpu s: engines / indexers / proxies per run (means); busy: the machine's (all processes, "
             "anything else running on it too). Placement: one FCFS prefill queue per engine at the run's own arrivals and "
             f"reuse (~{STEP_MS:.0f} ms + {TOKEN_MS} ms per uncached token per {BUDGET}-token chunk): regret = the "
             "chosen engine's queued work over the least loaded engine's at each send, late = picks with more "
             f"than {LATE_MS:.0f} ms of it, fcfs = mean TTFT of those queues.", "",
             "| workload | load | mode | shape | runs | TTFT p50 | p90 (per run) | vs first | mean (answered) | hit rate "
             "| picks per replica | cpu s eng / idx / prx | busy | regret | late | fcfs mean |",
             "| --- | ---: | --- | --- | ---: | ---: | --- | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    def mean_p90(runs: list, k: tuple) -> float:
        return mean([num(runs_by_key(s)[k]["summary"]["ttft"]["p90"]) for _, s in runs if k in runs_by_key(s)])

    first_runs = next(iter(loaded.values()))
    for k in keys:
        # A variant run only on later shapes is set against the first shape's
        # plain mode (e.g. 2x2's kvasir-noshare against 1x1's kvasir).
        base = mean_p90(first_runs, k)
        if math.isnan(base) and k[2].startswith("kvasir-"):
            base = mean_p90(first_runs, (k[0], k[1], "kvasir"))
        for name, runs in loaded.items():
            have = [(d, runs_by_key(s)[k]) for d, s in runs if k in runs_by_key(s)]
            if not have:
                continue
            t = [r["summary"]["ttft"] for _, r in have]
            p90s = [num(x["p90"]) for x in t]
            p90 = mean(p90s)
            notes = [r.get("notes", {}) for _, r in have]
            cpu = " / ".join(one_decimal(mean([n.get(f"cpu s {c}", math.nan) for n in notes]))
                             for c in ("engines", "indexers", "proxies"))
            busy = one_decimal(mean([n.get("cpu machine busy %", math.nan) for n in notes]), "%")
            place = [placement_regret(d / f"{k[0]}-{k[1]:.2f}-{k[2]}.csv") for d, _ in have]
            lines.append(
                f"| {k[0]} | {k[1]:.1f} | {k[2]} | {name} | {len(have)} | {ms(mean([num(x['p50']) for x in t]))} | "
                f"{ms(p90)} ({' / '.join(ms(x) for x in p90s)}) | {ratio(p90, base)} | "
                f"{ms(mean([answered_mean_ttft(d, r)[0] for d, r in have]))} | "
                f"{mean([r['summary']['cache_hit_rate'] for _, r in have]):.1%} | "
                f"{'; '.join(replica_split(r) for _, r in have)} | {cpu} | {busy} | "
                f"{ms(mean([p['regret'] for p in place]))} | {mean([p['late'] for p in place]):.1%} | "
                f"{ms(mean([p['fcfs'] for p in place]))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("this", help="a routing.py results directory")
    ap.add_argument("other", help="another one, of another shape")
    ap.add_argument("--out", help="write the table here too (default: print only)")
    a = ap.parse_args(argv)
    this_dir, other_dir = Path(a.this), Path(a.other)
    try:
        md = render(this_dir, read_summary(this_dir), other_dir, read_summary(other_dir))
    except Refused as e:
        print(f"shapes: {e}", file=sys.stderr)
        return 2
    if a.out:
        Path(a.out).write_text(md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
