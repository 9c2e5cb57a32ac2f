#!/usr/bin/env bash
# scripts/measure-marking.sh — what marking streamed rows as published costs.
#
# Usage: scripts/measure-marking.sh [EVENTS]   (default 100000; OUTBOX_RELAY_BIN skips the build)
#
# The stream marks the rows it delivered (`UPDATE ... SET published_at = now() FROM
# unnest(ids, event_ids) ...`, coalesced, off its hot path) so the recovery poller does not
# redo them. This drains the same backlog three times with a release build: rows marked
# published (the default), kept as they are (OUTBOX_MARK_PUBLISHED=false) and deleted
# (OUTBOX_DELETE_DELIVERED=true), on a throwaway Postgres and Redis, and prints per event: the
# WAL the inserts wrote, the WAL written while the relay drained (the marking's UPDATEs and
# their index and heap changes), the rows updated, the UPDATE statements, and the drain time.
#
# Then, in a second table, what one marking statement costs the Postgres backend by how many ids
# it carries (bench/mark_cost.py: the relay's own UPDATE and DELETE, 20 to 10,000 ids each, over
# MARK_COST_ROWS rows per size, default 60000; needs python3-venv for bench/.venv).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/lib.sh
. "$ROOT/scripts/lib.sh"
MARK_COST_ROWS=${MARK_COST_ROWS:-60000}
PYTHON=$(bench_python "$ROOT")
EVENTS=${1:-100000}
WORK=$(mktemp -d /tmp/outbox-relay-marking.XXXXXX)
chmod 755 "$WORK"
cleanup() {
    [[ -n ${RELAY_PID:-} ]] && kill "$RELAY_PID" 2>/dev/null || true
    "$ROOT/scripts/redis-stop.sh" "$WORK/redis" >/dev/null 2>&1 || true
    "$ROOT/scripts/pg-stop.sh" "$WORK/pg" >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT

BIN=${OUTBOX_RELAY_BIN:-}
if [[ -z $BIN ]]; then
    (cd "$ROOT" && cargo build --release --locked -q)
    BIN=$ROOT/target/release/outbox-relay
fi
PG=$("$ROOT/scripts/pg-start.sh" "$WORK/pg" -- -c track_io_timing=off 2>/dev/null)
REDIS=$("$ROOT/scripts/redis-start.sh" "$WORK/redis" 2>/dev/null)
q() { psql "$1" -qAtX -v ON_ERROR_STOP=1 -c "$2"; }
# The relay's migrations on database URL $1, quietly unless they fail.
migrate() {
    local out
    if ! out=$(OUTBOX_DATABASE_URL=$1 "$BIN" migrate 2>&1); then
        printf 'measure-marking.sh: outbox-relay migrate failed on %s:\n%s\n' "$1" "$out" >&2
        exit 1
    fi
}

printf '| delivered rows | insert WAL B/event | drain WAL B/event | rows updated or deleted | transactions during the drain | drain s |\n'
printf '|---|---:|---:|---:|---:|---:|\n'
for mode in mark keep delete; do
    db="mode_$mode"
    q "$PG" "CREATE DATABASE $db"
    url="${PG%/*}/$db"
    migrate "$url"
    q "$url" "SELECT pg_create_logical_replication_slot('slot_$mode', 'pgoutput')" >/dev/null
    redis-cli -u "$REDIS" flushall >/dev/null
    w0=$(q "$url" "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
    txns=$((EVENTS / 100))
    q "$url" "DO \$\$ BEGIN FOR i IN 1..$txns LOOP
        INSERT INTO outbox_events (event_id, event_name, payload, metadata)
        SELECT gen_random_uuid(), 'order.placed', jsonb_build_object('order_id', g, 'total', 42.5, 'note', repeat('x', 120)),
               '{\"traceparent\": \"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"}'
        FROM generate_series(1, 100) g;
        COMMIT; END LOOP; END \$\$"
    q "$url" "CHECKPOINT"
    w1=$(q "$url" "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
    upd0=$(q "$url" "SELECT n_tup_upd + n_tup_del FROM pg_stat_user_tables WHERE relname = 'outbox_events'")
    calls0=$(q "$url" "SELECT coalesce(sum(xact_commit), 0) FROM pg_stat_database WHERE datname = '$db'")
    start=$(date +%s.%N)
    OUTBOX_DATABASE_URL=$url OUTBOX_VALKEY_URL=$REDIS OUTBOX_SLOT=slot_$mode OUTBOX_RECOVERY=false OUTBOX_ON_SLOT_LOST=stop OUTBOX_MARK_PUBLISHED=$([[ $mode == keep ]] && echo false || echo true) \
        OUTBOX_DELETE_DELIVERED=$([[ $mode == delete ]] && echo true || echo false) \
        OUTBOX_METRICS_ADDR=127.0.0.1:0 "$BIN" run >"$WORK/relay-$mode.log" 2>&1 &
    RELAY_PID=$!
    deadline=$((SECONDS + 600))
    until [[ $(redis-cli -u "$REDIS" llen "asynq:{default}:pending") -ge $EVENTS ]]; do
        ((SECONDS < deadline)) || { tail -5 "$WORK/relay-$mode.log" >&2; exit 1; }
        kill -0 "$RELAY_PID" 2>/dev/null || { tail -5 "$WORK/relay-$mode.log" >&2; exit 1; }
        sleep 0.05
    done
    if [[ $mode == mark ]]; then
        until [[ $(q "$url" "SELECT count(*) FROM outbox_events WHERE published_at IS NULL") -eq 0 ]]; do sleep 0.05; done
    elif [[ $mode == delete ]]; then
        until [[ $(q "$url" "SELECT count(*) FROM outbox_events") -eq 0 ]]; do sleep 0.05; done
    fi
    end=$(date +%s.%N)
    kill -TERM "$RELAY_PID"; wait "$RELAY_PID" || true; RELAY_PID=
    sleep 0.7 # let the statistics collector catch up
    w2=$(q "$url" "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
    upd1=$(q "$url" "SELECT n_tup_upd + n_tup_del FROM pg_stat_user_tables WHERE relname = 'outbox_events'")
    calls1=$(q "$url" "SELECT coalesce(sum(xact_commit), 0) FROM pg_stat_database WHERE datname = '$db'")
    python3 - "$mode" "$EVENTS" "$w0" "$w1" "$w2" "$upd0" "$upd1" "$calls0" "$calls1" "$start" "$end" <<'PY'
import sys
mark, n, w0, w1, w2, u0, u1, c0, c1, t0, t1 = sys.argv[1:]
n = int(n)
print(f"| {mark} | {(int(w1)-int(w0))/n:.0f} | {(int(w2)-int(w1))/n:.1f} | {int(u1)-int(u0)} | "
      f"~{int(c1)-int(c0)} transactions | {float(t1)-float(t0):.2f} |")
PY
done
echo
echo "EVENTS=$EVENTS; the transactions column counts the database's commits during the drain (each marking statement is one; the relay's monitor adds a few reads)."

echo
db=mark_cost
url="${PG%/*}/$db"
q "$PG" "CREATE DATABASE $db"
migrate "$url"
"$PYTHON" "$ROOT/bench/mark_cost.py" --database-url "$url" --rows "$MARK_COST_ROWS"
