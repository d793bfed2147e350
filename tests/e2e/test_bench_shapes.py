"""`bench/shapes.py`, two routing runs of other shapes side by side (the
target "2x2 p90 within 5% of 1x1"): the table and the target row come from the
runs' own summary.json and CSVs, and two runs whose setups differ in more
than the shape are refused. Also routing.py's folder names per shape and
repeats.py's shape line. No stack: it reads results directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvasir_harness import REPO

SHAPES = REPO / "bench" / "shapes.py"
REPEATS = REPO / "bench" / "repeats.py"
from kvasir_harness.bench import routing


def deployment(proxies: int, replicas: int, rate: float = 1.6, blocks: int = 12288) -> dict:
    return {"kind": "deployed", "preset": "short", "engines": 8, "proxies": proxies, "replicas": replicas,
            "direct_share": 0.0, "restart": {"engine": 1, "at_share_of_arrivals": 0.3, "down_wall_s": 1.0},
            "workloads": {"trace": {"rate": rate, "num_gpu_blocks": blocks, "max_model_len": 196608,
                                    "time_scale": 0.25, "from_s": 650.0, "window_s": 120.0}}}


def results(d: Path, dep: dict, p90s: dict[str, float], picks: list[int], ttfts: dict[str, list]) -> Path:
    """A results directory: one trace run per mode at load 1.0, its CSV
    holding `ttfts` (None: a request that never answered)."""
    d.mkdir(parents=True)
    runs = []
    for mode, p90 in p90s.items():
        notes = {f"picks by indexer{i}": n for i, n in enumerate(picks)} if mode != "round-robin" else {}
        runs.append({"workload": "trace", "load": 1.0, "mode": mode, "rate": dep["workloads"]["trace"]["rate"],
                     "notes": notes,
                     "summary": {"ttft": {"p50": 100.0, "p90": p90, "p99": 2 * p90, "mean": "inf"},
                                 "cache_hit_rate": 0.5, "failed": 1}})
        rows = ["sent_s,ttft_ms,outcome,endpoint"]
        rows += [f"{i},{t},ok,e" if t is not None else f"{i},,error," for i, t in enumerate(ttfts[mode])]
        (d / f"trace-1.00-{mode}.csv").write_text("\n".join(rows) + "\n")
    (d / "summary.json").write_text(json.dumps({"runs": runs, "deployment": dep}))
    return d


def shapes(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SHAPES), *args], capture_output=True, text=True)


def test_the_table_and_the_target_come_from_both_runs(tmp_path):
    ttfts = {"kvasir": [100.0, 300.0, None], "approx-prefix": [200.0, 400.0, None]}
    big = results(tmp_path / "2x2", deployment(2, 2), {"kvasir": 1040.0, "approx-prefix": 1500.0}, [40, 60], ttfts)
    one = results(tmp_path / "1x1", deployment(1, 1), {"kvasir": 1000.0, "approx-prefix": 1000.0}, [100], ttfts)
    r = shapes(str(one), str(big), "--out", str(tmp_path / "shapes.md"))
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "shapes.md").read_text()
    assert "## Shapes: 1x1 against 2x2" in md
    # Means over the answered requests (200 and 300 ms), the unanswered counted apart.
    assert "| trace | 1.0 | kvasir | 100 ms / 100 ms | 1000 ms / 1040 ms | -3.8% | 200 ms / 200 ms | 50.0% / 50.0% " \
           "| 1 / 1 | 100 | 40 / 60 |" in md, md
    # The target row measures the larger shape against 1x1, whichever side it is on.
    assert "| trace | 1.0 | kvasir | 1040 ms | 1000 ms | +4.0% | **yes** |" in md, md
    assert "| trace | 1.0 | approx-prefix | 1500 ms | 1000 ms | +50.0% | no |" in md, md


def test_a_miss_of_the_target_is_said(tmp_path):
    ttfts = {"kvasir": [100.0]}
    big = results(tmp_path / "2x2", deployment(2, 2), {"kvasir": 1060.0}, [1, 1], ttfts)
    one = results(tmp_path / "1x1", deployment(1, 1), {"kvasir": 1000.0}, [2], ttfts)
    r = shapes(str(big), str(one))
    assert r.returncode == 0, r.stderr
    assert "| trace | 1.0 | kvasir | 1060 ms | 1000 ms | +6.0% | **no** |" in r.stdout, r.stdout


def test_another_setup_is_refused(tmp_path):
    ttfts = {"kvasir": [100.0]}
    big = results(tmp_path / "2x2", deployment(2, 2, rate=1.6), {"kvasir": 1000.0}, [1, 1], ttfts)
    faster = results(tmp_path / "fast", deployment(1, 1, rate=2.0, blocks=6000), {"kvasir": 1000.0}, [2], ttfts)
    r = shapes(str(big), str(faster))
    assert r.returncode == 2
    assert "trace rate: 1.6 against 2.0" in r.stderr and "trace num_gpu_blocks: 12288 against 6000" in r.stderr


def test_a_run_without_a_deployment_record_is_refused(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "summary.json").write_text(json.dumps({"runs": []}))
    big = results(tmp_path / "2x2", deployment(2, 2), {"kvasir": 1000.0}, [1, 1], {"kvasir": [1.0]})
    r = shapes(str(big), str(old))
    assert r.returncode == 2 and "no `deployment` record" in r.stderr


def test_only_the_default_shape_writes_the_folders_the_readme_quotes():
    assert routing.default_dir("short", True, 2, 2) == "routing-deployed-short"
    assert routing.default_dir("full", True, 2, 2) == "routing-deployed"
    assert routing.default_dir("short", True, 1, 1) == "routing-deployed-1x1-short"
    assert routing.default_dir("full", True, 2, 1) == "routing-deployed-2x1"
    assert routing.default_dir("short", False, 1, 1) == "routing-short"


def test_shape_flags_need_the_deployed_mode():
    with pytest.raises(SystemExit, match="need --deployment deployed"):
        routing.main(["--replicas", "1"])
    with pytest.raises(SystemExit, match="at least 1"):
        routing.main(["--deployment", "deployed", "--proxies", "0"])


def test_repeats_name_the_shape_and_refuse_mixed_ones(tmp_path):
    ttfts = {"kvasir": [1.0]}
    a = results(tmp_path / "run1", deployment(2, 2), {"kvasir": 1000.0}, [1, 1], ttfts)
    b = results(tmp_path / "run2", deployment(2, 2), {"kvasir": 1010.0}, [1, 1], ttfts)
    one = results(tmp_path / "run3", deployment(1, 1), {"kvasir": 1010.0}, [2], ttfts)
    r = subprocess.run([sys.executable, str(REPEATS), "--from", str(a), str(b), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "Shape: deployed-like, 2 Envoys x 2 indexer replicas (2x2)." in r.stdout, r.stdout
    r = subprocess.run([sys.executable, str(REPEATS), "--from", str(a), str(one), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "different shapes" in r.stderr


def test_repeats_compare_two_shapes_across_runs(tmp_path):
    ttfts = {"kvasir": [1.0], "approx-prefix": [1.0]}
    for i, (k, ap) in enumerate([(1000.0, 1500.0), (1100.0, 1400.0)], 1):
        results(tmp_path / "big" / f"run{i}", deployment(2, 2), {"kvasir": k, "approx-prefix": ap}, [1, 1], ttfts)
    for i, (k, ap) in enumerate([(1020.0, 1000.0), (1040.0, 1100.0)], 1):
        results(tmp_path / "one" / f"run{i}", deployment(1, 1), {"kvasir": k, "approx-prefix": ap}, [2], ttfts)
    big = [str(tmp_path / "big" / f"run{i}") for i in (1, 2)]
    r = subprocess.run([sys.executable, str(REPEATS), "--from", *big, "--out", str(tmp_path / "o"),
                        "--compare-to", str(tmp_path / "one")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "o" / "summary.md").read_text()
    assert "## Shapes across runs: 2x2 (2 runs) against 1x1 (2 runs)" in md, md
    # kvasir: means 1050 and 1030 ms, +1.9%, ranges overlap, within 5%.
    assert "| trace | 1.0 | kvasir | 1000 ms / 1100 ms | 1020 ms / 1040 ms | +1.9% | no | yes |" in md, md
    # approx-prefix: means 1450 and 1050 ms, ranges apart.
    assert "| trace | 1.0 | approx-prefix | 1500 ms / 1400 ms | 1000 ms / 1100 ms | +38.1% | yes | no |" in md, md


def test_repeats_of_calibrated_rates_are_not_compared(tmp_path):
    ttfts = {"kvasir": [1.0]}
    for i, rate in enumerate([1.6, 1.7], 1):
        results(tmp_path / "big" / f"run{i}", deployment(2, 2, rate=rate), {"kvasir": 1000.0}, [1, 1], ttfts)
        results(tmp_path / "one" / f"run{i}", deployment(1, 1), {"kvasir": 1000.0}, [2], ttfts)
    big = [str(tmp_path / "big" / f"run{i}") for i in (1, 2)]
    r = subprocess.run([sys.executable, str(REPEATS), "--from", *big, "--out", str(tmp_path / "o"),
                        "--compare-to", str(tmp_path / "one")], capture_output=True, text=True)
    assert r.returncode != 0 and "trace rate: 1.7 against 1.6" in r.stderr, r.stderr


def test_repeats_put_several_shapes_side_by_side_with_the_placement_yardstick(tmp_path):
    # Requests of 1,000 uncached tokens (60 ms each by the yardstick), the
    # second sent 10 ms after the first: to the other engine in 1x1, to the
    # same one in 2x2 (50 ms more queued there than on the idle engine); the
    # third a second later, to b.
    def csv_of(second: str) -> str:
        return ("id,sent_s,ttft_ms,prompt_tokens,cached_tokens,endpoint,outcome\n"
                f"0,0.0,60,1000,0,a,ok\n1,0.010,70,1000,0,{second},ok\n2,1.0,60,1000,0,b,ok\n")
    for shape, (p, r), second, p90s in [("1x1", (1, 1), "b", (1000.0, 1100.0)),
                                         ("2x2", (2, 2), "a", (1200.0, 1300.0))]:
        for i, p90 in enumerate(p90s, 1):
            d = results(tmp_path / "o" / shape / f"run{i}", deployment(p, r), {"kvasir": p90}, [2],
                        {"kvasir": [1.0]})
            (d / "trace-1.00-kvasir.csv").write_text(csv_of(second))
    r = subprocess.run([sys.executable, str(REPEATS), "--shapes", "1x1,2x2", "--from", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    md = (tmp_path / "o" / "summary.md").read_text()
    assert "## Shapes side by side" in md, md
    # Regret (0 + 50 + 0) / 3 ms in 2x2, FCFS TTFTs 60, 110 and 60 ms.
    assert "| trace | 1.0 | kvasir | 1x1 | 2 | 100 ms | 1050 ms (1000 ms / 1100 ms) | +0.0% | 63 ms | 50.0% " \
           "| 2; 2 | - / - / - | - | 0 ms | 0.0% | 60 ms |" in md, md
    assert "| trace | 1.0 | kvasir | 2x2 | 2 | 100 ms | 1250 ms (1200 ms / 1300 ms) | +19.0% | 63 ms | 50.0% " \
           "| 2; 2 | - / - / - | - | 17 ms | 0.0% | 77 ms |" in md, md
