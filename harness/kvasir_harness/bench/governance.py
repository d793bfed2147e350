"""The governance benchmarks token budgets and
flow control on the simulated cluster of the routing benchmark
(`bench/routing.py`: 8 vllm-sims with the h100-8b profile, Envoy, the
cache-indexer; its Cluster, run_one and calibration are reused here). Not
a test. Four scenarios, each in one invocation on the same cluster shape:

- noisy neighbour: 4 tenants at equal weight (`kvasir-bench tenants`),
  the load calibrated so the engines' prefill use is near saturation;
  tenant t00 sends 3x its rate for a window mid-run. Runs with and
  without the burst, with flow control off (kvasir as before) and on;
  each other tenant's TTFT in the window against its own without the
  burst;
- budgets: 2 Envoys x 2 indexer replicas sharing budgets through Redis,
  tenants streaming long answers at 2x their token budgets (one with
  max_tokens, two without, so their reservations are learned estimates)
  and one at half of it; tokens served against the budget, in real time
  (time scale 1: the budgets' minute is a wall minute);
- saturation: the Mooncake trace window of the routing benchmark at load
  2.0: SLO goodput (TTFT <= 2 s) with flow control, kvasir without it
  and round-robin;
- below saturation: the trace at loads 1.0 and 1.5 with late binding
  (flow control with its threshold below 1), and kvasir without it:
  mean TTFT against the routing report's perfect-balance yardstick at the
  run's own reuse.

Load 1.0 of the trace is the routing benchmark's (read from its results,
else calibrated the same way). Flow-control waits are wall time in the
indexer; they are set here in simulated ms and scaled by the time scale.
Results go to bench/results/governance[-short]/ (`kvasir-bench
governance-report` writes report.md there), and docs/benchmarks.md's table
between `<!-- bench:governance[-short]:start -->` and its end marker is
rewritten.

    .tools/venv/bin/python bench/governance.py --preset short   # make bench
    .tools/venv/bin/python bench/governance.py --preset full    # make bench-full
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import kvasir_harness as h
from kvasir_harness.paths import REPO, RESULTS

from . import routing as R  # the routing benchmark: runs, calibration
from . import sim_cluster as CL  # the cluster routing.py runs
SCENARIOS = ["noisy", "budgets", "saturation", "below"]
SLO_MS = 2000.0

PRESETS = {
    # make bench: about 10 minutes on 2 cores.
    "short": {
        "noisy": {"tenants": 4, "time_scale": 1.0, "duration_s": 40.0, "burst": (12.0, 32.0), "factor": 3.0,
                  "guess": 4.0, "target_util": 0.8, "tolerance": 0.06, "calibration_runs": 2,
                  "prefix": 2048, "unique": (4000, 16000), "output": (20, 60), "no_burst_fc_on": True},
        "budgets": {"duration_s": 150.0, "tokens_per_minute": 120_000, "prefix": 1024, "unique": (200, 800),
                    "output": (200, 600)},
        "routing_preset": "short", "saturation_load": 2.0, "below_loads": [1.0, 1.5],
    },
    # make bench-full: longer runs, the whole trace.
    "full": {
        "noisy": {"tenants": 4, "time_scale": 1.0, "duration_s": 120.0, "burst": (40.0, 90.0), "factor": 3.0,
                  "guess": 4.0, "target_util": 0.8, "tolerance": 0.04, "calibration_runs": 3,
                  "prefix": 2048, "unique": (4000, 16000), "output": (20, 60), "no_burst_fc_on": True},
        "budgets": {"duration_s": 300.0, "tokens_per_minute": 120_000, "prefix": 1024, "unique": (200, 800),
                    "output": (200, 600)},
        "routing_preset": "full", "saturation_load": 2.0, "below_loads": [1.0, 1.5],
    },
    # A quick check of the pipeline (not for figures): tiny runs.
    "smoke": {
        "noisy": {"tenants": 4, "time_scale": 1.0, "duration_s": 10.0, "burst": (3.0, 7.0), "factor": 3.0,
                  "guess": 0.5, "target_util": 0.8, "tolerance": 1.0, "calibration_runs": 1,
                  "prefix": 2048, "unique": (4000, 16000), "output": (20, 60), "no_burst_fc_on": False},
        "budgets": {"duration_s": 20.0, "tokens_per_minute": 20_000, "prefix": 1024, "unique": (200, 800),
                    "output": (200, 600)},
        "routing_preset": "short", "saturation_load": 2.0, "below_loads": [1.0],
    },
}

# Flow-control settings per scenario (the pool's `flowControl`; waits in
# simulated ms, scaled to wall ms by the run's time scale).
FLOW = {
    # Saturation by work: an engine with 16,384 prefill tokens queued
    # (about 0.5 s of h100-8b prefill) is saturated; picks wait once every
    # engine is (threshold 1.0), and a tenant over its share of the work in
    # flight already at half of that (reserve 0.5), so the others find room
    # at once. With the work term on, the compiled config has the filter
    # report first tokens, which end a pick's prefill in that count.
    # Chosen from the tries in bench/results/governance.md ("Noisy
    # neighbour: work-based saturation and the reserve": 65,536 without
    # first-token reports, 16,384 with them); saturation by request count
    # alone (0.2 = one waiting request) missed the target at 1.8-2.7x.
    "noisy": {"threshold": 1.0, "saturatedPrefillTokens": 16384, "reserve": 0.5, "maxWaitSimMs": 5000,
              "maxQueued": 1024, "maxQueuedPerTenant": 256},
    # One tenant (the trace): the whole queue is its. Engines keep at most
    # two prefills queued; a request that waited longer than this can no
    # longer meet the 2 s SLO: shed it.
    "saturation": {"threshold": 0.1, "maxWaitSimMs": 1200, "maxQueued": 4096, "maxQueuedPerTenant": 4096},
    # Late binding, never shed: the routing benchmark's (bench/variants.py,
    # LATE_BINDING, also its `flow.*` variants), where the choice is explained.
    "below": dict(R.VAR.LATE_BINDING),
}

# Budgets tenants: (demand over the budget, requests carry max_tokens).
BUDGET_TENANTS = {"t00": (2.0, True), "t01": (2.0, False), "t02": (2.0, False), "t03": (0.5, False)}


@dataclass
class Mode:
    """What a governance mode changes in the kvasir mode: the pool's flow
    control (indexer settings, wall ms) and tenants' token budgets."""

    flow: dict | None = None
    budgets: dict[str, int] = field(default_factory=dict)
    # Extra vllm-sim arguments (the engines' --scheduling-policy).
    sim_extra: list[str] = field(default_factory=list)


