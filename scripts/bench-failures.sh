#!/usr/bin/env bash
# scripts/bench-failures.sh — the benchmark's failure paths, run by .ci/run.
#
# Usage: scripts/bench-failures.sh
#
# The ceiling phase measures what logical decoding alone leaves with pg_recvlogical streaming
# beside the load. A pg_recvlogical that dies (at once, or in the middle of the ramp) must fail
# the run and say so, not leave a ceiling measured without a reader. Runs scripts/bench.sh
# --quick twice, with a pg_recvlogical that exits at once and with one killed in the middle of
# a step, and fails unless each run fails with pg_recvlogical's exit status in its output.
# Then once with --ceiling-cpu-split on a single CPU (taskset), which must refuse to run rather
# than report an unsplit machine as split; and scripts/measure-marking.sh with a relay whose
# migrations fail, which must say so with the relay's output.
set -euo pipefail

SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/lib.sh
. "$SCRIPTS/lib.sh"

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
fi

real="$(pg_bindir)/pg_recvlogical"
[[ -x $real ]] || die "no pg_recvlogical at $real"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Exits with status 3 before streaming anything.
printf '#!/bin/sh\nexit 3\n' >"$tmp/exits-at-once"
# The real pg_recvlogical (exec keeps the pid), killed with SIGKILL 2 s after it starts: during
# the ramp's one step of 5 s (a step that ended sooner, not held, would end the ramp before the
# kill). The kill checks that the pid is still pg_recvlogical's.
printf '#!/bin/sh\n(sleep 2; [ "$(cat /proc/$$/comm 2>/dev/null)" = pg_recvlogical ] && kill -9 $$) &\nexec "%s" "$@"\n' \
    "$real" >"$tmp/killed-mid-ramp"
chmod +x "$tmp/exits-at-once" "$tmp/killed-mid-ramp"

# Runs the ceiling phase with the given arguments, under the command in the array `wrapper`
# (none when empty); fails unless the run fails and its output holds `want`.
wrapper=()
expect_failure() {
    local name=$1 want=$2 out
    shift 2
    log "$name"
    if out=$("${wrapper[@]}" "$SCRIPTS/bench.sh" --quick -- --phases ceiling "$@" 2>&1); then
        printf '%s\n' "$out" | tail -20 >&2
        die "$name: the benchmark passed"
    fi
    if ! grep -qF -- "$want" <<<"$out"; then
        printf '%s\n' "$out" | tail -20 >&2
        die "$name: the benchmark failed without saying '$want'"
    fi
    log "$name: the run failed, saying '$want'"
}

expect_failure "pg_recvlogical exits at once" "pg_recvlogical exited (3)" \
    --ceiling-rates 1000 --step-seconds 1 --pg-recvlogical "$tmp/exits-at-once"
expect_failure "pg_recvlogical killed in the middle of the ramp" "pg_recvlogical exited (-9)" \
    --ceiling-rates 1000 --step-seconds 5 --pg-recvlogical "$tmp/killed-mid-ramp"
# One CPU of those this script may use (CPU 0 may not be among them).
one_cpu=$(python3 -c 'import os; print(min(os.sched_getaffinity(0)))')
wrapper=(taskset -c "$one_cpu")
expect_failure "the CPU split on one CPU" \
    "--ceiling-cpu-split needs at least two CPUs" \
    --ceiling-cpu-split --ceiling-rates 1000 --step-seconds 1

# scripts/measure-marking.sh with a relay whose migrations fail: it must fail with the relay's
# own words, not with the missing table's error from the step after.
log "measure-marking.sh with a failing migrate"
printf '#!/bin/sh\n[ "$1" = migrate ] && echo "fake relay: migrations refused" >&2\nexit 4\n' \
    >"$tmp/migrate-fails"
chmod +x "$tmp/migrate-fails"
if out=$(OUTBOX_RELAY_BIN="$tmp/migrate-fails" "$SCRIPTS/measure-marking.sh" 100 2>&1); then
    die "measure-marking.sh passed with a failing migrate"
fi
for want in "outbox-relay migrate failed" "fake relay: migrations refused"; do
    grep -qF -- "$want" <<<"$out" || {
        printf '%s\n' "$out" | tail -20 >&2
        die "measure-marking.sh with a failing migrate did not say '$want'"
    }
done
log "measure-marking.sh with a failing migrate: failed, saying so with the relay's output"
