"""Envoy from the shipped bootstrap (rendered by `bootstrap`), its secrets
(SDS files and the indexer token), and reading its admin interface."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import bootstrap
from .paths import ENVOY_BIN, WASM
from .policy import KEYS, PROVIDER_KEY
from .procs import Proc, free_port, request, wait_until


@dataclass
class Secrets:
    """Envoy's SDS files and the indexer's token file for one log dir."""

    provider_sds: Path
    indexer_sds: Path
    token_file: Path
    token: str


def secrets_for(logdir: Path) -> Secrets:
    """Fresh secrets for the processes of `logdir` (made once, then reused, so
    every Envoy and indexer started there share the token)."""
    d = logdir / "secrets"
    token_file = d / "indexer-token"
    if not token_file.exists():
        d.mkdir(parents=True, exist_ok=True)
        token_file.write_text(os.urandom(16).hex())
        (d / "provider.key").write_text(PROVIDER_KEY)
        (d / "provider.sds.yaml").write_text(bootstrap.sds_secret("provider-example-credential", str(d / "provider.key")))
        (d / "indexer.sds.yaml").write_text(bootstrap.sds_secret("kvasir-indexer-token", str(token_file)))
    return Secrets(d / "provider.sds.yaml", d / "indexer.sds.yaml", token_file, token_file.read_text())


@dataclass
class Envoy:
    proc: Proc
    port: int
    admin: int
    config_path: Path

    def stats(self) -> dict[str, int]:
        _, _, b = request("GET", self.admin, "/stats?format=json")
        out = {}
        for s in json.loads(b)["stats"]:
            if "value" in s:
                out[s["name"]] = s["value"]
        return out

    def stat(self, name: str) -> int:
        return self.stats().get(name, 0)

    def prometheus(self) -> str:
        """The admin's /stats/prometheus text (read it with `prom`)."""
        return request("GET", self.admin, "/stats/prometheus")[2].decode()

    def healthy(self, cluster: str, addresses: list[str]) -> bool:
        _, _, b = request("GET", self.admin, "/clusters", timeout=2)
        text = b.decode()
        return all(f"{cluster}::{a}::health_flags::healthy" in text for a in addresses)

    def post(self, path: str, body: Any, key: str | None = "acme", headers: dict[str, str] | None = None,
             raw: bool = False) -> tuple[int, dict[str, str], bytes]:
        """POST through the listener as tenant `key` (a name in KEYS, or a raw key)."""
        h = {"content-type": "application/json"}
        if key is not None:
            h["authorization"] = f"Bearer {KEYS.get(key, key)}"
        h.update(headers or {})
        data = body if raw else json.dumps(body)
        return request("POST", self.port, path, data, h)


def start_envoy(logdir: Path, plugin: str, pool: list[str], indexer: str, provider: str, name: str = "envoy",
                pre_filters: str | None = None, without_filter: bool = False, concurrency: int = 2,
                log_level: str = "info", pool_lb: str | None = None, request_timeout_s: float | None = None,
                indexers: list[str] | None = None, wasm: Path | None = None) -> Envoy:
    """Envoy from the shipped bootstrap; `without_filter` renders the same
    bootstrap minus the Kvasir filter (the benchmark's baseline), `pool_lb`
    swaps the pool's override-host policy for a plain load balancer,
    `indexers` lists several indexer replicas instead of `indexer`, `wasm`
    loads another build of the filter (a benchmark comparing two)."""
    port, admin = free_port(), free_port()
    text = bootstrap.render(
        bootstrap.TEMPLATE.read_text(),
        listen_port=port,
        admin_port=admin,
        pool_endpoints=pool,
        indexer=indexer,
        provider=provider,
        wasm=str(wasm or WASM),
        plugin_config=plugin,
        health_interval_s=0.5,
        pre_filters=pre_filters,
        without_filter=without_filter,
        pool_lb=pool_lb,
        provider_sds=str(secrets_for(logdir).provider_sds),
        indexer_sds=str(secrets_for(logdir).indexer_sds),
        request_timeout_s=request_timeout_s,
        indexers=indexers,
    )
    cfg = logdir / f"{name}.yaml"
    cfg.write_text(text)
    argv = [str(ENVOY_BIN), "-c", str(cfg), "--concurrency", str(concurrency), "--disable-hot-restart",
            "-l", log_level, "--component-log-level", f"wasm:{log_level}"]
    return Envoy(Proc(name, argv, logdir), port, admin, cfg)


def wait_envoy(e: Envoy, pool: list[str]) -> None:
    """Until the admin says ready and every pool endpoint is healthy."""
    wait_until("envoy admin /ready", lambda: e.proc.alive() and request("GET", e.admin, "/ready", timeout=2)[0] == 200)
    wait_until("pool endpoints healthy in envoy", lambda: e.healthy("kvasir_pool", pool))


def wasm_failures(e: Envoy) -> dict[str, Any]:
    """Signs of a failed or reloaded VM: reload counters, and panics or VM
    failures in the log."""
    st = e.stats()
    counters = {k: v for k, v in st.items() if k.startswith("wasm.kvasir.vm_reload") and v}
    log = e.proc.log()
    bad = [l for l in log.splitlines() if "panicked" in l or "Wasm VM failed" in l or "wasm vm failed" in l.lower()
           or ("wasm" in l and "critical" in l)]
    return {"counters": counters, "log": bad}