# Mode name -> its settings; filled by main() from the preset.
MODES: dict[str, Mode] = {}


def flow_config(scenario: str, time_scale: float, flow: dict | None = None) -> dict:
    """The indexer pool's flowControl for `scenario`, waits in wall ms."""
    return R.VAR.flow_section(flow or FLOW[scenario], time_scale)


# flowControl settings the indexer's pools file has and the policy does
# not carry yet (flowcontrol/README.md).
POOLS_FILE_ONLY = ("enginePriority", "enginePriorityBy", "reserveCountsWaiting", "overShareSlack")


class Cluster(CL.Cluster):
    """The routing benchmark's cluster, with the governance mode's policy
    (budgets, the pool's flow control for the filter's deadline) and
    indexer settings."""

    def sim_args(self) -> list[str]:
        m = MODES.get(self.mode)
        return [*super().sim_args(), *(m.sim_extra if m else [])]

    def policy(self) -> dict:
        m = MODES.get(self.mode)
        pol = copy.deepcopy(CL.POLICY)
        if m is None:
            return pol
        for t in pol["tenants"]:
            if t["name"] in m.budgets:
                t["budget"] = {"tokensPerMinute": m.budgets[t["name"]]}
        if m.flow:
            # The same section as the indexer's: the filter's pick deadline
            # grows by its maxWaitMs. (The pools file's own settings are not
            # the policy's: the filter writes whatever the pick answers.)
            pol["pools"][0]["flowControl"] = {k: v for k, v in m.flow.items() if k not in POOLS_FILE_ONLY}
        return pol

    def indexer_config(self, i: int, redis: h.Redis | None, overrides: dict | None) -> dict:
        cfg = super().indexer_config(i, redis, overrides)
        m = MODES.get(self.mode)
        if m and m.flow:
            pools = cfg.setdefault("pools", [{"name": "main", "model": h.MODEL, "tokenizer": str(h.TOKENIZER)}])
            pools[0]["flowControl"] = m.flow
        if m and m.budgets and redis is not None:
            cfg["budgets"] = {"store": "redis", "redisUrl": redis.url}
        return cfg

    def notes(self) -> dict:
        out = super().notes()
        if not self.indexers:
            return out
        words = ("rate_limit", "shed", "queue", "budget", "flow")
        for e in self.envoys:
            for k, v in e.stats().items():
                # kvasir.tenant.<t>.model.<m>.rate_limited.<limit> / shed.<cause>, pool counters.
                if v and k.startswith("kvasir.") and any(w in k for w in words):
                    key = "envoy " + k.removeprefix("kvasir.")
                    out[key] = out.get(key, 0) + v
        for ix in self.indexers:
            for s in h.prom.samples(ix.metrics_text()):
                if (s.name.endswith(("_bucket", "_created")) or "queued_prefill" in s.name
                        or not any(w in s.name for w in words)):
                    continue
                if s.value:
                    out[s.name] = round(out.get(s.name, 0) + s.value, 3)
        return out


