# shellcheck shell=bash
# scripts/lib.sh — helpers shared by the server start/stop scripts.
#
# Usage (from another script):
#   . "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# Provides:
#   log MSG...            print "[script] MSG" on stderr
#   die MSG...            log MSG and exit 1
#   free_port             print a TCP port that is free on 127.0.0.1 right now
#   port_is_free PORT     succeed if PORT can be bound on 127.0.0.1
#   as_pg_user CMD...     run CMD as the `postgres` user when we are root,
#                         directly otherwise (runs from `/`: pass absolute paths)
#   pg_bindir             print the PostgreSQL server bin dir (initdb, pg_ctl...):
#                         $OUTBOX_TEST_PG_BINDIR if set (scripts/fetch-postgres.sh), else the system's
#   redis_server_bin      print the redis-server to run: $OUTBOX_TEST_REDIS_SERVER if set
#                         (scripts/fetch-valkey.sh), else redis-server from PATH
#   outbox_cache_dir      print the folder for fetched binaries (see scripts/fetch-postgres.sh)
#   abs_path PATH         print PATH made absolute (need not exist)
#   tail_log FILE [N]     print the last N (default 40) lines of FILE on stderr
#   use_tls CERTDIR       make rcli (and redis_tls_args) use TLS with the certificates in
#                         CERTDIR: ca.crt, server.crt/server.key, client.crt/client.key
#   rcli PORT ARGS...     redis-cli to 127.0.0.1:PORT (with TLS after use_tls)
#   auth_from_conf DIR    export REDISCLI_AUTH (for rcli) from DIR/redis.conf's
#                         `requirepass`, unless it is set already
#   redis_tls_args PORT   print, one per line, the redis-server options that make it
#                         listen with TLS only, on PORT (after use_tls)
#   bench_python ROOT     print the python of ROOT/bench/.venv, creating it (or installing
#                         bench/requirements.txt again when that changed) first
#
# Nothing here touches the system Postgres (5432) or Redis (6379).

log() {
    printf '[%s] %s\n' "$(basename "$0")" "$*" >&2
}

die() {
    log "error: $*"
    exit 1
}

tail_log() {
    local file=$1 n=${2:-40}
    if [[ -r $file ]]; then
        printf -- '----- last %s lines of %s -----\n' "$n" "$file" >&2
        tail -n "$n" "$file" >&2 || true
        printf -- '-----\n' >&2
    fi
}

# Ask the kernel for an ephemeral port on 127.0.0.1. There is an unavoidable
# race between closing the probe socket and the server binding the port;
# callers retry with a fresh port when the server reports "address in use".
free_port() {
    if command -v python3 >/dev/null 2>&1; then
        python3 -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
s.close()'
        return
    fi
    # Fallback: probe random high ports until nothing answers on one.
    local port
    for _ in $(seq 1 200); do
        port=$((20000 + (RANDOM * 32768 + RANDOM) % 40000))
        if port_is_free "$port"; then
            echo "$port"
            return 0
        fi
    done
    die "could not find a free port on 127.0.0.1"
}

# Succeed if nothing listens on 127.0.0.1:PORT (and, with python3, the port
# can actually be bound).
port_is_free() {
    local port=$1
    if command -v python3 >/dev/null 2>&1; then
        python3 - "$port" <<'PY' 2>/dev/null
import socket, sys
s = socket.socket()
# Servers (postgres, redis) set SO_REUSEADDR, so TIME_WAIT leftovers from a
# previous run on this port must not count as "in use"; a listener still does.
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
finally:
    s.close()
PY
        return
    fi
    # Nothing answering a connect => treat as free.
    ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null
}

as_pg_user() {
    if [[ $(id -u) -eq 0 ]]; then
        # runuser keeps the caller's environment; start from / because the
        # caller's cwd (e.g. /root) is usually not readable by postgres.
        (cd / && exec runuser -u postgres -- "$@")
    else
        "$@"
    fi
}

pg_bindir() {
    local dir
    if [[ -n ${OUTBOX_TEST_PG_BINDIR:-} ]]; then
        [[ -x $OUTBOX_TEST_PG_BINDIR/pg_ctl ]] ||
            die "OUTBOX_TEST_PG_BINDIR=$OUTBOX_TEST_PG_BINDIR has no pg_ctl"
        echo "$OUTBOX_TEST_PG_BINDIR"
        return 0
    fi
    if command -v pg_config >/dev/null 2>&1; then
        dir=$(pg_config --bindir 2>/dev/null || true)
        if [[ -n $dir && -x $dir/pg_ctl ]]; then
            echo "$dir"
            return 0
        fi
    fi
    # Debian without pg_config (libpq-dev): newest /usr/lib/postgresql/N/bin.
    dir=$(find /usr/lib/postgresql -mindepth 3 -maxdepth 3 -path '*/bin/pg_ctl' 2>/dev/null |
        sort -V | tail -n 1)
    if [[ -n $dir ]]; then
        dirname "$dir"
        return 0
    fi
    if command -v pg_ctl >/dev/null 2>&1; then
        dirname "$(command -v pg_ctl)"
        return 0
    fi
    die "no PostgreSQL server binaries found (pg_config/pg_ctl); install postgresql"
}

redis_server_bin() {
    if [[ -n ${OUTBOX_TEST_REDIS_SERVER:-} ]]; then
        [[ -x $OUTBOX_TEST_REDIS_SERVER ]] ||
            die "OUTBOX_TEST_REDIS_SERVER=$OUTBOX_TEST_REDIS_SERVER is not an executable"
        echo "$OUTBOX_TEST_REDIS_SERVER"
        return 0
    fi
    command -v redis-server >/dev/null 2>&1 || die "redis-server not found (apt-get install redis-server)"
    command -v redis-server
}

