"""Run-to-run spread of the routing benchmark: the same `bench/routing.py`
invocation N times, then one table of every run's TTFT percentiles and hit
rate per (workload, load, mode), with each mode's spread across runs and,
per run, the kvasir mode's p90 against the approximate mode's.

A single full run compares kvasir and approx-prefix once per load; where the
two hold the same prefixes (low load: nothing is evicted behind a picks
index's back) their difference is run-to-run noise, and this says how big
that noise is. It runs nothing by itself beyond routing.py; `--from`
summarises run directories that already exist.

    .tools/venv/bin/python bench/repeats.py --runs 3 -- \\
        --preset full --workloads trace,chat --modes approx-prefix,kvasir \\
        --loads 1.0 --trace-rate 1.5 --chat-rate 12.5 --no-progress
    .tools/venv/bin/python bench/repeats.py --from bench/results/repeats/run1 bench/results/repeats/run2

Shapes side by side (an ablation), interleaved round by round so
a noisy machine weighs on every shape alike; `--variants` can be limited to
some shapes:

    .tools/venv/bin/python bench/repeats.py --runs 3 --shapes 1x1,2x1,1x2,2x2 \\
        --variants-only-on 2x2 -- --preset short --deployment deployed --workloads trace \\
        --modes kvasir --loads 1.0 --trace-rate 1.6 --no-progress \\
        --variants 'noshare:sharedLoad.redisUrl=null'
    .tools/venv/bin/python bench/repeats.py --shapes 1x1,2x2 --from bench/results/repeats-deployed-shapes

The deployed-like mode passes through the same way (`-- --deployment
deployed [--proxies N --replicas M] ...`); its runs go to
`bench/results/repeats-deployed[-NxM]/` unless `--out` says otherwise, so
the single-proxy repeats stay where they are, and the summary names the
shape the runs recorded.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

from kvasir_harness.paths import RESULTS

from . import deployed_targets as dt
from . import shapes as SHAPES

# The routing benchmark, run as its own process per repeat.
ROUTING = [sys.executable, "-m", "kvasir_harness.bench.routing"]


def render_targets(dirs: list[Path]) -> str:
    """The deployed-shape targets (bench/deployed_targets.py) checked in each run
    and how many runs meet each: what "confirmed beyond run-to-run noise"
    asks. Targets whose runs are missing everywhere are left out; empty
    when no run has any."""
    per_run = [{t["target"]: t for t in dt.rows_of(d)} for d in dirs]
    order = [t for t in per_run[0] if any(r.get(t, {}).get("met") is not None for r in per_run)]
    if not order:
        return ""
    lines = ["", "The deployed-shape targets in each run (bench/deployed_targets.py; variants against the same targets):", "",
             "| target | measured per run | runs that meet it |", "| --- | --- | ---: |"]
    for t in order:
        have = [r[t] for r in per_run if t in r and r[t]["met"] is not None]
        met = sum(1 for x in have if x["met"])
        lines.append(f"| {t} | {' / '.join(x['measured'] for x in have)} | {met} of {len(have)} |")
    return "\n".join(lines) + "\n"


def run_dirs(folder: Path) -> list[Path]:
    """A repeats folder's run directories (run1, run2, ...)."""
    dirs = sorted((d for d in folder.glob("run*") if (d / "summary.json").exists()),
                  key=lambda d: int(d.name[3:]) if d.name[3:].isdigit() else 0)
    if len(dirs) < 2:
        raise SystemExit(f"{folder}: fewer than 2 run directories with a summary.json")
    return dirs


def load_summaries(dirs: list[Path]) -> list[dict]:
    """Each directory's summary.json."""
    out = []
    for d in dirs:
        f = d / "summary.json"
        if not f.exists():
            raise SystemExit(f"{f} missing: not a routing.py results directory")
        out.append(json.loads(f.read_text()))
    return out


def load_runs(summaries: list[dict]) -> list[dict]:
    """Each summary's runs, keyed by (workload, load, mode)."""
    return [{(r["workload"], r["load"], r["mode"]): r for r in s["runs"]} for s in summaries]


def shape_of(summaries: list[dict]) -> str:
    """The shape the runs recorded (routing.py's `deployment` record); runs
    of different shapes are not one spread."""
    seen = set()
    for s in summaries:
        d = s.get("deployment")
        seen.add(None if d is None else (d["kind"], d["proxies"], d["replicas"]))
    if len(seen) > 1:
        raise SystemExit("the runs recorded different shapes ("
                         + ", ".join(sorted(describe(x) for x in seen)) + "): not one spread")
    return describe(seen.pop()) if seen else describe(None)