def log(msg: str) -> None:
    print(f"[governance] {msg}", file=sys.stderr, flush=True)


def run_tenants(workload: str, mode: str, load: float, ts: float, wl_args: list[str], out: Path, logroot: Path,
                shape: CL.Shape = CL.SINGLE) -> dict:
    """One `kvasir-bench tenants` run on a fresh cluster; returns its meta
    (with the proxies' and indexers' counters in its notes)."""
    logdir = Path(tempfile.mkdtemp(prefix=f"{workload}-{mode}-", dir=logroot))
    t0 = time.monotonic()
    with Cluster(mode, logdir, ts, shape) as c:
        args = ["tenants", "--workload", workload, "--time-scale", str(ts), "--mode", mode, "--load", str(load),
                "--out-dir", str(out), "--no-progress", "--drain-s", "120", *wl_args]
        for e in c.envoys:
            args += ["--url", f"http://127.0.0.1:{e.port}"]
        for u in c.metrics_urls():
            args += ["--engine-metrics", u]
        R.bench(args)
        notes = c.notes()
    path = out / f"{workload}-{load:.2f}-{mode}.json"
    meta = json.loads(path.read_text())
    meta["notes"].pop("start_unix_ms", None)
    meta["notes"].update(notes)
    meta["notes"]["wall_s_incl_start"] = round(time.monotonic() - t0, 1)
    path.write_text(json.dumps(meta, indent=2))
    if not (logroot / "keep").exists():
        shutil.rmtree(logdir, ignore_errors=True)
    return meta


# The engine-priority mode of the noisy neighbour (`--engine-priority`):
# flow control as kvasir-fc plus the pool's enginePriority, the engines at
# vLLM's --scheduling-policy priority.
PRIO_MODE = "kvasir-fcp"
PRIO_LABEL = "flow control + engine priority"


