#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo fuzz, libFuzzer) of the parsers that read
# untrusted bytes; the targets are in fuzz/fuzz_targets/, docs/testing.md
# ("Fuzzing") says what each checks.
#
#   bash scripts/fuzz.sh [TARGET...]     every target, or the ones named
#   FUZZ_SECONDS=300 bash scripts/fuzz.sh policy
#
# Each target runs for FUZZ_SECONDS (default 60) from its committed seeds
# (fuzz/corpus/<target>/, read only) plus a working corpus that persists in
# fuzz/target/corpus/<target>/. A crash leaves its input in
# fuzz/artifacts/<target>/ and fails the run (after the other targets).
#
# cargo-fuzz needs a nightly toolchain (its -Z sanitizer and coverage
# flags); installed here, idempotently, as every make target installs what
# it needs: cargo-fuzz into .tools/, nightly through rustup if missing.
# Built without a sanitizer (-s none): the crates forbid unsafe code, so
# AddressSanitizer would find little and halve the executions.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TOOLS="$ROOT/.tools"
CARGO_FUZZ_VERSION=0.13.1
SECONDS_PER_TARGET=${FUZZ_SECONDS:-60}

log() { printf '[fuzz] %s\n' "$*"; }

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  log "installing the nightly toolchain (cargo-fuzz needs it)"
  rustup toolchain install nightly --profile minimal
fi
if [ "$("$TOOLS/bin/cargo-fuzz" --version 2>/dev/null)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]; then
  log "installing cargo-fuzz $CARGO_FUZZ_VERSION into $TOOLS"
  cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked --root "$TOOLS"
fi
export PATH="$TOOLS/bin:$PATH"

if [ $# -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo +nightly fuzz list)
fi

# One build, then the binaries themselves: `cargo fuzz run` would rebuild
# before each target whenever a crate changed meanwhile.
log "building ${targets[*]}"
cargo +nightly fuzz build -s none
triple=$(rustc +nightly -vV | sed -n 's/^host: //p')
bindir="$ROOT/fuzz/target/$triple/release"

failed=()
for t in "${targets[@]}"; do
  work="$ROOT/fuzz/target/corpus/$t"
  logf="$ROOT/fuzz/target/logs/$t.log"
  mkdir -p "$work" "$(dirname "$logf")" "$ROOT/fuzz/artifacts/$t"
  log "$t: ${SECONDS_PER_TARGET}s (log: ${logf#"$ROOT"/})"
  if "$bindir/$t" "$work" "$ROOT/fuzz/corpus/$t" \
      -artifact_prefix="$ROOT/fuzz/artifacts/$t/" \
      -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=4096 \
      -print_final_stats=1 >"$logf" 2>&1; then
    # The execution count and the last coverage line (edges, features, corpus).
    execs=$(grep -E '^stat::number_of_executed_units' "$logf" | awk '{print $2}' || true)
    cov=$(grep -E '^#[0-9]+.* cov: ' "$logf" | tail -1 | grep -oE 'cov: [0-9]+ ft: [0-9]+ corp: [0-9]+' || true)
    log "$t: ok, ${execs:-?} executions, ${cov:-no coverage line}"
  else
    failed+=("$t")
    log "$t: FAILED; reproduce: $bindir/$t <input from fuzz/artifacts/$t/>"
    grep -A3 -m1 'panicked' "$logf" | sed 's/^/    /' || true
    tail -n 12 "$logf" | sed 's/^/    /'
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  log "crashes in: ${failed[*]} (inputs in fuzz/artifacts/)"
  exit 1
fi
log "all ${#targets[@]} targets ran ${SECONDS_PER_TARGET}s without a crash"
