"""What the deployed-like routing runs (`bench/routing.py --deployment
deployed`) read from the trace and from their own records: the
reused content the engines' caches are sized against, and the restart as
the records saw it. Pure functions over files; loaded by routing.py."""

from __future__ import annotations

import collections
import csv
import json
import math
from pathlib import Path

# The restart note's window: requests sent this many simulated seconds
# after the restart, against those sent before it.
AFTER_RESTART_S = 60.0
# The chat's reused content, estimated from routing.py's CHAT_SHAPE means: a turn adds
# a question and an answer, every turn but a conversation's last is read
# again by the next, and no turn starts after the arrival window, so a
# conversation arriving at a gets min(turns, 1 + (duration - a) / cycle)
# turns, a cycle being the think time plus about one answer.
CHAT_MEAN = {"system": 3000, "tenants": 8, "turns": 7.0, "turn_tokens": 500 + 100, "cycle_s": 3.0 + 1.5}


def trace_reused_tokens(trace: Path, from_s: float, window_s: float | None) -> tuple[int, int]:
    """(tokens of the trace blocks more than one request of the window
    reads: what the caches must hold for every hit the window offers, the
    window's longest prompt)."""
    to = math.inf if window_s is None else from_s + window_s
    readers: collections.Counter = collections.Counter()
    longest = 0
    with trace.open() as f:
        for line in f:
            r = json.loads(line)
            if from_s * 1e3 <= r["timestamp"] < to * 1e3:
                readers.update(set(r["hash_ids"]))
                longest = max(longest, r["input_length"])
    return sum(1 for n in readers.values() if n > 1) * 512, longest


def chat_reused_tokens(conversations_per_s: float, duration_s: float) -> int:
    """The chat's reused content, estimated (CHAT_MEAN); the run's own
    records measure it afterwards (`measured_chat_reused_tokens`)."""
    m = CHAT_MEAN
    steps = 100
    turns = sum(min(m["turns"], 1 + (duration_s - (i + 0.5) * duration_s / steps) / m["cycle_s"])
                for i in range(steps)) / steps
    return int(conversations_per_s * duration_s * (turns - 1) * m["turn_tokens"] + m["system"] * m["tenants"])


def measured_chat_reused_tokens(csv_path: Path) -> int:
    """From a chat run's records, roughly: every conversation's prompt and
    answer up to its last turn but one (what that last turn read again)
    less its tenant's system prompt, plus each system prompt once. A
    tenant's system prompt is taken as its shortest first-turn prompt less
    the shortest question (CHAT_SHAPE's 200 words)."""
    by_conv: dict[str, list[dict]] = collections.defaultdict(list)
    with csv_path.open() as f:
        for r in csv.DictReader(f):
            if r["outcome"] == "ok":
                by_conv[r["conversation"]].append(r)
    systems: dict[str, int] = {}
    for turns in by_conv.values():
        first = min(turns, key=lambda r: int(r["turn"]))
        systems[first["tenant"]] = min(systems.get(first["tenant"], 1 << 30), max(0, int(first["prompt_tokens"]) - 200))
    total = sum(systems.values())
    for turns in by_conv.values():
        if len(turns) > 1:
            prev = sorted(turns, key=lambda r: int(r["turn"]))[-2]
            total += int(prev["prompt_tokens"]) + int(prev["completion_tokens"]) - systems[prev["tenant"]]
    return total


def percentile(v: list[float], q: float) -> float:
    """Nearest-rank percentile; unanswered requests are passed as inf."""
    if not v:
        return math.nan
    v = sorted(v)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def restart_notes(csv_path: Path, restarted: str, restart_s: float) -> dict:
    """The restart as the records saw it: the requests the restarted engine
    served before and after it, and TTFT (simulated ms, a request that
    never answered counted as infinitely slow, as in the report) of the
    requests sent in the AFTER_RESTART_S after it against those sent
    before it (whose failures are mostly the requests the kill cut off)."""
    before, after = [], []
    with csv_path.open() as f:
        for r in csv.DictReader(f):
            t = float(r["sent_s"])
            if t < restart_s:
                before.append(r)
            elif t < restart_s + AFTER_RESTART_S:
                after.append(r)

    def ttft(rs: list[dict]) -> list[float]:
        return [float(r["ttft_ms"]) if r["outcome"] == "ok" and r["ttft_ms"] else math.inf for r in rs]

    def to_restarted(rs: list[dict]) -> int:
        return sum(1 for r in rs if r["endpoint"] == restarted)

    def ms(v: float) -> float | None:
        # JSON has no infinity: null is a percentile that never answered.
        return None if math.isinf(v) or math.isnan(v) else round(v)

    tb, ta = ttft(before), ttft(after)
    w = f"{AFTER_RESTART_S:.0f}s after"
    return {
        "restart at s": round(restart_s, 1),
        "requests before": len(before),
        "of them to the restarted engine": to_restarted(before),
        # Mostly those in flight on the engine when it was killed.
        "failed before": sum(1 for r in before if r["outcome"] != "ok"),
        f"requests {w}": len(after),
        f"to the restarted engine {w}": to_restarted(after),
        f"failed {w}": sum(1 for r in after if r["outcome"] != "ok"),
        "TTFT p50 before ms": ms(percentile(tb, 0.5)),
        "TTFT p90 before ms": ms(percentile(tb, 0.9)),
        f"TTFT p50 {w} ms": ms(percentile(ta, 0.5)),
        f"TTFT p90 {w} ms": ms(percentile(ta, 0.9)),
    }