def noisy(p: dict, out: Path, logroot: Path, setup: list[str], engine_priority: bool = False,
          rate: float | None = None) -> dict:
    """The noisy-neighbour runs; returns the scenario for scenarios.json.
    With `engine_priority`, also the runs of PRIO_MODE (and it is the
    subject); with `rate`, no calibration (one run without the burst at it)."""
    n = p["noisy"]
    ts = n["time_scale"]
    MODES["kvasir"] = Mode()
    MODES["kvasir-fc"] = Mode(flow=flow_config("noisy", ts))
    if engine_priority:
        MODES[PRIO_MODE] = Mode(flow={**flow_config("noisy", ts), "enginePriority": True},
                                sim_extra=["--scheduling-policy", "priority"])
    frm, to = n["burst"]

    def args(rate: float, burst: bool) -> list[str]:
        a = ["--tenants", str(n["tenants"]), "--rate", f"{rate:.4f}", "--duration-s", str(n["duration_s"]),
             "--prefix-tokens", str(n["prefix"]), "--unique-tokens", "{}..{}".format(*n["unique"]),
             "--output-tokens", "{}..{}".format(*n["output"])]
        return a + (["--burst", f"0:{n['factor']}:{frm}..{to}"] if burst else [])

    # The run without the burst and without flow control calibrates the
    # load: its prefill use near `target_util`, else rescaled and run again.
    steps = []
    runs = n["calibration_runs"] if rate is None else 1
    rate = n["guess"] if rate is None else rate
    for i in range(runs):
        meta = run_tenants("noisy", "kvasir", 1.0, ts, args(rate, False), out, logroot)
        u = meta["engines"]["prefill_utilisation"]
        steps.append((rate, u))
        log(f"noisy calibration: {rate:.3f} requests/s per tenant -> prefill use {u:.1%}")
        if abs(u - n["target_util"]) <= n["tolerance"] or i == runs - 1:
            break
        rate *= n["target_util"] / u
    pairs = [{"label": "flow control off", "burst": "noisy-burst-1.00-kvasir", "baseline": "noisy-1.00-kvasir"}]
    run_tenants("noisy-burst", "kvasir", 1.0, ts, args(rate, True), out, logroot)
    base_on = "noisy-1.00-kvasir"
    if n["no_burst_fc_on"]:
        run_tenants("noisy", "kvasir-fc", 1.0, ts, args(rate, False), out, logroot)
        base_on = "noisy-1.00-kvasir-fc"
    run_tenants("noisy-burst", "kvasir-fc", 1.0, ts, args(rate, True), out, logroot)
    pairs.append({"label": "flow control on", "burst": "noisy-burst-1.00-kvasir-fc", "baseline": base_on})
    if base_on != "noisy-1.00-kvasir":
        # Also against today's figures: the burst with flow control against
        # no burst without it.
        pairs.append({"label": "flow control on, against off without the burst",
                      "burst": "noisy-burst-1.00-kvasir-fc", "baseline": "noisy-1.00-kvasir"})
    subject = "flow control on"
    if engine_priority:
        run_tenants("noisy", PRIO_MODE, 1.0, ts, args(rate, False), out, logroot)
        run_tenants("noisy-burst", PRIO_MODE, 1.0, ts, args(rate, True), out, logroot)
        pairs.append({"label": PRIO_LABEL, "burst": f"noisy-burst-1.00-{PRIO_MODE}",
                      "baseline": f"noisy-1.00-{PRIO_MODE}"})
        pairs.append({"label": f"{PRIO_LABEL}, against off without the burst",
                      "burst": f"noisy-burst-1.00-{PRIO_MODE}", "baseline": "noisy-1.00-kvasir"})
        subject = PRIO_LABEL
        setup.append(f"{PRIO_LABEL} ({PRIO_MODE}): kvasir-fc's flowControl plus enginePriority (every pick answer "
                     "carries vLLM's priority, 0 for a tenant at or under its weighted share of the work in flight "
                     "and waiting, 1 over it; the filter writes it into the body and the x-vllm-priority header), "
                     "the engines at --scheduling-policy priority.")
    fc = MODES["kvasir-fc"].flow
    tried = ", ".join(f"{r:.3f} -> {x:.1%}" for r, x in steps)
    setup.append(
        f"noisy neighbour: {n['tenants']} tenants at equal weight (t00..), each Poisson at {rate:.3f} requests per "
        f"simulated second (calibration, rate -> prefill use without the burst and flow control: {tried}; target "
        f"{n['target_util']:.0%}), token-id prompts of a {n['prefix']}-token tenant prefix plus "
        f"{n['unique'][0]}-{n['unique'][1]} tokens of their own, {n['output'][0]}-{n['output'][1]}-token answers, "
        f"{n['duration_s']:.0f} s of arrivals at time scale {ts}; t00 sends {n['factor']}x its rate from {frm:.0f} s "
        f"to {to:.0f} s (the same requests plus extra ones). Flow control on: the pool's flowControl {json.dumps(fc)} "
        f"(wall ms); the no-burst figure of flow control on is from "
        + ("its own run without the burst." if n["no_burst_fc_on"] else "the run without flow control."))
    return {"burstTenant": "t00", "factor": n["factor"], "fromS": frm, "toS": to, "pairs": pairs,
            "subject": subject}


