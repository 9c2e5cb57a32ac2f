#!/usr/bin/env bash
# scripts/fuzz.sh — run the fuzz targets (fuzz/fuzz_targets) for a while each.
#
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET]   (default 60)
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`). libFuzzer needs nightly compiler flags; on a
# stable toolchain RUSTC_BOOTSTRAP=1 enables them. Targets: `decode` (arbitrary bytes into the
# pgoutput decoder after a valid Relation) and `task` (arbitrary column text into the task
# builder). A crash leaves its input in fuzz/artifacts/ and exits non-zero.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SECS=${1:-60}
command -v cargo-fuzz >/dev/null || { echo "cargo-fuzz missing: cargo install cargo-fuzz" >&2; exit 2; }
for target in decode task; do
    echo "==> fuzzing $target for ${SECS}s" >&2
    RUSTC_BOOTSTRAP=1 cargo fuzz run -O "$target" -- -max_total_time="$SECS" 2>&1 | tail -n 1
done
