"""The routing benchmark: the same simulated cluster, the same
workloads, five routing modes, one run. Not a test.

For every workload (the Mooncake trace, the multi-tenant chat, and the
shapes nobody tuned the routers on: `longchat`, `agents`, `bursty`, see
bench/src/workloads.rs), load level and routing mode it starts 8 fresh vllm-sims (H100-8B latency profile,
time-scaled), the mode's proxy, and replays the workload through Envoy with
`kvasir-bench` as streaming requests:

- round-robin:   Envoy without the filter, ROUND_ROBIN over the pool (what a
                 Kubernetes Service gives);
- least-request: Envoy without the filter, LEAST_REQUEST;
- approx-prefix: the Kvasir filter + a cache-indexer whose prefix index
                 learns only from its own picks (`--index picks`: hash the
                 prompt in blocks, per-endpoint LRU, the Gateway API
                 Inference Extension's approximate prefix scorer), with the
                 same load terms;
- kvasir:        the Kvasir filter + the cache-indexer fed by the engines' KV
                 events;
- picker:        no filter: Envoy as a Gateway API Inference Extension
                 gateway (ext_proc, full-duplex bodies, an override_host
                 pool) asking the same indexer's endpoint picker, which
                 ranks as kvasir does (docs/picker.md).

Load 1.0 is calibrated first: a round-robin run at a guessed rate measures
prefill utilisation, and the rate is scaled to where round-robin runs at
about 70%. The report (markdown, SVG plots, per-request CSV) goes to
`--out` (default `bench/results/routing` for `--preset full`,
`bench/results/routing-short` for `short`); `kvasir-bench report` writes
it.

`--deployment deployed` runs every mode on a deployed-like shape instead:
clients spread over 2 Envoys, each Envoy's indexer cluster
holding 2 indexer replicas that share their load through a redis-server
the benchmark starts (`sharedLoad`), the indexers given only the engines'
HTTP addresses (KV-event sockets read from `GET /kv_event_sources`),
engine caches holding about half the workload's reused content (so they
evict), one engine killed and restarted on its port partway through each
run, and optionally a share of the traffic sent to the engines directly
(`--direct-share`). Round-robin and least-request run on 2 Envoys without
the filter. Results go to `bench/results/routing-deployed[-short]/`.
`--proxies N --replicas M` give it another shape (1x1: one Envoy, one
indexer, no Redis), written to `routing-deployed-NxM[-short]/` so the 2x2
folders the README quotes stay as they are; `--compare-to DIR` sets such a
run beside another shape's (same preset, caches, rates, restart; its rates
taken over unless given) in `shapes.md` and the report (bench/shapes.py).
summary.json gets a `deployment` record of the setup for that check.

    .tools/venv/bin/python bench/routing.py --preset short   # make bench
    .tools/venv/bin/python bench/routing.py --preset short --workloads all --out bench/results/workloads-short
    .tools/venv/bin/python bench/routing.py --preset full    # make bench-full
    .tools/venv/bin/python bench/routing.py --preset short --deployment deployed
    .tools/venv/bin/python bench/routing.py --preset short --deployment deployed --proxies 1 --replicas 1 \\
        --compare-to bench/results/routing-deployed-short
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import kvasir_harness as h  # harness/kvasir_harness: processes, ports, bounded waits, the launchers
from kvasir_harness.paths import BENCH_BIN, RESULTS, TRACE

# Two runs of other shapes side by side (`--compare-to`).
from . import shapes as SHAPES
# The trace's and the records' readings of the deployed-like runs.
from . import deployed_records as RECORDS
from . import cpu_usage as CPU
# The kvasir mode's variants (`--variants`): other pool settings, late binding.
from . import variants as VAR
# The cluster each run starts: engines, Envoys, indexers, its shape.
from . import sim_cluster as CL

MODES = ["round-robin", "least-request", "approx-prefix", "kvasir", "picker"]
TARGET_UTIL = 0.70
# How far from TARGET_UTIL a calibration run may land and be taken as load
# 1.0. At 5 points a run at 75% passed, which made every trace load ~10%
# heavier than a run that settled at 71% and the full runs incomparable;
# round-robin's utilisation moves ~3 points per 0.1x of trace speed.
CALIBRATION_TOLERANCE = 0.02

# The shapes beyond the trace and the chat (`kvasir-bench workload --shape
# NAME`; parameters and where they come from: bench/src/workloads.rs and
# docs/benchmarks.md "Workloads"), each with its preset settings. Their rate
# is sessions started per simulated second, calibrated to load 1.0 like the
# others'. Time scales: real time where the wall request rate at load 1.0
# stays about where the chat's does (~40 requests per wall second); the
# bursty mix sends ~60 requests per simulated second at load 1.0 and more in
# a burst, so it runs at half speed. Windows: a conversation takes ~1 min
# and an agent 1-2 min, so shorter windows would hold few whole sessions.
# The guesses are where calibration settled on this machine.
WORKLOAD_SHAPES = {
    "longchat": {
        "about": "long-context conversations: 4 system prompts of 4-8k tokens (popularity 1/(i+1)), 3-10 turns of "
                 "which 30% paste a 1.5-5k-token document and the rest ask 30-300 tokens, 150-600-token answers, "
                 "5 s mean pause, contexts up to 30k tokens",
        "short": {"time_scale": 1.0, "loads": [1.0], "duration_s": 90.0, "guess": 1.2},
        "full": {"time_scale": 1.0, "loads": [1.0, 2.0], "duration_s": 240.0, "guess": 1.2},
    },
    "agents": {
        "about": "agentic tool loops: 3 frameworks with 3-6k-token system prompts, a 200-800-token task, 10-50 "
                 "steps each of a 30-150-token tool call and a 50-1500-token tool result (log-uniform), 1.5 s mean "
                 "tool latency, contexts up to 32k tokens",
        "short": {"time_scale": 1.0, "loads": [1.0], "duration_s": 90.0, "guess": 0.5},
        "full": {"time_scale": 1.0, "loads": [1.0, 2.0], "duration_s": 240.0, "guess": 0.5},
    },
    "bursty": {
        "about": "a bursty mix with little sharing: 96% of requests 200-1000 tokens (log-uniform), 4% a 20-60k-token "
                 "document, each under one of 4 short client preambles; on/off Poisson arrivals, 3 s bursts at 8x "
                 "the rate of 9 s quiet spells (means)",
        "short": {"time_scale": 2.0, "loads": [1.0], "duration_s": 60.0, "guess": 40.0},
        "full": {"time_scale": 2.0, "loads": [1.0, 2.0], "duration_s": 180.0, "guess": 40.0},
    },
}
ALL_WORKLOADS = ["trace", "chat", *WORKLOAD_SHAPES]

# Chat requests are short next to the trace's (~5k tokens, mostly cached):
# 70% prefill use of 8 H100-profile engines takes ~14 conversations (~40
# requests) per simulated second, so the chat runs in real time (time scale
# 1) to keep the wall request rate within what 2 cores drive (~40% CPU
# there); its load 1.0 is capped at CHAT_MAX_RATE_PER_SCALE x time scale
# (the report then shows the prefill use actually reached).
PRESETS = {
    # make bench: a window of the trace at loads 1.0 and 2.0; the chat at 1.0.
    # The window is 650-770 s: its pooled-cache bound (~30%) is close to the
    # whole trace's (32%); the first minutes hold few repeats (~8%).
    "short": {"trace_time_scale": 0.25, "chat_time_scale": 1.0, "trace_loads": [1.0, 2.0], "chat_loads": [1.0],
              "trace_from_s": 650.0, "trace_window_s": 120.0, "chat_duration_s": 30.0,
              # Calibration's first guesses (the rates calibration settles at;
              # the short chat always ends at the cap).
              "trace_guess": 1.6, "chat_guess": 16.0,
              **{f"{w}_{k}": v for w, shape in WORKLOAD_SHAPES.items() for k, v in shape["short"].items()}},
    # make bench-full: the whole trace at four loads (1.5 and 2.0 both past
    # what round-robin's engines keep up with), the chat at two (about 75
    # minutes on 2 cores).
    "full": {"trace_time_scale": 0.25, "chat_time_scale": 1.0, "trace_loads": [0.5, 1.0, 1.5, 2.0],
             "chat_loads": [1.0, 2.0], "trace_from_s": 0.0, "trace_window_s": None, "chat_duration_s": 60.0,
             "trace_guess": 1.5, "chat_guess": 12.5,
             **{f"{w}_{k}": v for w, shape in WORKLOAD_SHAPES.items() for k, v in shape["full"].items()}},
}
# Conversations per simulated second the chat's load 1.0 may ask for, per
# unit of time scale (wall requests per second is what costs CPU).
CHAT_MAX_RATE_PER_SCALE = 16.0
# The chat's shape (kvasir-bench chat flags): long system prompts per tenant
# and histories that grow to several thousand tokens.
CHAT_SHAPE = ["--tenants", "8", "--tenant-skew", "0.5", "--system-words", "2000..4000", "--turns", "4..10",
              "--user-words", "200..800", "--output-tokens", "50..150", "--think-s", "3"]

# The deployed-like shape (`--deployment deployed`); its Envoys,
# replicas and sharing round are sim_cluster's.
# The workload's reused content over what all engines' caches hold together.
WORKING_SET_OVER_CACHE = 2.0
# When one engine is killed and restarted (down for sim_cluster's
# RESTART_DOWN_S): this share into the arrival window (wall time from the
# load generator's launch; the note gives the exact time on the records'
# axis). Early enough that the restarted engine is back before the
# utilisation window (the second half) starts.
RESTART_AT = 0.3
RESTARTED = 1  # which engine (sim1), the same in every mode
# How often the replicas' view of each other is sampled during a run (wall).
SHARED_LOAD_SAMPLE_S = 0.5
# The deployed chat runs at half real speed. In real time (1.0) its results
# were not the simulated cluster's: kvasir's p90 was 30.6% above
# approx-prefix's in one run and 37.5% below in another with the same
# settings, hit rates 71-75% against 87% at 2.0, and the measured p90 up to
# 1.6x what the report's FCFS queue model gives on the engines each mode
# chose, while the machine was only 32-38% busy (bench/cpu_usage.py). At
# 2.0 both modes' p90 were within 10% of that model
# (bench/results/routing-deployed-analysis.md, "The deployed chat's clock").
DEPLOYED_CHAT_TIME_SCALE = 2.0
# The chat's prompts stay below 16k tokens (4k system + 10 turns of at most
# 950): a smaller max-model-len lets its caches shrink below the trace's
# longest prompt.
CHAT_MAX_MODEL_LEN = 32_768


def deployed_blocks(reused_tokens: int, max_model_len: int) -> tuple[int, str]:
    """Blocks per engine so all engines together hold 1 / WORKING_SET_OVER_CACHE
    of the reused content, never more than the single-proxy runs' caches and
    never less than one sequence of `max_model_len` (vllm-sim refuses
    less); and a sentence saying which."""
    want = math.ceil(reused_tokens / WORKING_SET_OVER_CACHE / CL.ENGINES / CL.BLOCK)
    floor = math.ceil(max_model_len / CL.BLOCK)
    blocks = max(min(want, CL.NUM_GPU_BLOCKS), floor)
    ratio = reused_tokens / (blocks * CL.BLOCK * CL.ENGINES)
    why = ("" if blocks == want else
           " (held at the single-proxy runs' size: the reused content is already more than "
           f"{WORKING_SET_OVER_CACHE:.0f}x that)" if blocks == CL.NUM_GPU_BLOCKS else
           f" (raised to hold one sequence of max-model-len {max_model_len}, as vllm-sim requires)")
    return blocks, (f"{blocks} blocks per engine ({blocks * CL.BLOCK * CL.ENGINES / 1e6:.2f}M tokens in all) for "
                    f"{reused_tokens / 1e6:.2f}M tokens of reused content: {ratio:.1f}x what the caches hold{why}")


def log(msg: str) -> None:
    print(f"[routing] {msg}", file=sys.stderr, flush=True)


def bench(args: list[str]) -> None:
    cmd = [str(BENCH_BIN), *args]
    subprocess.run(cmd, check=True, timeout=3600)


def bench_with_restart(args: list[str], c: CL.Cluster, restart_after_s: float) -> float:
    """Runs kvasir-bench while engine RESTARTED is killed and restarted
    `restart_after_s` wall seconds after its launch; returns when it was
    killed (Unix seconds). The load generator is stopped on any error."""
    p = subprocess.Popen([str(BENCH_BIN), *args])
    try:
        deadline = time.monotonic() + restart_after_s
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise SystemExit(f"kvasir-bench ended (status {p.returncode}) before the restart")
            time.sleep(0.05)
        at = c.restart(RESTARTED)
        log(f"restarted sim{RESTARTED} on {c.sims[RESTARTED].address}")
        rc = p.wait(timeout=3600)
        if rc != 0:
            raise subprocess.CalledProcessError(rc, p.args)
        return at
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def arrival_window_s(workload: str, rate: float, p: dict) -> float:
    """Simulated seconds over which the run's requests arrive."""
    if workload != "trace":
        return p[f"{workload}_duration_s"]
    window = p["trace_window_s"] or 1000.0  # the whole trace spans ~17 minutes
    return window / rate