def budgets(p: dict, out: Path, logroot: Path, setup: list[str]) -> dict:
    """The budgets run (2 Envoys x 2 replicas, Redis); returns the scenario."""
    b = p["budgets"]
    tpm = b["tokens_per_minute"]
    names = list(BUDGET_TENANTS)
    MODES["kvasir-budgets"] = Mode(budgets={t: tpm for t in names})
    mean_tokens = b["prefix"] // 512 * 512 + sum(b["unique"]) / 2 + sum(b["output"]) / 2
    # Requests per second of a tenant at 1x its budget.
    rate = tpm / 60.0 / mean_tokens
    shares = [BUDGET_TENANTS[t][0] for t in names]
    no_max = [str(i) for i, t in enumerate(names) if not BUDGET_TENANTS[t][1]]
    args = ["--tenants", str(len(names)), "--rate", f"{rate:.4f}", "--shares", ",".join(map(str, shares)),
            "--duration-s", str(b["duration_s"]), "--prefix-tokens", str(b["prefix"]),
            "--unique-tokens", "{}..{}".format(*b["unique"]), "--output-tokens", "{}..{}".format(*b["output"]),
            "--no-max-tokens", ",".join(no_max)]
    shape = CL.Shape(True, CL.NUM_GPU_BLOCKS, CL.MAX_MODEL_LEN)
    run_tenants("budgets", "kvasir-budgets", 1.0, 1.0, args, out, logroot, shape)
    setup.append(
        f"budgets: {CL.PROXIES} Envoys x {CL.REPLICAS} indexer replicas sharing budgets through a redis-server "
        f"(`budgets: {{store: redis}}`), requests alternating over the Envoys; every tenant's budget "
        f"tokensPerMinute {tpm} (prompt, cached at weight 1, plus completion); prompts of a {b['prefix']}-token "
        f"tenant prefix plus {b['unique'][0]}-{b['unique'][1]} tokens, answers of {b['output'][0]}-{b['output'][1]} "
        f"tokens (about {mean_tokens:.0f} tokens a request), Poisson for {b['duration_s']:.0f} s at time scale 1; "
        + ", ".join(f"{t} at {d}x its budget{'' if m else ' without max_tokens'}"
                    for t, (d, m) in BUDGET_TENANTS.items())
        + " (a tenant without max_tokens sends its prompt as chat messages of words, about a token each, to "
          "/v1/chat/completions: /v1/completions would answer 16 tokens, the API's default).")
    return {"run": "budgets-1.00-kvasir-budgets", "durationS": b["duration_s"], "windowS": 60.0,
            "tenants": [{"name": t, "tokensPerMinute": tpm, "demand": d, "maxTokens": m}
                        for t, (d, m) in BUDGET_TENANTS.items()]}


def trace_rate(p: dict, given: float | None, logroot: Path, setup: list[str]) -> float:
    """Trace load 1.0: given, else the routing benchmark's calibration of
    the same window, else calibrated here the same way."""
    rp = R.PRESETS[p["routing_preset"]]
    if given:
        setup.append(f"trace: load 1.0 given as {given} x trace speed.")
        return given
    name = "routing" if p["routing_preset"] == "full" else f"routing-{p['routing_preset']}"
    ref = RESULTS / name / "trace-1.00-round-robin.json"
    if ref.exists():
        rate = float(json.loads(ref.read_text())["rate"])
        setup.append(f"trace: load 1.0 = {rate:.3f} x trace speed, the routing benchmark's calibration "
                     f"(bench/results/{name}/: round-robin at about {R.TARGET_UTIL:.0%} prefill use).")
        return rate
    scratch = logroot / "calibration"
    scratch.mkdir(exist_ok=True)
    rate, u, _ = R.calibrate("trace", rp["trace_guess"], rp, scratch, logroot)
    setup.append(f"trace: load 1.0 = {rate:.3f} x trace speed (calibrated here: round-robin at {u:.1%} prefill use).")
    return rate


