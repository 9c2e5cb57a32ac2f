#!/usr/bin/env bash
# scripts/valkey-sentinel-start.sh — start a throwaway Sentinel-managed Valkey/Redis for tests.
#
# Usage:
#   scripts/valkey-sentinel-start.sh DIR [NAME] [--tls CERTDIR] [--sentinel-password-file FILE]
#
#   DIR   directory for the servers (created if missing): DIR/primary,
#         DIR/replica and DIR/sentinel1..3, each started by redis-start.sh
#         (redis.pid, redis.log, `port`, `url`; a sentinel's config is its
#         redis.conf).
#   NAME  the name the sentinels know the primary by; default mymaster.
#   --tls CERTDIR  every server (primary, replica, sentinels) listens with TLS
#         only and requires a client certificate (redis-start.sh --tls
#         CERTDIR); replication and the sentinels' links use TLS too; the
#         URLs are rediss://.
#   --sentinel-password-file FILE  the sentinels require the password in FILE
#         (`requirepass`; they use it with each other too). The primary and
#         the replica have none.
#
# Starts a primary and one replica (`--replicaof`) on free loopback ports, no
# persistence, then three sentinels (`redis-server --sentinel`) that monitor
# the primary with quorum 2, down-after-milliseconds 1000 and
# failover-timeout 5000. Waits up to ~30 s until the replica is in sync and
# every sentinel knows the replica and the two other sentinels. Prints the
# comma-separated URLs of the three sentinels as the only stdout line (also
# written to DIR/url); everything else goes to stderr. Stop it with
# scripts/valkey-sentinel-stop.sh DIR.
set -euo pipefail

SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/lib.sh
. "$SCRIPTS/lib.sh"

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

[[ $# -ge 1 ]] || usage
[[ $1 != -h && $1 != --help ]] || usage
DIR=$(abs_path "$1")
shift
NAME=mymaster
if [[ $# -ge 1 && $1 != --* ]]; then
    NAME=$1
    shift
fi
TLS_ARGS=()
SENTINEL_PASSWORD=""
while [[ $# -ge 1 ]]; do
    case "$1" in
    --tls)
        [[ $# -ge 2 ]] || usage
        use_tls "$2"
        TLS_ARGS=(--tls "$TLS_DIR")
        shift 2
        ;;
    --sentinel-password-file)
        [[ $# -ge 2 && -r $2 ]] || die "--sentinel-password-file needs a readable FILE"
        SENTINEL_PASSWORD=$(cat "$2")
        [[ $SENTINEL_PASSWORD =~ ^[A-Za-z0-9._-]+$ ]] || die "$2: use letters, digits, '.', '_' or '-'"
        shift 2
        ;;
    *) usage ;;
    esac
done
[[ $NAME =~ ^[A-Za-z0-9._-]+$ ]] || die "bad NAME '$NAME'"
SENTINELS=3

command -v redis-cli >/dev/null 2>&1 || die "redis-cli not found (apt-get install redis-tools)"
[[ ! -e $DIR/url ]] || die "$DIR already holds a sentinel setup; stop it first (valkey-sentinel-stop.sh $DIR)"
mkdir -p "$DIR"

cli() {
    rcli "$@"
}

# A sentinel, with its password if any.
scli() {
    if [[ -n $SENTINEL_PASSWORD ]]; then
        REDISCLI_AUTH=$SENTINEL_PASSWORD rcli "$@"
    else
        rcli "$@"
    fi
}

url=$("$SCRIPTS/redis-start.sh" "$DIR/primary" "${TLS_ARGS[@]}")
PRIMARY=${url##*:}
"$SCRIPTS/redis-start.sh" "$DIR/replica" "${TLS_ARGS[@]}" -- \
    --replicaof 127.0.0.1 "$PRIMARY" >/dev/null

PORTS=()
URLS=()
for n in $(seq 1 "$SENTINELS"); do
    dir=$DIR/sentinel$n
    mkdir -p "$dir"
    # Sentinel rewrites this file (its state); redis-start.sh passes it first.
    cat >"$dir/redis.conf" <<EOF
sentinel monitor $NAME 127.0.0.1 $PRIMARY 2
sentinel down-after-milliseconds $NAME 1000
sentinel failover-timeout $NAME 5000
sentinel parallel-syncs $NAME 1
EOF
    if [[ -n $SENTINEL_PASSWORD ]]; then
        echo "requirepass \"$SENTINEL_PASSWORD\"" >>"$dir/redis.conf"
    fi
    url=$("$SCRIPTS/redis-start.sh" "$dir" "${TLS_ARGS[@]}" -- --sentinel)
    PORTS+=("${url##*:}")
    URLS+=("$url")
done

# The value after KEY in the key/value lines of `SENTINEL MASTER`.
field() {
    awk -v k="$1" 'prev == k { print; exit } { prev = $0 }'
}

ready() {
    local repl port master
    repl=$(cli "$(cat "$DIR/replica/port")" info replication 2>/dev/null) || return 1
    grep -q '^master_link_status:up' <<<"$repl" || return 1
    for port in "${PORTS[@]}"; do
        master=$(scli "$port" sentinel master "$NAME" 2>/dev/null) || return 1
        [[ $(field num-slaves <<<"$master") == 1 ]] || return 1
        [[ $(field num-other-sentinels <<<"$master") == $((SENTINELS - 1)) ]] || return 1
        [[ $(field flags <<<"$master") == master ]] || return 1
    done
}

if ! wait_for 30 ready; then
    for port in "${PORTS[@]}"; do
        scli "$port" sentinel master "$NAME" >&2 || true
    done
    die "the sentinels did not become ready within 30 s"
fi

LIST=$(
    IFS=,
    echo "${URLS[*]}"
)
echo "$NAME" >"$DIR/name"
echo "$LIST" >"$DIR/url"
log "primary 127.0.0.1:$PRIMARY, replica 127.0.0.1:$(cat "$DIR/replica/port"), sentinels $LIST"
echo "$LIST"