def describe(shape: tuple | None) -> str:
    if shape is None:
        return "not recorded (runs from before routing.py recorded it)"
    kind, proxies, replicas = shape
    if kind == "deployed":
        return (f"deployed-like, {proxies} Envoy{'s' if proxies > 1 else ''} x {replicas} indexer "
                f"replica{'s' if replicas > 1 else ''} ({proxies}x{replicas})")
    return "single proxy (1 Envoy, 1 indexer)"


def default_out(rest: list[str]) -> Path:
    """bench/results/repeats for single-proxy runs, repeats-deployed[-NxM]
    for deployed ones (the shape named when it is not 2x2, as routing.py
    names its folders)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--deployment", default="single")
    ap.add_argument("--proxies", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=2)
    known, _ = ap.parse_known_args(rest)
    name = "repeats"
    if known.deployment == "deployed":
        name += "-deployed" + ("" if (known.proxies, known.replicas) == (2, 2)
                               else f"-{known.proxies}x{known.replicas}")
    return RESULTS / name


def ms(v: float | str) -> str:
    # The report writes "inf" for a percentile past the last answered
    # request (deployed runs: the restart cuts some off).
    v = float(v)
    if math.isinf(v):
        return "∞"
    return f"{v / 1000:.2f} s" if v >= 10_000 else f"{v:.0f} ms" if v >= 100 else f"{v:.1f} ms"


def spread(vals: list[float | str]) -> str:
    vals = [float(v) for v in vals]
    lo, hi = min(vals), max(vals)
    mean = sum(vals) / len(vals)
    return f"{ms(lo)}-{ms(hi)} ({(hi - lo) / mean:.1%})" if mean > 0 and math.isfinite(mean) else "-"


def render(dirs: list[Path], runs: list[dict], command: str, shape: str) -> str:
    keys = sorted(set().union(*(r.keys() for r in runs)))
    lines = [
        "# Routing benchmark: run-to-run spread",
        "",
        f"{len(runs)} runs of `{command}`" if command else f"{len(runs)} runs",
        "(" + ", ".join(f"`{d.name}`" for d in dirs) + "). Each run starts a fresh cluster per mode; "
        "the spread is (max - min) / mean across runs.",
        "",
        f"Shape: {shape}.",
        "",
        "| workload | load | mode | TTFT p50 per run | TTFT p90 per run | TTFT p99 per run | hit rate per run "
        "| p90 spread | p99 spread |",
        "| --- | ---: | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k in keys:
        have = [r[k] for r in runs if k in r]
        t = [h["summary"]["ttft"] for h in have]
        lines.append(
            f"| {k[0]} | {k[1]:.1f} | {k[2]} | {' / '.join(ms(x['p50']) for x in t)} | "
            f"{' / '.join(ms(x['p90']) for x in t)} | {' / '.join(ms(x['p99']) for x in t)} | "
            f"{' / '.join(format(h['summary']['cache_hit_rate'], '.1%') for h in have)} | "
            f"{spread([x['p90'] for x in t])} | {spread([x['p99'] for x in t])} |")
    pairs = sorted({(w, ld) for w, ld, _ in keys})
    rows = []
    for w, ld in pairs:
        diffs = []
        for r in runs:
            a, k = r.get((w, ld, "approx-prefix")), r.get((w, ld, "kvasir"))
            if a and k:
                kp, ap = float(k["summary"]["ttft"]["p90"]), float(a["summary"]["ttft"]["p90"])
                if math.isfinite(kp) and math.isfinite(ap) and ap > 0:
                    diffs.append(kp / ap - 1)
        if diffs:
            below = sum(1 for x in diffs if x < 0)
            rows.append(f"| {w} | {ld:.1f} | {' / '.join(f'{x:+.1%}' for x in diffs)} | {below} of {len(diffs)} |")
    if rows:
        lines += ["", "kvasir's p90 TTFT against approx-prefix's in the same run:", "",
                  "| workload | load | kvasir p90 / approx p90 - 1, per run | runs with kvasir below |",
                  "| --- | ---: | --- | ---: |", *rows]
    return "\n".join(lines) + "\n"


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    """`1x1,2x2` -> [(1, 1), (2, 2)]."""
    out = []
    for part in filter(None, (x.strip() for x in spec.split(","))):
        a, _, b = part.partition("x")
        if not (a.isdigit() and b.isdigit() and int(a) > 0 and int(b) > 0):
            raise SystemExit(f"--shapes: expected NxM (Envoys x replicas), got {part!r}")
        out.append((int(a), int(b)))
    if not out:
        raise SystemExit("--shapes: no shape given")
    return out


def without_variants(rest: list[str]) -> list[str]:
    """routing.py's arguments less `--variants`."""
    out, skip = [], False
    for x in rest:
        if skip:
            skip = False
        elif x == "--variants":
            skip = True
        elif not x.startswith("--variants="):
            out.append(x)
    return out


