"""A throwaway redis-server on 127.0.0.1 for the indexers' shared state
(`sharedLoad`, the Responses store): no persistence, stopped with the
stack."""

from __future__ import annotations

import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from .procs import Exited, Proc, free_port, wait_until


def redis_available() -> bool:
    return shutil.which("redis-server") is not None


@dataclass
class Redis:
    proc: Proc
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def ping(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")

    def stop(self) -> None:
        self.proc.stop()


def start_redis(logdir: Path, name: str = "redis") -> Redis:
    """redis-server on a free port (`scripts/setup.sh` installs it), nothing
    saved to disk; returns once it answers PING (bounded)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server not installed (scripts/setup.sh installs it)")
    port = free_port()
    argv = [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    r = Redis(Proc(name, argv, logdir), port)

    def up() -> bool:
        if not r.proc.alive():
            raise Exited(f"{name} exited: {r.proc.log()[-2000:]}")
        return r.ping()

    wait_until(f"{name} PING", up)
    return r
