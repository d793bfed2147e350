"""What a soak measures besides its own load: each process's resident
memory sampled over the run, and whether it was steady.

"Steady" here means both of:

* **no trend**: the least-squares slope of RSS over the run after its
  first 20% (the warm-up: pools, caches, connection buffers and the
  allocator's arenas fill) is at most `SLOPE_LIMIT_MIB` per 10 minutes, or
  `SLOPE_LIMIT_SHARE` of the process's median RSS if that is more;
* **no drift**: the median RSS of the run's last tenth is within
  `DRIFT_LIMIT_SHARE` (or `DRIFT_LIMIT_MIB`, if more) of the median of
  its second tenth (for a 10-minute run: the last minute against the
  second minute).

The slope catches a slow leak the noise hides from two medians; the drift
catches a step the fit averages away. Absolute floors keep a 10 MiB
process from failing on one page's noise. The slope limit is translated
into the largest per-request leak it lets pass (`leak_bound_bytes`), so
a reader can judge it against the run's request count.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Callable

WARMUP_SHARE = 0.2
SLOPE_LIMIT_MIB = 4.0
SLOPE_LIMIT_SHARE = 0.02
DRIFT_LIMIT_MIB = 2.0
DRIFT_LIMIT_SHARE = 0.03
# Points kept per process in a summary's series (the raw samples are not
# committed: a 10-minute run at one sample per 2 s would be 300 per process).
SERIES_POINTS = 40

RULE = (f"steady = after the first {WARMUP_SHARE:.0%} of the run, the least-squares RSS slope is at most "
        f"max({SLOPE_LIMIT_MIB:g} MiB, {SLOPE_LIMIT_SHARE:.0%} of the median RSS) per 10 minutes, and the "
        f"median RSS of the run's last tenth is within max({DRIFT_LIMIT_MIB:g} MiB, {DRIFT_LIMIT_SHARE:.0%}) "
        "of the median of its second tenth")


def rss_kib(pid: int) -> int | None:
    """VmRSS of `pid` in KiB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


class Sampler:
    """Samples every `interval_s`, on a thread of its own: each named
    process's RSS (MiB) and each named probe's value (e.g. Envoy's active
    requests; a probe that raises is recorded as None)."""

    def __init__(self, pids: dict[str, int], interval_s: float,
                 probes: dict[str, Callable[[], float]] | None = None):
        self.pids = pids
        self.interval_s = interval_s
        self.probes = probes or {}
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = 0.0

    def _run(self) -> None:
        next_at = self.t0
        while not self._stop.is_set():
            s: dict = {"t": round(time.monotonic() - self.t0, 2)}
            for name, pid in self.pids.items():
                kib = rss_kib(pid)
                s[name] = None if kib is None else round(kib / 1024, 2)
            for name, fn in self.probes.items():
                try:
                    s[name] = fn()
                except Exception:  # noqa: BLE001 - a probe's failure is a missing point
                    s[name] = None
            self.samples.append(s)
            next_at += self.interval_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def __enter__(self) -> "Sampler":
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def series(self, name: str) -> list[tuple[float, float]]:
        return [(s["t"], s[name]) for s in self.samples if s.get(name) is not None]


def slope_per_s(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, v)."""
    if len(points) < 2:
        return 0.0
    mt = statistics.fmean(t for t, _ in points)
    mv = statistics.fmean(v for _, v in points)
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / den if den else 0.0


def _between(points: list[tuple[float, float]], lo: float, hi: float) -> list[float]:
    return [v for t, v in points if lo <= t <= hi]


def steadiness(points: list[tuple[float, float]], duration_s: float, requests: int = 0) -> dict:
    """The verdict on one process's RSS series (MiB over seconds of a run
    lasting `duration_s`), with the figures behind it. `requests`: what the
    run served, to express the slope limit as bytes per request."""
    if not points:
        return {"samples": 0, "steady": None}
    values = [v for _, v in points]
    after = [(t, v) for t, v in points if t >= WARMUP_SHARE * duration_s] or points
    median = statistics.median(v for _, v in after)
    slope_10min = slope_per_s(after) * 600
    slope_limit = max(SLOPE_LIMIT_MIB, SLOPE_LIMIT_SHARE * median)
    second = _between(points, 0.1 * duration_s, 0.2 * duration_s) or values[:1]
    last = _between(points, 0.9 * duration_s, duration_s + 60) or values[-1:]
    m2, mlast = statistics.median(second), statistics.median(last)
    drift = mlast - m2
    drift_limit = max(DRIFT_LIMIT_MIB, DRIFT_LIMIT_SHARE * m2)
    out = {
        "samples": len(points),
        "start_mib": round(values[0], 1),
        "end_mib": round(values[-1], 1),
        "peak_mib": round(max(values), 1),
        "median_after_warmup_mib": round(median, 1),
        "slope_mib_per_10min": round(slope_10min, 2),
        "slope_limit_mib_per_10min": round(slope_limit, 2),
        "second_tenth_median_mib": round(m2, 1),
        "last_tenth_median_mib": round(mlast, 1),
        "drift_mib": round(drift, 2),
        "drift_pct": round(100 * drift / m2, 2) if m2 else 0.0,
        "drift_limit_mib": round(drift_limit, 2),
        "steady": abs(slope_10min) <= slope_limit and abs(drift) <= drift_limit,
    }
    if requests:
        # The slope limit over the part of the run it was fitted on, shared
        # among the requests served meanwhile.
        span = max(after[-1][0] - after[0][0], 1e-9)
        share = span / max(duration_s, 1e-9)
        out["leak_bound_bytes_per_request"] = round(slope_limit * (span / 600) * 2**20 / max(requests * share, 1))
    return out


def thin(points: list[tuple[float, float]], n: int = SERIES_POINTS) -> list[list[float]]:
    """At most `n` points of a series, evenly spaced, the last one kept."""
    if len(points) <= n:
        return [[round(t, 1), round(v, 1)] for t, v in points]
    step = (len(points) - 1) / (n - 1)
    return [[round(points[round(i * step)][0], 1), round(points[round(i * step)][1], 1)] for i in range(n)]


def memory_table(rss: dict[str, dict]) -> list[str]:
    """Markdown rows of per-process RSS verdicts."""
    rows = ["| process | start MiB | end MiB | peak MiB | slope MiB/10 min (limit) | 2nd-tenth → last-tenth median MiB "
            "(drift) | steady |", "|---|---:|---:|---:|---:|---:|:---:|"]
    for name, r in rss.items():
        if not r.get("samples"):
            rows.append(f"| {name} | – | – | – | – | – | no samples |")
            continue
        rows.append(f"| {name} | {r['start_mib']} | {r['end_mib']} | {r['peak_mib']} | "
                    f"{r['slope_mib_per_10min']:+} ({r['slope_limit_mib_per_10min']}) | "
                    f"{r['second_tenth_median_mib']} → {r['last_tenth_median_mib']} ({r['drift_pct']:+}%) | "
                    f"{'yes' if r['steady'] else 'NO'} |")
    return rows
