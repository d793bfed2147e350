"""`bench/routing.py --workloads longchat,agents,bursty` on a tiny size: 3
engines, a few simulated seconds of each shape at a given rate (no
calibration), the kvasir mode, one report. Every shape goes through the real
stack (Envoy, the filter, the indexer, vllm-sims with the Qwen3 tokenizer),
and a later turn served where its previous turn was finds that whole turn
cached: the shapes' texts make shared prefixes token-identical under the
engines' tokenizer, chat template and block hashing. The benchmark itself is
`bench/routing.py --workloads all`."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from bench_tiny import rows, use_tiny
from kvasir_harness.bench import routing

SHAPES = ["longchat", "agents", "bursty"]
TINY = {"trace_time_scale": 0.25, "chat_time_scale": 1.0, "trace_loads": [1.0], "chat_loads": [1.0],
        "trace_from_s": 0.0, "trace_window_s": 8.0, "chat_duration_s": 5.0, "trace_guess": 1.0, "chat_guess": 1.0,
        # Conversations' later turns come after a 150-600-token answer and a
        # pause (5 s mean), so the long chat needs the longest window.
        "longchat_time_scale": 0.5, "longchat_loads": [1.0], "longchat_duration_s": 14.0, "longchat_guess": 1.0,
        "agents_time_scale": 0.5, "agents_loads": [1.0], "agents_duration_s": 8.0, "agents_guess": 1.0,
        "bursty_time_scale": 0.5, "bursty_loads": [1.0], "bursty_duration_s": 6.0, "bursty_guess": 4.0}
# Rates at which seed 7 plans enough sessions inside these short windows
# (`kvasir-bench workload-stats`): 21, 11 and 14.
RATES = {"longchat": 2.0, "agents": 2.0, "bursty": 8.0}


@pytest.fixture
def tiny(monkeypatch, artifacts):
    use_tiny(monkeypatch, TINY, max_model_len=None, pool_settings=True)


def test_each_shape_runs_through_the_stack_into_one_report(tiny, tmp_path):
    out = tmp_path / "out"
    args = ["--preset", "tiny", "--workloads", ",".join(SHAPES), "--modes", "kvasir", "--out", str(out),
            "--no-progress"]
    for w, r in RATES.items():
        args += [f"--{w}-rate", str(r)]
    assert routing.main(args) == 0
    md = (out / "report.md").read_text()
    for w in SHAPES:
        meta = json.loads((out / f"{w}-1.00-kvasir.json").read_text())
        assert meta["workload"] == w and meta["rate"] == RATES[w], meta
        recs = rows(out / f"{w}-1.00-kvasir.csv")
        assert recs and all(r["outcome"] == "ok" for r in recs), [r for r in recs if r["outcome"] != "ok"][:3]
        assert f"## {w}\n" in md and f"{w}: load 1.0 given as {RATES[w]}" in md
        # The setup says what the shape planned.
        assert f"(`kvasir-bench workload --shape {w}`). Planned at load 1.0:" in md
    summary = json.loads((out / "summary.json").read_text())
    assert {r["workload"] for r in summary["runs"]} == set(SHAPES)

    # Multi-turn shapes: a turn on the engine that served the previous one
    # reuses all of it (prompt and answer), up to the last partial block.
    for w in ("longchat", "agents"):
        by_conv = defaultdict(dict)
        for r in rows(out / f"{w}-1.00-kvasir.csv"):
            by_conv[r["conversation"]][int(r["turn"])] = r
        pairs = [(turns[k - 1], turns[k]) for turns in by_conv.values() for k in turns if k - 1 in turns]
        same = [(a, b) for a, b in pairs if a["endpoint"] == b["endpoint"]]
        assert len(same) >= 3, (w, len(pairs), len(same))
        for a, b in same:
            before = int(a["prompt_tokens"]) + int(a["completion_tokens"])
            assert int(b["cached_tokens"]) >= before - 2 * 16, (w, a, b)
    # The bursty mix shares only its short client preambles.
    recs = rows(out / "bursty-1.00-kvasir.csv")
    cached = sum(int(r["cached_tokens"]) for r in recs)
    prompt = sum(int(r["prompt_tokens"]) for r in recs)
    assert cached < 0.1 * prompt, (cached, prompt)


def test_an_unknown_workload_is_refused():
    with pytest.raises(SystemExit, match="unknown workload nope"):
        routing.main(["--workloads", "trace,nope"])
