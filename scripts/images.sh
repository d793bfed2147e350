#!/usr/bin/env bash
# make images: the controller and cache-indexer images, built without a
# Docker engine and without pulling a base image.
#
#  1. static musl binaries for this machine's architecture (rustup's musl
#     target, Debian's musl-gcc for the C code), and the wasm filter;
#  2. copied to target/images/<arch>/, where the Dockerfiles' `prebuilt`
#     stage takes them (--target prebuilt; the Rust build stage
#     is skipped, nothing is pulled: the final stage is FROM scratch);
#  3. built with buildah (or podman) using the vfs storage driver and
#     chroot isolation, which need neither a daemon nor overlayfs; with
#     neither tool, docker buildx is tried;
#  4. checked: each binary is static, each image's entrypoint runs
#     (--version) inside the image as its user, and each image is written
#     as an OCI archive to target/images/.
#
# Environment: REGISTRY (default localhost/kvasir), TAG (default dev),
# BUILDER (buildah | podman | docker; default: the first installed).
# Not part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."

REGISTRY="${REGISTRY:-localhost/kvasir}"
TAG="${TAG:-dev}"
case "$(uname -m)" in
  x86_64) ARCH=amd64; RUST_TARGET=x86_64-unknown-linux-musl ;;
  aarch64) ARCH=arm64; RUST_TARGET=aarch64-unknown-linux-musl ;;
  *) echo "images: unsupported machine $(uname -m)" >&2; exit 1 ;;
esac
CC_VAR="CC_${RUST_TARGET//-/_}"
OUT="target/images/$ARCH"

if [ -z "${BUILDER:-}" ]; then
  for b in buildah podman docker; do
    if command -v "$b" >/dev/null; then BUILDER="$b"; break; fi
  done
fi
: "${BUILDER:?no image builder: apt-get install buildah (or podman)}"
command -v musl-gcc >/dev/null || { echo "images: musl-gcc missing: apt-get install musl-tools" >&2; exit 1; }
rustup target list --installed | grep -qx "$RUST_TARGET" || rustup target add "$RUST_TARGET"

echo "== binaries ($RUST_TARGET)"
# Their own target directory: the musl build does not wait on (or
# invalidate) the workspace's glibc one.
env "$CC_VAR=musl-gcc" CARGO_TARGET_DIR=target/musl \
  cargo build --release --locked --target "$RUST_TARGET" \
    -p kvasir-controller --bin kvasir-controller -p kvasir-cache-indexer --bin cache-indexer
cargo build --locked --profile wasm-release -p kvasir-filter --target wasm32-wasip1
mkdir -p "$OUT"
install -m 0755 "target/musl/$RUST_TARGET/release/kvasir-controller" "$OUT/kvasir-controller"
install -m 0755 "target/musl/$RUST_TARGET/release/cache-indexer" "$OUT/cache-indexer"
install -m 0644 target/wasm32-wasip1/wasm-release/kvasir_filter.wasm "$OUT/kvasir_filter.wasm"
for b in kvasir-controller cache-indexer; do
  if readelf -l "$OUT/$b" | grep -q 'Requesting program interpreter'; then
    echo "images: $OUT/$b is dynamically linked" >&2; exit 1
  fi
done

build() { # name dockerfile
  local image="$REGISTRY/$1:$TAG"
  echo "== $image ($BUILDER, linux/$ARCH)"
  case "$BUILDER" in
    buildah)
      buildah --storage-driver "${STORAGE_DRIVER:-vfs}" bud --isolation chroot --pull=never \
        --platform "linux/$ARCH" --target prebuilt -f "$2" -t "$image" .
      buildah --storage-driver "${STORAGE_DRIVER:-vfs}" push "$image" "oci-archive:target/images/$1-$ARCH.tar:$image" ;;
    podman)
      podman --storage-driver "${STORAGE_DRIVER:-vfs}" build --isolation chroot --pull=never \
        --platform "linux/$ARCH" --target prebuilt -f "$2" -t "$image" .
      podman --storage-driver "${STORAGE_DRIVER:-vfs}" save --format oci-archive -o "target/images/$1-$ARCH.tar" "$image" ;;
    docker)
      docker buildx build --platform "linux/$ARCH" --target prebuilt -f "$2" -t "$image" \
        --output "type=oci,dest=target/images/$1-$ARCH.tar" . ;;
  esac
}

# Runs the image's entrypoint inside the image's own root filesystem, as
# the image's user (buildah's chroot isolation: no OCI runtime, which
# cannot start containers in every sandbox): proof the image holds a
# binary that runs by itself.
check() { # name binary
  local image="$REGISTRY/$1:$TAG" sd="${STORAGE_DRIVER:-vfs}" ctr user
  if ! command -v buildah >/dev/null || [ "$BUILDER" = docker ]; then
    echo "$1: built (not run: needs buildah)"; return
  fi
  ctr=$(buildah --storage-driver "$sd" from --pull=never "$image")
  user=$(buildah --storage-driver "$sd" inspect --format '{{.OCIv1.Config.User}}' "$image")
  echo "$1: user $user, entrypoint $(buildah --storage-driver "$sd" inspect --format '{{.OCIv1.Config.Entrypoint}}' "$image")"
  buildah --storage-driver "$sd" run --isolation chroot --user "$user" "$ctr" -- "/$2" --version
  buildah --storage-driver "$sd" rm "$ctr" >/dev/null
}

build kvasir-controller gateway-api/Dockerfile.controller
build cache-indexer gateway-api/Dockerfile.indexer
check kvasir-controller kvasir-controller
check cache-indexer cache-indexer
ls -l target/images/*.tar
