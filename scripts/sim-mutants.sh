#!/usr/bin/env bash
# scripts/sim-mutants.sh — does the simulation find the bugs it exists for? Each patch in
# tests/sim/mutants/ breaks the delivery core on purpose, in a copy of this working tree:
#
#   *.caught.patch   the simulation must fail within SEEDS schedules; it stops at the first
#                    failing seed and prints it (replay it in the copy with: simulate --seed N
#                    --verbose)
#   *.guarded.patch  a bug the release-build invariants must contain: every schedule passes (the
#                    seeds are spread over the machine's cores)
#
#   scripts/sim-mutants.sh [SEEDS]      default 300 schedules per mutant, from seed 1
#
# before-the-fix.caught.patch is the code issue 12 started from: the writer writes a batch
# handed over while it backs off, and its checks are gone from release builds (they were
# debug_asserts). old-writer-with-release-checks.guarded.patch is the same writer with today's
# checks: they stop the session, and nothing is lost. refusals-merged-as-sorted.caught.patch is
# the stream before review found that refusals come queue by queue, not in batch order.
# stranded-open-batch.caught.patch is write spacing that leaves a caught-up session's open batch
# unsent while its writer is idle: caught by the liveness check at the quiet end, which reads the
# slot before the nodes stop (a stop sends what the session holds).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

seeds=${1:-300}
if ! [[ $seeds =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: scripts/sim-mutants.sh [SEEDS] (a positive number)" >&2
    exit 2
fi
root=$PWD
# The repository's target directory: the mutants share its compiled dependencies.
target=${CARGO_TARGET_DIR:-$root/target}
work=$(mktemp -d)
# A mutant's build replaces target/release/examples/simulate, and cargo, finding the real
# package's own build fresh, would not put the real binary back: keep it and restore it.
cargo build --release --locked --quiet --example simulate
real="$target/release/examples/simulate"
cp "$real" "$work/real.simulate"
# The mutants' copies keep the tree's paths relative to the workspace, so their builds write the
# same library artifacts as the real tree's, newer than its sources: touching a source makes the
# next build of the real tree rebuild them (seen: a later `cargo build` linked the last mutant).
trap 'cp "$work/real.simulate" "$real"; touch "$root/src/lib.rs"; rm -rf "$work"' EXIT

status=0
for patch in tests/sim/mutants/*.patch; do
    name=$(basename "$patch" .patch)
    expect=${name##*.}
    tree="$work/$name"
    mkdir -p "$tree"
    rsync -a --exclude target/ --exclude /.git "$root/" "$tree/"
    patch -d "$tree" -p1 --quiet <"$patch"
    (cd "$tree" && CARGO_TARGET_DIR="$target" cargo build --release --locked --quiet --example simulate)
    bin="$work/$name.simulate"
    cp "$target/release/examples/simulate" "$bin"
    log="$work/$name.log"
    case $expect in
    caught)
        # One process, from seed 1, stopping at the first failing schedule: the seed printed is
        # the first that fails.
        "$bin" --seeds "$seeds" --fail-fast >"$log" 2>&1 || true
        ;;
    *)
        # Every schedule must pass: disjoint ranges of seeds over the machine's cores.
        jobs=$(nproc)
        per=$(((seeds + jobs - 1) / jobs))
        pids=()
        for ((j = 0; j < jobs && j * per < seeds; j++)); do
            n=$((seeds - j * per < per ? seeds - j * per : per))
            "$bin" --from $((1 + j * per)) --seeds "$n" >"$log.$j" 2>&1 &
            pids+=($!)
        done
        for pid in "${pids[@]}"; do
            wait "$pid" || true
        done
        cat "$log".* >"$log"
        ;;
    esac
    first=$(grep '^simulation seed' "$log" | awk '{print $3}' | sort -n | head -n 1 || true)
    case $expect in
    caught)
        if [[ -n $first ]]; then
            echo "$name: caught, the first failing schedule is seed $first:"
            grep -m 1 -A 2 '^simulation seed' "$log" | sed -n '2,3p'
        else
            echo "$name: NOT CAUGHT in $seeds schedules" >&2
            status=1
        fi
        ;;
    guarded)
        if [[ -z $first ]]; then
            echo "$name: contained: all $seeds schedules pass"
        else
            echo "$name: NOT CONTAINED: seed $first fails" >&2
            grep -m 1 -A 4 '^simulation seed' "$log" >&2
            status=1
        fi
        ;;
    *)
        echo "$patch: the name must end in .caught.patch or .guarded.patch" >&2
        status=1
        ;;
    esac
done
exit "$status"
