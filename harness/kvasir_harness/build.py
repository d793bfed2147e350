"""The built artifacts: rebuilding the filter and the policy compiler when
their sources changed (`make build` normally did it already), and compiling
a policy set into the filter's plugin configuration."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from .paths import COMPILE, REPO


def cargo(*args: str, timeout: float = 1500) -> None:
    subprocess.run(["cargo", *args], cwd=REPO, check=True, timeout=timeout)


def stale(artifact: Path) -> bool:
    """Missing, or older than a source it is built from."""
    if not artifact.exists():
        return True
    built = artifact.stat().st_mtime
    for d in ("filter/src", "filter/examples", "policy/src", "proto/src", "proto/proto"):
        for f in (REPO / d).rglob("*"):
            if f.suffix in (".rs", ".proto") and f.stat().st_mtime > built:
                return True
    return any((REPO / d / "Cargo.toml").stat().st_mtime > built for d in ("filter", "policy", "proto"))


def compile_plugin(policy: dict[str, Any], settings: dict[str, Any] | None = None) -> str:
    """The plugin configuration JSON for a policy set (through the policy
    compiler and the filter's own loader)."""
    p = subprocess.run(
        [str(COMPILE), "-", json.dumps(settings or {})],
        input=json.dumps(policy),
        capture_output=True,
        text=True,
        timeout=30,
    )
    if p.returncode != 0:
        raise AssertionError(f"compile_policy failed: {p.stderr}")
    return p.stdout
