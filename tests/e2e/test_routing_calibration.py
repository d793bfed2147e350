"""`bench/routing.py`'s calibration of load 1.0 (round-robin at ~70% prefill
use), with the runs scripted: it stops at the first run within the
tolerance, steps the rate by 0.7 / measured, takes the closest of three
runs when none lands within it, and stops at the chat's cap. No stack."""

from __future__ import annotations

from pathlib import Path

import pytest


from kvasir_harness.bench import routing


def scripted(monkeypatch, utilisations: list[float]) -> list[float]:
    """Makes each round-robin run measure the next utilisation; returns the
    rates the runs were asked for."""
    asked: list[float] = []

    def run_one(workload, mode, load, rate, *rest, **kw):
        assert mode == "round-robin"
        asked.append(rate)
        return {"engines": {"prefill_utilisation": utilisations[len(asked) - 1]}}

    monkeypatch.setattr(routing, "run_one", run_one)
    return asked


P = routing.PRESETS["short"]


def test_a_run_within_the_tolerance_is_taken_at_once(monkeypatch):
    asked = scripted(monkeypatch, [0.71])
    rate, u, steps = routing.calibrate("trace", 1.6, P, Path("."), Path("."))
    assert (rate, u, asked) == (1.6, 0.71, [1.6])


def test_the_rate_steps_by_target_over_measured(monkeypatch):
    asked = scripted(monkeypatch, [0.80, 0.695])
    rate, u, _ = routing.calibrate("trace", 1.6, P, Path("."), Path("."))
    assert asked == [1.6, pytest.approx(1.6 * 0.7 / 0.8)]
    assert (rate, u) == (pytest.approx(1.4), 0.695)


def test_after_three_runs_outside_the_tolerance_the_closest_is_taken(monkeypatch):
    # Not monotone (noise on a short window): the first run is the closest.
    asked = scripted(monkeypatch, [0.732, 0.651, 0.742])
    rate, u, steps = routing.calibrate("trace", 1.6, P, Path("."), Path("."))
    assert len(asked) == 3
    assert (rate, u) == (1.6, 0.732)
    assert [s[1] for s in steps] == [0.732, 0.651, 0.742]


def test_the_chat_stops_at_its_cap(monkeypatch):
    cap = routing.CHAT_MAX_RATE_PER_SCALE * P["chat_time_scale"]
    asked = scripted(monkeypatch, [0.61])
    rate, u, _ = routing.calibrate("chat", cap, P, Path("."), Path("."))
    assert (rate, u, asked) == (cap, 0.61, [cap])
