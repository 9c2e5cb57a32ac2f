#!/usr/bin/env bash
# scripts/measure-slots.sh — does splitting the outbox over several slots raise throughput?
#
# Usage: scripts/measure-slots.sh [EVENTS] [SLOTS...]   (default 200000 events; 1 2 slots)
#
# For each slot count N: a fresh database with EVENTS outbox rows in 100-row transactions,
# N publications that split the outbox with PostgreSQL 15 row filters (`WHERE (id % N = k)`),
# one pgoutput slot per publication created before the rows, then N pg_recvlogical processes
# drain their slots at the same time (to /dev/null, up to the LSN after the backlog). Prints the
# wall time, the events per second over all slots, and the walsenders' CPU time: every
# walsender decodes all of the WAL, so the decoding work grows with N even though each slot
# sends only its share.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
EVENTS=${1:-200000}
shift || true
COUNTS=("$@")
[[ ${#COUNTS[@]} -gt 0 ]] || COUNTS=(1 2)
WORK=$(mktemp -d /tmp/outbox-relay-slots.XXXXXX)
chmod 755 "$WORK"
trap '"$ROOT/scripts/pg-stop.sh" "$WORK/pg" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
PG=$("$ROOT/scripts/pg-start.sh" "$WORK/pg" -- -c max_wal_senders=20 -c max_replication_slots=20 2>/dev/null)
BIN=$(pg_config --bindir)
q() { psql "$1" -qAtX -v ON_ERROR_STOP=1 -c "$2"; }
cpu_of() { # utime+stime in clock ticks of the walsenders of database $1
    local total=0 pid
    for pid in $(q "$PG" "SELECT pid FROM pg_stat_replication WHERE application_name LIKE 'slots-$1-%'"); do
        read -r -a f <"/proc/$pid/stat" || continue
        total=$((total + f[13] + f[14]))
    done
    echo "$total"
}

printf '| slots | wall s | events/s (all slots) | walsender CPU s |\n|---:|---:|---:|---:|\n'
for n in "${COUNTS[@]}"; do
    db="slots_$n"
    q "$PG" "CREATE DATABASE $db"
    url="${PG%/*}/$db"
    q "$url" "CREATE TABLE outbox_events (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        event_id uuid NOT NULL UNIQUE, event_name text NOT NULL, payload jsonb NOT NULL,
        metadata jsonb NOT NULL DEFAULT '{}', created_at timestamptz NOT NULL DEFAULT now(),
        published_at timestamptz)"
    for k in $(seq 0 $((n - 1))); do
        q "$url" "CREATE PUBLICATION p_${n}_$k FOR TABLE outbox_events WHERE (id % $n = $k) WITH (publish = 'insert')"
        q "$url" "SELECT pg_create_logical_replication_slot('s_${n}_$k', 'pgoutput')" >/dev/null
    done
    q "$url" "DO \$\$ BEGIN FOR i IN 1..$((EVENTS / 100)) LOOP
        INSERT INTO outbox_events (event_id, event_name, payload, metadata)
        SELECT gen_random_uuid(), 'order.placed', jsonb_build_object('order_id', g, 'note', repeat('x', 120)),
               '{\"traceparent\": \"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\"}'
        FROM generate_series(1, 100) g;
        COMMIT; END LOOP; END \$\$"
    end=$(q "$url" "SELECT pg_current_wal_lsn()")
    start=$(date +%s.%N)
    pids=()
    for k in $(seq 0 $((n - 1))); do
        "$BIN/pg_recvlogical" -d "$url?application_name=slots-$n-$k" --slot "s_${n}_$k" --start \
            -o proto_version=1 -o "publication_names=p_${n}_$k" --endpos "$end" -f /dev/null &
        pids+=($!)
    done
    sleep 0.05
    cpu=0
    while kill -0 "${pids[@]}" 2>/dev/null; do c=$(cpu_of "$n"); ((c > cpu)) && cpu=$c; sleep 0.02; done
    wait "${pids[@]}" || true
    stop=$(date +%s.%N)
    python3 -c "import sys; w=float(sys.argv[2])-float(sys.argv[1]); print(f'| $n | {w:.2f} | {int(sys.argv[3])/w:,.0f} | {int(sys.argv[4])/100:.2f} |')" \
        "$start" "$stop" "$EVENTS" "$cpu"
done
