#!/usr/bin/env bash
# scripts/pg-start.sh — start a throwaway PostgreSQL server for tests/demos.
#
# Usage:
#   scripts/pg-start.sh DIR [PORT] [-- EXTRA_POSTGRES_ARGS...]
#
#   DIR    directory for the cluster (created if missing). Holds data/,
#          postgres.log, the unix socket, `port` and `url`. When running as
#          root it is chowned to `postgres`, which must be able to traverse
#          every parent directory (a dir under /tmp works).
#   PORT   TCP port on 127.0.0.1; default: the port recorded in DIR/port when
#          restarting an existing cluster, else a free port from the kernel.
#   EXTRA  passed to postgres after the defaults, so they win, e.g.
#          `-- -c wal_level=replica -c max_wal_senders=5`.
#
# The server binaries are $OUTBOX_TEST_PG_BINDIR's if set (scripts/fetch-postgres.sh
# prints one), else the system's. Runs initdb (trust auth, superuser `postgres`, UTF8, C locale) unless
# DIR/data already exists, then `pg_ctl start -w` listening on 127.0.0.1 only
# with wal_level=logical and test-friendly settings (fsync off, ...).
# Prints `postgres://postgres@127.0.0.1:PORT/postgres` as the only stdout line
# (also written to DIR/url); everything else goes to stderr. If the cluster in
# DIR is already running it just prints its URL.
# Stop it with scripts/pg-stop.sh DIR.
set -euo pipefail

# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

