#!/usr/bin/env bash
# scripts/test.sh — the project's test command.
#
# Usage:
#   scripts/test.sh [--quick] [--pg MAJOR] [--valkey] [--upgrade] [CARGO_TEST_ARGS...]
#
#   --quick  exports OUTBOX_TEST_QUICK=1 so slow tests can cut themselves short.
#   --pg MAJOR  runs every Postgres of the tests (the shared one and those the
#            tests start) with PostgreSQL MAJOR (14..18) from
#            scripts/fetch-postgres.sh: exports OUTBOX_TEST_PG_BINDIR.
#   --valkey runs every Redis server of the tests with valkey-server 8.1 from
#            scripts/fetch-valkey.sh: exports OUTBOX_TEST_REDIS_SERVER.
#   --upgrade fetches full PostgreSQL 16, 17 and 18 installs (with pg_upgrade) with
#            scripts/fetch-postgres-full.sh for tests/upgrade.rs: exports
#            OUTBOX_TEST_PG_FULL_16, OUTBOX_TEST_PG_FULL_17 and OUTBOX_TEST_PG_FULL_18.
#   These options come first and are not forwarded; without them the system's
#   PostgreSQL and redis-server run (or OUTBOX_TEST_PG_BINDIR /
#   OUTBOX_TEST_REDIS_SERVER from the environment).
#   Anything else goes to `cargo test --locked`, e.g.
#   `scripts/test.sh --test relay -- --nocapture`.
#
# Creates a temp dir /tmp/outbox-relay-test.XXXXXX, starts one shared
# throwaway PostgreSQL (wal_level=logical) in it with scripts/pg-start.sh and
# exports for the tests:
#   OUTBOX_TEST_PG_URL   postgres://postgres@127.0.0.1:PORT/postgres
#   OUTBOX_TEST_SCRIPTS  absolute path of scripts/ (pg-start.sh, redis-start.sh...)
#   OUTBOX_TEST_TMP      the temp dir; servers that tests start under it are
#                        killed by the cleanup even if the tests leak them
#   RUST_TEST_THREADS    2 unless already set
# On exit (or INT/TERM) it stops the Postgres, stops/kills any postgres or
# redis-server running from the temp dir, and removes the dir. Exits with
# cargo's status. Never touches the system servers on 5432/6379.

# The cleanup functions only run from traps, which shellcheck cannot see.
# shellcheck disable=SC2317
set -euo pipefail

SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$SCRIPTS")
# shellcheck source=scripts/lib.sh
. "$SCRIPTS/lib.sh"

QUICK=0
while [[ $# -gt 0 ]]; do
    case "$1" in
    --quick) QUICK=1 ;;
    --pg)
        [[ $# -ge 2 ]] || die "--pg needs a major version (14..18)"
        OUTBOX_TEST_PG_BINDIR=$("$SCRIPTS/fetch-postgres.sh" "$2")
        export OUTBOX_TEST_PG_BINDIR
        shift
        ;;
    --valkey)
        OUTBOX_TEST_REDIS_SERVER=$("$SCRIPTS/fetch-valkey.sh")
        export OUTBOX_TEST_REDIS_SERVER
        ;;
    --upgrade)
        for major in 16 17 18; do
            bindir=$("$SCRIPTS/fetch-postgres-full.sh" "$major")
            export "OUTBOX_TEST_PG_FULL_$major=$bindir"
        done
        ;;
    *) break ;;
    esac
    shift
done

TMP=""
CARGO_PID=""
CLEANED=0

# Signal a process and all its descendants (by pid, children first).
kill_tree() {
    local sig=$1 pid=$2 child
    for child in $(pgrep -P "$pid" 2>/dev/null || true); do
        kill_tree "$sig" "$child"
    done
    kill "-$sig" "$pid" 2>/dev/null || true
}

