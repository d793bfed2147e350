#!/usr/bin/env bash
# `make bench`: every benchmark, numbers to bench/results/ and the README.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/results
SECONDS_PER=${BENCH_SECONDS:-10}

echo "== vllm-sim: throughput at time scale 0, memory at 25k cached blocks"
target/release/vllm-sim-bench --seconds "$SECONDS_PER" --out bench/results/sim.json >/dev/null

python3 scripts/bench_report.py
echo "== results: bench/results/ (summary in README.md)"
