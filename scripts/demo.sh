#!/usr/bin/env bash
# scripts/demo.sh — see outbox-relay deliver outbox rows as asynq tasks, end to end.
#
# Usage:
#   scripts/demo.sh [--once]
#
#   --once  stop after showing the tasks (also: OUTBOX_DEMO_ONCE=1). Without
#           it the relay keeps running until Ctrl-C, so you can insert more
#           rows with psql and watch them arrive.
#
# Runs the relay's main job (`outbox-relay run`) against a local PostgreSQL
# and Valkey/Redis, inserts an order and 5 outbox events in one transaction
# and shows them arriving as asynq tasks (`outbox-relay peek`), plus how far
# the replication slot has confirmed.
#
# Environment:
#   OUTBOX_DATABASE_URL  PostgreSQL to use (needs wal_level=logical). Unset:
#                        a throwaway server is started with pg-start.sh.
#   OUTBOX_VALKEY_URL    Valkey/Redis to use (or the Go kit's VALKEY_ADDR,
#                        VALKEY_PASSWORD, VALKEY_DB). Unset: a throwaway
#                        redis-server is started with redis-start.sh.
#   OUTBOX_RELAY_BIN     relay binary to run; unset: `cargo build --release
#                        --locked` and use target/release/outbox-relay.
#   OUTBOX_DEMO_DIR      work dir (default /tmp/outbox-relay-demo): the
#                        throwaway servers and relay.log live there. Its
#                        parents must be traversable by user postgres when
#                        running as root.
#   Other OUTBOX_* settings (OUTBOX_SLOT, OUTBOX_QUEUE, ...) reach the relay.
#
# On exit (also on error or Ctrl-C) it stops the relay and the servers it
# started itself (removing their data); servers you pointed it at are left
# running. In a database you gave it, the demo leaves an `orders` table, the
# sample rows and the migration's outbox table and publication, but drops
# the replication slot if the demo created it. The relay log stays in the
# work dir.

# The cleanup functions only run from traps, which shellcheck cannot see.
# shellcheck disable=SC2317
set -euo pipefail

SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$SCRIPTS")
# shellcheck source=scripts/lib.sh
. "$SCRIPTS/lib.sh"

usage() {
    sed -n '2,/^# The cleanup/{/^# The cleanup/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

ONCE=0
if [[ ${OUTBOX_DEMO_ONCE:-0} =~ ^(1|true|yes)$ ]]; then
    ONCE=1
fi
for arg in "$@"; do
    case "$arg" in
    --once) ONCE=1 ;;
    -h | --help) usage ;;
    *)
        log "unknown argument '$arg'"
        usage
        ;;
    esac
done

EVENTS=5            # outbox rows the demo inserts
WAIT_SECS=30        # bound of each wait (slot, tasks)
SLOT=${OUTBOX_SLOT:-outbox_relay}
MODE=${OUTBOX_MODE:-stream}  # poll: no replication slot to wait for or show
TABLE=${OUTBOX_TABLE:-outbox_events}
QUEUE=${OUTBOX_QUEUE:-default}

step() {
    printf '==> %s\n' "$*"
}

info() {
    printf '    %s\n' "$*"
}

# Milliseconds since the epoch.
now_ms() {
    local t=${EPOCHREALTIME/[.,]/}
    echo $((t / 1000))
}

# Seconds since now_ms printed $1, e.g. "0.3s".
since() {
    local ms=$(($(now_ms) - $1))
    printf '%d.%ds' $((ms / 1000)) $((ms % 1000 / 100))
}

# postgres://user:secret@host/db -> postgres://user:***@host/db
redact() {
    sed -E 's#(://[^:/@]*):[^@/]*@#\1:***@#' <<<"$1"
}

for tool in psql redis-cli flock; do
    command -v "$tool" >/dev/null 2>&1 || die "$tool not found (apt-get install postgresql-client redis-tools util-linux)"
done

# ---- state for the cleanup ----------------------------------------------------
DEMO_DIR=$(abs_path "${OUTBOX_DEMO_DIR:-/tmp/outbox-relay-demo}")
PG_DIR=$DEMO_DIR/pg
REDIS_DIR=$DEMO_DIR/redis
RELAY_LOG=$DEMO_DIR/relay.log
RELAY_PIDFILE=$DEMO_DIR/relay.pid
STARTED_PG=0
STARTED_REDIS=0
CREATED_SLOT=0   # the demo created the slot in a database it did not start
RELAY_PID=""
RELAY_RC=""
CLEANED=0
WAITING=0        # 1 while the interactive mode waits on the relay
STOP_ASKED=0     # Ctrl-C / SIGTERM arrived during that wait