# Fetched server binaries live here, never in the repository. As root the default is under
# /var/cache: the `postgres` user runs the binaries and cannot enter /root.
outbox_cache_dir() {
    if [[ -n ${OUTBOX_CACHE:-} ]]; then
        abs_path "$OUTBOX_CACHE"
    elif [[ $(id -u) -eq 0 ]]; then
        echo /var/cache/outbox-relay
    else
        echo "${XDG_CACHE_HOME:-$HOME/.cache}/outbox-relay"
    fi
}

abs_path() {
    local p=$1
    [[ $p == /* ]] || p="$PWD/$p"
    # Normalise without requiring existence.
    realpath -m -- "$p"
}

# Refuse obviously dangerous targets for rm -rf.
assert_removable_dir() {
    local d=$1
    case "$d" in
    "" | / | /tmp | /var | /usr | /etc | /root | /home | /work | "$HOME")
        die "refusing to remove '$d'"
        ;;
    esac
    [[ $d == /?*/?* ]] || die "refusing to remove '$d' (too close to /)"
}

# Parses the `DIR [--keep]` arguments of the stop scripts into DIR and KEEP. The caller
# defines `usage`. Exits 0 when DIR does not exist (nothing to stop).
parse_stop_args() {
    DIR=""
    KEEP=0
    local arg
    for arg in "$@"; do
        case "$arg" in
        -h | --help) usage ;;
        --keep) KEEP=1 ;;
        -*) die "unknown option '$arg'" ;;
        *)
            [[ -z $DIR ]] || die "unexpected argument '$arg'"
            DIR=$(abs_path "$arg")
            ;;
        esac
    done
    [[ -n $DIR ]] || usage
    if [[ ! -d $DIR ]]; then
        log "$DIR does not exist; nothing to do"
        exit 0
    fi
}

# Stops every server in the subdirectories of $1 (as started by the cluster or Sentinel start
# scripts) with redis-stop.sh: sentinels first, so they do not react to the rest going away.
# Then removes $1 unless KEEP is 1.
stop_server_dirs() {
    local dir=$1 pass node stop
    stop="$(dirname "${BASH_SOURCE[0]}")/redis-stop.sh"
    for pass in sentinels others; do
        for node in "$dir"/*/; do
            node=${node%/}
            [[ -f $node/port ]] || continue
            case "$(basename "$node")" in
            sentinel*) [[ $pass == sentinels ]] || continue ;;
            *) [[ $pass == others ]] || continue ;;
            esac
            "$stop" "$node" --keep
        done
    done
    rm -f "$dir/url"
    if ((!KEEP)); then
        assert_removable_dir "$dir"
        rm -rf -- "$dir"
        log "removed $dir"
    fi
}

# wait_for SECONDS CMD [ARG...]: runs CMD every 0.1 s until it succeeds (status 0) or SECONDS
# have passed (status 1).
wait_for() {
    local tries=$(($1 * 10))
    shift
    for _ in $(seq 1 "$tries"); do
        "$@" && return 0
        sleep 0.1
    done
    return 1
}

# TLS for redis-cli (rcli) and the servers (redis_tls_args); empty: plain TCP.
TLS_DIR=""
use_tls() {
    local f
    TLS_DIR=$(abs_path "$1")
    for f in ca.crt server.crt server.key client.crt client.key; do
        [[ -r $TLS_DIR/$f ]] || die "TLS: $TLS_DIR/$f is missing"
    done
}

rcli() {
    local port=$1
    shift
    if [[ -n $TLS_DIR ]]; then
        redis-cli --tls --cacert "$TLS_DIR/ca.crt" --cert "$TLS_DIR/client.crt" \
            --key "$TLS_DIR/client.key" -h 127.0.0.1 -p "$port" "$@"
    else
        redis-cli -h 127.0.0.1 -p "$port" "$@"
    fi
}

# TLS only (the plain port off); clients must show a certificate of the CA, and the server's
# own connections (replication, the cluster bus, a sentinel's links) use TLS and the client
# certificate too.
redis_tls_args() {
    printf '%s\n' --port 0 --tls-port "$1" \
        --tls-cert-file "$TLS_DIR/server.crt" --tls-key-file "$TLS_DIR/server.key" \
        --tls-client-cert-file "$TLS_DIR/client.crt" --tls-client-key-file "$TLS_DIR/client.key" \
        --tls-ca-cert-file "$TLS_DIR/ca.crt" --tls-auth-clients yes --tls-replication yes
}

# A server whose config file sets a password (a sentinel started with one): rcli needs it.
auth_from_conf() {
    local pw
    [[ -z ${REDISCLI_AUTH:-} && -f $1/redis.conf ]] || return 0
    pw=$(sed -n 's/^requirepass "\{0,1\}\([^"]*\)"\{0,1\}$/\1/p' "$1/redis.conf" | head -n 1)
    [[ -z $pw ]] || export REDISCLI_AUTH=$pw
}

bench_python() {
    local root=$1 venv=$1/bench/.venv
    if [[ ! -x $venv/bin/python ]] || ! cmp -s "$root/bench/requirements.txt" "$venv/requirements.txt"; then
        # Called inside $(...), where set -e is off: each step says whether it failed.
        log "installing bench/requirements.txt into bench/.venv"
        python3 -m venv "$venv" >&2 || return 1
        "$venv/bin/pip" install --quiet --disable-pip-version-check \
            -r "$root/bench/requirements.txt" >&2 || return 1
        cp "$root/bench/requirements.txt" "$venv/requirements.txt" || return 1
    fi
    echo "$venv/bin/python"
}
