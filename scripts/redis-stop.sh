#!/usr/bin/env bash
# scripts/redis-stop.sh — stop a throwaway Redis started by redis-start.sh.
#
# Usage:
#   scripts/redis-stop.sh DIR [--keep]
#
#   DIR     the directory given to redis-start.sh
#   --keep  keep DIR (log, port, url) so redis-start.sh DIR restarts on the
#           same port; without it DIR is removed.
#
# Sends `SHUTDOWN NOSAVE` (over TLS for a server started with --tls); falls
# back to SIGTERM, then SIGKILL, on the pid in DIR/redis.pid. Not an error if the server is not running or DIR is missing.
set -euo pipefail

# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

parse_stop_args "$@"

PIDFILE=$DIR/redis.pid
PID=$(cat "$PIDFILE" 2>/dev/null || true)
[[ $PID =~ ^[0-9]+$ ]] || PID=""
PORT=$(cat "$DIR/port" 2>/dev/null || true)
auth_from_conf "$DIR"
# A TLS-only server (redis-start.sh --tls); without its certificates the signals below stop it.
if [[ -s $DIR/tls && -r $(cat "$DIR/tls")/client.key ]]; then
    use_tls "$(cat "$DIR/tls")"
fi

# Alive = exists, is not a zombie (PID 1 here reaps orphans lazily), and is
# a redis-server or valkey-server (guards against a recycled pid).
alive() {
    [[ -n $PID && -r /proc/$PID/stat ]] || return 1
    [[ $(awk '{print $3}' "/proc/$PID/stat" 2>/dev/null) != Z ]] || return 1
    local comm
    comm=$(cat "/proc/$PID/comm" 2>/dev/null) || return 1
    [[ $comm == redis-server* || $comm == valkey-server* ]]
}

wait_gone() {
    local tries=$1
    for _ in $(seq 1 "$tries"); do
        alive || return 0
        sleep 0.1
    done
    ! alive
}

if alive; then
    log "stopping redis-server pid $PID${PORT:+ on port $PORT}"
    if [[ -n $PORT ]]; then
        rcli "$PORT" shutdown nosave >/dev/null 2>&1 || true
    fi
    if ! wait_gone 50; then
        log "SHUTDOWN did not stop it; sending SIGTERM"
        kill -TERM "$PID" 2>/dev/null || true
        if ! wait_gone 50; then
            log "sending SIGKILL"
            kill -KILL "$PID" 2>/dev/null || true
            wait_gone 20 || log "warning: pid $PID still present"
        fi
    fi
    rm -f "$PIDFILE"
elif [[ -n $PORT ]] && [[ $(rcli "$PORT" ping 2>/dev/null) == PONG ]]; then
    # No usable pidfile, but something answers on our recorded port; only
    # shut it down if it really runs from DIR.
    dir=$(rcli "$PORT" config get dir 2>/dev/null | sed -n 2p || true)
    if [[ $dir == "$DIR" ]]; then
        log "stopping redis-server on port $PORT (no pidfile)"
        rcli "$PORT" shutdown nosave >/dev/null 2>&1 || true
    else
        log "port $PORT answers but is not the server from $DIR; leaving it alone"
    fi
else
    log "redis-server in $DIR is not running"
fi

if ((!KEEP)); then
    assert_removable_dir "$DIR"
    rm -rf -- "$DIR"
    log "removed $DIR"
fi
