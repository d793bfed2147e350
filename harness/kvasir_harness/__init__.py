"""Kvasir's Python harness: what tests/e2e, tests/sim, bench/ and scripts/
share to run the local stack (vllm-sims, the cache-indexer, Envoy with the
Kvasir filter) on 127.0.0.1 and read it.

Modules:
    paths      the repository, built artifacts, the benchmarks' trace and results, model names, load_script()
    procs      Proc, Processes, free_port, wait_until (Exited), request
    bootstrap  the Envoy bootstrap renderer (envoy/render.py wraps it)
    build      rebuilding stale artifacts, compile_plugin
    policy     the local stack's policy set and keys
    sim        the vllm-sim launcher (Sim, launch_sim, start_sim, wait_sim, restart_sim)
    indexer    the cache-indexer launcher (Indexer, indexer_for)
    envoy      Envoy (start_envoy, wait_envoy), its secrets, wasm_failures
    prom       the Prometheus text parser
    redis      a throwaway redis-server (Redis, start_redis, redis_available)
    api        OpenAI-shaped bodies and SSE events
    kube       a real etcd + kube-apiserver (and Envoy Gateway) for the control-plane tests
    examples   crds/examples/ as documents for a namespace, and the Envoy Gateway Gateway they attach to (PyYAML)
    picker     Envoy as an Inference Extension gateway calling the indexer's endpoint picker
    prometheus a real Prometheus server scraping the stack, queried over its HTTP API
    secret_scan  the end-of-run scan of every process log for the secrets the tests used
    bench      the benchmarks' drivers (bench/*.py are their command lines)
    chaos      the fault suite: faults injected under load (bench/chaos.py, make chaos)

The common names are re-exported here (`import kvasir_harness as h`). The
package needs only the standard library, so envoy/render.py (which wraps
`bootstrap`) also runs under a bare python3.
"""

from __future__ import annotations

from . import bootstrap, prom
from .api import chat, sse_events, sse_named_events
from .build import cargo, compile_plugin, stale
from .envoy import Envoy, Secrets, secrets_for, start_envoy, wait_envoy, wasm_failures
from .indexer import Indexer, indexer_available, indexer_for
from .paths import (BENCH_BIN, COMPILE, ENVOY_BIN, INDEXER_BIN, MODEL, PROVIDER_MODEL, REPO, RESULTS, SIM_BIN, TARGET,
                    TOKENIZER, TRACE, WASM, load_script)
from .policy import KEYS, POLICY, PROVIDER_KEY, SETTINGS, sha256
from .redis import Redis, redis_available, start_redis
from .procs import HTTP_TIMEOUT_S, START_TIMEOUT_S, Exited, Proc, Processes, free_port, request, wait_until
from .sim import Sim, launch_sim, restart_sim, start_sim, wait_sim

__all__ = [
    "bootstrap", "prom",
    "chat", "sse_events", "sse_named_events",
    "cargo", "compile_plugin", "stale",
    "Envoy", "Secrets", "secrets_for", "start_envoy", "wait_envoy", "wasm_failures",
    "Indexer", "indexer_available", "indexer_for",
    "BENCH_BIN", "COMPILE", "ENVOY_BIN", "INDEXER_BIN", "MODEL", "PROVIDER_MODEL", "REPO", "RESULTS", "SIM_BIN", "TARGET",
    "TOKENIZER", "TRACE", "WASM",
    "load_script",
    "KEYS", "POLICY", "PROVIDER_KEY", "SETTINGS", "sha256",
    "Redis", "redis_available", "start_redis",
    "HTTP_TIMEOUT_S", "START_TIMEOUT_S", "Exited", "Proc", "Processes", "free_port", "request", "wait_until",
    "Sim", "launch_sim", "restart_sim", "start_sim", "wait_sim",
]
