"""`bench/repeats.py`, the routing benchmark's run-to-run spread: its table
comes from the runs' own summary.json files, and it refuses what it cannot
summarise. No stack: it reads results directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvasir_harness import REPO

REPEATS = REPO / "bench" / "repeats.py"


def summary(run_dir: Path, p90s: dict[str, float], hit: float) -> None:
    """A results directory holding one trace run per mode at load 1.0."""
    run_dir.mkdir(parents=True)
    runs = [{"workload": "trace", "load": 1.0, "mode": mode,
             "summary": {"ttft": {"p50": 100.0, "p90": p90, "p99": 2 * p90, "mean": 300.0}, "cache_hit_rate": hit}}
            for mode, p90 in p90s.items()]
    (run_dir / "summary.json").write_text(json.dumps({"runs": runs}))


def test_spread_and_per_run_comparison_come_from_the_runs(tmp_path):
    summary(tmp_path / "run1", {"approx-prefix": 2000.0, "kvasir": 2010.0}, 0.30)
    summary(tmp_path / "run2", {"approx-prefix": 2020.0, "kvasir": 1999.8}, 0.31)
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(REPEATS), "--from", str(tmp_path / "run1"), str(tmp_path / "run2"),
                    "--out", str(out), "--command", "routing.py --loads 1.0"], check=True, capture_output=True)
    md = (out / "summary.md").read_text()
    assert "2 runs of `routing.py --loads 1.0`" in md
    # approx-prefix: 2000 and 2020 ms, spread 20 / 2010 = 1.0%.
    assert "| trace | 1.0 | approx-prefix | 100 ms / 100 ms | 2000 ms / 2020 ms | 4000 ms / 4040 ms " \
           "| 30.0% / 31.0% | 2000 ms-2020 ms (1.0%) |" in md, md
    # kvasir 0.5% above in run 1, 1.0% below in run 2.
    assert "| trace | 1.0 | +0.5% / -1.0% | 1 of 2 |" in md, md


def test_a_directory_without_a_summary_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    r = subprocess.run([sys.executable, str(REPEATS), "--from", str(tmp_path / "empty"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "summary.json missing" in r.stderr


def test_routings_out_is_set_per_run(tmp_path):
    r = subprocess.run([sys.executable, str(REPEATS), "--runs", "2", "--out", str(tmp_path), "--", "--out", "x"],
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "--out is set per run" in r.stderr


def test_unanswered_percentiles_are_shown_not_a_crash(tmp_path):
    # Deployed runs lose requests to the restart: the report writes "inf".
    for i, p99 in enumerate(["inf", 4000.0], 1):
        summary(tmp_path / f"run{i}", {"kvasir": 2000.0}, 0.3)
        f = tmp_path / f"run{i}" / "summary.json"
        s = json.loads(f.read_text())
        s["runs"][0]["summary"]["ttft"]["p99"] = p99
        f.write_text(json.dumps(s))
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(REPEATS), "--from", str(tmp_path / "run1"), str(tmp_path / "run2"),
                    "--out", str(out)], check=True, capture_output=True)
    md = (out / "summary.md").read_text()
    assert "| ∞ / 4000 ms |" in md and "| 2000 ms-2000 ms (0.0%) | - |" in md, md


def test_deployed_runs_get_issue_22s_targets_per_run(tmp_path):
    # Two deployed runs: kvasir's p90 33% then 10% below approx-prefix's, so
    # the 20% target is met in one of two; the hit-rate row needs each
    # run's bound (15%).
    for i, kp90 in enumerate([2000.0, 2700.0], 1):
        d = tmp_path / f"run{i}"
        summary(d, {"approx-prefix": 3000.0, "kvasir": kp90}, 0.15)
        s = json.loads((d / "summary.json").read_text())
        s["deployment"] = {"kind": "deployed", "proxies": 2, "replicas": 2}
        s["bound"] = {"hit_rate": 0.15}
        (d / "summary.json").write_text(json.dumps(s))
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(REPEATS), "--from", str(tmp_path / "run1"), str(tmp_path / "run2"),
                    "--out", str(out)], check=True, capture_output=True)
    md = (out / "summary.md").read_text()
    assert "| trace @1.0: kvasir TTFT p90 >= 20% below approx-prefix's | 2000 ms vs 3000 ms: 33.3% below / " \
           "2700 ms vs 3000 ms: 10.0% below | 1 of 2 |" in md, md
    assert "| trace @1.0: kvasir hit rate >= 95% of the pooled-cache bound | 15.0% vs bound 15.0%: 100.0% / " \
           "15.0% vs bound 15.0%: 100.0% | 2 of 2 |" in md, md
    # Load 1.5 never ran: no row.
    assert "trace @1.5" not in md


def test_single_proxy_runs_get_no_targets_table(tmp_path):
    for i in (1, 2):
        summary(tmp_path / f"run{i}", {"approx-prefix": 3000.0, "kvasir": 2000.0}, 0.15)
    out = tmp_path / "out"
    subprocess.run([sys.executable, str(REPEATS), "--from", str(tmp_path / "run1"), str(tmp_path / "run2"),
                    "--out", str(out)], check=True, capture_output=True)
    assert "deployed-shape targets" not in (out / "summary.md").read_text()
