#!/usr/bin/env bash
# `make bench`: every benchmark, numbers to bench/results/ and docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/results
SECONDS_PER=${BENCH_SECONDS:-8}

echo "== vllm-sim: throughput at time scale 0, memory at 25k cached blocks"
target/release/vllm-sim-bench --seconds "$SECONDS_PER" --out bench/results/sim.json >/dev/null

echo "== cache-indexer: event ingestion, memory per block, overlap latency (its examples, the soak's load among them, built here)"
cargo build --release -q -p kvasir-cache-indexer --examples
target/release/examples/ingest_bench > bench/results/indexer_ingest.json

echo "== cache-indexer: Pick latency (in process and over gRPC), cold tokenization"
target/release/examples/pick_bench > bench/results/indexer_pick.json

echo "== Envoy data path: latency the filter + pick adds over the same route without it"
# 3 interleaved rounds of 5 s per path and rate; the added latency is their median.
.tools/venv/bin/python bench/filter_overhead.py --rounds 3 --seconds 5 --out bench/results/filter.json >/dev/null

echo "== routing: the Mooncake trace and a multi-tenant chat through Envoy, four routing modes (short version)"
.tools/venv/bin/python bench/routing.py --preset "${ROUTING_PRESET:-short}" --no-progress

echo "== routing as deployed: 2 Envoys x 2 indexer replicas sharing load through Redis, caches under pressure, an engine restarted (short version)"
.tools/venv/bin/python bench/routing.py --preset "${ROUTING_PRESET:-short}" --deployment deployed --no-progress
deployed=bench/results/routing-deployed$([ "${ROUTING_PRESET:-short}" = full ] || echo "-${ROUTING_PRESET:-short}")
.tools/venv/bin/python bench/deployed_targets.py "$deployed" >/dev/null

echo "== governance: a noisy neighbour, budgets over 2 Envoys x 2 replicas, saturation and below it, flow control on and off (short version)"
.tools/venv/bin/python bench/governance.py --preset "${GOVERNANCE_PRESET:-short}"

echo "== soaks: 1,000 held streams through Envoy with the filter, then the indexer alone under 10k KV events/s + 2k picks/s (SOAK_SECONDS each, default 600)"
# A soak that fails (an error, or memory not steady) fails `make bench`, after
# the other benchmarks have written their results.
soak_rc=0
.tools/venv/bin/python bench/soak.py all --seconds "${SOAK_SECONDS:-600}" --check || soak_rc=$?

.tools/venv/bin/python scripts/bench_report.py
echo "== results: bench/results/ (summary in docs/benchmarks.md; soaks in bench/results/soak/report.md)"
exit "$soak_rc"
