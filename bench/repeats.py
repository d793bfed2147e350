#!/usr/bin/env python3
"""Run-to-run spread of the routing benchmark, and deployed shapes repeated. The code is
kvasir_harness.bench.repeats; this file is its command line."""

import sys

from kvasir_harness.bench.repeats import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
