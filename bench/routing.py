#!/usr/bin/env python3
"""The routing benchmark: the same simulated cluster, the same workloads, five
routing modes, one run. The code is kvasir_harness.bench.routing; this file
is its command line."""

import sys

from kvasir_harness.bench.routing import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