def run_one(workload: str, mode: str, load: float, rate: float, p: dict, out: Path, logroot: Path,
            progress: bool, shape: CL.Shape = CL.SINGLE, cluster: type | None = None) -> dict:
    """One run; `cluster`: the Cluster class to start (default sim_cluster's)."""
    logdir = Path(tempfile.mkdtemp(prefix=f"{workload}-{mode}-", dir=logroot))
    ts = p[f"{workload}_time_scale"]
    restart_unix = None
    with (cluster or CL.Cluster)(mode, logdir, ts, shape) as c:
        common = ["--time-scale", str(ts), "--mode", mode, "--load", str(load), "--out-dir", str(out)]
        for e in c.envoys:
            common += ["--url", f"http://127.0.0.1:{e.port}"]
        for u in c.metrics_urls():
            common += ["--engine-metrics", u]
        if shape.direct_share > 0:
            common += ["--direct-share", str(shape.direct_share)]
            for s in c.sims:
                common += ["--direct-url", f"http://{s.address}"]
        if not progress:
            common.append("--no-progress")
        if workload == "trace":
            window = p["trace_window_s"]
            args = ["trace", *common, "--trace", str(TRACE), "--speed", f"{rate:.4f}", "--from-s", str(p["trace_from_s"])]
            if window is not None:
                args += ["--duration-s", str(window)]
        elif workload == "chat":
            dur = p["chat_duration_s"]
            args = ["chat", *common, *CHAT_SHAPE, "--conversations-per-s", f"{rate:.4f}", "--duration-s", str(dur)]
        else:
            args = ["workload", *common, "--shape", workload, "--rate", f"{rate:.4f}", "--duration-s",
                    str(p[f"{workload}_duration_s"])]
        t0 = time.monotonic()
        cpu = CPU.CpuWatch(lambda: {"engines": c.sims, "indexers": c.indexers, "proxies": c.envoys})
        cpu.start()
        sampler = (SHAPES.SharedLoadSampler(c.indexers, SHARED_LOAD_SAMPLE_S)
                   if shape.deployed and len(c.indexers) > 1 else None)
        if shape.deployed:
            with sampler or contextlib.nullcontext():
                restart_unix = bench_with_restart(args, c, RESTART_AT * arrival_window_s(workload, rate, p) * ts)
            restarted = c.sims[RESTARTED].address
        else:
            bench(args)
        cpu_notes = cpu.notes()
        notes = c.notes()
        notes.update(cpu_notes)
        if sampler is not None:
            notes.update(sampler.notes())
        if shape.deployed and c.indexers:
            # The restarted engine's new sockets are found on a reconnect
            # with backoff (0.5 s doubling): on a loaded machine that can
            # come after a short run's last request. Wait for it (bounded).
            until = time.monotonic() + 15
            while c.engine_source_changes() < 1 and time.monotonic() < until:
                time.sleep(0.2)
            notes["KV-event source changes seen"] = c.engine_source_changes()
    name = f"{workload}-{load:.2f}-{mode}"
    meta_path = out / f"{name}.json"
    meta = json.loads(meta_path.read_text())
    start_ms = meta["notes"].pop("start_unix_ms", None)
    if restart_unix is not None and start_ms is not None:
        notes.update(RECORDS.restart_notes(out / f"{name}.csv", restarted, (restart_unix - start_ms / 1e3) / ts))
    meta["notes"].update(notes)
    meta["notes"]["wall_s_incl_start"] = round(time.monotonic() - t0, 1)
    meta_path.write_text(json.dumps(meta, indent=2))
    if not (logroot / "keep").exists():
        shutil.rmtree(logdir, ignore_errors=True)
    return meta