# Stop the relay with SIGTERM (SIGKILL if it is still running 25 s later; its
# own OUTBOX_SHUTDOWN_TIMEOUT defaults to 10 s) and set RELAY_RC to its exit
# status.
stop_relay() {
    [[ -n $RELAY_PID ]] || return 0
    local pid=$RELAY_PID i
    RELAY_PID=""
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 250; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "relay (pid $pid) still running 25 s after SIGTERM; killing it"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    RELAY_RC=0
    wait "$pid" 2>/dev/null || RELAY_RC=$?
    rm -f "$RELAY_PIDFILE"
}

cleanup() {
    ((CLEANED)) && return 0
    CLEANED=1
    set +e
    local out
    if [[ -n $RELAY_PID ]]; then
        stop_relay
        info "relay stopped (exit status $RELAY_RC)"
    fi
    # An unused slot makes the server keep WAL forever: do not leave one
    # behind in the user's database (one that existed before is kept).
    if ((CREATED_SLOT)); then
        if sql -v slot="$SLOT" >/dev/null 2>&1 <<<"
            SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
            WHERE slot_name = :'slot' AND NOT active"; then
            info "dropped the replication slot '$SLOT' the demo created"
        else
            log "warning: could not drop the replication slot '$SLOT'; drop it with: SELECT pg_drop_replication_slot('$SLOT')"
        fi
    fi
    if ((STARTED_PG)); then
        out=$("$SCRIPTS/pg-stop.sh" "$PG_DIR" fast 2>&1) || printf '%s\n' "$out" >&2
        info "stopped the demo's PostgreSQL"
    fi
    if ((STARTED_REDIS)); then
        out=$("$SCRIPTS/redis-stop.sh" "$REDIS_DIR" 2>&1) || printf '%s\n' "$out" >&2
        info "stopped the demo's Redis"
    fi
}

on_exit() {
    local rc=$?
    cleanup
    exit "$rc"
}

on_signal() {
    if ((WAITING)); then
        # The interactive wait below handles it: stopping is the normal end.
        STOP_ASKED=1
        return 0
    fi
    exit "$1"
}

trap on_exit EXIT
trap 'on_signal 130' INT
trap 'on_signal 143' TERM

# Die with the relay's log tail when it is no longer running.
check_relay_alive() {
    if ! kill -0 "$RELAY_PID" 2>/dev/null; then
        local pid=$RELAY_PID rc=0
        RELAY_PID=""
        wait "$pid" 2>/dev/null || rc=$?
        rm -f "$RELAY_PIDFILE"
        tail_log "$RELAY_LOG" 30
        die "the relay exited unexpectedly (status $rc); log: $RELAY_LOG"
    fi
}

step "outbox-relay demo (work dir $DEMO_DIR)"
mkdir -p "$DEMO_DIR"
chmod 755 "$DEMO_DIR"
# One demo per work dir. Long-lived children get the lock fd closed
# ({LOCK_FD}>&-) so that a server left behind by a killed demo cannot hold it.
exec {LOCK_FD}>"$DEMO_DIR/.lock"
flock -n "$LOCK_FD" ||
    die "another demo is using $DEMO_DIR; stop it or set OUTBOX_DEMO_DIR to another directory"

# ---- the relay binary -----------------------------------------------------------
if [[ -n ${OUTBOX_RELAY_BIN:-} ]]; then
    BIN=$(abs_path "$OUTBOX_RELAY_BIN")
    [[ -x $BIN && -f $BIN ]] || die "OUTBOX_RELAY_BIN=$OUTBOX_RELAY_BIN is not an executable file"
    step "using the relay binary $BIN"
else
    step "building the relay: cargo build --release --locked"
    command -v cargo >/dev/null 2>&1 || die "cargo not found; install Rust (https://rustup.rs) or set OUTBOX_RELAY_BIN"
    (cd "$ROOT" && cargo build --release --locked)
    BIN=$(cd "$ROOT" && abs_path "${CARGO_TARGET_DIR:-target}/release/outbox-relay")
    [[ -x $BIN ]] || die "build finished but $BIN is missing"
fi

