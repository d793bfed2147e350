"""`kvasir-bench model`, the offline cluster model: its table comes from the
replay (a trace whose prompts share one prefix is found cached by the scored
policy and never by round-robin), and bad weights are refused with the field
and why. No stack: it reads a trace file."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvasir_harness import TARGET

BENCH = TARGET / "release" / "kvasir-bench"


def model(*args: str) -> subprocess.CompletedProcess:
    if not BENCH.exists():
        pytest.skip("kvasir-bench not built")
    return subprocess.run([str(BENCH), "model", *args], capture_output=True, text=True, timeout=60,
                          env={"RUST_BACKTRACE": "0"})


def test_the_scored_policy_finds_a_shared_prefix_and_round_robin_does_not(tmp_path):
    trace = tmp_path / "t.jsonl"
    # 16 requests, 2 s apart, all starting with the same 8 ids (4k tokens).
    lines = [{"timestamp": i * 2000, "input_length": 4608, "output_length": 8,
              "hash_ids": [*range(8), 100 + i]} for i in range(16)]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    r = model("--trace", str(trace), "--speeds", "1", "--policies", "round-robin,kvasir",
              "--variant", "att0:attention=0")
    assert r.returncode == 0, r.stderr
    rows = {c[1]: c for c in ([x.strip() for x in line.strip("|").split("|")]
                             for line in r.stdout.splitlines()[2:])}
    assert set(rows) == {"round-robin", "kvasir", "att0"}, r.stdout
    # Round-robin over 8 engines: each sees the prefix twice, the second
    # time cached. The scored picks keep it on one engine: 15 of 16 hit.
    assert rows["round-robin"][2] == f"{8 * 4096 / (16 * 4608):.1%}", r.stdout
    assert rows["kvasir"][2] == f"{15 * 4096 / (16 * 4608):.1%}", r.stdout


@pytest.mark.parametrize("variant,message", [
    ("nameonly", "expected name:key=value"),
    ("x:queuedPrefil=1", "unknown field `queuedPrefil`"),
    ("x:decode=-1", "decode: must be a finite number >= 0, got -1"),
    ("x:kvKnee=1", "kvKnee: must be in [0, 1), got 1"),
])
def test_bad_variants_are_refused_with_the_field_and_why(tmp_path, variant, message):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}) + "\n")
    r = model("--trace", str(trace), "--variant", variant)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