# Pids of live (non-zombie) postgres / redis-server processes whose working
# directory is inside $TMP (postgres runs in its data dir, redis in --dir).
procs_under_tmp() {
    local p pid comm cwd
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        comm=$(cat "$p/comm" 2>/dev/null) || continue
        case "$comm" in postgres | redis-server* | valkey-server*) ;; *) continue ;; esac
        cwd=$(readlink "$p/cwd" 2>/dev/null) || continue
        [[ $cwd == "$TMP" || $cwd == "$TMP"/* ]] && echo "$pid"
    done
    return 0
}

cleanup() {
    ((CLEANED)) && return 0
    CLEANED=1
    set +e
    if [[ -n $CARGO_PID ]] && kill -0 "$CARGO_PID" 2>/dev/null; then
        log "stopping cargo (pid $CARGO_PID)"
        kill_tree TERM "$CARGO_PID"
        for _ in $(seq 1 50); do
            kill -0 "$CARGO_PID" 2>/dev/null || break
            sleep 0.1
        done
        kill_tree KILL "$CARGO_PID"
    fi
    [[ -n $TMP && -d $TMP ]] || return 0
    # iptables rules a killed test left behind (tests/links.rs tags them with this run's dir).
    if command -v iptables-save >/dev/null 2>&1; then
        local rule args tag
        tag=$(basename "$TMP")
        while IFS= read -r rule; do
            log "deleting a leftover iptables rule: $rule"
            rule=${rule//\"/}
            read -ra args <<<"${rule/#-A /-D }"
            iptables "${args[@]}" 2>/dev/null
        done < <(iptables-save -t filter 2>/dev/null | grep -F -- "--comment \"$tag\" ")
    fi
    "$SCRIPTS/pg-stop.sh" "$TMP/pg" fast --keep >/dev/null 2>&1
    # Servers that tests started under $TMP and did not stop.
    local f bindir
    bindir=$(pg_bindir 2>/dev/null)
    while IFS= read -r f; do
        log "stopping leftover postgres in $(dirname "$f")"
        as_pg_user "$bindir/pg_ctl" -D "$(dirname "$f")" -m immediate -w -t 20 stop >/dev/null 2>&1
    done < <(find "$TMP" -name postmaster.pid -type f 2>/dev/null)
    while IFS= read -r f; do
        log "stopping leftover redis-server in $(dirname "$f")"
        "$SCRIPTS/redis-stop.sh" "$(dirname "$f")" --keep >/dev/null 2>&1
    done < <(find "$TMP" -name redis.pid -type f 2>/dev/null)
    local pids
    pids=$(procs_under_tmp)
    if [[ -n $pids ]]; then
        log "killing leftover server processes: $(echo "$pids" | tr '\n' ' ')"
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null
        sleep 0.2
    fi
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

TMP=$(mktemp -d /tmp/outbox-relay-test.XXXXXX)
chmod 755 "$TMP"

# Every test makes its own database and slot: room for all of them.
PG_URL=$("$SCRIPTS/pg-start.sh" "$TMP/pg" -- -c max_replication_slots=200 -c max_wal_senders=60 -c max_connections=300)

export OUTBOX_TEST_PG_URL=$PG_URL
export OUTBOX_TEST_SCRIPTS=$SCRIPTS
export OUTBOX_TEST_TMP=$TMP
export RUST_TEST_THREADS=${RUST_TEST_THREADS:-2}
if ((QUICK)); then
    export OUTBOX_TEST_QUICK=1
fi

echo "==> test.sh: postgres $PG_URL ($("$(pg_bindir)/postgres" --version), dir $TMP/pg); $("$(redis_server_bin)" --version | cut -d' ' -f1-3); RUST_TEST_THREADS=$RUST_TEST_THREADS; OUTBOX_TEST_QUICK=${OUTBOX_TEST_QUICK:-0}; running: cargo test --locked $*" >&2

cd "$ROOT"
# In the background so that INT/TERM reach our trap at once; the cleanup
# then stops cargo and the test binaries it started.
cargo test --locked "$@" &
CARGO_PID=$!
rc=0
wait "$CARGO_PID" || rc=$?
CARGO_PID=""
exit "$rc"
