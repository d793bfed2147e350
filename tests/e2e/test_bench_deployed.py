"""`bench/routing.py --deployment deployed` on a tiny slice: 3 engines, 8
seconds of the trace, round-robin and kvasir. Each run spreads its requests
over 2 Envoys, the kvasir run's picks over 2 indexer replicas sharing load
through Redis, one engine is restarted mid-run, and one report comes out;
then kvasir alone on 1 Envoy x 1 replica, compared with it (`--compare-to`).
The benchmark itself is `bench/routing.py --deployment deployed`."""

from __future__ import annotations

import json

import pytest

from bench_tiny import rows, use_tiny
from kvasir_harness.bench import routing


@pytest.fixture
def tiny(monkeypatch, artifacts):
    use_tiny(monkeypatch, redis=True)
    # Past the clusters' start and the first requests (a quarter of the
    # 8 s window at this time scale is 0.5 s wall).
    monkeypatch.setattr(routing, "RESTART_AT", 0.4)


def test_the_deployed_mode_spreads_restarts_and_reports(tiny, tmp_path):
    out = tmp_path / "out"
    assert routing.main(["--preset", "tiny", "--deployment", "deployed", "--workloads", "trace", "--modes",
                         "round-robin,kvasir", "--trace-rate", "1.0", "--out", str(out), "--no-progress"]) == 0
    for mode in ("round-robin", "kvasir"):
        meta = json.loads((out / f"trace-1.00-{mode}.json").read_text())
        notes = meta["notes"]
        via = {k: v for k, v in notes.items() if k.startswith("planned via ")}
        assert len(via) == 2 and all(v > 0 for v in via.values()), notes
        assert "restart at s" in notes, notes
        restart_s = notes["restart at s"]
        recs = rows(out / f"trace-1.00-{mode}.csv")
        assert len(recs) == 28
        # Requests sent once the engine is back (it restarts within a
        # simulated second or two; Envoy and the indexer notice within
        # their health-check and scrape intervals) all succeed.
        later = [r for r in recs if float(r["sent_s"]) > restart_s + 4.0]
        assert later and all(r["outcome"] == "ok" for r in later), later
        assert all(r["endpoint"] for r in later)
    notes = json.loads((out / "trace-1.00-kvasir.json").read_text())["notes"]
    assert notes["picks by indexer0"] > 0 and notes["picks by indexer1"] > 0, notes
    assert notes["indexer0 peers seen"] == 1 and notes["indexer1 peers seen"] == 1, notes
    assert notes["KV-event source changes seen"] >= 1, notes
    # The deployed shape's kvasir mode late-binds (bench/variants.py DEPLOYED_LATE_BINDING).
    assert "flow held picks" in notes, notes
    # The replicas' view of each other, sampled while the run went.
    assert "indexer0 peer pending chains mean" in notes and "indexer1 peer in-flight mean" in notes, notes
    # CPU by process group over the load: every group ran and used some;
    # round-robin has no indexers.
    assert notes["cpu s engines"] > 0 and notes["cpu s indexers"] > 0 and notes["cpu s proxies"] > 0, notes
    assert 0 < notes["cpu machine busy %"] <= 100 and notes["cpu cores busy"] > 0, notes
    rr = json.loads((out / "trace-1.00-round-robin.json").read_text())["notes"]
    assert rr["cpu s indexers"] == 0 and rr["cpu s engines"] > 0, rr
    md = (out / "report.md").read_text()
    assert "Deployed-like shape (2x2)" in md and "restart at s" in md
    assert "kvasir runs with late binding" in md
    assert "| 1.0 | kvasir | 28 |" in md
    deployment = json.loads((out / "summary.json").read_text())["deployment"]
    assert deployment["replicas"] == 2
    assert deployment["late_binding_scoring"] == routing.VAR.LATE_SCORING, deployment

    # The same setup as 1x1, compared with the 2x2 run: its rate taken from it.
    one = tmp_path / "one"
    assert routing.main(["--preset", "tiny", "--deployment", "deployed", "--workloads", "trace", "--modes", "kvasir",
                         "--proxies", "1", "--replicas", "1", "--out", str(one), "--compare-to", str(out),
                         "--no-progress"]) == 0
    meta = json.loads((one / "trace-1.00-kvasir.json").read_text())
    assert meta["rate"] == 1.0
    assert meta["notes"]["picks by indexer0"] > 0 and "indexer0 peers seen" not in meta["notes"], meta["notes"]
    cmp = (one / "shapes.md").read_text()
    assert "## Shapes: 1x1 against 2x2" in cmp and "Target: 2x2 p90 TTFT within 5% of 1x1" in cmp, cmp
    assert cmp in (one / "report.md").read_text()
