"""`kvasir-bench replay`: a chat run's conversations through the simulator's
engines in virtual time. Its table has the run's measured row and one per
placement (the run's own placement keeps each conversation where the run put
it); bad placements, weights and folders are refused with what is wrong. No
stack: it reads a results folder."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvasir_harness import TARGET

BENCH = TARGET / "release" / "kvasir-bench"

HEADER = ("id,tenant,conversation,turn,sent_s,ttft_ms,itl_ms,e2e_ms,prompt_tokens,cached_tokens,"
          "completion_tokens,endpoint,status,outcome,error")


def replay(*args: str) -> subprocess.CompletedProcess:
    if not BENCH.exists():
        pytest.skip("kvasir-bench not built")
    return subprocess.run([str(BENCH), "replay", *args], capture_output=True, text=True, timeout=60,
                          env={"RUST_BACKTRACE": "0"})


def chat_run(folder, blocks=None):
    """Two conversations on two engines: t0's two turns on A, t1's one on B."""
    rows = [
        (0, "t0", 0, 0, 0.0, 150.0, 8.0, 900.0, 3000, 0, 100, "A"),
        (1, "t1", 1, 0, 0.5, 150.0, 8.0, 900.0, 3000, 0, 100, "B"),
        (2, "t0", 0, 1, 3.0, 40.0, 8.0, 800.0, 3600, 3088, 100, "A"),
    ]
    lines = [HEADER] + [",".join(map(str, r)) + ",200,ok," for r in rows]
    (folder / "chat-1.00-kvasir.csv").write_text("\n".join(lines) + "\n")
    stats = {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0}
    meta = {"workload": "chat", "mode": "kvasir", "load": 1.0, "rate": 1.0, "time_scale": 1.0,
            "wall_s": 1.0, "engines": {"engines": 2, "prefill_utilisation": 0.0,
                                       "busy_utilisation": 0.0, "preemptions": 0.0},
            "summary": {"requests": 3, "ok": 3, "failed": 0, "timeouts": 0, "ttft": stats,
                        "itl": stats, "e2e": stats, "duration_s": 4.0, "throughput_rps": 1.0,
                        "output_tokens_per_s": 1.0, "cache_hit_rate": 0.3, "goodput_rps": 1.0,
                        "goodput_share": 1.0, "per_endpoint": [["A", 2], ["B", 1]]},
            "ttft_growth": 1.0}
    (folder / "chat-1.00-kvasir.json").write_text(json.dumps(meta))
    if blocks is not None:
        summary = {"deployment": {"workloads": {"chat": {"num_gpu_blocks": blocks}}}}
        (folder / "summary.json").write_text(json.dumps(summary))


def table(stdout: str) -> dict[str, list[str]]:
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in stdout.splitlines() if line.startswith("| ") and "---" not in line]
    return {r[0]: r for r in rows[1:]}


def test_the_runs_own_placement_and_the_oracles_each_get_a_row(tmp_path):
    chat_run(tmp_path, blocks=2048)
    r = replay("--dir", str(tmp_path), "--placements", "own;kvasir;at-arrival:0.5;central:quickest:0.5")
    assert r.returncode == 0, r.stderr
    rows = table(r.stdout)
    assert set(rows) == {"measured (the run)", "own", "kvasir", "at-arrival:0.5",
                         "central:quickest:0.5"}, r.stdout
    assert "2 conversations on 2 engines of 2048 blocks" in r.stdout
    # Measured: 3088 of 9600 prompt tokens cached.
    assert rows["measured (the run)"][5] == f"{3088 / 9600:.1%}", r.stdout
    # The run's placement: t0's two turns on the first engine, t1's on the
    # other; t0's second turn finds its first prompt and answer there.
    assert rows["own"][6] == "2 1", r.stdout
    assert float(rows["own"][5].rstrip("%")) > 30.0, r.stdout


@pytest.mark.parametrize("args,message", [
    (["--placements", "central:soonest:1"], "order \"soonest\" is neither oldest nor quickest"),
    (["--placements", "at-arrival:-1"], "\"-1\" is not a number >= 0"),
    (["--placements", "kvasir:queuedPrefil=1"], "unknown field `queuedPrefil`"),
    (["--mode", "round-robin"], "no chat run of mode round-robin at load 1"),
])
def test_bad_placements_and_runs_are_refused_with_what_is_wrong(tmp_path, args, message):
    chat_run(tmp_path, blocks=2048)
    r = replay("--dir", str(tmp_path), *args)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr


def test_a_folder_without_a_deployment_record_needs_the_cache_size(tmp_path):
    chat_run(tmp_path)
    r = replay("--dir", str(tmp_path))
    assert r.returncode != 0
    assert "give --num-gpu-blocks" in r.stderr, r.stderr
    r = replay("--dir", str(tmp_path), "--num-gpu-blocks", "2048", "--placements", "own")
    assert r.returncode == 0, r.stderr


def trace_run(folder, trace_file):
    """Two trace requests sharing their first hash id, on one engine."""
    trace = [{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [7, 8]},
             {"timestamp": 1000, "input_length": 1024, "output_length": 4, "hash_ids": [7, 9]}]
    trace_file.write_text("\n".join(json.dumps(t) for t in trace) + "\n")
    rows = [(i, "trace", "", 0, float(i), 100.0, 8.0, 200.0, 1024, 512 * i, 4, "A") for i in range(2)]
    lines = [HEADER] + [",".join(map(str, r)) + ",200,ok," for r in rows]
    (folder / "trace-1.00-kvasir.csv").write_text("\n".join(lines) + "\n")
    chat_run(folder)
    meta = json.loads((folder / "chat-1.00-kvasir.json").read_text())
    meta["workload"] = "trace"
    (folder / "trace-1.00-kvasir.json").write_text(json.dumps(meta))


def test_a_trace_run_replays_with_the_trace_it_replayed(tmp_path):
    trace_file = tmp_path / "t.jsonl"
    d = tmp_path / "run"
    d.mkdir()
    trace_run(d, trace_file)
    r = replay("--dir", str(d), "--workload", "trace", "--num-gpu-blocks", "1024", "--placements", "own")
    assert r.returncode != 0 and "--workload trace needs --trace" in r.stderr, r.stderr
    r = replay("--dir", str(d), "--workload", "trace", "--trace", str(trace_file), "--num-gpu-blocks", "1024",
               "--placements", "own;kvasir")
    assert r.returncode == 0, r.stderr
    rows = table(r.stdout)
    # The second request finds the first's 512-token block.
    assert rows["own"][5] == "25.0%" and rows["measured (the run)"][5] == "25.0%", r.stdout
    assert "kvasir" in rows, r.stdout
    trace_file.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 4,
                                      "hash_ids": [1]}) + "\n")
    r = replay("--dir", str(d), "--workload", "trace", "--trace", str(trace_file), "--num-gpu-blocks", "1024")
    assert r.returncode != 0
    assert "record 0 has 1024 prompt tokens, the trace's request 0 has 10" in r.stderr, r.stderr
