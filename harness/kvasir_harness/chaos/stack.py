"""The stacks the fault scenarios run: vllm-sims with a real latency model
(so streams are held for a while), one or more cache-indexer replicas from
a config file (optionally sharing a Redis), and one Envoy with the built
filter whose indexer cluster lists the replicas, or TCP proxies in front of
them. Everything on 127.0.0.1, stopped on exit."""

from __future__ import annotations

import json
import os
import signal
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .. import prom
from ..build import compile_plugin
from ..envoy import Envoy, secrets_for, start_envoy, wait_envoy
from ..indexer import Indexer
from ..paths import INDEXER_BIN, MODEL, TOKENIZER
from ..policy import POLICY, SETTINGS
from ..procs import Processes, free_port, request, wait_until
from ..redis import Redis, start_redis
from ..sim import Sim, start_sim, wait_sim
from .tcpproxy import TcpProxy


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of `pid` in MiB (VmRSS), None when unreadable."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def indexer_config(sims: list[Sim], logdir: Path, name: str, top: dict[str, Any] | None = None,
                   pool: dict[str, Any] | None = None) -> Indexer:
    """An unstarted cache-indexer from a config file: pool `main` over
    `sims` (KV-event sockets read from each engine's /kv_event_sources),
    `top`'s sections (budgets, responses, sharedLoad), on free ports."""
    main = {"name": "main", "model": MODEL, "tokenizer": str(TOKENIZER),
            "scrape": {"intervalMs": 100, "timeoutMs": 100},
            "endpoints": [{"address": s.address} for s in sims], **(pool or {})}
    path = logdir / f"{name}.json"
    path.write_text(json.dumps({"pools": [main], **(top or {})}))
    grpc_port, http_port = free_port(), free_port()
    argv = [str(INDEXER_BIN), "--config", str(path), "--grpc-addr", f"127.0.0.1:{grpc_port}",
            "--http-addr", f"127.0.0.1:{http_port}", "--grpc-token-file", str(secrets_for(logdir).token_file)]
    ix = Indexer(None, grpc_port, http_port, argv, logdir)
    return ix


@dataclass
class ChaosStack:
    logdir: Path
    sims: list[Sim]
    indexers: list[Indexer]
    envoy: Envoy
    redis: Redis | None = None
    # With one Envoy per replica: every Envoy, `envoy` the first.
    envoys: list[Envoy] = field(default_factory=list)
    # `probes`: an Envoy per replica calling only that one, no load on it
    # (to ask one replica for picks while the main Envoy spreads them).
    probes: list[Envoy] = field(default_factory=list)
    proxies: list[TcpProxy] = field(default_factory=list)
    ps: Processes | None = None

    def sim_by_address(self) -> dict[str, Sim]:
        return {s.address: s for s in self.sims}

    def stat(self, name: str) -> int:
        return self.envoy.stat(name)

    def memory(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for i, e in enumerate(self.envoys or [self.envoy]):
            out[f"envoy{i}"] = rss_mib(e.proc.p.pid if e.proc.alive() else None)
        for i, ix in enumerate(self.indexers):
            out[f"indexer{i}"] = rss_mib(ix.proc.p.pid if ix.proc and ix.proc.alive() else None)
        if self.redis is not None:
            out["redis"] = rss_mib(self.redis.proc.p.pid if self.redis.proc.alive() else None)
        return out

    def retries(self) -> int:
        """Requests Envoy retried on another engine (every Envoy of the stack)."""
        return sum(e.stat("cluster.kvasir_pool.upstream_rq_retry") for e in (self.envoys or [self.envoy]))

    def sim_fault(self, sim: Sim, **faults: Any) -> dict[str, Any]:
        status, _, b = request("POST", sim.port, "/sim/faults", json.dumps(faults),
                               {"content-type": "application/json"}, timeout=5)
        assert status == 200, b
        return json.loads(b)

    def indexed_blocks(self, ix: Indexer) -> dict[str, float]:
        """The index's blocks per endpoint address, from the indexer's
        `kvasir_indexer_indexed_blocks`."""
        return prom.by_label(ix.metrics_text(), "kvasir_indexer_indexed_blocks", "endpoint")

    def engine_blocks(self) -> dict[str, float]:
        """Each engine's own count of cached blocks (`vllm_sim:cached_blocks`)."""
        out = {}
        for s in self.sims:
            if s.proc.alive():
                out[s.address] = s.metric("vllm_sim:cached_blocks")
        return out


def signal_proc(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@contextmanager
def chaos_stack(logdir: Path, name: str, sims: int = 3, replicas: int = 1, proxied: bool = False,
                redis: bool = False, top: dict[str, Any] | None = None, policy: dict[str, Any] | None = None,
                profile: str = "h100-8b", time_scale: float = 1.0, pick_timeout_ms: int | None = None,
                sim_extra: list[str] | None = None, envoy_per_replica: bool = False,
                probes: bool = False) -> Iterator[ChaosStack]:
    """`sims` engines, `replicas` indexers (config files; `top`'s sections,
    where the string "{redis}" in a value is replaced by the Redis URL),
    one Envoy whose indexer cluster lists every replica, each behind a TCP
    proxy when `proxied`; or, `envoy_per_replica`, one Envoy per replica
    calling only that one (so which replica a request reaches is known)."""
    d = logdir / name
    d.mkdir(parents=True, exist_ok=True)
    with Processes() as ps:
        engines = [ps.add(start_sim(d, f"sim{i}", profile=profile, time_scale=time_scale, extra=sim_extra))
                   for i in range(sims)]
        r = ps.add(start_redis(d)) if redis else None
        if r is not None and top:
            top = json.loads(json.dumps(top).replace("{redis}", r.url))
        for s in engines:
            wait_sim(s)
        idx = [indexer_config(engines, d, f"indexer{i}", top) for i in range(replicas)]
        proxies = [TcpProxy(ix.grpc_port, f"indexer{i}") for i, ix in enumerate(idx)] if proxied else []
        for p in proxies:
            ps.add(p)
        targets = [p.address for p in proxies] if proxied else [ix.address for ix in idx]
        pol = json.loads(json.dumps(policy or POLICY))
        if pick_timeout_ms is not None:
            pol["pools"][0]["indexerTimeoutMs"] = pick_timeout_ms
        plugin = compile_plugin(pol, SETTINGS)
        addrs = [s.address for s in engines]
        if envoy_per_replica:
            envoys = [ps.add(start_envoy(d, plugin, addrs, t, engines[0].address, name=f"envoy{i}"))
                      for i, t in enumerate(targets)]
            wanted = [[t] for t in targets]
        else:
            envoys = [ps.add(start_envoy(d, plugin, addrs, targets[0], engines[0].address, name="envoy",
                                         indexers=targets if len(targets) > 1 else None))]
            wanted = [targets]
        probe_envoys = [ps.add(start_envoy(d, plugin, addrs, t, engines[0].address, name=f"probe{i}"))
                        for i, t in enumerate(targets)] if probes else []
        for ix in idx:
            ix.start()
            ps.add(ix)
        probe_wanted = [[t] for t in targets] if probes else []
        for e, want in zip(envoys + probe_envoys, wanted + probe_wanted):
            wait_envoy(e, addrs)
            wait_until("indexers healthy in envoy", lambda e=e, want=want: e.healthy("kvasir_indexer", want), timeout=30)
        yield ChaosStack(d, engines, idx, envoys[0], redis=r, proxies=proxies, ps=ps, envoys=envoys, probes=probe_envoys)


def kill(proc_pid: int) -> None:
    signal_proc(proc_pid, signal.SIGKILL)
