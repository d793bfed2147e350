#!/usr/bin/env python3
"""The fault suite: each scenario injects one fault into the local stack
(real Envoy with the filter, cache-indexers, vllm-sims, redis-server) under
a steady mixed load and checks what it promises. The code is
kvasir_harness.chaos; this file is its command line.

    .tools/venv/bin/python bench/chaos.py                 # every scenario, full durations
    .tools/venv/bin/python bench/chaos.py --quick engine_killed kv_events
"""

import sys

from kvasir_harness.chaos.run import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