# ---- PostgreSQL -------------------------------------------------------------------
# Leftovers of a demo that was killed before it could clean up (the lock
# above guarantees no running demo owns them).
if [[ -e $PG_DIR || -e $REDIS_DIR || -e $RELAY_PIDFILE ]]; then
    step "removing leftovers of an earlier demo in $DEMO_DIR"
    old=$(cat "$RELAY_PIDFILE" 2>/dev/null || true)
    if [[ $old =~ ^[0-9]+$ ]] && tr '\0' ' ' <"/proc/$old/cmdline" 2>/dev/null | grep -q 'outbox-relay run'; then
        info "stopping the relay left running (pid $old)"
        kill -TERM "$old" 2>/dev/null || true
        for ((i = 0; i < 150; i++)); do
            kill -0 "$old" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$old" 2>/dev/null || true
    fi
    rm -f "$RELAY_PIDFILE"
    "$SCRIPTS/pg-stop.sh" "$PG_DIR" immediate >/dev/null 2>&1 || true
    "$SCRIPTS/redis-stop.sh" "$REDIS_DIR" >/dev/null 2>&1 || true
fi

if [[ -n ${OUTBOX_DATABASE_URL:-} ]]; then
    DB_URL=$OUTBOX_DATABASE_URL
    # shellcheck disable=SC2016 # printed for the user to paste, unexpanded
    DB_HINT='"$OUTBOX_DATABASE_URL"'
    step "using PostgreSQL from OUTBOX_DATABASE_URL: $(redact "$DB_URL")"
else
    step "starting a throwaway PostgreSQL (scripts/pg-start.sh $PG_DIR)"
    STARTED_PG=1
    if ! DB_URL=$("$SCRIPTS/pg-start.sh" "$PG_DIR" 2>"$DEMO_DIR/pg-start.log" {LOCK_FD}>&-); then
        cat "$DEMO_DIR/pg-start.log" >&2
        die "could not start PostgreSQL"
    fi
    rm -f "$DEMO_DIR/pg-start.log"
    DB_HINT="'$DB_URL'"
    info "$DB_URL"
fi
export OUTBOX_DATABASE_URL=$DB_URL

# psql against the demo database: quiet (no NOTICEs either), unaligned,
# tuples only, stop on error.
sql() {
    PGOPTIONS="${PGOPTIONS:-} -c client_min_messages=warning" \
        psql "$DB_URL" -X -q -A -t -v ON_ERROR_STOP=1 "$@"
}

sql -c 'SELECT 1' >/dev/null || die "cannot connect to PostgreSQL at $(redact "$DB_URL")"
wal_level=$(sql -c 'SHOW wal_level')
if [[ $MODE == stream && $wal_level != logical ]]; then
    die "PostgreSQL has wal_level=$wal_level; the relay streams with wal_level=logical only (restart it with -c wal_level=logical, or set OUTBOX_MODE=poll)"
fi

# ---- Valkey / Redis ---------------------------------------------------------------
VALKEY_URL=""
if [[ -n ${OUTBOX_VALKEY_URL:-} ]]; then
    VALKEY_URL=$OUTBOX_VALKEY_URL
    step "using Valkey from OUTBOX_VALKEY_URL: $(redact "$VALKEY_URL")"
elif [[ -n ${VALKEY_ADDR:-} ]]; then
    step "using Valkey from VALKEY_ADDR: $VALKEY_ADDR (db ${VALKEY_DB:-0})"
else
    step "starting a throwaway Redis (scripts/redis-start.sh $REDIS_DIR)"
    STARTED_REDIS=1
    if ! VALKEY_URL=$("$SCRIPTS/redis-start.sh" "$REDIS_DIR" 2>"$DEMO_DIR/redis-start.log" {LOCK_FD}>&-); then
        cat "$DEMO_DIR/redis-start.log" >&2
        die "could not start Redis"
    fi
    rm -f "$DEMO_DIR/redis-start.log"
    info "$VALKEY_URL"
fi
if [[ -n $VALKEY_URL ]]; then
    export OUTBOX_VALKEY_URL=$VALKEY_URL
fi

# redis-cli against the Valkey the relay writes to.
rcli() {
    if [[ -n $VALKEY_URL ]]; then
        redis-cli --no-auth-warning -u "$VALKEY_URL" "$@"
    else
        local auth=()
        if [[ -n ${VALKEY_PASSWORD:-} ]]; then
            auth=(-a "$VALKEY_PASSWORD")
        fi
        redis-cli --no-auth-warning -h "${VALKEY_ADDR%:*}" -p "${VALKEY_ADDR##*:}" \
            -n "${VALKEY_DB:-0}" "${auth[@]}" "$@"
    fi
}

