#!/usr/bin/env bash
# make images: the controller and cache-indexer images, built without a
# Docker engine and without pulling a base image.
#
#  1. static musl binaries for each architecture, and the wasm filter:
#     for this machine's own with rustup's musl target and Debian's
#     musl-gcc; for another (ARCHES="amd64 arm64") with cargo-zigbuild,
#     zig being the C compiler and linker (the Dockerfiles' own recipe;
#     `pip install ziglang cargo-zigbuild`);
#  2. copied to target/images/<arch>/, where the Dockerfiles' `prebuilt`
#     stage takes them (--target prebuilt: the Rust build stage is
#     skipped, nothing is pulled, the base is scratch);
#  3. built with buildah (or podman) using the vfs storage driver and
#     chroot isolation, which need neither a daemon, nor overlayfs, nor an
#     OCI runtime; with neither tool, docker buildx is tried. One
#     architecture: the image is $REGISTRY/<name>:$TAG; several: each is
#     :$TAG-<arch> and :$TAG is a manifest list of them;
#  4. checked: each binary is static; each image's entrypoint runs
#     (--version) inside the image as its user (a foreign architecture's
#     is run with qemu-user-static when installed, else not run); each
#     image (or manifest list) is written as an OCI archive to
#     target/images/.
#
# Environment: REGISTRY (default localhost/kvasir), TAG (default dev),
# ARCHES (default: this machine's), BUILDER (buildah | podman | docker;
# default: the first installed), STORAGE_DRIVER (default vfs).
# Not part of `make test`.
set -euo pipefail
cd "$(dirname "$0")/.."

REGISTRY="${REGISTRY:-localhost/kvasir}"
TAG="${TAG:-dev}"
SD="${STORAGE_DRIVER:-vfs}"
case "$(uname -m)" in
  x86_64) HOST=amd64 ;;
  aarch64) HOST=arm64 ;;
  *) echo "images: unsupported machine $(uname -m)" >&2; exit 1 ;;
esac
read -r -a ARCHES <<< "${ARCHES:-$HOST}"
rust_target() {
  case "$1" in
    amd64) echo x86_64-unknown-linux-musl ;;
    arm64) echo aarch64-unknown-linux-musl ;;
    *) echo "images: unsupported architecture $1 (amd64, arm64)" >&2; exit 1 ;;
  esac
}
qemu_arch() { case "$1" in amd64) echo x86_64 ;; arm64) echo aarch64 ;; esac; }

if [ -z "${BUILDER:-}" ]; then
  for b in buildah podman docker; do
    if command -v "$b" >/dev/null; then BUILDER="$b"; break; fi
  done
fi
: "${BUILDER:?no image builder: apt-get install buildah (or podman)}"

cargo build --locked --profile wasm-release -p kvasir-filter --target wasm32-wasip1
for arch in "${ARCHES[@]}"; do
  t=$(rust_target "$arch")
  out="target/images/$arch"
  rustup target list --installed | grep -qx "$t" || rustup target add "$t"
  echo "== binaries ($t)"
  # Their own target directories: these builds do not wait on (or
  # invalidate) the workspace's glibc one.
  if [ "$arch" = "$HOST" ]; then
    command -v musl-gcc >/dev/null || { echo "images: musl-gcc missing: apt-get install musl-tools" >&2; exit 1; }
    dir=target/musl
    env "CC_${t//-/_}=musl-gcc" CARGO_TARGET_DIR="$dir" \
      cargo build --release --locked --target "$t" \
        -p kvasir-controller --bin kvasir-controller -p kvasir-cache-indexer --bin cache-indexer
  else
    command -v cargo-zigbuild >/dev/null || {
      echo "images: building for $arch needs cargo-zigbuild and zig: pip install ziglang cargo-zigbuild" >&2; exit 1; }
    dir=target/zig
    CARGO_TARGET_DIR="$dir" cargo zigbuild --release --locked --target "$t" \
      -p kvasir-controller --bin kvasir-controller -p kvasir-cache-indexer --bin cache-indexer
  fi
  mkdir -p "$out"
  install -m 0755 "$dir/$t/release/kvasir-controller" "$out/kvasir-controller"
  install -m 0755 "$dir/$t/release/cache-indexer" "$out/cache-indexer"
  install -m 0644 target/wasm32-wasip1/wasm-release/kvasir_filter.wasm "$out/kvasir_filter.wasm"
  for b in kvasir-controller cache-indexer; do
    if readelf -l "$out/$b" | grep -q 'Requesting program interpreter'; then
      echo "images: $out/$b is dynamically linked" >&2; exit 1
    fi
  done
