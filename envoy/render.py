#!/usr/bin/env python3
"""Writes an Envoy bootstrap from envoy/envoy.yaml with other ports,
endpoints, wasm path and plugin configuration (stdlib only).

A thin command-line wrapper: the renderer is
harness/kvasir_harness/bootstrap.py (the tests, the benchmark and the demo
import it from there); see its docstring for what changes and how.

    python3 envoy/render.py --listen-port 18000 --admin-port 18001 \\
        --pool-endpoint 127.0.0.1:8001 --pool-endpoint 127.0.0.1:8002 \\
        --indexer 127.0.0.1:50051 --provider 127.0.0.1:8100 \\
        --wasm target/wasm32-wasip1/wasm-release/kvasir_filter.wasm \\
        --plugin-config plugin.json > /tmp/envoy.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from kvasir_harness.bootstrap import POOL_LB, TEMPLATE, main, render, sds_secret  # noqa: F401
except ImportError:
    # A python3 the harness is not installed in (the READMEs run this file
    # with the system python3, setup or not): take the package from the
    # checkout. Its bootstrap module needs only the standard library.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
    from kvasir_harness.bootstrap import POOL_LB, TEMPLATE, main, render, sds_secret  # noqa: F401

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
