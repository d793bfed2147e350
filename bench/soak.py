#!/usr/bin/env python3
"""Soaks: 1,000 held streams through Envoy with the filter, and the indexer alone under
KV events plus picks, each judged on errors and steady memory. The code is
kvasir_harness.bench.soak; this file is its command line."""

import sys

from kvasir_harness.bench.soak import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