done

ref() { # name arch
  if [ "${#ARCHES[@]}" -eq 1 ]; then echo "$REGISTRY/$1:$TAG"; else echo "$REGISTRY/$1:$TAG-$2"; fi
}

build() { # name dockerfile arch
  local image; image=$(ref "$1" "$3")
  echo "== $image ($BUILDER, linux/$3)"
  if [ "$BUILDER" != docker ]; then
    # The name may hold a manifest list of an earlier multi-architecture run.
    "$BUILDER" --storage-driver "$SD" manifest rm "$image" >/dev/null 2>&1 || true
  fi
  case "$BUILDER" in
    buildah)
      buildah --storage-driver "$SD" bud --isolation chroot --pull=never --layers=false \
        --platform "linux/$3" --target prebuilt -f "$2" -t "$image" . ;;
    podman)
      podman --storage-driver "$SD" build --isolation chroot --pull=never \
        --platform "linux/$3" --target prebuilt -f "$2" -t "$image" . ;;
    docker)
      docker buildx build --platform "linux/$3" --target prebuilt -f "$2" -t "$image" \
        --output "type=oci,dest=target/images/$1-$3.tar" . ;;
  esac
}

archive() { # name
  local list="$REGISTRY/$1:$TAG"
  case "$BUILDER" in
    buildah|podman)
      local tool="$BUILDER"
      if [ "${#ARCHES[@]}" -eq 1 ]; then
        if [ "$tool" = buildah ]; then
          buildah --storage-driver "$SD" push "$list" "oci-archive:target/images/$1.tar:$list"
        else
          podman --storage-driver "$SD" save --format oci-archive -o "target/images/$1.tar" "$list"
        fi
      else
        # The name may hold an earlier single-architecture image or list.
        "$tool" --storage-driver "$SD" manifest rm "$list" >/dev/null 2>&1 || true
        "$tool" --storage-driver "$SD" rmi "$list" >/dev/null 2>&1 || true
        "$tool" --storage-driver "$SD" manifest create "$list"
        for arch in "${ARCHES[@]}"; do
          "$tool" --storage-driver "$SD" manifest add --arch "$arch" --os linux "$list" "containers-storage:$(ref "$1" "$arch")"
        done
        "$tool" --storage-driver "$SD" manifest push --all "$list" "oci-archive:target/images/$1.tar:$list"
      fi ;;
    docker) ;;
  esac
}

# Runs the image's entrypoint inside the image's own root filesystem, as
# the image's user (buildah's chroot isolation: no OCI runtime, which
# cannot start containers in every sandbox): proof the image holds a
# binary that runs by itself. Another architecture's binary is taken out
# of the image and run with qemu-user-static, when installed.
check() { # name binary arch
  local image sd="$SD" ctr user mnt qemu
  image=$(ref "$1" "$3")
  if ! command -v buildah >/dev/null || [ "$BUILDER" = docker ]; then
    echo "$1 ($3): built (not run: needs buildah)"; return
  fi
  ctr=$(buildah --storage-driver "$sd" from --pull=never "$image")
  user=$(buildah --storage-driver "$sd" inspect --format '{{.OCIv1.Config.User}}' "$image")
  echo "$1 ($3): user $user, entrypoint $(buildah --storage-driver "$sd" inspect --format '{{.OCIv1.Config.Entrypoint}}' "$image"), architecture $(buildah --storage-driver "$sd" inspect --format '{{.OCIv1.Architecture}}' "$image")"
  if [ "$3" = "$HOST" ]; then
    buildah --storage-driver "$sd" run --isolation chroot --user "$user" "$ctr" -- "/$2" --version
  elif qemu=$(command -v "qemu-$(qemu_arch "$3")-static"); then
    mnt=$(buildah --storage-driver "$sd" mount "$ctr")
    "$qemu" "$mnt/$2" --version
    buildah --storage-driver "$sd" umount "$ctr" >/dev/null
  else
    echo "$1 ($3): not run (no qemu-$(qemu_arch "$3")-static)"
  fi
  buildah --storage-driver "$sd" rm "$ctr" >/dev/null
}

for arch in "${ARCHES[@]}"; do
  build kvasir-controller gateway-api/Dockerfile.controller "$arch"
  build cache-indexer gateway-api/Dockerfile.indexer "$arch"
done
for arch in "${ARCHES[@]}"; do
  check kvasir-controller kvasir-controller "$arch"
  check cache-indexer cache-indexer "$arch"
done
archive kvasir-controller
archive cache-indexer
ls -l target/images/*.tar
