"""No secret in any log: a check over every log file the processes of a test
session wrote (every `Proc`: Envoy, the cache-indexer, the controller,
vllm-sims, ...), for every secret the session used:

- the tenants' API keys: `policy.KEYS`, and every `sk-...` string the test
  modules, the harness and the demo keys (gateway-api/demo/) hold, the
  keys tests send on purpose to be refused included (a key a client sent
  is a secret whether or not it is valid);
- the indexer token and the provider key: the files each process was given
  (`--grpc-token-file`, the `secrets/` folder `envoy.secrets_for` makes
  beside the logs) and `policy.PROVIDER_KEY`;
- the API server token of any kubeconfig a process was given.

`install()` wraps `Proc` so that each log is scanned when its process is
stopped (before a fixture removes its folder); `finish()` scans the logs
of processes never stopped and returns every finding as `file:line: what`
(the secret itself is not repeated). Used by tests/e2e/conftest.py.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import sys
from pathlib import Path

from .paths import REPO
from .policy import KEYS, PROVIDER_KEY
from .procs import Proc

_KEY = re.compile(r"(?<![A-Za-z0-9_-])sk-[A-Za-z0-9][A-Za-z0-9_.-]{2,}")
# Shorter strings would match too much by chance.
MIN_SECRET = 8

_logs: dict[Path, Proc] = {}
_scanned: set[Path] = set()
_findings: list[str] = []
_installed = False


def _literal_keys(path: Path) -> set[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return set()
    found = set(_KEY.findall(text))
    # Base64 values of Secrets (`data:`).
    for b in re.findall(r":\s*([A-Za-z0-9+/]{12,}={0,2})\s*(?:#.*)?$", text, re.M):
        try:
            found |= set(_KEY.findall(base64.b64decode(b, validate=True).decode("utf-8", "replace")))
        except ValueError:
            pass
    return found


@functools.lru_cache(maxsize=1)
def static_secrets() -> dict[str, str]:
    """secret -> what it is, from the harness and the repository's files."""
    out = {k: f"API key of tenant {t}" for t, k in KEYS.items()}
    out[PROVIDER_KEY] = "the provider key"
    files = [*(REPO / "tests" / "e2e").glob("*.py"), *(REPO / "harness" / "kvasir_harness").glob("*.py"),
             *(REPO / "gateway-api" / "demo").glob("*.yaml"), REPO / "scripts" / "demo.py"]
    for f in files:
        for k in _literal_keys(f):
            out.setdefault(k, f"API key written in {f.relative_to(REPO)}")
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _argv_files(argv: list[str], flag: str) -> list[Path]:
    out = []
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            out.append(Path(argv[i + 1]))
        elif a.startswith(flag + "="):
            out.append(Path(a.split("=", 1)[1]))
    return out


def dynamic_secrets() -> dict[str, str]:
    """secret -> what it is, from the processes started so far and the test
    modules loaded (a key made per run, e.g. a random provider credential)."""
    out: dict[str, str] = {}
    for log, proc in list(_logs.items()):
        secrets = log.parent / "secrets"
        for name, what in (("indexer-token", "the indexer token"), ("provider.key", "the provider key")):
            if (v := _read(secrets / name)) is not None:
                out[v] = what
        for f in _argv_files(proc.argv, "--grpc-token-file"):
            if (v := _read(f)) is not None:
                out[v] = "the indexer token"
        for f in _argv_files(proc.argv, "--kubeconfig"):
            try:
                cfg = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            for u in cfg.get("users", []):
                if t := (u.get("user") or {}).get("token"):
                    out[t] = "the API server token"
    tests = str(REPO / "tests")
    for mod in list(sys.modules.values()):
        if not (getattr(mod, "__file__", None) or "").startswith(tests):
            continue
        for v in list(vars(mod).values()):
            if isinstance(v, str):
                for k in _KEY.findall(v):
                    out.setdefault(k, f"API key held by {mod.__name__}")
    return out


def secrets() -> dict[str, str]:
    out = {**static_secrets(), **dynamic_secrets()}
    return {s: what for s, what in out.items() if len(s) >= MIN_SECRET}


def scan(path: Path, secrets: dict[str, str]) -> list[str]:
    """`path:line: <what> appears` for each line of `path` holding a secret."""
    try:
        data = path.read_bytes()
    except OSError:
        return []
    found = []
    lines: list[bytes] | None = None
    for secret, what in secrets.items():
        s = secret.encode()
        if s not in data:
            continue
        lines = lines if lines is not None else data.split(b"\n")
        found += [f"{path}:{i}: {what} appears" for i, line in enumerate(lines, 1) if s in line]
    return found


def _check(path: Path) -> None:
    _scanned.add(path)
    _findings.extend(scan(path, secrets()))


def install() -> None:
    """Wraps `Proc` (once): each started process's log is registered, and
    scanned when the process is stopped."""
    global _installed
    if _installed:
        return
    _installed = True
    init, stop = Proc.__init__, Proc.stop

    def registering_init(self, *a, **kw):
        init(self, *a, **kw)
        _logs[self.log_path] = self
        _scanned.discard(self.log_path)

    def scanning_stop(self, *a, **kw):
        try:
            stop(self, *a, **kw)
        finally:
            _check(self.log_path)

    Proc.__init__ = registering_init
    Proc.stop = scanning_stop


def finish() -> list[str]:
    """Scans the logs not scanned yet (processes never stopped) and returns
    every finding of the session."""
    for log in list(_logs):
        if log not in _scanned:
            _check(log)
    return sorted(set(_findings))


def logs_seen() -> int:
    """How many process logs the session registered."""
    return len(_logs)