def trace_runs(p: dict, rate: float, scenarios: list[str], out: Path, logroot: Path, setup: list[str]) -> tuple:
    """The saturation and below-saturation runs; returns their scenarios."""
    rp = R.PRESETS[p["routing_preset"]]
    ts = rp["trace_time_scale"]
    MODES["kvasir"] = Mode()
    MODES["kvasir-fc"] = Mode(flow=flow_config("saturation", ts))
    MODES["kvasir-lb"] = Mode(flow=flow_config("below", ts))
    window = rp["trace_window_s"]
    setup.append("trace: " + ("the whole trace" if window is None else
                              f"trace time {rp['trace_from_s']:.0f}-{rp['trace_from_s'] + window:.0f} s (the routing "
                              f"benchmark's window)") + f", time scale {ts}.")

    def run(mode: str, load: float) -> str:
        log(f"trace load {load} mode {mode}")
        R.run_one("trace", mode, load, rate * load, rp, out, logroot, progress=False, cluster=Cluster)
        return f"trace-{load:.2f}-{mode}"

    sat = None
    if "saturation" in scenarios:
        load = p["saturation_load"]
        runs = [("round-robin", run("round-robin", load)), ("kvasir", run("kvasir", load)),
                ("kvasir + flow control", run("kvasir-fc", load))]
        sat = {"load": load, "sloMs": SLO_MS, "runs": [{"label": l, "run": r} for l, r in runs],
               "subject": "kvasir + flow control", "baseline": "round-robin"}
        setup.append(f"saturation: flow control {json.dumps(MODES['kvasir-fc'].flow)} (wall ms; "
                     f"{FLOW['saturation']['maxWaitSimMs']} simulated ms of waiting at most).")
    below = []
    if "below" in scenarios:
        for load in p["below_loads"]:
            runs = [("kvasir", run("kvasir", load)), ("kvasir + late binding", run("kvasir-lb", load))]
            below.append({"load": load, "runs": [{"label": l, "run": r} for l, r in runs],
                          "subject": "kvasir + late binding"})
        setup.append(f"below saturation: late binding = flow control {json.dumps(MODES['kvasir-lb'].flow)} (wall ms).")
    return sat, below


