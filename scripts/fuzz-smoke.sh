#!/usr/bin/env bash
# scripts/fuzz-smoke.sh — a short run of every cargo-fuzz target (fuzz/fuzz_targets/*.rs).
#
# Usage: scripts/fuzz-smoke.sh [SECONDS_PER_TARGET]   (default 20)
#
# Needs a nightly toolchain (`rustup toolchain list`) and cargo-fuzz; installs cargo-fuzz from
# crates.io (`cargo install --locked cargo-fuzz`) when it is missing. Without a nightly toolchain
# it says so and exits 0: the fuzz targets need -Z sanitizer flags that stable rustc refuses.
# The targets' properties live in fuzz/targets.rs; tests/fuzz_targets.rs runs them on generated
# and mutated inputs with proptest on the stable toolchain, in every test run (and in CI).
# Each target runs for SECONDS_PER_TARGET with libFuzzer's -max_total_time; a crash (a panic or
# a failed assertion in a target) fails the script and leaves the input in
# fuzz/artifacts/<target>/. The corpus grows in fuzz/corpus/<target>/ (not committed).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SECONDS_PER_TARGET=${1:-20}
[[ $SECONDS_PER_TARGET =~ ^[0-9]+$ ]] || {
    echo "fuzz-smoke: SECONDS_PER_TARGET must be a number, not '$SECONDS_PER_TARGET'" >&2
    exit 2
}

if ! rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    echo "fuzz-smoke: no nightly toolchain; skipping (cargo fuzz needs nightly)"
    exit 0
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz-smoke: installing cargo-fuzz"
    cargo install --locked cargo-fuzz
fi

cd "$ROOT/fuzz"
for target in $(cargo +nightly fuzz list); do
    echo "fuzz-smoke: $target for ${SECONDS_PER_TARGET}s"
    cargo +nightly fuzz run "$target" -- -max_total_time="$SECONDS_PER_TARGET"
done
echo "fuzz-smoke: ok"
