#!/usr/bin/env python3
"""Where a mode's cache hits fell short of the pooled-cache bound on the trace. The code is
kvasir_harness.bench.hit_gap; this file is its command line."""

import sys

from kvasir_harness.bench.hit_gap import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