def calibrate(workload: str, guess: float, p: dict, scratch: Path, logroot: Path,
              shape: CL.Shape = CL.SINGLE) -> tuple[float, float, list]:
    """The rate where round-robin's prefill utilisation is ~70% on the very
    requests the runs replay: a round-robin run at `guess`, the rate scaled
    by 0.7 / measured, and one more such step if the second run is more
    than CALIBRATION_TOLERANCE off (utilisation is not quite linear in the
    rate: queues and cache reuse change with it, and one run of a short
    window is noisy). Returns the run closest to 70% as (rate, its
    utilisation, [(rate, utilisation), ...]), or the cap for a capped chat."""
    steps = []
    rate = guess
    for i in range(3):
        meta = run_one(workload, "round-robin", float(i), rate, p, scratch, logroot, progress=False, shape=shape)
        u = meta["engines"]["prefill_utilisation"]
        if not isinstance(u, (int, float)) or not u > 0:
            raise SystemExit(f"calibration of {workload}: no prefill measured (is the sim too old?)")
        steps.append((rate, u))
        log(f"calibration {workload}: round-robin at {rate:.3f} -> prefill use {u:.1%}")
        if abs(u - TARGET_UTIL) <= CALIBRATION_TOLERANCE or i == 2:
            break
        nxt = rate * TARGET_UTIL / u
        if workload == "chat":
            cap = CHAT_MAX_RATE_PER_SCALE * p["chat_time_scale"]
            if nxt > cap:
                # Capped: no point measuring again at the cap.
                return cap, u, steps
        rate = nxt
    # Within the tolerance that is the last run; after three runs outside
    # it, the closest (steps need not move monotonically: 1.600 -> 73.2%,
    # 1.531 -> 65.1%, 1.647 -> 74.2% on the short window once).
    best = min(steps, key=lambda s: abs(s[1] - TARGET_UTIL))
    return best[0], best[1], steps


