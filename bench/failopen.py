#!/usr/bin/env python3
"""Picks under held streams: how many fail open, why, and what the pick costs. The code is
kvasir_harness.bench.failopen; this file is its command line."""

import sys

from kvasir_harness.bench.failopen import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
