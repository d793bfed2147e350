"""What a scenario reports: its checks (what was promised, the bound, what
was measured, whether it held), the load's counts, measured figures,
memory, and notes that explain named losses."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..procs import wait_until


@dataclass
class Result:
    name: str
    fault: str
    command: str
    checks: list[dict[str, Any]] = field(default_factory=list)
    load: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    memory: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    wall_s: float = 0.0

    def check(self, what: str, held: bool, measured: Any = None, bound: Any = None, known_bug: str | None = None) -> bool:
        """Records a check. `known_bug`: the check can fail because of a
        product bug described there (one that shows in some runs, not all);
        its failure does not fail the scenario, and the results name it."""
        c = {"what": what, "held": bool(held), "measured": measured, "bound": bound}
        if known_bug:
            c["known_bug"] = known_bug
        self.checks.append(c)
        return bool(held)

    @property
    def ok(self) -> bool:
        return self.error is None and all(c["held"] or c.get("known_bug") for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "fault": self.fault, "ok": self.ok, "command": self.command,
                "wall_s": round(self.wall_s, 1), "checks": self.checks, "load": self.load, "figures": self.figures,
                "memory": self.memory, "notes": self.notes, "error": self.error}


def timed_wait(what: str, fn: Callable[[], Any], timeout: float, interval: float = 0.05) -> float | None:
    """Seconds until `fn` holds, or None when it did not within `timeout`."""
    t0 = time.monotonic()
    try:
        wait_until(what, fn, timeout=timeout, interval=interval)
    except TimeoutError:
        return None
    return round(time.monotonic() - t0, 3)


def r3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