def deployed_shape(workload: str, p: dict, direct_share: float, setup: list[str]) -> CL.Shape:
    """The deployed shape for `workload`: caches sized against its reused
    content (the chat's estimated at its load-1.0 cap or guess), stated in
    `setup`."""
    if workload == "trace":
        reused, longest = RECORDS.trace_reused_tokens(TRACE, p["trace_from_s"], p["trace_window_s"])
        if longest > CL.MAX_MODEL_LEN:
            raise SystemExit(f"the trace window's longest prompt ({longest} tokens) exceeds {CL.MAX_MODEL_LEN}")
        blocks, why = deployed_blocks(reused, CL.MAX_MODEL_LEN)
        setup.append(f"trace caches: {why}.")
        return CL.Shape(True, blocks, CL.MAX_MODEL_LEN, direct_share)
    if workload in WORKLOAD_SHAPES:
        # Its plan at the first guess says what is reused and how long the
        # longest sequence gets.
        st = shape_stats(workload, p[f"{workload}_guess"], p)
        max_len = max(CHAT_MAX_MODEL_LEN, -(-(st["longest_sequence_tokens"] + 1024) // 8192) * 8192)
        blocks, why = deployed_blocks(st["reused_tokens"], max_len)
        setup.append(f"{workload} caches (max-model-len {max_len}): {why}, from its plan at {p[f'{workload}_guess']} "
                     "sessions/s.")
        return CL.Shape(True, blocks, max_len, direct_share)
    rate = min(p["chat_guess"], CHAT_MAX_RATE_PER_SCALE) * p["chat_time_scale"]
    blocks, why = deployed_blocks(RECORDS.chat_reused_tokens(rate, p["chat_duration_s"]), CHAT_MAX_MODEL_LEN)
    setup.append(f"chat caches (max-model-len {CHAT_MAX_MODEL_LEN}): {why}, estimated at {rate:.1f} "
                 "conversations/s from the chat's mean shape.")
    return CL.Shape(True, blocks, CHAT_MAX_MODEL_LEN, direct_share)


def shape_stats(workload: str, rate: float, p: dict) -> dict:
    """What `kvasir-bench workload-stats` plans for a shape at `rate`."""
    out = subprocess.run([str(BENCH_BIN), "workload-stats", "--shape", workload, "--rate", f"{rate:.4f}",
                          "--duration-s", str(p[f"{workload}_duration_s"])],
                         check=True, timeout=600, capture_output=True, text=True).stdout
    return json.loads(out)


def default_dir(preset: str, deployed: bool, proxies: int, replicas: int) -> str:
    """bench/results/<this>: `routing[-deployed][-PxR][-preset]`, the shape
    named only when it is not the default 2x2, so other shapes never
    overwrite the folders the README quotes (scripts/bench_report.py)."""
    name = "routing-deployed" if deployed else "routing"
    if deployed and (proxies, replicas) != (CL.PROXIES, CL.REPLICAS):
        name += f"-{proxies}x{replicas}"
    return name + ("" if preset == "full" else f"-{preset}")


def deployed_setup(proxies: int, replicas: int, direct_share: float) -> str:
    """The setup's sentence on the deployed-like shape."""
    envoys = f"{proxies} Envoy{'s' if proxies > 1 else ''}"
    if replicas > 1:
        indexers = (f"each Envoy's indexer cluster lists {replicas} cache-indexer replicas (Envoy's round robin spreads "
                    "each worker's `Session` stream, so picks and their reports stay on one replica) that share "
                    "in-flight picks, queued prefill, picks still in prefill and recent placements (`sharedLoad."
                    "placements`) through a redis-server started for "
                    f"the run (`sharedLoad`, one round every {CL.SHARED_LOAD_MS} simulated ms: its default 25 ms scaled by "
                    "the run's time scale, at least 5 wall ms)")
    else:
        indexers = "each Envoy's indexer cluster holds the same single cache-indexer (no Redis, nothing to share)"
    return (f"Deployed-like shape ({proxies}x{replicas}): the load generator alternates trace requests (chat "
            f"conversations as a whole) over {envoys}; with the filter, {indexers}; each indexer has only the "
            "engines' HTTP addresses and reads their KV-event sockets from `GET /kv_event_sources`; round-robin "
            f"and least-request run on {envoys} without the filter. Engine sim{RESTARTED} is killed (SIGKILL) "
            f"{RESTART_AT:.0%} into each run's arrival window and started again {CL.RESTART_DOWN_S:.0f} wall s later on "
            "its port (empty cache, new KV-event sockets, event sequence from 0); the per-run facts give when, what "
            f"it served before and after, and the TTFT of the requests sent in the {RECORDS.AFTER_RESTART_S:.0f} simulated "
            "seconds after it."
            + (f" A share of {direct_share:.0%} of the trace requests / conversations (the same in every mode) goes "
               "to the engines directly, not through any router." if direct_share else ""))


def arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="short")
    ap.add_argument("--out", help="results directory (default: bench/results/routing for the full preset, "
                                  "bench/results/routing-short for the short one, so `make bench` never "
                                  "overwrites the full run the README quotes)")
    ap.add_argument("--workloads", default="trace,chat",
                    help=f"comma-separated, of {', '.join(ALL_WORKLOADS)}; `all` for every one (one report)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--loads", help="comma-separated load factors for every workload (default: the preset's)")
    ap.add_argument("--trace-rate", type=float, help="trace speed-up at load 1.0 (skips calibration)")
    ap.add_argument("--chat-rate", type=float, help="conversations/s at load 1.0 (skips calibration)")
    for w in WORKLOAD_SHAPES:
        ap.add_argument(f"--{w}-rate", type=float, help=f"{w}: sessions/s at load 1.0 (skips calibration)")
    ap.add_argument("--chat-time-scale", type=float, help="wall seconds per simulated second for the chat "
                    "(default: the preset's); above 1 the chat's wall request rate, and so the load on this "
                    "machine's cores, falls by that factor, and its load-1.0 cap rises with it")
    ap.add_argument("--variants", default="", help="extra kvasir modes with other pool settings: "
                    "`name:key=value[,section.key=value];...`, bare keys are scoring weights (e.g. "
                    "`qp05:queuedPrefill=0.5,saturation.leaveOutQueued=true`), `sharedLoad.*` keys the "
                    "replicas' sharing (e.g. `noplace:sharedLoad.placements=false`), `flow.*` keys turn on late "
                    "binding (the pool's flow control, in the indexers and the filter's policy) with LATE_BINDING's "
                    "settings overridden (e.g. `lb:flow.threshold=1.0,flow.saturatedPrefillTokens=6554`; waits as "
                    "`flow.maxWaitSimMs`, simulated ms); run after the modes")
    ap.add_argument("--late-binding", choices=["on", "off"],
                    help="kvasir (and its variants) with late binding: the pool's flow control holding picks once "
                         "every engine has ~0.2 s of prefill queued and binding the endpoint when one has room "
                         "(bench/variants.py LATE_BINDING); approx-prefix never (default: "
                         f"{'on' if VAR.DEPLOYED_LATE_BINDING else 'off'} deployed, off single)")
    ap.add_argument("--deployment", choices=["single", "deployed"], default="single",
                    help="single: one Envoy, one indexer (today's results, comparable run to run); deployed: "
                         f"{CL.PROXIES} Envoys x {CL.REPLICAS} indexer replicas sharing load through Redis, caches under "
                         "pressure, one engine restarted mid-run")
    ap.add_argument("--direct-share", type=float, default=0.0,
                    help="deployed only: share of trace requests / conversations sent to the engines directly, "
                         "not through any router (default 0)")
    ap.add_argument("--proxies", type=int, help=f"deployed only: Envoys (default {CL.PROXIES})")
    ap.add_argument("--replicas", type=int, help=f"deployed only: indexer replicas each Envoy spreads picks over "
                    f"(default {CL.REPLICAS}; with 1, no Redis)")
    ap.add_argument("--compare-to", help="another run's results directory of the same setup and another shape "
                    "(e.g. 1x1 against 2x2): its load-1.0 rates are used unless given, a setup that differs in "
                    "anything but the shape is refused, and the comparison (bench/shapes.py) goes into "
                    "shapes.md and the report")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def checked_shape(a: argparse.Namespace) -> tuple[bool, int, int, dict | None]:
    """The shape's arguments checked: (deployed, proxies, replicas, the
    `--compare-to` run's summary or None)."""
    deployed = a.deployment == "deployed"
    if a.direct_share and not deployed:
        raise SystemExit("--direct-share needs --deployment deployed")
    if not 0.0 <= a.direct_share < 1.0:
        raise SystemExit("--direct-share must be within [0, 1)")
    if (a.proxies is not None or a.replicas is not None) and not deployed:
        raise SystemExit("--proxies and --replicas need --deployment deployed")
    proxies = CL.PROXIES if a.proxies is None else a.proxies
    replicas = CL.REPLICAS if a.replicas is None else a.replicas
    if proxies < 1 or replicas < 1:
        raise SystemExit("--proxies and --replicas must be at least 1")
    other = None
    if a.compare_to:
        try:
            other = SHAPES.read_summary(Path(a.compare_to))
        except SHAPES.Refused as e:
            raise SystemExit(f"--compare-to: {e}")
    return deployed, proxies, replicas, other


def preset_of(a: argparse.Namespace, deployed: bool) -> dict:
    """The preset with `--chat-time-scale` (or the deployed chat's) applied."""
    p = dict(PRESETS[a.preset])
    if a.chat_time_scale is not None:
        if not a.chat_time_scale > 0:
            raise SystemExit("--chat-time-scale must be above 0")
        p["chat_time_scale"] = a.chat_time_scale
    elif deployed:
        p["chat_time_scale"] = DEPLOYED_CHAT_TIME_SCALE
    return p


def modes_of(a: argparse.Namespace, deployed: bool) -> tuple[list[str], bool]:
    """The modes to run, variants last, and whether kvasir late-binds;
    sets the variants' settings for this run (bench/variants.py)."""
    modes = a.modes.split(",")
    late = a.late_binding == "on" if a.late_binding else deployed and VAR.DEPLOYED_LATE_BINDING
    modes += VAR.configure(late, a.variants)
    for m in modes:
        if m not in MODES and m not in VAR.VARIANTS:
            raise SystemExit(f"unknown mode {m!r}; known: {MODES}")
    for b in (BENCH_BIN, h.SIM_BIN, h.INDEXER_BIN, h.WASM, h.COMPILE, h.ENVOY_BIN):
        if not b.exists():
            raise SystemExit(f"{b} missing: run `make build` first")
    return modes, late


def command_line(a: argparse.Namespace, deployed: bool, proxies: int, replicas: int) -> str:
    """The command the report names."""
    cmdline = "make bench" if a.preset == "short" else "make bench-full"
    if deployed:
        cmdline = f"bench/routing.py --preset {a.preset} --deployment deployed" + (
            f" --direct-share {a.direct_share}" if a.direct_share else "") + (
            "" if (proxies, replicas) == (CL.PROXIES, CL.REPLICAS) else f" --proxies {proxies} --replicas {replicas}")
    if a.late_binding:
        cmdline += f" --late-binding {a.late_binding}"
    return cmdline


def cluster_setup(p: dict, deployed: bool, late: bool) -> list[str]:
    """The setup's sentences on the engines, the proxies and the modes."""
    setup = [
        f"{CL.ENGINES} vllm-sims, latency profile {CL.PROFILE} (FACTS.md: ~30 ms + 0.03 ms per uncached token of prefill, "
        f"~6 ms decode steps), {'KV blocks (sized per workload below)' if deployed else f'{CL.NUM_GPU_BLOCKS} KV blocks'} "
        f"of {CL.BLOCK} tokens each, max-num-seqs 256, "
        f"token budget {CL.BUDGET}; time scale {p['trace_time_scale']} for the trace, {p['chat_time_scale']} for the chat"
        # A preset that runs none of the shapes (a test's) has no time scale for them.
        + "".join(f", {p[f'{w}_time_scale']} for {w}" for w in WORKLOAD_SHAPES if f"{w}_time_scale" in p)
        + " (wall seconds per simulated second).",
        "Envoy 1.40 (2 workers) in every mode; a fresh cluster (sims, indexer, Envoy) per run; the load generator "
        "and all processes share this machine's 2 cores.",
        "Modes: round-robin and least-request = Envoy's own load balancers with no filter; approx-prefix = Kvasir's filter "
        "+ cache-indexer with `--index picks` (prefix index learned from its own picks, per-endpoint LRU, the Inference "
        "Extension's approach) and the same load terms; kvasir = the filter + the indexer fed by KV events; picker = no "
        "filter: Envoy as an Inference Extension gateway (ext_proc, full-duplex bodies, an override_host pool) asking "
        "the same indexer's endpoint picker, which ranks as kvasir does.",
    ]
    if late:
        setup.append(f"kvasir runs with late binding: the pool's flow control {json.dumps(VAR.LATE_BINDING)} (the "
                     "wait in simulated ms, scaled by the time scale) in every indexer replica and the filter's "
                     "policy: a pick waits "
                     "at the indexer once every engine has that many prefill tokens queued and is bound to an "
                     "endpoint when one has room (approx-prefix runs without it); with it kvasir's scoring weights "
                     f"{json.dumps(VAR.LATE_SCORING)} (the indexer's default queuedPrefill is 0.25): the queue term "
                     "can weigh less while late binding holds picks on busy engines.")
    return setup


def load_one(w: str, given: float | None, theirs: float | None, compare_to: str | None, p: dict, shape: CL.Shape,
             scratch: Path, logroot: Path, setup: list[str]) -> float:
    """Workload `w`'s rate at load 1.0: given, the compared run's, or
    calibrated; stated in `setup`."""
    if not given and theirs:
        setup.append(f"{w}: load 1.0 = {theirs:.3f}, the compared run's ({compare_to})")
        return theirs
    if given:
        setup.append(f"{w}: load 1.0 given as {given}")
        return given
    guess = (p["trace_guess"] if w == "trace" else p["chat_guess"] * p["chat_time_scale"] if w == "chat"
             else p[f"{w}_guess"])
    rate, u, steps = calibrate(w, guess, p, scratch, logroot, shape=shape)
    unit = "x trace speed" if w == "trace" else "conversations/s" if w == "chat" else "sessions/s"
    last_rate = steps[-1][0]
    capped = (w == "chat" and rate >= CHAT_MAX_RATE_PER_SCALE * p["chat_time_scale"] - 1e-9
              and rate < last_rate * TARGET_UTIL / u - 1e-9)
    tried = ", ".join(f"{r:.3f} -> {x:.1%}" for r, x in steps)
    setup.append(f"{w}: calibration (round-robin, rate -> prefill use: {tried}); load 1.0 = {rate:.3f} {unit}"
                 + (f" (capped: {TARGET_UTIL:.0%} would need ~{last_rate * TARGET_UTIL / u:.2f}, more requests "
                    "per wall second than this 2-core machine drives)" if capped
                    else f" (target {TARGET_UTIL:.0%} within {CALIBRATION_TOLERANCE * 100:.0f} points, at most 3 runs"
                    + ("; none was, so the closest is taken" if abs(u - TARGET_UTIL) > CALIBRATION_TOLERANCE
                       else "") + ")")
                 + ".")
    return rate


def workload_setup(workloads: list[str], p: dict, shapes: dict, out: Path, setup: list[str]) -> None:
    """The trace's pooled-cache bound (bound.json) and the workloads'
    sentences."""
    if "trace" in workloads:
        window = p["trace_window_s"]
        bargs = ["bound", "--trace", str(TRACE), "--capacity-tokens", str(CL.ENGINES * shapes["trace"].num_gpu_blocks * CL.BLOCK),
                 "--from-s", str(p["trace_from_s"]), "--out", str(out / "bound.json"), *CL.ENGINE_ARGS]
        if window is not None:
            bargs += ["--duration-s", str(window)]
        bench(bargs)
        setup.append("trace: " + ("the whole trace (3,993 requests, 17 min of trace time)" if window is None
                                  else f"trace time {p['trace_from_s']:.0f}-{p['trace_from_s'] + window:.0f} s"))
    if "chat" in workloads:
        setup.append(f"chat: 8 tenants (popularity skew 0.5) with 2-4k-token system prompts, 4-10 turns of 200-800-word "
                     f"questions and 50-150-token answers, 3 s mean think time, Poisson conversation arrivals for "
                     f"{p['chat_duration_s']:.0f} simulated seconds (`kvasir-bench chat {' '.join(CHAT_SHAPE)}`).")


def shapes_setup(workloads: list[str], p: dict, rates: dict, setup: list[str]) -> None:
    """The new shapes' sentences: parameters, and what each plans at its
    load-1.0 rate (if every session ran to its end)."""
    for w in workloads:
        if w not in WORKLOAD_SHAPES:
            continue
        st = shape_stats(w, rates[w], p)
        pt = st["prompt_tokens"]
        setup.append(
            f"{w}: {WORKLOAD_SHAPES[w]['about']}; sessions start for {p[f'{w}_duration_s']:.0f} simulated seconds "
            f"(`kvasir-bench workload --shape {w}`). Planned at load 1.0: {st['sessions']} sessions, "
            f"{st['requests']} requests ({st['turns']['mean']:.1f} per session), prompts mean / p50 / p99 "
            f"{pt['mean']:.0f} / {pt['p50']:.0f} / {pt['p99']:.0f} tokens (largest {pt['max']:.0f}), "
            f"{st['shared_prefix_fraction']:.1%} of prompt tokens repeat an earlier request's prefix "
            f"({st['system_fraction']:.1%} system prompts), sessions started per second have variance / mean "
            f"{st['arrivals_per_s_dispersion']:.1f} (Poisson 1); runs end with the window, so late sessions are "
            "cut short.")


def write_report(out: Path, cmdline: str, record: dict, compare_to: str | None, other: dict | None) -> None:
    """`kvasir-bench report`, the deployment record in summary.json and,
    with `--compare-to`, the shapes side by side."""
    bench(["report", "--dir", str(out), "--command", cmdline, *CL.ENGINE_ARGS])
    summary = json.loads((out / "summary.json").read_text())
    summary["deployment"] = record
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if other is not None:
        md = SHAPES.render(out, summary, Path(compare_to), other)
        (out / "shapes.md").write_text(md)
        with (out / "report.md").open("a") as f:
            f.write("\n" + md)
        print(md, end="")


def main(argv: list[str]) -> int:
    a = arg_parser().parse_args(argv)
    deployed, proxies, replicas, other = checked_shape(a)
    p = preset_of(a, deployed)
    workloads = ALL_WORKLOADS if a.workloads == "all" else a.workloads.split(",")
    unknown = [w for w in workloads if w not in ALL_WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload {', '.join(unknown)}; known: {', '.join(ALL_WORKLOADS)} (or all)")
    loads = {w: [float(x) for x in a.loads.split(",")] if a.loads else p[f"{w}_loads"] for w in workloads}
    modes, late = modes_of(a, deployed)

    out = Path(a.out) if a.out else RESULTS / default_dir(a.preset, deployed, proxies, replicas)
    if a.compare_to and out.resolve() == Path(a.compare_to).resolve():
        raise SystemExit("--compare-to names this run's own results directory, which the run replaces")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    logroot = Path(tempfile.mkdtemp(prefix="kvasir-routing-"))
    scratch = logroot / "calibration"
    scratch.mkdir()
    t_start = time.monotonic()
    setup = cluster_setup(p, deployed, late)
    shapes = {w: CL.SINGLE for w in workloads}
    if deployed:
        setup.append(deployed_setup(proxies, replicas, a.direct_share))
    rates = {}
    for w in workloads:
        if deployed:
            shapes[w] = replace(deployed_shape(w, p, a.direct_share, setup), proxy_count=proxies,
                                replica_count=replicas)
        theirs = (other or {}).get("deployment", {}).get("workloads", {}).get(w, {}).get("rate")
        given = getattr(a, f"{w}_rate")
        rates[w] = load_one(w, given, theirs, a.compare_to, p, shapes[w], scratch, logroot, setup)
    record = SHAPES.deployment_record(
        a.deployment, a.preset, CL.ENGINES, (proxies, replicas) if deployed else (1, 1), a.direct_share,
        {"engine": RESTARTED, "at_share_of_arrivals": RESTART_AT, "down_wall_s": CL.RESTART_DOWN_S} if deployed else None,
        {w: {"rate": rates[w], "num_gpu_blocks": sh.num_gpu_blocks, "max_model_len": sh.max_model_len}
         for w, sh in shapes.items()}, p)
    for w in workloads:
        if w in WORKLOAD_SHAPES:
            # bench/shapes.py records the chat's window for every workload but the trace.
            record["workloads"][w]["duration_s"] = p[f"{w}_duration_s"]
    if late:
        # Compared shapes must agree on it (bench/shapes.py compares every key).
        record["late_binding"] = VAR.KVASIR["flow"]
        record["late_binding_scoring"] = VAR.KVASIR["scoring"]
    if other is not None:
        diff = SHAPES.setup_differences(record, other["deployment"])
        if diff:
            raise SystemExit(f"--compare-to {a.compare_to}: another setup, not only another shape: " + "; ".join(diff))
    workload_setup(workloads, p, shapes, out, setup)
    shapes_setup(workloads, p, rates, setup)

    for w in workloads:
        for load in loads[w]:
            for m in modes:
                log(f"{w} load {load} mode {m}")
                run_one(w, m, load, rates[w] * load, p, out, logroot, progress=not a.no_progress, shape=shapes[w])
    if deployed and "chat" in workloads:
        rr = out / f"chat-{loads['chat'][0]:.2f}-round-robin.csv"
        if rr.exists():
            got = RECORDS.measured_chat_reused_tokens(rr)
            setup.append(f"chat: reused content measured on {rr.name}'s records: about {got / 1e6:.2f}M tokens, "
                         f"{got / (shapes['chat'].num_gpu_blocks * CL.BLOCK * CL.ENGINES):.1f}x what the caches hold.")
    setup.append(f"Total wall time {time.monotonic() - t_start:.0f} s.")
    (out / "setup.txt").write_text("\n".join(setup) + "\n")
    write_report(out, command_line(a, deployed, proxies, replicas), record, a.compare_to, other)
    shutil.rmtree(logroot, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