def run_shapes(a: argparse.Namespace, rest: list[str]) -> int:
    """`--shapes`: every round runs each shape once, in order; then each
    shape's spread and the shapes side by side (bench/shapes.py)."""
    shapes = parse_shapes(a.shapes)
    names = [f"{p}x{r}" for p, r in shapes]
    only = set(filter(None, (a.variants_only_on or "").split(","))) or set(names)
    out = Path(a.out) if a.out else RESULTS / "repeats-deployed-shapes"
    if a.dirs:
        if len(a.dirs) != 1:
            raise SystemExit("--shapes with --from takes one folder (its <shape>/run*/ directories)")
        out = Path(a.dirs[0])
    else:
        if "--deployment" not in rest or rest[rest.index("--deployment") + 1:][:1] != ["deployed"]:
            raise SystemExit("--shapes needs `-- --deployment deployed ...`")
        if any(x.startswith(("--proxies", "--replicas", "--out")) for x in rest):
            raise SystemExit("--shapes sets --proxies, --replicas and --out per run; leave them out")
        if a.runs < 2:
            raise SystemExit("--runs must be at least 2 to show a spread")
        for i in range(1, a.runs + 1):
            for (p, r), name in zip(shapes, names):
                d = out / name / f"run{i}"
                args = rest if name in only else without_variants(rest)
                print(f"[repeats] round {i} of {a.runs}, shape {name} -> {d}", flush=True)
                subprocess.run([*ROUTING, *args, "--proxies", str(p), "--replicas", str(r),
                                "--out", str(d)], check=True)
    command = a.command or ("python bench/routing.py " + " ".join(shlex.quote(x) for x in rest) if rest else "")
    md = []
    dirs_by_shape = {}
    for name in names:
        dirs = run_dirs(out / name)
        dirs_by_shape[name] = dirs
        summaries = load_summaries(dirs)
        md.append(render(dirs, load_runs(summaries), command, shape_of(summaries)))
    try:
        md.append(SHAPES.render_ablation(dirs_by_shape))
    except SHAPES.Refused as e:
        raise SystemExit(f"--shapes: {e}")
    text = "\n".join(md)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(text)
    print(text, end="")
    return 0


def main(argv: list[str]) -> int:
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    else:
        rest = []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", help="default: bench/results/repeats, or repeats-deployed[-NxM] for "
                    "`--deployment deployed` runs")
    ap.add_argument("--from", dest="dirs", nargs="+", help="summarise these run directories, run nothing")
    ap.add_argument("--command", default="", help="the command to name in the summary (with --from)")
    ap.add_argument("--compare-to", help="another repeats folder (its run*/ directories) of the same setup and "
                    "another shape: adds the shapes' p90 per run, their means and the 2x2-within-5%%-of-1x1 "
                    "row (bench/shapes.py)")
    ap.add_argument("--shapes", help="deployed only: NxM shapes (Envoys x indexer replicas), e.g. "
                    "1x1,2x1,1x2,2x2, each run once per round in this order; runs go to OUT/<shape>/run<i> "
                    "(default OUT: bench/results/repeats-deployed-shapes), the summary adds the shapes side by "
                    "side with a placement yardstick (bench/shapes.py); with --from, one such OUT")
    ap.add_argument("--variants-only-on", help="with --shapes: the shapes that get routing.py's --variants "
                    "(default: all)")
    a = ap.parse_args(argv)
    if a.shapes:
        return run_shapes(a, rest)
    out = Path(a.out) if a.out else default_out(rest)
    if a.dirs:
        dirs = [Path(d) for d in a.dirs]
        command = a.command
    else:
        if a.runs < 2:
            raise SystemExit("--runs must be at least 2 to show a spread")
        if any(x == "--out" or x.startswith("--out=") for x in rest):
            raise SystemExit("routing.py's --out is set per run here; leave it out")
        out.mkdir(parents=True, exist_ok=True)
        dirs = []
        for i in range(1, a.runs + 1):
            d = out / f"run{i}"
            print(f"[repeats] run {i} of {a.runs} -> {d}", flush=True)
            subprocess.run([*ROUTING, *rest, "--out", str(d)], check=True)
            dirs.append(d)
        command = "python bench/routing.py " + " ".join(shlex.quote(x) for x in rest)
    summaries = load_summaries(dirs)
    md = render(dirs, load_runs(summaries), command, shape_of(summaries))
    if all((s.get("deployment") or {}).get("kind") == "deployed" for s in summaries):
        md += render_targets(dirs)
    if a.compare_to:
        shapes = SHAPES
        others = run_dirs(Path(a.compare_to))
        try:
            md += "\n" + shapes.render_repeats(dirs, [shapes.read_summary(d) for d in dirs], others,
                                               [shapes.read_summary(d) for d in others])
        except shapes.Refused as e:
            raise SystemExit(f"--compare-to: {e}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
