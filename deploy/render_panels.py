#!/usr/bin/env python3
"""Renders the Grafana dashboard's panels (deploy/grafana/kvasir.json) to
PNG from a Prometheus's query_range API, one image per dashboard row, for
a look at the dashboard without Grafana (the images in docs/images/ come
from tests/e2e/test_dashboards.py's run through this script: `make
dashboards`).

    .tools/venv/bin/python deploy/render_panels.py --prometheus http://127.0.0.1:9090 \\
        --minutes 15 --out /tmp/kvasir-panels

Each panel's queries run as Grafana would run them, with `$tenant` and
`$pool` as "All" (`.*`) and `$__rate_interval` as given; series are
labelled by the target's legendFormat. Needs matplotlib (in the venv).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable

DASHBOARD = Path(__file__).resolve().parent / "grafana" / "kvasir.json"
COLUMNS = 3


def substitute(expr: str, rate_interval: str = "10s", variables: dict[str, str] | None = None) -> str:
    """The query Grafana sends: variables replaced (multi-value "All" is
    `.*`), `$__rate_interval` by `rate_interval`."""
    out = expr.replace("$__rate_interval", rate_interval)
    for name, value in {"tenant": ".*", "pool": ".*", **(variables or {})}.items():
        out = out.replace(f"${name}", value)
    return out


def rows(dashboard: dict) -> list[tuple[str, list[dict]]]:
    """(row title, its panels) in order."""
    out: list[tuple[str, list[dict]]] = []
    for p in dashboard["panels"]:
        if p["type"] == "row":
            out.append((p["title"], []))
        else:
            if not out:
                out.append(("", []))
            out[-1][1].append(p)
    return out


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip() or \
        ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def query_range(prometheus: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    q = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": str(step)})
    with urllib.request.urlopen(f"{prometheus.rstrip('/')}/api/v1/query_range?{q}", timeout=30) as r:
        body = json.loads(r.read())
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body.get('error')}")
    return body["data"]["result"]


def formatter(unit: str) -> Callable[[float, Any], str]:
    def short(v: float) -> str:
        a = abs(v)
        if a >= 1e6:
            return f"{v / 1e6:.3g}M"
        if a >= 1e3:
            return f"{v / 1e3:.3g}k"
        return f"{v:.3g}"

    def fmt(v: float, _pos: Any = None) -> str:
        if unit == "percentunit":
            return f"{v * 100:.3g}%"
        if unit == "ms":
            return f"{v / 1000:.3g} s" if abs(v) >= 1000 else f"{v:.3g} ms"
        if unit == "s":
            return f"{v * 1000:.3g} ms" if 0 < abs(v) < 1 else f"{v:.3g} s"
        if unit == "bytes":
            return f"{v / 1024:.3g} KiB" if abs(v) >= 1024 else f"{v:.0f} B"
        if unit == "reqps":
            return f"{short(v)} req/s"
        if unit == "ops":
            return f"{short(v)}/s"
        if unit.startswith("suffix:"):
            return f"{short(v)}{unit[len('suffix:'):]}"
        return short(v)

    return fmt


def render(prometheus: str, start: float, end: float, out: Path, step: float = 1.0, rate_interval: str = "10s",
           dashboard: Path = DASHBOARD, marks: list[tuple[float, str]] | None = None,
           prefix: str = "dashboard-") -> list[Path]:
    """One PNG per row of `dashboard` under `out`; `marks`: (unix time,
    label) drawn as vertical lines on every panel (what the run did)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for title, panels in rows(json.loads(dashboard.read_text())):
        n = len(panels)
        lines = math.ceil(n / COLUMNS)
        fig, axes = plt.subplots(lines, COLUMNS, figsize=(5.2 * COLUMNS, 3.1 * lines), squeeze=False)
        for ax in axes.flat[n:]:
            ax.axis("off")
        for ax, panel in zip(axes.flat, panels):
            plotted, lowest, highest = 0, math.inf, -math.inf
            for target in panel["targets"]:
                for s in query_range(prometheus, substitute(target["expr"], rate_interval), start, end, step):
                    pts = [(float(t) - start, float(v)) for t, v in s["values"]]
                    finite = [v for _, v in pts if math.isfinite(v)]
                    if not finite:
                        continue
                    # A missing step is a gap in the line, as in Grafana
                    # (a stopped target's series end, they do not slope).
                    xs, ys = [], []
                    for t, v in pts:
                        if xs and t - xs[-1] > 1.5 * step:
                            xs.append(xs[-1] + step)
                            ys.append(math.nan)
                        xs.append(t)
                        ys.append(v)
                    lowest, highest = min(lowest, *finite), max(highest, *finite)
                    ax.plot(xs, ys, linewidth=1.1, label=legend(target.get("legendFormat", ""), s["metric"]))
                    plotted += 1
            for i, (t, _label) in enumerate(marks or [], 1):
                ax.axvline(t - start, color="0.55", linestyle=":", linewidth=0.9)
                ax.annotate(str(i), xy=(t - start, 0.99), xycoords=("data", "axes fraction"), fontsize=6,
                            ha="right", va="top", color="0.35")
            ax.set_title(panel["title"], fontsize=10, loc="left")
            ax.yaxis.set_major_formatter(FuncFormatter(formatter(panel["fieldConfig"]["defaults"].get("unit", ""))))
            ax.tick_params(labelsize=7)
            ax.set_xlim(0, end - start)
            if plotted and lowest >= 0:
                ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], highest * 1.05, 1e-9))
            ax.grid(True, linewidth=0.3, alpha=0.6)
            if plotted:
                ax.legend(fontsize=6, loc="best", ncol=2 if plotted > 6 else 1, framealpha=0.6)
            else:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5")
        for ax in axes[-1]:
            ax.set_xlabel("seconds", fontsize=7)
        fig.suptitle(f"Kvasir dashboard: {title}", fontsize=12, x=0.01, ha="left")
        if marks:
            fig.text(0.01, 1 - 0.42 / fig.get_figheight(), "   ".join(f"{i} {label}" for i, (_t, label) in
                                                                      enumerate(marks, 1)),
                     fontsize=8, color="0.3", ha="left", va="top")
        fig.tight_layout(rect=(0, 0, 1, 1 - (0.3 if marks else 0) / fig.get_figheight()))
        path = out / f"{prefix}{re.sub(r'[^a-z0-9]+', '-', title.lower()).strip('-')}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090")
    ap.add_argument("--minutes", type=float, default=15, help="the last N minutes (default 15)")
    ap.add_argument("--step", type=float, default=None, help="seconds between points (default: range / 300)")
    ap.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for (default 1m)")
    ap.add_argument("--out", type=Path, default=Path("kvasir-panels"))
    a = ap.parse_args(argv)
    end = time.time()
    start = end - a.minutes * 60
    for p in render(a.prometheus, start, end, a.out, step=a.step or max(1.0, (end - start) / 300),
                    rate_interval=a.rate_interval):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
