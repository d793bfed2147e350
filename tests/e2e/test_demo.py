"""`make demo`'s script, run as a user runs it (`scripts/demo.py --quick`:
the same steps on a smaller workload) with a deadline: it exits 0, prints
every section, and its figures are present and sane: both runs served
every request, latencies are positive and ordered, the cached share is a
percentage and Kvasir's is at least round-robin's, each policy did what
its row says, the budget answered 429s, the per-tenant table has both
tenants with units, and the playground's and the dashboard's addresses
are printed and exist."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvasir_harness import ENVOY_BIN, INDEXER_BIN, REPO, SIM_BIN, WASM

DEADLINE_S = 240


def seconds(cell: str) -> float:
    m = re.fullmatch(r"([0-9.]+) (ms|s)", cell.strip())
    assert m, f"not a duration with its unit: {cell!r}"
    return float(m.group(1)) / (1000 if m.group(2) == "ms" else 1)


def table(out: str, head: str) -> dict[str, list[str]]:
    """The rows of the table whose header line starts with `head`: first
    column -> the other cells (split on runs of 2+ spaces)."""
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(head))
    assert set(lines[i + 1].replace(" ", "")) == {"-"}, lines[i + 1]
    rows = {}
    for line in lines[i + 2:]:
        if not line.strip() or line.startswith(" "):
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells[1:]
    return rows


@pytest.fixture(scope="module")
def run() -> tuple[str, float]:
    for p in (WASM, SIM_BIN, INDEXER_BIN, ENVOY_BIN):
        if not p.exists():
            pytest.fail(f"{p} is missing: run `make build`")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "demo.py"), "--quick"], cwd=REPO,
                       capture_output=True, text=True, timeout=DEADLINE_S)
    wall = time.monotonic() - t0
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p.stdout, wall


def test_every_section_is_printed(run):
    out, wall = run
    for heading in ("1. the workload through a plain Envoy route, round-robin, then through Kvasir",
                    "2. the policies on the same stack", "3. per tenant, from the filter's stats",
                    "4. the two runs side by side", "Done in "):
        assert heading in out, f"no {heading!r} in\n{out}"
    assert "kvasir_" not in out.split("3. per tenant")[1], "raw Prometheus lines in the summary"
    assert wall < DEADLINE_S


def test_the_side_by_side_figures_are_sane(run):
    out, _ = run
    rows = table(out, "same workload")
    assert rows["requests served (200)"] == ["18", "18"], rows
    assert rows["failed"] == ["0", "0"], rows
    for col in (0, 1):
        p50, p90, p99 = (seconds(rows[k][col]) for k in ("TTFT p50", "TTFT p90", "TTFT p99"))
        assert 0 < p50 <= p90 <= p99 < 30, rows
        e50, e99 = seconds(rows["end-to-end p50"][col]), seconds(rows["end-to-end p99"][col])
        assert p50 < e50 <= e99 < 60, rows
    cached = []
    for cell in rows["prompt tokens cached"]:
        m = re.fullmatch(r"(\d+)% \(([0-9.]+k?) of ([0-9.]+k?)\)", cell)
        assert m, cell
        cached.append(int(m.group(1)))
        assert 0 <= cached[-1] <= 100
    # The same prompts both times; the cache-aware side finds at least as many.
    assert rows["prompt tokens cached"][0].split(" of ")[1] == rows["prompt tokens cached"][1].split(" of ")[1]
    assert cached[1] >= cached[0], rows["prompt tokens cached"]
    for cell in rows["engines used (requests each)"]:
        m = re.fullmatch(r"(\d) \(([\d /]+)\)", cell)
        assert m, cell
        each = [int(x) for x in m.group(2).split(" / ")]
        assert sum(each) == 18 and int(m.group(1)) == sum(1 for x in each if x), cell


def test_the_policies_acted(run):
    out, _ = run
    rows = table(out, "request ")
    alias = rows["acme asks for model gpt-4o-mini"]
    assert alias[0].startswith("200 from vllm-") and alias[0].endswith("as Qwen/Qwen3-8B"), alias
    shed = rows["beta (free) while the pool is busy"]
    assert shed[0].startswith("HTTP 429, Retry-After") and "shed-free-when-busy" in shed[1], shed
    burst = rows["acme (gold) while the pool is busy"]
    assert burst[0] == "200 from provider as provider-model", burst
    pii = rows["acme, the same with an e-mail and a card number"]
    assert pii[0].startswith("200 from vllm-") and "keep-pii-inside" in pii[1], pii
    budget = rows["beta sends 5 streams at once (budget: 2 in flight)"]
    assert budget[0] == "2 x 200, 3 x 429" and "concurrent" in budget[1], budget


def test_the_per_tenant_table(run):
    out, _ = run
    head = "tenant  routed"
    rows = table(out, head)
    assert set(rows) == {"acme", "beta"}, rows
    header = next(line for line in out.splitlines() if line.startswith(head))
    cols = re.split(r"\s{2,}", header.strip())[1:]
    for tenant, cells in rows.items():
        v = dict(zip(cols, cells))
        assert int(v["routed"]) > 0, v
        assert re.fullmatch(r"[0-9.]+k? / [0-9.]+k?", v["prompt tok cached / uncached"]), v
        for k in ("TTFT p50", "TTFT p99", "e2e p50"):
            assert seconds(v[k]) > 0, v
        assert seconds(v["TTFT p50"]) <= seconds(v["TTFT p99"]), v
        assert v["fail-open"] == "0", v
    assert rows["beta"][cols.index("rate-limited")] == "3", rows
    assert int(rows["beta"][cols.index("shed")]) >= 1, rows
    assert int(rows["acme"][cols.index("to provider")]) >= 1, rows


def test_the_next_steps_name_real_places(run):
    out, _ = run
    assert "http://127.0.0.1:8640/" in out and "make playground" in out
    m = re.search(r"dashboard\s+(\S+\.json)", out)
    assert m and (REPO / m.group(1)).is_file(), out[-1500:]
    assert (Path(REPO) / "deploy" / "prometheus" / "prometheus.yml").is_file()
