#!/usr/bin/env python3
"""The latency the Kvasir filter plus the indexer pick adds over the same Envoy
route without the filter. The code is kvasir_harness.bench.filter_overhead;
this file is its command line."""

import sys

from kvasir_harness.bench.filter_overhead import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
