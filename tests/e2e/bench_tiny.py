"""The routing benchmark cut down to a tiny slice for the e2e tests: its
preset, engine count and sizes, and the records it writes."""

from __future__ import annotations

import csv

import pytest

from kvasir_harness import TARGET, redis_available
from kvasir_harness.bench import routing

# 8 seconds of the trace (from 360 s: 28 requests, the longest 37k tokens)
# and 5 of the chat.
TINY = {"trace_time_scale": 0.25, "chat_time_scale": 1.0, "trace_loads": [1.0], "chat_loads": [1.0],
        "trace_from_s": 360.0, "trace_window_s": 8.0, "chat_duration_s": 5.0, "trace_guess": 1.0, "chat_guess": 1.0}


def use_tiny(monkeypatch, preset: dict | None = None, *, redis: bool = False,
             max_model_len: int | None = 40_960, pool_settings: bool = False) -> None:
    """Registers `preset` (TINY by default) as the `tiny` preset on 3
    engines; skips when the binaries (or Redis, when asked) are missing.
    `max_model_len`: small caches need a small one (vllm-sim wants one
    sequence to fit); None keeps the benchmark's. `pool_settings`: keep
    the pool settings main() gives kvasir's run (late binding in the
    deployed shape); by default they are cleared for the test."""
    for b in (TARGET / "release" / "kvasir-bench", routing.h.INDEXER_BIN):
        if not b.exists():
            pytest.skip(f"{b} not built")
    if redis and not redis_available():
        pytest.skip("redis-server not installed (scripts/setup.sh installs it)")
    monkeypatch.setitem(routing.PRESETS, "tiny", preset or TINY)
    monkeypatch.setattr(routing.CL, "ENGINES", 3)
    if max_model_len is not None:
        monkeypatch.setattr(routing.CL, "MAX_MODEL_LEN", max_model_len)
    if not pool_settings:
        monkeypatch.setattr(routing.VAR, "KVASIR", {})


def rows(path) -> list[dict]:
    """A run's per-request records."""
    with path.open() as f:
        return list(csv.DictReader(f))
