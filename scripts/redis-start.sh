#!/usr/bin/env bash
# scripts/redis-start.sh — start a throwaway Redis server for tests/demos.
#
# Usage:
#   scripts/redis-start.sh DIR [PORT] [--tls CERTDIR] [-- SERVER_ARGS...]
#
#   DIR   directory for the server (created if missing): redis.pid,
#         redis.log, `port` and `url` live there. If DIR/redis.conf exists,
#         redis-server is started with it as its config file (for example a
#         sentinel.conf, with `--sentinel` among SERVER_ARGS).
#   PORT  TCP port on 127.0.0.1; default: the port recorded in DIR/port when
#         restarting, else a free port from the kernel.
#   --tls CERTDIR  listen with TLS only (no plain port), with CERTDIR's
#         server.crt/server.key, clients needing a certificate of CERTDIR's
#         ca.crt (`--tls-auth-clients yes`); the server's own outgoing
#         connections (replication, the cluster bus, a sentinel's) use TLS with
#         client.crt/client.key (`--tls-replication yes`). Recorded in DIR/tls,
#         so a restart keeps it. The URL is then rediss://.
#   SERVER_ARGS  more redis-server options (e.g. `--cluster-enabled yes`),
#         after the script's own; give them again on a restart.
#
# Starts `redis-server` ($OUTBOX_TEST_REDIS_SERVER if set, e.g. the valkey-server that
# scripts/fetch-valkey.sh prints) daemonized on 127.0.0.1 with no persistence
# (--save "" --appendonly no), waits up to ~10 s for PING to answer PONG and
# prints `redis://127.0.0.1:PORT` as the only stdout line (also written to
# DIR/url); everything else goes to stderr. If a server started in DIR is
# still running it just prints its URL. Stop it with scripts/redis-stop.sh DIR.
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
if [[ $# -ge 1 && $1 != -- && $1 != --tls ]]; then
    PORT=$1
    shift
fi
TLS=""
if [[ $# -ge 1 && $1 == --tls ]]; then
    [[ $# -ge 2 ]] || usage
    TLS=$(abs_path "$2")
    shift 2
fi
EXTRA=()
if [[ $# -ge 1 ]]; then
    [[ $1 == -- ]] || usage
    shift
    EXTRA=("$@")
fi
if [[ -n $PORT ]] && { ! [[ $PORT =~ ^[0-9]+$ ]] || ((PORT < 1 || PORT > 65535)); }; then
    die "bad PORT '$PORT'"
fi

REDIS_SERVER=$(redis_server_bin)
command -v redis-cli >/dev/null 2>&1 || die "redis-cli not found (apt-get install redis-tools)"

PIDFILE=$DIR/redis.pid
LOGFILE=$DIR/redis.log

if [[ -z $TLS && -s $DIR/tls ]]; then
    TLS=$(cat "$DIR/tls")
fi
[[ -z $TLS ]] || use_tls "$TLS"
auth_from_conf "$DIR"

ping() {
    [[ $(rcli "$1" ping 2>/dev/null) == PONG ]]
}

# Is the redis-server whose pid is in PIDFILE alive (and not a zombie)?
pid_alive() {
    local pid
    pid=$(cat "$PIDFILE" 2>/dev/null || true)
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ -r /proc/$pid/stat ]] || return 1
    [[ $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]]
}

# ---- already running? -------------------------------------------------------
if [[ -s $DIR/port && -s $DIR/url ]] && pid_alive && ping "$(cat "$DIR/port")"; then
    log "already running: $(cat "$DIR/url")"
    cat "$DIR/url"
    exit 0
fi

mkdir -p "$DIR"
if [[ -n $TLS ]]; then
    echo "$TLS_DIR" >"$DIR/tls"
fi

AUTO_PORT=0
if [[ -z $PORT ]]; then
    if [[ -s $DIR/port ]]; then
        PORT=$(cat "$DIR/port")
    else
        PORT=$(free_port)
        AUTO_PORT=1
    fi
fi

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
    rm -f "$PIDFILE"
    log_lines=0
    [[ -f $LOGFILE ]] && log_lines=$(wc -l <"$LOGFILE")
    log "starting redis-server on 127.0.0.1:$PORT (dir $DIR, log $LOGFILE)"
    CONF=()
    [[ -f $DIR/redis.conf ]] && CONF=("$DIR/redis.conf")
    LISTEN=(--port "$PORT")
    [[ -z $TLS ]] || mapfile -t LISTEN < <(redis_tls_args "$PORT")
    "$REDIS_SERVER" "${CONF[@]}" --daemonize yes --bind 127.0.0.1 "${LISTEN[@]}" \
        --save "" --appendonly no --dir "$DIR" \
        --pidfile "$PIDFILE" --logfile "$LOGFILE" "${EXTRA[@]}" >&2 ||
        die "redis-server failed to launch"

    ok=0
    for _ in $(seq 1 100); do # ~10 s
        if ping "$PORT"; then
            ok=1
            break
        fi
        # The daemon exits soon after forking if it cannot bind etc.
        if grep -q 'Address already in use\|# Failed\|# Fatal' \
            <(tail -n "+$((log_lines + 1))" "$LOGFILE" 2>/dev/null); then
            break
        fi
        sleep 0.1
    done
    ((ok)) && break

    if ((AUTO_PORT && attempt < 5)) &&
        tail -n "+$((log_lines + 1))" "$LOGFILE" 2>/dev/null | grep -q 'Address already in use'; then
        log "port $PORT was taken meanwhile; retrying with another"
        PORT=$(free_port)
        attempt=$((attempt + 1))
        continue
    fi
    # Do not leave a half-started server behind.
    if pid_alive; then
        kill -TERM "$(cat "$PIDFILE")" 2>/dev/null || true
    fi
    tail_log "$LOGFILE"
    die "redis-server on port $PORT did not answer PING within 10 s"
done

URL="redis://127.0.0.1:$PORT"
[[ -z $TLS ]] || URL="rediss://127.0.0.1:$PORT"
echo "$PORT" >"$DIR/port"
echo "$URL" >"$DIR/url"
echo "$URL"
