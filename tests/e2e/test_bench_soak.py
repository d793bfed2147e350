"""The soaks' command (`bench/soak.py`, run by `make bench` for 10 minutes
each) at a small scale: both soaks run, every request through Envoy is
answered, the indexer takes the events and picks it is sent, and the
summary carries the figures the report and the docs read. Whether memory
is steady is judged by the long run only (a short run is mostly warm-up)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvasir_harness import BENCH_BIN, INDEXER_BIN, REPO, cargo, redis_available
from kvasir_harness.bench.soak import LOAD_BIN

SECONDS = 12
RSS_FIELDS = {"samples", "start_mib", "end_mib", "peak_mib", "slope_mib_per_10min", "slope_limit_mib_per_10min",
              "second_tenth_median_mib", "last_tenth_median_mib", "drift_pct", "steady"}


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    for b in (BENCH_BIN, INDEXER_BIN):
        if not b.exists():
            pytest.skip(f"{b.name} not built")
    if not redis_available():
        pytest.skip("redis-server not installed")
    if not LOAD_BIN.exists():
        cargo("build", "--release", "-p", "kvasir-cache-indexer", "--example", "soak_load")
    out = tmp_path_factory.mktemp("soak")
    argv = [sys.executable, str(REPO / "bench" / "soak.py"), "all", "--seconds", str(SECONDS), "--out", str(out),
            "--streams", "40", "--sims", "2", "--max-tokens", "24", "--prompt-words", "50",
            "--engines", "2", "--events-per-s", "1000", "--picks-per-s", "100", "--sample-s", "1"]
    p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / "report.md").exists()
    return json.loads((out / "summary.json").read_text())


def test_held_streams_through_envoy_are_all_answered(summary):
    s = summary["streams"]
    assert s["config"]["streams"] == 40 and s["config"]["duration_s"] == SECONDS
    assert s["requests"] > 40, s
    assert s["errors"] == 0 and s["failed"] == 0, s
    assert s["ok"] == s["requests"]
    assert s["failopen"] == 0, s["filter"]
    # Every pick was budgeted (through Redis) and admitted.
    assert s["budget_picks"].get("admitted", 0) >= s["requests"], s["budget_picks"]
    assert s["budget_picks"].get("limited", 0) == 0
    assert s["peak_open"] == 40
    assert s["envoy_active_requests_after_warmup"]["max"] > 0
    for proc in ("envoy", "indexer", "redis", "sim0", "sim1", "load_generator"):
        assert RSS_FIELDS <= set(s["rss"][proc]), proc
        assert s["rss"][proc]["samples"] >= SECONDS // 2, proc
    assert s["rss_series"]["envoy"]
    # Envoy's heap beside its RSS, and what Redis holds, key by key.
    assert s["envoy_heap"]["allocated"]["samples"] >= SECONDS // 2
    assert s["redis"]["by_key"]["kvasir:budget:acme"]["type"] == "hash"


def test_indexer_takes_the_events_and_picks_it_is_sent(summary):
    s = summary["indexer"]
    assert s["config"]["target_events_per_s"] == 1000 and s["config"]["target_picks_per_s"] == 100
    # Small rates: this machine reaches them, so they are checked.
    assert s["events_per_s"] >= 900 and s["picks_per_s"] >= 90, s
    assert s["picks_err"] == 0 and s["reports_err"] == 0 and s["picks_dropped"] == 0, s
    # What was sent after the subscription arrived is applied (allow the
    # batches in flight when the counters were read).
    assert s["events_applied_by_indexer"] >= 0.95 * s["events_sent"], s
    assert s["events_skipped_by_indexer"] == 0
    lat = s["pick_latency_us"]
    assert 0 < lat["p50_us"] <= lat["p99_us"] <= lat["max_us"]
    assert len(s["pick_latency_by_window"]) >= SECONDS - 1
    assert RSS_FIELDS <= set(s["rss"]["indexer"])
    # The index holds what the fake engines hold: it fills and stays.
    assert max(v for _, v in s["indexer_gauges"]["indexed_blocks"]) > 0


def test_summary_states_the_steady_rule(summary):
    assert "least-squares" in summary["steady_rule"] and "last tenth" in summary["steady_rule"]
