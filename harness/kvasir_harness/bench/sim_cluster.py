"""The simulated cluster the routing benchmark runs each mode on
(bench/routing.py; bench/governance.py subclasses it): 8 fresh vllm-sims,
the mode's Envoys and, with the Kvasir filter, its cache-indexer (or
replicas sharing load through a redis-server in the deployed-like shape).
The `picker` mode has no filter: its Envoys are configured as an Inference
Extension gateway asking the indexer's endpoint picker over ext_proc
(harness/kvasir_harness/picker.py, the override_host pool shape). Not a
test."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

import kvasir_harness as h  # harness/kvasir_harness: processes, ports, bounded waits, the launchers
from kvasir_harness import picker as gie  # the Inference Extension gateway's bootstrap

# The kvasir mode's variants (`--variants`): other pool settings, late binding.
from . import variants as VAR

ENGINES = 8
NUM_GPU_BLOCKS = 25_000
BLOCK = 16
PROFILE = "h100-8b"
BUDGET = 8192  # vllm-sim's --max-num-batched-tokens default, which the sims run with
# The engines as `kvasir-bench bound` and `report` price requests with no queueing.
ENGINE_ARGS = ["--profile", PROFILE, "--max-num-batched-tokens", str(BUDGET), "--engine-block", str(BLOCK)]
# Long enough for the trace's longest prompt (191k tokens) plus its answer.
MAX_MODEL_LEN = 196_608

# Tenants are named in a header (x-tenant) set by the load generator: the
# benchmark measures routing, not authentication.
TENANTS = [f"t{i:02d}" for i in range(16)] + ["trace"]
POLICY = {
    "tenantSource": {"header": "x-tenant"},
    "tenants": [{"name": t} for t in TENANTS],
    "pools": [{"name": "main", "models": [h.MODEL], "cluster": "kvasir_pool", "indexerCluster": "kvasir_indexer",
               "indexerPool": "main", "indexerTimeoutMs": 100}],
    "policies": [],
    "defaultAction": {"route": {"pool": "main", "includeUsage": True}},
}
# 2 MiB - 1: the trace's longest prompt is ~1.3 MB of JSON token ids
# (Envoy's per-connection buffer in the bootstrap is 2 MiB).
SETTINGS = {"exposeServedEndpoint": True, "bodyLimitBytes": 2 * 1024 * 1024 - 1}

# The deployed-like shape (`--deployment deployed`): its default
# Envoys x indexer replicas.
PROXIES = 2
REPLICAS = 2
# The indexers' sharing round in a deployment (sharedLoad.intervalMs's
# default) and the fastest the indexer accepts.
SHARED_LOAD_MS = 25
SHARED_LOAD_MIN_MS = 5
# How long a restarted engine stays down (wall): a pod takes longer, but
# this is already several of the indexer's scrapes and Envoy's health
# checks, so both see it gone, and within what kvasir-bench's engine
# scrapes wait out.
RESTART_DOWN_S = 1.0
# The mode that routes through the indexer's endpoint picker instead of
# the filter: the same indexer, ranking and pool settings as `kvasir`.
PICKER = "picker"


@dataclass(frozen=True)
class Shape:
    """What a run's cluster looks like: the single-proxy benchmark, or the
    deployed-like one with its engine cache size."""

    deployed: bool = False
    num_gpu_blocks: int = NUM_GPU_BLOCKS
    max_model_len: int = MAX_MODEL_LEN
    direct_share: float = 0.0
    # Deployed only (`--proxies`, `--replicas`): the single shape is 1x1.
    proxy_count: int = PROXIES
    replica_count: int = REPLICAS

    @property
    def proxies(self) -> int:
        return self.proxy_count if self.deployed else 1

    @property
    def replicas(self) -> int:
        return self.replica_count if self.deployed else 1


SINGLE = Shape()


class Cluster:
    """Fresh sims plus one mode's proxies (and indexers, and Redis in the
    deployed shape); stops everything on exit."""

    def __init__(self, mode: str, logdir: Path, time_scale: float, shape: Shape = SINGLE):
        self.mode, self.logdir, self.time_scale, self.shape = mode, logdir, time_scale, shape
        self.sims: list[h.Sim] = []
        self.indexers: list[h.Indexer] = []
        # Each indexer replica's endpoint picker address (the picker mode).
        self.pickers: list[str] = []
        self.envoys: list[h.Envoy] = []
        self.procs = h.Processes()

    @property
    def envoy(self) -> h.Envoy:
        return self.envoys[0]

    @property
    def indexer(self) -> h.Indexer | None:
        return self.indexers[0] if self.indexers else None

    def __enter__(self) -> "Cluster":
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def sim_args(self) -> list[str]:
        """The engines' extra vllm-sim arguments (a subclass adds its mode's)."""
        sh = self.shape
        args = ["--num-gpu-blocks", str(sh.num_gpu_blocks), "--max-model-len", str(sh.max_model_len)]
        # A variant's `sim.schedulingPolicy` (bench/variants.py).
        policy = ((VAR.overrides(self.mode) or {}).get("sim") or {}).get("schedulingPolicy")
        return args + (["--scheduling-policy", policy] if policy else [])

    def _start(self) -> None:
        sh = self.shape
        self.sims = [self.procs.add(h.start_sim(self.logdir, f"sim{i}", profile=PROFILE, time_scale=self.time_scale,
                                                extra=self.sim_args()))
                     for i in range(ENGINES)]
        for s in self.sims:
            h.wait_sim(s)
        pool = [s.address for s in self.sims]
        if self.mode in ("round-robin", "least-request"):
            lb = self.mode.replace("-", "_")
            self.envoys = [self.procs.add(h.start_envoy(self.logdir, "{}", pool, "127.0.0.1:9", "127.0.0.1:9",
                                                        name=f"envoy{i}", without_filter=True, pool_lb=lb,
                                                        log_level="warning"))
                           for i in range(sh.proxies)]
        elif self.mode == PICKER:
            self._start_indexers()
            # Envoy i asks replica i's picker, as each proxy asks its own
            # indexer replica first in the filter's modes.
            self.envoys = [self.procs.add(gie.start_picker_envoy(self.logdir, self.pickers[i % len(self.pickers)],
                                                                  pool, "override_host", name=f"envoy{i}"))
                           for i in range(sh.proxies)]
        else:
            self._start_indexers()
            plugin = h.compile_plugin(self.policy(), SETTINGS)
            addrs = [ix.address for ix in self.indexers]
            self.envoys = [self.procs.add(h.start_envoy(self.logdir, plugin, pool, addrs[0], "127.0.0.1:9",
                                                        name=f"envoy{i}", indexers=addrs, log_level="warning"))
                           for i in range(sh.proxies)]
        for e in self.envoys:
            if self.mode == PICKER:
                # Its pool has no health checks (the picker knows the engines).
                h.wait_until("gateway envoy ready", lambda: e.proc.alive()
                             and h.request("GET", e.admin, "/ready", timeout=2)[0] == 200)
                continue
            h.wait_envoy(e, pool)
            if self.indexers:
                h.wait_until("indexer cluster healthy in envoy",
                             lambda: e.healthy("kvasir_indexer", [ix.address for ix in self.indexers]))

    def _start_indexers(self) -> None:
        """The mode's indexer (or replicas sharing load through Redis)."""
        sh = self.shape
        extra_ix = ["--index", "picks"] if self.mode == "approx-prefix" else []
        overrides = VAR.overrides(self.mode)
        redis = self.procs.add(h.start_redis(self.logdir)) if sh.replicas > 1 else None
        for i in range(sh.replicas):
            cfg = self.indexer_config(i, redis, overrides)
            picker = None
            if self.mode == PICKER:
                # The picker answers from the same compiled policy the
                # filter would run (tenants, pool, flow control).
                picker = f"127.0.0.1:{h.free_port()}"
                policy = self.logdir / f"picker-policy{i}.json"
                policy.write_text(h.compile_plugin(self.policy(), SETTINGS))
                cfg["pickers"] = [{"addr": picker, "pool": "main", "policyFile": str(policy)}]
            args = list(extra_ix)
            if cfg:
                path = self.logdir / f"indexer{i}.json"
                path.write_text(json.dumps(cfg))
                args += ["--config", str(path)]
            # Deployed: only the engines' HTTP addresses, so a restarted
            # engine's new KV-event sockets are found as in a cluster.
            ix = self.procs.add(h.indexer_for(self.sims, self.logdir, scrape_interval_ms=100, extra=args,
                                              events_from_engine=sh.deployed))
            ix.start()
            self.indexers.append(ix)
            if picker:
                self.pickers.append(picker)

    def flow(self) -> dict | None:
        """The mode's pool `flowControl` (late binding), or None."""
        return VAR.flow(self.mode, self.time_scale)

    def policy(self) -> dict:
        """The policy set the filter runs (bench/governance.py's cluster
        gives other modes their own). With flow control the pool carries
        the indexer's section too: the filter's pick deadline grows by its
        maxWaitMs and, with the work term, the filter reports first tokens."""
        flow = self.flow()
        if not flow:
            return POLICY
        pol = copy.deepcopy(POLICY)
        # enginePriority(By) and the release order are the indexer's pools
        # file's alone (the filter writes whatever priority the pick answers,
        # and waits the same whichever pick the queue releases first).
        indexer_only = ("enginePriority", "enginePriorityBy", "releaseOrder", "maxQuickestSkipMs")
        pol["pools"][0]["flowControl"] = {k: v for k, v in flow.items() if k not in indexer_only}
        return pol

    def indexer_config(self, i: int, redis: h.Redis | None, overrides: dict | None) -> dict:
        """Replica `i`'s config file ({}: none): a variant's pool settings,
        the shared load through `redis` with several replicas."""
        cfg: dict = {}
        # A variant's `sharedLoad.*` keys go to the indexer's own section
        # (e.g. `noplace:sharedLoad.placements=false`), the rest to the pool.
        overrides = dict(overrides or {})
        shared = overrides.pop("sharedLoad", {})
        overrides.pop("sim", None)  # the engines' (sim_args)
        if overrides.pop("flow", None) and self.flow():
            overrides["flowControl"] = self.flow()
        if overrides:
            # A scoring variant: the same pool, other settings.
            cfg["pools"] = [{"name": "main", "model": h.MODEL, "tokenizer": str(h.TOKENIZER), **overrides}]
        if redis is not None:
            # The replicas' sharing round (25 wall ms by default) scaled with
            # the run's clock, so the staleness a replica sees is the same in
            # simulated time as in a deployment running in real time: at time
            # scale 0.25 an unscaled round would be 100 simulated ms, four
            # times a deployment's, against four times its request rate.
            interval = max(SHARED_LOAD_MIN_MS, round(SHARED_LOAD_MS * self.time_scale))
            cfg["sharedLoad"] = {"redisUrl": redis.url, "replicaId": f"indexer-{i}", "intervalMs": interval, **shared}
        return cfg

    def __exit__(self, *exc) -> None:
        self.procs.stop_all()

    def metrics_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{s.port}/metrics" for s in self.sims]

    def restart(self, i: int) -> float:
        """Kills engine `i` and starts it again on its port (new KV-event
        sockets, empty cache); returns when it was killed (Unix seconds)."""
        at = time.time()
        back = h.restart_sim(self.sims[i], self.logdir, f"sim{i}-restarted", down_s=RESTART_DOWN_S)
        self.procs.add(back)
        h.wait_sim(back)
        self.sims[i] = back
        return at

    def notes(self) -> dict:
        """Proxy-side facts of the run: fail-opens and pick errors, summed
        over the proxies and replicas; in the deployed shape, what each
        proxy and replica did."""
        out: dict = {}
        if not self.indexers:
            return out
        for e in self.envoys:
            for k, v in e.stats().items():
                if ".pool.main." in k and any(w in k for w in ("fail_open", "pick.")) and v:
                    key = k.split(".pool.main.", 1)[1]
                    out[key] = out.get(key, 0) + v
        # How the indexer decided: `all_saturated` picks ranked endpoints that
        # were all past the saturation thresholds.
        decisions: dict[str, int] = {}
        for i, ix in enumerate(self.indexers):
            by = ix.metric_by("kvasir_indexer_picks_total", "decision")
            for d, n in by.items():
                decisions[d] = decisions.get(d, 0) + int(n)
            if self.shape.deployed:
                # Also with one replica, so shapes compare (bench/shapes.py).
                out[f"picks by indexer{i}"] = int(sum(by.values()))
            if len(self.indexers) > 1:
                out[f"indexer{i} peers seen"] = int(ix.metric("kvasir_indexer_shared_load_peers"))
        for d, n in sorted(decisions.items()):
            if n:
                out[f"decision.{d}"] = n
        if self.flow():
            out.update(self.flow_notes())
        return out

    def flow_notes(self) -> dict:
        """Late binding's picks held, released and shed, and their wait,
        summed over the replicas."""
        names = {"flow held picks": "kvasir_indexer_flow_queued_total",
                 "flow released picks": "kvasir_indexer_flow_released_total",
                 "flow shed picks": "kvasir_indexer_flow_shed_total",
                 "flow wait s (sum)": "kvasir_indexer_flow_queue_wait_seconds_sum"}
        out = {k: round(sum(ix.metric(m) for ix in self.indexers), 3) for k, m in names.items()}
        held = out["flow released picks"]
        out["flow wait ms per released pick"] = round(1e3 * out["flow wait s (sum)"] / held, 1) if held else 0.0
        return out

    def engine_source_changes(self) -> int:
        """KV-event source changes the indexers saw (a restarted engine's
        new sockets), summed."""
        return int(sum(ix.metric("kvasir_indexer_kv_event_source_changes_total") for ix in self.indexers))
