#!/usr/bin/env python3
"""The deployed-shape targets checked on a deployed-like routing run, each
miss with how much and why. The code is
kvasir_harness.bench.deployed_targets; this file is its command line."""

import sys

from kvasir_harness.bench.deployed_targets import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
