"""The routing benchmark's `picker` mode on a tiny slice: 3 engines, 8
seconds of the trace, kvasir (the filter) and picker (no filter: Envoy as an
Inference Extension gateway asking the same indexer's endpoint picker over
ext_proc) in one run and one report. Both serve every request, and the
picker's choices are the indexer's (its pick counters move, requests land on
the engines holding their prefix). The benchmark itself is
`bench/routing.py --modes ...,picker`."""

from __future__ import annotations

import csv
import json

import pytest

from kvasir_harness import TARGET
from kvasir_harness.bench import routing

TINY = {"trace_time_scale": 0.25, "chat_time_scale": 1.0, "trace_loads": [1.0], "chat_loads": [1.0],
        # 28 requests, the longest 37k tokens.
        "trace_from_s": 360.0, "trace_window_s": 8.0, "chat_duration_s": 5.0, "trace_guess": 1.0, "chat_guess": 1.0}


@pytest.fixture
def tiny(monkeypatch, artifacts):
    for b in (TARGET / "release" / "kvasir-bench", routing.h.INDEXER_BIN):
        if not b.exists():
            pytest.skip(f"{b} not built")
    monkeypatch.setitem(routing.PRESETS, "tiny", TINY)
    monkeypatch.setattr(routing.CL, "ENGINES", 3)
    monkeypatch.setattr(routing.CL, "MAX_MODEL_LEN", 40_960)
    monkeypatch.setattr(routing.VAR, "KVASIR", {})


def rows(path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


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
