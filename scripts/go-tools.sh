#!/usr/bin/env bash
# Builds the Go tools the real-control-plane tests run, from the Go module
# proxy only (no release binaries), into the git-ignored .tools/bin/:
#
#   etcd            go.etcd.io/etcd/server/v3          (tools/etcd)
#   kube-apiserver  k8s.io/kubernetes/cmd/kube-apiserver (tools/kube-apiserver)
#   envoy-gateway   github.com/envoyproxy/gateway/cmd/envoy-gateway (tools/envoy-gateway)
#   egctl           github.com/envoyproxy/gateway/cmd/egctl         (tools/envoy-gateway)
#
# Each tools/<module> pins one upstream dependency graph in its go.mod and
# go.sum (`tool` directives); see tools/README.md for why there are three.
#
# Idempotent: a binary is rebuilt only when its stamp (.tools/bin/.stamps/)
# differs from what this script would build: the module's go.mod and go.sum,
# the package, the flags and the Go version. A warm run costs seconds.
# A failed build stops the script, naming the tool, with go's output.
#
# Usage: scripts/go-tools.sh [tool...]   (default: all four)
# Environment: GO (the go command, default `go`), KVASIR_GO_TOOLS_JOBS
# (go build -p, default: the number of CPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
BIN="$REPO/.tools/bin"
STAMPS="$BIN/.stamps"
GO="${GO:-go}"

log() { printf '[go-tools] %s\n' "$*"; }

if ! command -v "$GO" >/dev/null 2>&1; then
  log "missing the go command (Go >= 1.26 is needed to build etcd, kube-apiserver and Envoy Gateway)"
  exit 1
fi

# Versions: each must agree with its tools/<module>/go.mod (checked below).
KUBE_VERSION=v1.36.3
EG_VERSION=v1.9.1
ETCD_VERSION=v3.6.17

# -trimpath: reproducible, path-free binaries (and build-cache entries that
# do not depend on where the checkout is). -s -w: no symbol table or DWARF,
# which makes the links faster and the binaries about a third smaller.
# -mod=readonly: go.sum is the pin; a build never edits it.
export GOFLAGS="-trimpath -mod=readonly"
export CGO_ENABLED=0
JOBS="${KVASIR_GO_TOOLS_JOBS:-$(nproc 2>/dev/null || echo 2)}"

kube_ldflags() {
  local v="${KUBE_VERSION#v}"
  local major="${v%%.*}" rest="${v#*.}"
  local minor="${rest%%.*}"
  local x
  # component-base's version is what the server reports (/version,
  # --version); client-go's is in its clients' user agent. Without them
  # both say v0.0.0-master+$Format:%H$.
  for x in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    printf -- '-X %s.gitVersion=%s -X %s.gitMajor=%s -X %s.gitMinor=%s -X %s.gitTreeState=clean ' \
      "$x" "$KUBE_VERSION" "$x" "$major" "$x" "$minor" "$x"
  done
  printf -- '-s -w'
}

# tool -> "module-dir|package|ldflags"
spec() {
  case "$1" in
    etcd) echo "tools/etcd|go.etcd.io/etcd/server/v3|-s -w" ;;
    kube-apiserver) echo "tools/kube-apiserver|k8s.io/kubernetes/cmd/kube-apiserver|$(kube_ldflags)" ;;
    envoy-gateway) echo "tools/envoy-gateway|github.com/envoyproxy/gateway/cmd/envoy-gateway|-s -w -X github.com/envoyproxy/gateway/internal/cmd/version.envoyGatewayVersion=$EG_VERSION" ;;
    egctl) echo "tools/envoy-gateway|github.com/envoyproxy/gateway/cmd/egctl|-s -w -X github.com/envoyproxy/gateway/internal/cmd/version.envoyGatewayVersion=$EG_VERSION" ;;
  esac
}
ALL_TOOLS=(etcd kube-apiserver envoy-gateway egctl)

# The module version a tools/ module pins, read from its go.mod.
pinned() { # MODDIR MODULE
  awk -v m="$2" '$1 == m { print $2 } $1 == "require" && $2 == m { print $3 }' "$1/go.mod" | head -1
}
check_pin() { # MODDIR MODULE WANT
  local got
  got=$(pinned "$1" "$2")
  if [ "$got" != "$3" ]; then
    log "$1/go.mod pins $2 at '${got:-nothing}', this script expects $3: update both together"
    exit 1
  fi
}
check_pin tools/etcd go.etcd.io/etcd/server/v3 "$ETCD_VERSION"
check_pin tools/kube-apiserver k8s.io/kubernetes "$KUBE_VERSION"
check_pin tools/envoy-gateway github.com/envoyproxy/gateway "$EG_VERSION"

GO_VERSION=$("$GO" env GOVERSION)
mkdir -p "$BIN" "$STAMPS"

build() { # TOOL
  local tool="$1" moddir pkg ldflags stamp want start
  IFS='|' read -r moddir pkg ldflags <<<"$(spec "$tool")"
  want=$(printf '%s\n' "$tool" "$pkg" "$ldflags" "$GOFLAGS" "CGO_ENABLED=$CGO_ENABLED" "$GO_VERSION" \
    "$(cat "$moddir/go.mod" "$moddir/go.sum" | sha256sum | cut -d' ' -f1)")
  stamp="$STAMPS/$tool"
  if [ -x "$BIN/$tool" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    log "$tool: up to date"
    return 0
  fi
  log "building $tool ($pkg, $GO_VERSION, -p $JOBS); minutes with a cold Go build cache"
  start=$(date +%s)
  rm -f "$stamp"
  if ! (cd "$moddir" && "$GO" build -p "$JOBS" -ldflags "$ldflags" -o "$BIN/.$tool.tmp" "$pkg"); then
    rm -f "$BIN/.$tool.tmp"
    log "FAILED to build $tool ($pkg in $moddir): see go's output above"
    exit 1
  fi
  mv -f "$BIN/.$tool.tmp" "$BIN/$tool"
  printf '%s\n' "$want" >"$stamp"
  log "$tool built in $(($(date +%s) - start)) s ($(du -h "$BIN/$tool" | cut -f1))"
}

tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=("${ALL_TOOLS[@]}")
for t in "${tools[@]}"; do
  case " ${ALL_TOOLS[*]} " in
    *" $t "*) ;;
    *) log "unknown tool: $t (one of: ${ALL_TOOLS[*]})"; exit 2 ;;
  esac
done
for t in "${tools[@]}"; do
  build "$t"
done
