"""The routing benchmark's load generator (`kvasir-bench`) against the real
stack: what it records is what the engines did, so the benchmark's numbers
can be trusted. Tiny workloads; the benchmark itself is `make bench`."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest

from kvasir_harness import TARGET, compile_plugin, start_envoy, wait_envoy, wait_until

from kvasir_harness.bench import sim_cluster  # the routing benchmark's policy and settings

BENCH = TARGET / "release" / "kvasir-bench"


@pytest.fixture(scope="module")
def bench_envoy(stack):
    """An Envoy with the filter and the benchmark's policy (tenant from the
    x-tenant header) over the e2e sims and indexer."""
    if not stack.has_indexer:
        pytest.skip("cache-indexer not built")
    if not BENCH.exists():
        pytest.skip("kvasir-bench not built")
    pool = [s.address for s in stack.sims]
    e = start_envoy(stack.logdir, compile_plugin(sim_cluster.POLICY, sim_cluster.SETTINGS), pool, stack.indexer.address,
                    stack.provider.address, name="envoy-loadgen")
    try:
        wait_envoy(e, pool)
        wait_until("indexer healthy", lambda: e.healthy("kvasir_indexer", [stack.indexer.address]))
        yield e
    finally:
        e.proc.stop()


def rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def common(e, stack, out: Path) -> list[str]:
    args = ["--url", f"http://127.0.0.1:{e.port}", "--time-scale", "1", "--mode", "kvasir", "--load", "1",
            "--out-dir", str(out), "--no-progress", "--drain-s", "60"]
    for s in stack.sims:
        args += ["--engine-metrics", f"http://127.0.0.1:{s.port}/metrics"]
    return args


def test_trace_replay_records_what_the_engines_did(bench_envoy, stack, tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [101, 102, 103]},
        {"timestamp": 300, "input_length": 2000, "output_length": 3, "hash_ids": [101, 102, 103, 104]},
        {"timestamp": 350, "input_length": 100, "output_length": 1, "hash_ids": [999]},
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    subprocess.run([str(BENCH), "trace", *common(bench_envoy, stack, tmp_path), "--trace", str(trace)],
                   check=True, timeout=120)
    r = rows(tmp_path / "trace-1.00-kvasir.csv")
    assert [x["outcome"] for x in r] == ["ok"] * 3
    assert [int(x["prompt_tokens"]) for x in r] == [1500, 2000, 100]
    assert [int(x["completion_tokens"]) for x in r] == [5, 3, 1]
    assert all(x["endpoint"] in {s.address for s in stack.sims} for x in r)
    # The second shares the first's 1500 tokens: it goes where they are
    # cached and the engine reports the full blocks of them as cached.
    assert r[1]["endpoint"] == r[0]["endpoint"]
    assert int(r[1]["cached_tokens"]) == 1488
    assert float(r[0]["ttft_ms"]) <= float(r[0]["e2e_ms"])
    assert float(r[0]["itl_ms"]) >= 0
    meta = json.loads((tmp_path / "trace-1.00-kvasir.json").read_text())
    assert meta["summary"]["requests"] == 3 and meta["summary"]["ok"] == 3
    assert abs(meta["summary"]["cache_hit_rate"] - 1488 / 3600) < 1e-9
    # The zero-latency sims spend no simulated prefill time.
    assert meta["engines"]["engines"] == len(stack.sims)

    # The report and plots come out of the same directory.
    subprocess.run([str(BENCH), "report", "--dir", str(tmp_path), "--command", "pytest"], check=True, timeout=60)
    md = (tmp_path / "report.md").read_text()
    assert "| 1.0 | kvasir | 3 | 0 |" in md
    assert (tmp_path / "trace-ttft-cdf.svg").read_text().startswith("<svg")


def test_chat_turns_carry_their_history(bench_envoy, stack, tmp_path):
    subprocess.run(
        [str(BENCH), "chat", *common(bench_envoy, stack, tmp_path), "--conversations-per-s", "3", "--duration-s", "2",
         "--tenants", "2", "--turns", "2..2", "--think-s", "0", "--system-words", "300..300", "--user-words", "20..20",
         "--output-tokens", "4..4", "--seed", "3"],
        check=True, timeout=120,
    )
    r = rows(tmp_path / "chat-1.00-kvasir.csv")
    assert r and all(x["outcome"] == "ok" for x in r), r
    by_conv: dict[str, list[dict]] = {}
    for x in r:
        by_conv.setdefault(x["conversation"], []).append(x)
    # No turn starts after the last arrival, so late conversations stop
    # after their first turn; the others carry their history.
    full = [t for t in by_conv.values() if len(t) == 2]
    assert full, by_conv
    assert all([int(t["turn"]) for t in turns] in ([0], [0, 1]) for turns in by_conv.values())
    for turns in full:
        first, second = turns
        assert first["tenant"] in ("t00", "t01")
        # The second turn's prompt holds the first's prompt and answer.
        assert int(second["prompt_tokens"]) > int(first["prompt_tokens"]) + 20
        assert int(first["completion_tokens"]) == 4
        assert second["endpoint"] == first["endpoint"]
        assert int(second["cached_tokens"]) >= int(first["prompt_tokens"]) // 16 * 16 - 16
        # What the report's chat floor assumes: a later turn can reuse at
        # most its previous turn's prompt and answer.
        assert int(second["cached_tokens"]) <= int(first["prompt_tokens"]) + int(first["completion_tokens"])

    # The report prices the run with no queueing, at its own reuse and at
    # the best any router could get, which is never the slower of the two.
    subprocess.run([str(BENCH), "report", "--dir", str(tmp_path), "--command", "pytest"], check=True, timeout=60)
    summary = json.loads((tmp_path / "summary.json").read_text())
    [u] = summary["unqueued"]
    assert u["workload"] == "chat" and u["mode"] == "kvasir"
    assert 0 < u["best"]["mean"] <= u["own"]["mean"], u
    assert "the floor of any router's TTFT on this workload" in (tmp_path / "report.md").read_text()
