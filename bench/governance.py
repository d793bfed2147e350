#!/usr/bin/env python3
"""The governance benchmarks: token budgets and flow control on the routing
benchmark's simulated cluster. The code is kvasir_harness.bench.governance;
this file is its command line."""

import sys

from kvasir_harness.bench.governance import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
