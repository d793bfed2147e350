"""The indexer launcher: a cache-indexer with one pool `main` over given
vllm-sims, taking only calls with the token Envoys started in the same log
folder inject, and reading its own /metrics."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from . import prom
from .envoy import secrets_for
from .paths import INDEXER_BIN, MODEL, TOKENIZER
from .procs import Proc, free_port, request, wait_until
from .sim import Sim


def indexer_available() -> bool:
    """The binary is built and has the flags the launcher passes."""
    if not INDEXER_BIN.exists():
        return False
    try:
        out = subprocess.run([str(INDEXER_BIN), "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--endpoint" in out and "--grpc-addr" in out


@dataclass
class Indexer:
    proc: Proc | None
    grpc_port: int
    http_port: int
    argv: list[str] = field(default_factory=list)
    logdir: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> None:
        assert self.logdir is not None
        self.proc = Proc("cache-indexer", self.argv, self.logdir)
        wait_until("cache-indexer /readyz", lambda: self.proc.alive() and request("GET", self.http_port, "/readyz", timeout=2)[0] == 200)

    def stop(self) -> None:
        if self.proc:
            self.proc.stop()

    def metrics_text(self) -> str:
        return request("GET", self.http_port, "/metrics")[2].decode()

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples carrying `labels`, from one fetch."""
        return prom.total(self.metrics_text(), name, **labels)

    def metric_by(self, name: str, label: str) -> dict[str, float]:
        """`name` summed per value of `label`, from one fetch."""
        return prom.by_label(self.metrics_text(), name, label)


def indexer_for(sims: list[Sim], logdir: Path, scrape_interval_ms: int = 100, extra: list[str] | None = None,
                events_from_engine: bool = False) -> Indexer:
    """An (unstarted) cache-indexer with one pool `main` over `sims`, on free
    ports, taking only calls with the token of `secrets_for(logdir)` (the one
    Envoys started there inject); `start()` runs it and waits for /readyz.
    `extra`: more flags. `events_from_engine`: give only each engine's HTTP
    address, so the indexer reads its KV-event sockets from the engine's
    `GET /kv_event_sources` (as with vLLM 0.34 and no ports configured);
    otherwise the sockets are given explicitly."""
    grpc_port, http_port = free_port(), free_port()
    argv = [
        str(INDEXER_BIN), "--grpc-addr", f"127.0.0.1:{grpc_port}", "--http-addr", f"127.0.0.1:{http_port}",
        "--tokenizer", str(TOKENIZER), "--model", MODEL, "--scrape-interval-ms", str(scrape_interval_ms),
        *(extra or []),
    ]
    # Secure by default, as deployed: only Envoy (which injects the token
    # from the same file) may call the indexer.
    argv += ["--grpc-token-file", str(secrets_for(logdir).token_file)]
    for s in sims:
        sockets = "" if events_from_engine else f",events=tcp://127.0.0.1:{s.events},replay=tcp://127.0.0.1:{s.replay}"
        argv += ["--endpoint", f"pool=main,address={s.address}{sockets}"]
    return Indexer(None, grpc_port, http_port, argv, logdir)