def update_readme(out: Path) -> None:
    """docs/benchmarks.md's table for this results directory, between its
    markers (`readme.md` in the results directory, its links made relative
    to docs/)."""
    name = out.name
    page = REPO / "docs" / "benchmarks.md"
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    text = page.read_text()
    if start not in text or end not in text:
        log(f"docs/benchmarks.md has no {start} ... {end}: table not updated")
        return
    table = (out / "readme.md").read_text().replace("](bench/", "](../bench/")
    pat = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    page.write_text(pat.sub(lambda _: f"{start}\n{table}{end}", text, count=1))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="short")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {SCENARIOS}")
    ap.add_argument("--out", help="results directory (default bench/results/governance for full, "
                                  "bench/results/governance-short for short)")
    ap.add_argument("--trace-rate", type=float, help="trace speed-up at load 1.0 (default: the routing benchmark's)")
    ap.add_argument("--flow", action="append", default=[], metavar="SCENARIO:KEY=VALUE",
                    help="override a scenario's flow-control setting, e.g. below:threshold=0.3 (repeatable)")
    ap.add_argument("--no-readme", action="store_true", help="leave docs/benchmarks.md alone")
    ap.add_argument("--engine-priority", action="store_true",
                    help="noisy: also run flow control with the pool's enginePriority and the engines at "
                         f"--scheduling-policy priority ({PRIO_MODE}), in the same invocation")
    ap.add_argument("--noisy-rate", type=float,
                    help="noisy: requests per simulated second per tenant, instead of calibrating")
    ap.add_argument("--noisy-factor", type=float,
                    help="noisy: t00's rate in the burst window as a multiple of its own (default: the preset's, "
                         "3.0); 1.0 sends no extra requests (the burst run repeats the run without it: run-to-run "
                         "noise), 1.25 is t00 at its equal share of a pool the others use at 80%%")
    a = ap.parse_args(argv)
    scenarios = [s for s in a.scenarios.split(",") if s]
    if a.noisy_factor is not None and a.noisy_factor < 1.0:
        raise SystemExit(f"--noisy-factor {a.noisy_factor}: expected 1.0 or more")
    for s in scenarios:
        if s not in SCENARIOS:
            raise SystemExit(f"unknown scenario {s!r}; known: {SCENARIOS}")
    for o in a.flow:
        sc, _, kv = o.partition(":")
        k, _, v = kv.partition("=")
        if sc not in FLOW or not k or not v:
            raise SystemExit(f"--flow {o!r}: expected SCENARIO:KEY=VALUE with SCENARIO one of {sorted(FLOW)}")
        FLOW[sc][k] = {"true": True, "false": False}.get(v, None)
        if FLOW[sc][k] is None:
            FLOW[sc][k] = float(v) if "." in v else int(v)
    for b in (R.BENCH_BIN, h.SIM_BIN, h.INDEXER_BIN, h.WASM, h.COMPILE, h.ENVOY_BIN):
        if not b.exists():
            raise SystemExit(f"{b} missing: run `make build` first")
    p = PRESETS[a.preset]
    out = Path(a.out) if a.out else RESULTS / ("governance" if a.preset == "full" else
                                                                  f"governance-{a.preset}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    logroot = Path(tempfile.mkdtemp(prefix="kvasir-governance-"))
    t0 = time.monotonic()
    setup = [
        f"{CL.ENGINES} vllm-sims (latency profile {CL.PROFILE}, {CL.NUM_GPU_BLOCKS} KV blocks of {CL.BLOCK} tokens, token "
        f"budget {CL.BUDGET}), Envoy 1.40 (2 workers) with the Kvasir filter and the cache-indexer (round-robin: "
        "Envoy's own, no filter); a fresh cluster per run; everything shares this machine's 2 cores.",
        "Modes: kvasir = the filter + the indexer fed by KV events, flow control off; "
        "kvasir-fc / kvasir-lb = the same with the pool's flow control on; kvasir-budgets = with tenants' "
        "token budgets.",
    ]
    sc: dict = {"command": f"bench/governance.py --preset {a.preset}" if a.scenarios == ",".join(SCENARIOS)
                else f"bench/governance.py --preset {a.preset} --scenarios {a.scenarios}", "setup": setup}
    if a.flow:
        sc["command"] += "".join(f" --flow {o}" for o in a.flow)
    if a.engine_priority:
        sc["command"] += " --engine-priority"
    if a.noisy_rate:
        sc["command"] += f" --noisy-rate {a.noisy_rate}"
    if a.noisy_factor:
        p["noisy"]["factor"] = a.noisy_factor
        sc["command"] += f" --noisy-factor {a.noisy_factor}"
    if "noisy" in scenarios:
        sc["noisy"] = noisy(p, out, logroot, setup, a.engine_priority, a.noisy_rate)
    if "budgets" in scenarios:
        sc["budgets"] = budgets(p, out, logroot, setup)
    if "saturation" in scenarios or "below" in scenarios:
        rate = trace_rate(p, a.trace_rate, logroot, setup)
        sc["saturation"], sc["below"] = trace_runs(p, rate, scenarios, out, logroot, setup)
    setup.append(f"Total wall time {time.monotonic() - t0:.0f} s.")
    (out / "scenarios.json").write_text(json.dumps(sc, indent=2))
    R.bench(["governance-report", "--dir", str(out), *CL.ENGINE_ARGS])
    if not a.no_readme:
        update_readme(out)
    shutil.rmtree(logroot, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
