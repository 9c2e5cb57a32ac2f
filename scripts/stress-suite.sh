#!/usr/bin/env bash
# scripts/stress-suite.sh — the suite, again and again, beside a CPU hog: does anything flake?
#
# Usage:
#   scripts/stress-suite.sh [--runs N] [--hogs K] [--keep-going] [-- TEST_SH_ARGS...]
#
#   --runs N       how many runs in a row (default 10)
#   --hogs K       CPU hogs beside the suite, as `stress --cpu K` (default: the number of cores;
#                  0 for none). `stress` is Debian's package of that name: installed when missing
#                  and we are root.
#   --keep-going   run all N even after a failure (default: stop at the first)
#   after --       passed to scripts/test.sh (default: the timing-sensitive binaries below,
#                  with --no-fail-fast)
#
# Each run is one scripts/test.sh, with its own throwaway servers. Prints one line per run
# (`STRESS run=I result=ok|FAILED seconds=S`), keeps each run's whole output in
# target/stress/run-I.log, and ends with `N passed, N failed` over the runs. Exits non-zero if
# any run failed. The hogs are stopped on exit, whatever happens.
#
# The default binaries are the ones whose tests wait on time, on a server or on another
# process: the fault scenarios, the stream and the poller, memory, dead links, replicas and
# takeover, observability (stall, NOTIFY, NOSCRIPT, heartbeats), delivery and refusals, replay,
# failover, the shared event_id check, publications dropped under load, a poller cut off
# holding locks, the order fence, decoding on a standby.
set -euo pipefail

SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$SCRIPTS")
# shellcheck source=scripts/lib.sh
. "$SCRIPTS/lib.sh"

RUNS=10
HOGS=$(nproc)
KEEP_GOING=0
TEST_ARGS=()
while [[ $# -gt 0 ]]; do
    case "$1" in
    -h | --help)
        sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
        exit 2
        ;;
    --runs)
        [[ $# -ge 2 && $2 =~ ^[0-9]+$ && $2 -gt 0 ]] || die "--runs needs a positive number"
        RUNS=$2
        shift
        ;;
    --hogs)
        [[ $# -ge 2 && $2 =~ ^[0-9]+$ ]] || die "--hogs needs a number (0 for none)"
        HOGS=$2
        shift
        ;;
    --keep-going) KEEP_GOING=1 ;;
    --)
        shift
        TEST_ARGS=("$@")
        break
        ;;
    *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done
if [[ ${#TEST_ARGS[@]} -eq 0 ]]; then
    TEST_ARGS=(--no-fail-fast)
    for t in faults stream poller memory links replicas observability delivery refusals \
        replay failover shared_event_ids publication poller_locks order_fence standby; do
        TEST_ARGS+=(--test "$t")
    done
fi

HOG_PID=""
# shellcheck disable=SC2317 # runs from the trap
stop_hogs() {
    [[ -n $HOG_PID ]] || return 0
    kill -TERM -- "-$HOG_PID" 2>/dev/null || kill -TERM "$HOG_PID" 2>/dev/null || true
    wait "$HOG_PID" 2>/dev/null || true
    HOG_PID=""
}
trap stop_hogs EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if ((HOGS > 0)); then
    if ! command -v stress >/dev/null 2>&1; then
        [[ $(id -u) -eq 0 ]] || die "stress not found (apt-get install stress)"
        log "installing stress"
        apt-get update -qq >/dev/null && apt-get install -y -qq stress >/dev/null
    fi
    # In its own process group, so that stop_hogs ends the workers too.
    setsid stress --cpu "$HOGS" >/dev/null 2>&1 &
    HOG_PID=$!
    log "stress --cpu $HOGS beside the suite (pid $HOG_PID)"
fi

OUT=$ROOT/target/stress
mkdir -p "$OUT"
# Build first, beside the hogs too, so that the first run times tests, not the compiler.
(cd "$ROOT" && cargo test --locked --no-run --quiet) >&2

passed=0
failed=0
for i in $(seq 1 "$RUNS"); do
    start=$SECONDS
    if "$SCRIPTS/test.sh" "${TEST_ARGS[@]}" >"$OUT/run-$i.log" 2>&1; then
        result=ok
        passed=$((passed + 1))
    else
        result=FAILED
        failed=$((failed + 1))
    fi
    echo "STRESS run=$i result=$result seconds=$((SECONDS - start)) log=$OUT/run-$i.log"
    if [[ $result == FAILED ]]; then
        grep -E '^(test .* FAILED|---- |thread .* panicked)' "$OUT/run-$i.log" | head -20 >&2 || true
        ((KEEP_GOING)) || break
    fi
done
echo "stress: $passed passed, $failed failed"
((failed == 0))