[[ $(rcli ping 2>&1) == PONG ]] || die "Valkey does not answer PING: $(rcli ping 2>&1 | head -n 1)"

# The queues the events can land in: OUTBOX_QUEUE and every route target.
QUEUES=("$QUEUE")
if [[ -n ${OUTBOX_QUEUE_ROUTES:-} ]]; then
    while IFS= read -r q; do
        if [[ -n $q && " ${QUEUES[*]} " != *" $q "* ]]; then
            QUEUES+=("$q")
        fi
    done < <(tr ',' '\n' <<<"$OUTBOX_QUEUE_ROUTES" | sed -n 's/^[^=]*=[[:space:]]*//p' | sed 's/[[:space:]]*$//')
fi

# Tasks pending in those queues, summed.
pending_count() {
    local q n total=0
    for q in "${QUEUES[@]}"; do
        n=$(rcli llen "asynq:{$q}:pending" 2>&1)
        [[ $n =~ ^[0-9]+$ ]] || die "LLEN asynq:{$q}:pending failed: $n"
        total=$((total + n))
    done
    echo "$total"
}

# ---- migrate and run ----------------------------------------------------------------
step "outbox-relay migrate"
"$BIN" migrate 2>&1 | sed 's/^/    /'

if [[ $MODE == stream ]]; then
    slot_active=$(sql -v slot="$SLOT" <<<"SELECT active FROM pg_replication_slots WHERE slot_name = :'slot'")
    if [[ $slot_active == t ]]; then
        die "replication slot '$SLOT' is in use (another relay?); stop it or set OUTBOX_SLOT to another name"
    fi
    if [[ -z $slot_active ]] && ((!STARTED_PG)); then
        CREATED_SLOT=1
    fi
fi

step "starting outbox-relay run in the background (log: $RELAY_LOG)"
"$BIN" run >"$RELAY_LOG" 2>&1 {LOCK_FD}>&- &
RELAY_PID=$!
echo "$RELAY_PID" >"$RELAY_PIDFILE"
info "pid $RELAY_PID"

if [[ $MODE == stream ]]; then
    step "waiting for the relay to hold its replication slot '$SLOT'"
    # Rows committed before the slot exists are not streamed, so insert only now.
    start=$SECONDS
    t0=$(now_ms)
    while :; do
        check_relay_alive
        slot_active=$(sql -v slot="$SLOT" <<<"SELECT active FROM pg_replication_slots WHERE slot_name = :'slot'")
        [[ $slot_active == t ]] && break
        if ((SECONDS - start >= WAIT_SECS)); then
            tail_log "$RELAY_LOG" 30
            die "the relay did not activate slot '$SLOT' within ${WAIT_SECS}s (log: $RELAY_LOG)"
        fi
        sleep 0.2
    done
    info "slot active after $(since "$t0")"
else
    step "OUTBOX_MODE=$MODE: no replication slot to wait for"
    sleep 1
    check_relay_alive
fi

# ---- the business transaction -------------------------------------------------------
before=$(pending_count)
step "inserting an order and $EVENTS outbox events in ONE transaction"
sql -c 'CREATE TABLE IF NOT EXISTS orders (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer   text          NOT NULL,
    total      numeric(10,2) NOT NULL,
    created_at timestamptz   NOT NULL DEFAULT now()
)'
# :order_id comes from the business row, so the events and the order commit
# (or roll back) together: that is the transactional outbox.
tx_out=$(sql -v table="$TABLE" <<'SQL'
BEGIN;
INSERT INTO orders (customer, total) VALUES ('ada@example.com', 42.50) RETURNING id AS order_id \gset
INSERT INTO :table (event_id, event_name, payload, metadata) VALUES
  (gen_random_uuid(), 'user.signed_up',
   jsonb_build_object('user_id', 7, 'email', 'ada@example.com'),
   '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}'),
  (gen_random_uuid(), 'order.placed',
   jsonb_build_object('order_id', :order_id, 'total', 42.5),
   '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}'),
  (gen_random_uuid(), 'order.paid',
   jsonb_build_object('order_id', :order_id, 'amount', 42.5, 'method', 'card'),
   '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}'),
  (gen_random_uuid(), 'invoice.issued',
   jsonb_build_object('order_id', :order_id, 'invoice', 'INV-' || :order_id),
   '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}'),
  (gen_random_uuid(), 'email.requested',
   jsonb_build_object('to', 'ada@example.com', 'template', 'order_confirmation', 'order_id', :order_id),
   '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}');
COMMIT;
SELECT :order_id, pg_current_wal_lsn();
SQL
)
IFS='|' read -r order_id commit_lsn <<<"$tx_out"
info "committed order #$order_id with events user.signed_up, order.placed, order.paid, invoice.issued, email.requested (WAL at $commit_lsn)"

