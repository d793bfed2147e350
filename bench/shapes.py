#!/usr/bin/env python3
"""Two routing benchmark runs that differ only in their shape (Envoys x
indexer replicas), side by side. The code is
kvasir_harness.bench.shapes; this file is its command line."""

import sys

from kvasir_harness.bench.shapes import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
