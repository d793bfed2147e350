"""CPU used during one routing run, by process group, so a report can tell
a routing difference from the machine's own contention: on this 2-core
machine the engines, proxies, indexers, Redis and the load generator all
share the cores, and a mode whose own processes use more CPU slows the
simulated engines' clocks too. Loaded by routing.py."""

from __future__ import annotations

import time
from typing import Any, Callable

from kvasir_harness.procs import machine_busy_seconds, proc_cpu_seconds


def _proc(item: Any):
    return getattr(item, "proc", None)


class CpuWatch:
    """CPU seconds each group's processes used between `start()` and
    `notes()`, and how busy the whole machine was. `groups` is called at
    both ends (a restarted engine is a new process): a process that
    exited in between is not counted in its group (a killed engine's use
    shows in "other"), one started in between counts from its start."""

    def __init__(self, groups: Callable[[], dict[str, list]]):
        self.groups = groups
        self.before: dict[int, float] = {}
        self.machine0 = (0.0, 0.0)
        self.wall0 = 0.0

    def start(self) -> None:
        self.before = {}
        for items in self.groups().values():
            for it in items:
                p = _proc(it)
                cpu = p.cpu_seconds() if p else None
                if cpu is not None:
                    self.before[p.p.pid] = cpu
        self.machine0 = machine_busy_seconds()
        self.wall0 = time.monotonic()

    def notes(self) -> dict[str, float]:
        """`cpu s <group>` per group, `cpu s other` (the load generator,
        Redis, exited processes and anything else on the machine),
        `cpu cores busy` (mean over the run) and `cpu machine busy %`."""
        out: dict[str, float] = {}
        counted = 0.0
        for name, items in self.groups().items():
            used = 0.0
            for it in items:
                p = _proc(it)
                now = proc_cpu_seconds(p.p.pid) if p else None
                if now is not None:
                    used += max(0.0, now - self.before.get(p.p.pid, 0.0))
            out[f"cpu s {name}"] = round(used, 1)
            counted += used
        busy1, total1 = machine_busy_seconds()
        busy, total = busy1 - self.machine0[0], total1 - self.machine0[1]
        wall = max(1e-9, time.monotonic() - self.wall0)
        out["cpu s other"] = round(max(0.0, busy - counted), 1)
        out["cpu cores busy"] = round(busy / wall, 2)
        out["cpu machine busy %"] = round(100.0 * busy / total, 1) if total > 0 else 0.0
        return out