# ---- the tasks ------------------------------------------------------------------------
queue_keys=()
for q in "${QUEUES[@]}"; do queue_keys+=("asynq:{$q}:pending"); done
step "waiting for the $EVENTS tasks in ${queue_keys[*]}"
start=$SECONDS
t0=$(now_ms)
while :; do
    check_relay_alive
    now=$(pending_count)
    ((now - before >= EVENTS)) && break
    if ((SECONDS - start >= WAIT_SECS)); then
        tail_log "$RELAY_LOG" 30
        die "only $((now - before)) of $EVENTS tasks arrived within ${WAIT_SECS}s (a worker consuming the queue would also explain it; log: $RELAY_LOG)"
    fi
    sleep 0.2
done
info "$((now - before)) new tasks pending after $(since "$t0")"

for q in "${QUEUES[@]}"; do
    step "outbox-relay peek --queue $q"
    "$BIN" peek --queue "$q"
done
if ((before > 0)); then
    info "(the queues already held $before tasks; peek lists the oldest first)"
fi

# ---- the slot ---------------------------------------------------------------------------
if [[ $MODE == stream ]]; then
    # The relay acknowledges a commit once Valkey confirmed all its tasks; give
    # the acknowledgement a moment to reach the server.
    step "replication slot '$SLOT'"
    start=$SECONDS
    while :; do
        slot_row=$(sql -v slot="$SLOT" -v lsn="$commit_lsn" <<<"
            SELECT confirmed_flush_lsn, pg_current_wal_lsn(),
                   pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn),
                   confirmed_flush_lsn >= :'lsn'::pg_lsn
            FROM pg_replication_slots WHERE slot_name = :'slot'")
        IFS='|' read -r confirmed current behind caught_up <<<"$slot_row"
        [[ $caught_up == t ]] && break
        ((SECONDS - start >= 10)) && break
        sleep 0.2
    done
    info "confirmed_flush_lsn  $confirmed"
    info "pg_current_wal_lsn   $current  ($behind bytes of WAL not yet confirmed)"
    if [[ $caught_up != t ]]; then
        info "(the relay has not acknowledged the demo's commit yet; it does so after Valkey confirms the tasks)"
    fi
fi

# ---- the end --------------------------------------------------------------------------------
if ((ONCE)); then
    step "stopping the relay (SIGTERM)"
    stop_relay
    if [[ $RELAY_RC != 0 ]]; then
        tail_log "$RELAY_LOG" 30
        die "the relay exited with status $RELAY_RC (log: $RELAY_LOG)"
    fi
    info "relay exited 0"
    step "done (relay log: $RELAY_LOG)"
    exit 0
fi

peek_env=""
if ((STARTED_REDIS)); then
    peek_env="OUTBOX_VALKEY_URL='$VALKEY_URL' "
fi
servers=""
if ((STARTED_PG || STARTED_REDIS)); then
    servers=" and the servers the demo started"
fi
step "the relay keeps running (pid $RELAY_PID). In another terminal:"
cat <<EOF
    # insert an event and watch it arrive:
    psql $DB_HINT -c "INSERT INTO $TABLE (event_id, event_name, payload) VALUES (gen_random_uuid(), 'order.shipped', '{\"order_id\": $order_id}')"
    ${peek_env}$BIN peek --queue $QUEUE
    # follow the relay's log:
    tail -f $RELAY_LOG
EOF
step "press Ctrl-C to stop the relay$servers"

# Ctrl-C / SIGTERM interrupt `wait`; on_signal then only sets STOP_ASKED.
WAITING=1
rc=0
wait "$RELAY_PID" || rc=$?
WAITING=0
if ((!STOP_ASKED)); then
    # The relay ended by itself, and `wait` collected its status.
    RELAY_PID=""
    rm -f "$RELAY_PIDFILE"
    tail_log "$RELAY_LOG" 30
    die "the relay exited unexpectedly (status $rc); log: $RELAY_LOG"
fi
echo
step "stopping"
stop_relay
if [[ $RELAY_RC != 0 ]]; then
    tail_log "$RELAY_LOG" 30
    die "the relay exited with status $RELAY_RC (log: $RELAY_LOG)"
fi
info "relay exited 0"
step "done (relay log: $RELAY_LOG)"
exit 0
