#!/usr/bin/env bash
# scripts/test-matrix.sh — the suite's core against every supported server version.
#
# Usage:
#   scripts/test-matrix.sh [MAJOR...]      (default: 14 16 17 18)
#
# For each PostgreSQL MAJOR (fetched by scripts/fetch-postgres.sh) runs, with
# Valkey 8.1 as the sink (scripts/fetch-valkey.sh), the core of the suite:
# the stream (tests/stream.rs), the poller (tests/poller.rs), the main fault
# scenarios (tests/faults.rs, on the oldest and newest majors by default: see FAULTS_ON
# below), the failover
# (tests/failover.rs), decoding on a standby (tests/standby.rs, 16+), a dropped
# publication (tests/publication.rs), a slot recreated behind the relay's back
# (tests/slot_recreated.rs) and the runbook's commands (tests/runbook.rs), each version
# through scripts/test.sh --pg MAJOR --valkey. Then pg_upgrade under the relay
# (tests/upgrade.rs: 16 to 18 and 17 to 18, with the full installs of
# scripts/fetch-postgres-full.sh; UPGRADE=off leaves it out), through
# scripts/test.sh --upgrade --valkey. The full suite runs on the
# system's PostgreSQL 15 and Redis 7 (plain scripts/test.sh). Prints one line
# per version (and one for the upgrade) with its time, and exits non-zero if
# any failed.
set -euo pipefail

SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/lib.sh
. "$SCRIPTS/lib.sh"

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
fi
VERSIONS=("$@")
[[ ${#VERSIONS[@]} -gt 0 ]] || VERSIONS=(14 16 17 18)
CORE=(--no-fail-fast --test stream --test poller --test failover --test standby --test publication --test slot_recreated --test runbook)
# The fault scenarios (about 110 s a version here) run on the oldest and the newest major by
# default (CI's time budget; the full suite runs them on 15 as well): FAULTS_ON=all, a list of
# majors (e.g. FAULTS_ON="16 17"), or none, from the environment.
FAULTS_ON=${FAULTS_ON:-14 18}
UPGRADE=${UPGRADE:-on}

# Fetch first, so a registry problem shows as such and not as a test failure.
"$SCRIPTS/fetch-valkey.sh" >/dev/null
for v in "${VERSIONS[@]}"; do
    "$SCRIPTS/fetch-postgres.sh" "$v" >/dev/null
done
if [[ $UPGRADE == on ]]; then
    for v in 16 17 18; do
        "$SCRIPTS/fetch-postgres-full.sh" "$v" >/dev/null
    done
fi

failed=()
summary=()
for v in "${VERSIONS[@]}"; do
    start=$SECONDS
    log "PostgreSQL $v + Valkey 8.1"
    tests=("${CORE[@]}")
    [[ $FAULTS_ON == all || " $FAULTS_ON " == *" $v "* ]] && tests+=(--test faults)
    if "$SCRIPTS/test.sh" --pg "$v" --valkey "${tests[@]}"; then
        result=ok
    else
        result=FAILED
        failed+=("$v")
    fi
    summary+=("MATRIX pg=$v valkey=8.1 result=$result seconds=$((SECONDS - start))")
done
if [[ $UPGRADE == on ]]; then
    start=$SECONDS
    log "pg_upgrade 16 -> 18 and 17 -> 18 + Valkey 8.1"
    if "$SCRIPTS/test.sh" --upgrade --valkey --test upgrade; then
        result=ok
    else
        result=FAILED
        failed+=("upgrade")
    fi
    summary+=("MATRIX pg_upgrade=16,17->18 valkey=8.1 result=$result seconds=$((SECONDS - start))")
fi
printf '%s\n' "${summary[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
    die "failed on PostgreSQL ${failed[*]}"
fi