[[ $# -ge 1 ]] || usage
[[ $1 != -h && $1 != --help ]] || usage
DIR=$(abs_path "$1")
shift
PORT=""
if [[ $# -gt 0 && $1 != -- ]]; then
    PORT=$1
    shift
    if ! [[ $PORT =~ ^[0-9]+$ ]] || ((PORT < 1 || PORT > 65535)); then
        die "bad PORT '$PORT'"
    fi
fi
EXTRA=()
if [[ $# -gt 0 ]]; then
    [[ $1 == -- ]] || die "unexpected argument '$1' (extra postgres args go after --)"
    shift
    EXTRA=("$@")
fi

BIN=$(pg_bindir)
DATA=$DIR/data
LOGFILE=$DIR/postgres.log
IS_ROOT=0
[[ $(id -u) -eq 0 ]] && IS_ROOT=1

# ---- already running? -------------------------------------------------------
if [[ -f $DATA/PG_VERSION ]] && as_pg_user "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; then
    if [[ -s $DIR/url ]]; then
        log "already running: $(cat "$DIR/url")"
        cat "$DIR/url"
        exit 0
    fi
    die "a server is running on $DATA but $DIR/url is missing; stop it with pg-stop.sh"
fi

# ---- directory and permissions ------------------------------------------------
# Name the first ancestor of $1 that user postgres cannot search (empty if none).
first_unsearchable() {
    local p="" part parts
    IFS=/ read -r -a parts <<<"${1#/}"
    for part in "${parts[@]}"; do
        [[ -n $part ]] || continue
        p="$p/$part"
        [[ -e $p ]] || break
        if ! as_pg_user test -x "$p"; then
            echo "$p"
            return 0
        fi
    done
}
if ((IS_ROOT)); then
    id postgres >/dev/null 2>&1 || die "user 'postgres' does not exist (needed to run the server as root)"
    bad=$(first_unsearchable "$(dirname "$DIR")")
    if [[ -n $bad ]]; then
        die "user postgres cannot reach $DIR (no search permission on $bad); use a directory whose parents are world-traversable (e.g. under /tmp, or chmod o+x $bad)"
    fi
fi
mkdir -p "$DIR"
if ((IS_ROOT)); then
    chown postgres:postgres "$DIR"
    chmod 755 "$DIR"
    as_pg_user test -x "$DIR" -a -w "$DIR" || die "user postgres cannot write to $DIR"
fi

# A unix socket path is limited to ~107 bytes: DIR/.s.PGSQL.NNNNN
if ((${#DIR} + 17 > 107)); then
    die "DIR path too long for a unix socket (${#DIR} chars): $DIR"
fi

# ---- choose port ---------------------------------------------------------------
AUTO_PORT=0
if [[ -z $PORT ]]; then
    if [[ -f $DATA/PG_VERSION && -s $DIR/port ]]; then
        PORT=$(cat "$DIR/port")
    else
        PORT=$(free_port)
        AUTO_PORT=1
    fi
elif [[ -s $DIR/port && $(cat "$DIR/port") != "$PORT" ]]; then
    log "note: restarting on port $PORT instead of recorded $(cat "$DIR/port")"
fi
if ((!AUTO_PORT)) && ! port_is_free "$PORT"; then
    die "port $PORT on 127.0.0.1 is already in use"
fi

# ---- initdb (first start only) -----------------------------------------------
if [[ ! -f $DATA/PG_VERSION ]]; then
    if [[ -e $DATA ]]; then
        die "$DATA exists but is not a PostgreSQL data directory (failed initdb?); remove $DIR and retry"
    fi
    log "initdb $DATA"
    if ! as_pg_user "$BIN/initdb" -D "$DATA" --auth=trust -U postgres --no-sync \
        -E UTF8 --locale=C >"$DIR/initdb.log" 2>&1; then
        tail_log "$DIR/initdb.log"
        die "initdb failed (full log: $DIR/initdb.log)"
    fi
fi

# Quote one word for the /bin/sh command line that pg_ctl builds from -o.
shq() {
    local s=${1//\'/\'\\\'\'}
    printf "'%s'" "$s"
}

build_opts() {
    local port=$1 opts="" a
    local settings=(
        "listen_addresses=127.0.0.1"
        "port=$port"
        "unix_socket_directories=$DIR"
        "wal_level=logical"
        "max_replication_slots=20"
        "max_wal_senders=20"
        "fsync=off"
        "full_page_writes=off"
        "synchronous_commit=on"
        "wal_sender_timeout=60s"
        "log_min_messages=warning"
        "max_connections=100"
        "shared_buffers=128MB"
    )
    for a in "${settings[@]}"; do
        opts+=" -c $(shq "$a")"
    done
    for a in "${EXTRA[@]}"; do
        opts+=" $(shq "$a")"
    done
    printf '%s' "${opts# }"
}

# ---- start (retry with a new port if an auto-chosen one got taken) ----------
attempt=1
while :; do
    if ! port_is_free "$PORT"; then
        if ((AUTO_PORT && attempt < 5)); then
            PORT=$(free_port)
            attempt=$((attempt + 1))
            continue
        fi
        die "port $PORT on 127.0.0.1 is already in use"
    fi
    log "starting postgres on 127.0.0.1:$PORT (data $DATA, log $LOGFILE)"
    log_lines=0
    [[ -f $LOGFILE ]] && log_lines=$(wc -l <"$LOGFILE")
    if as_pg_user "$BIN/pg_ctl" -D "$DATA" -l "$LOGFILE" -w -t 60 \
        -o "$(build_opts "$PORT")" start >&2; then
        break
    fi
    if ((AUTO_PORT && attempt < 5)) &&
        tail -n "+$((log_lines + 1))" "$LOGFILE" 2>/dev/null | grep -q 'could not bind\|Address already in use'; then
        log "port $PORT was taken meanwhile; retrying with another"
        PORT=$(free_port)
        attempt=$((attempt + 1))
        continue
    fi
    tail_log "$LOGFILE"
    die "pg_ctl start failed (log: $LOGFILE)"
done

URL="postgres://postgres@127.0.0.1:$PORT/postgres"
echo "$PORT" >"$DIR/port"
echo "$URL" >"$DIR/url"
chmod 644 "$DIR/port" "$DIR/url"
echo "$URL"
