"""Process plumbing: free ports, bounded waits, child processes that are
always stopped, and a plain HTTP request to 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

from .paths import REPO

START_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 20.0


def free_port() -> int:
    """A port free right now (another process can still take it before it
    is bound: prefer a child that binds port 0 and reports its port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Exited(RuntimeError):
    """A process that was waited for is gone: waiting longer cannot help."""


def wait_until(what: str, fn, timeout: float = START_TIMEOUT_S, interval: float = 0.05):
    """Polls `fn` until it returns something truthy (returned) or the
    deadline passes (TimeoutError naming `what` and the last result or
    exception); `fn` raising `Exited` ends the wait at once."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
            last = v
        except Exited:
            raise
        except Exception as e:  # noqa: BLE001 - polled until the deadline
            last = e
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what} (last: {last!r})")


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (not its children), from
    `/proc/<pid>/stat`; None when it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces: count fields after its ")".
    fields = stat.rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, summed
    over cores, from `/proc/stat` (idle and iowait count as not busy)."""
    first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(x) for x in first]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


class Proc:
    """A child process with its output in `logdir/<name>.log`, in a session
    of its own so that stopping it reaches its children too."""

    def __init__(self, name: str, argv: list[str], logdir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = argv
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.p = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def alive(self) -> bool:
        return self.p.poll() is None

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) the process has used so far, from
        `/proc`; None once it has exited or where `/proc` is missing."""
        return proc_cpu_seconds(self.p.pid) if self.alive() else None

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """`sig` to the process group, SIGKILL if it is still there after 5 s."""
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(timeout=5)
        self._log.close()


class Processes:
    """Owns a stack's processes (anything with a `proc`, or a `stop()`):
    on exit, also on an exception or Ctrl-C, stops them all, the last
    started first, each stop's failure reported and the others still
    stopped."""

    def __init__(self) -> None:
        self._items: list[Any] = []

    def add(self, item: Any) -> Any:
        self._items.append(item)
        return item

    def __enter__(self) -> "Processes":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        while self._items:
            item = self._items.pop()
            try:
                item.stop() if hasattr(item, "stop") else item.proc.stop()
            except Exception as e:  # noqa: BLE001 - keep stopping the others
                print(f"stopping {item!r}: {e}", file=sys.stderr)


def request(method: str, port: int, path: str, body: bytes | str | None = None, headers: dict[str, str] | None = None,
            timeout: float = HTTP_TIMEOUT_S) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request to 127.0.0.1:`port`: (status, lower-cased
    headers, body)."""
    if isinstance(body, str):
        body = body.encode()
    c = HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()
