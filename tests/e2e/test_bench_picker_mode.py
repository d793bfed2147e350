"""The routing benchmark's `picker` mode on a tiny slice: 3 engines, 8
seconds of the trace, kvasir (the filter) and picker (no filter: Envoy as an
Inference Extension gateway asking the same indexer's endpoint picker over
ext_proc) in one run and one report. Both serve every request, and the
picker's choices are the indexer's (its pick counters move, requests land on
the engines holding their prefix). The benchmark itself is
`bench/routing.py --modes ...,picker`."""

from __future__ import annotations

import json

import pytest

from bench_tiny import rows, use_tiny
from kvasir_harness.bench import routing


@pytest.fixture
def tiny(monkeypatch, artifacts):
    use_tiny(monkeypatch)


def test_the_picker_mode_routes_through_ext_proc_beside_the_filter(tiny, tmp_path):
    out = tmp_path / "out"
    assert routing.main(["--preset", "tiny", "--workloads", "trace", "--modes", "kvasir,picker", "--trace-rate",
                         "1.0", "--out", str(out), "--no-progress"]) == 0
    for mode in ("kvasir", "picker"):
        recs = rows(out / f"trace-1.00-{mode}.csv")
        assert len(recs) == 28 and all(r["outcome"] == "ok" for r in recs), [r for r in recs if r["outcome"] != "ok"]
        assert all(r["endpoint"] for r in recs)
    notes = json.loads((out / "trace-1.00-picker.json").read_text())["notes"]
    # The indexer decided every picker request (no filter in this mode:
    # no filter counters).
    decided = sum(v for k, v in notes.items() if k.startswith("decision."))
    assert decided >= 28, notes
    assert "pick.ok" not in notes, notes
    md = (out / "report.md").read_text()
    assert "| 1.0 | picker |" in md and "picker = no filter" in md
