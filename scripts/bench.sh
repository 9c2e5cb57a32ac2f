#!/usr/bin/env bash
# scripts/bench.sh — the end-to-end benchmark: throughput against pg_recvlogical, the poller and a
# naive one-round-trip-per-event relay, and commit-to-enqueued latency under steady load.
#
# Usage:
#   scripts/bench.sh [--events N] [--quick] [--docs-dir DIR] [-- BENCH_PY_ARGS...]
#
#   --events N     events per backlog phase (default 200000; 20000 with --quick)
#   --quick        a short smoke run: 2 s load steps, a shorter ramp. Its report says so in its
#                  first line, and it goes to target/bench/ unless --docs-dir is given.
#   --docs-dir DIR where benchmarks.md (the section between <!-- bench:begin --> and
#                  <!-- bench:end -->) and bench-latency.png are written (default docs/).
#   after --       passed to bench/bench.py (e.g. --phases stream,steady --rates 1000).
#
# Production geometry (issue 16; docs/benchmarks.md "Across a link"): the phases calibrate,
# link, payload, fsync and ceiling, e.g. the full run
#   scripts/bench.sh -- --phases calibrate,link,payload,fsync,ceiling --repeat 3 --step-seconds 5
# and the smoke run
#   scripts/bench.sh --quick -- --phases calibrate,link,payload,fsync,ceiling --link-events 5000 --link-delays direct,0,1 --step-seconds 2
# When --phases names fsync, a second throwaway Postgres runs with fsync=on,
# synchronous_commit=on and full_page_writes=on.
#
# Starts its own throwaway PostgreSQL (scripts/pg-start.sh, with track_commit_timestamp=on) and
# Redis (scripts/redis-start.sh) under /tmp/outbox-relay-bench.XXXXXX, builds the release binary
# and the naive_relay and load_gen examples, creates bench/.venv with bench/requirements.txt,
# and runs bench/bench.py. Stops the servers and removes the temp dir on exit. Logs and raw
# results go to target/bench/run/. Run it on a quiet machine: it measures the whole machine.
# Never touches the system servers on 5432/6379.

# The cleanup function only runs from traps, which shellcheck cannot see.
# shellcheck disable=SC2317
set -euo pipefail

SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$SCRIPTS")
# shellcheck source=scripts/lib.sh
. "$SCRIPTS/lib.sh"

usage() {
    sed -n '2,/^$/{/^$/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

EVENTS=""
QUICK=0
DOCS_DIR=""
PY_ARGS=()
ORIG_ARGS=("$@")
while [[ $# -gt 0 ]]; do
    case "$1" in
    -h | --help) usage ;;
    --quick) QUICK=1 ;;
    --events)
        [[ $# -ge 2 && $2 =~ ^[0-9]+$ && $2 -gt 0 ]] || die "--events needs a positive number"
        EVENTS=$2
        shift
        ;;
    --docs-dir)
        [[ $# -ge 2 ]] || die "--docs-dir needs a directory"
        DOCS_DIR=$(abs_path "$2")
        shift
        ;;
    --)
        shift
        PY_ARGS=("$@")
        break
        ;;
    *) die "unknown argument '$1' (see --help)" ;;
    esac
    shift
done
if [[ -z $EVENTS ]]; then
    EVENTS=200000
    ((QUICK)) && EVENTS=20000
fi
if [[ -z $DOCS_DIR ]]; then
    DOCS_DIR=$ROOT/docs
    ((QUICK)) && DOCS_DIR=$ROOT/target/bench
fi

TMP=""
CLEANED=0
cleanup() {
    ((CLEANED)) && return 0
    CLEANED=1
    set +e
    [[ -n $TMP && -d $TMP ]] || return 0
    "$SCRIPTS/pg-stop.sh" "$TMP/pg" fast >/dev/null 2>&1
    [[ -d $TMP/pg-fsync ]] && "$SCRIPTS/pg-stop.sh" "$TMP/pg-fsync" fast >/dev/null 2>&1
    "$SCRIPTS/redis-stop.sh" "$TMP/redis" >/dev/null 2>&1
    assert_removable_dir "$TMP"
    rm -rf -- "$TMP"
}
on_exit() {
    local rc=$?
    cleanup
    exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

cd "$ROOT"

log "building the release binary and the benchmark examples"
cargo build --release --locked --bin outbox-relay --example naive_relay --example load_gen \
    --example latency_proxy --example latency_queue >&2

PYTHON=$(bench_python "$ROOT")

TMP=$(mktemp -d /tmp/outbox-relay-bench.XXXXXX)
chmod 755 "$TMP"
PG_URL=$("$SCRIPTS/pg-start.sh" "$TMP/pg" -- \
    -c max_wal_senders=10 -c max_replication_slots=10 -c track_commit_timestamp=on)
REDIS_URL=$("$SCRIPTS/redis-start.sh" "$TMP/redis")
# The fsync phase's server: as durable as a production one.
FSYNC_ARGS=()
for ((i = 0; i < ${#PY_ARGS[@]}; i++)); do
    phases=""
    case "${PY_ARGS[i]}" in
    --phases) phases=${PY_ARGS[i + 1]:-} ;;
    --phases=*) phases=${PY_ARGS[i]#--phases=} ;;
    esac
    if [[ ,$phases, == *,fsync,* ]]; then
        FSYNC_URL=$("$SCRIPTS/pg-start.sh" "$TMP/pg-fsync" -- \
            -c max_wal_senders=10 -c max_replication_slots=10 -c track_commit_timestamp=on \
            -c fsync=on -c synchronous_commit=on -c full_page_writes=on)
        FSYNC_ARGS=(--pg-fsync-url "$FSYNC_URL")
    fi
done

COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
if [[ -n $(git status --porcelain --untracked-files=no -- src Cargo.toml Cargo.lock 2>/dev/null) ]]; then
    COMMIT="$COMMIT+uncommitted changes"
fi
WORK=$ROOT/target/bench/run
mkdir -p "$WORK"

QUICK_ARG=()
((QUICK)) && QUICK_ARG=(--quick)
log "postgres $PG_URL, redis $REDIS_URL; $EVENTS events per backlog phase; report to $DOCS_DIR"
"$PYTHON" bench/bench.py \
    --pg-url "$PG_URL" --redis-url "$REDIS_URL" \
    --relay "$ROOT/target/release/outbox-relay" \
    --naive "$ROOT/target/release/examples/naive_relay" \
    --load-gen "$ROOT/target/release/examples/load_gen" \
    --latency-proxy "$ROOT/target/release/examples/latency_proxy" \
    --latency-queue "$ROOT/target/release/examples/latency_queue" "${FSYNC_ARGS[@]}" \
    --pg-recvlogical "$(pg_bindir)/pg_recvlogical" \
    --events "$EVENTS" "${QUICK_ARG[@]}" \
    --docs-dir "$DOCS_DIR" --template "$ROOT/docs/benchmarks.md" --workdir "$WORK" \
    --command "scripts/bench.sh ${ORIG_ARGS[*]}" --commit "$COMMIT" \
    "${PY_ARGS[@]}"
