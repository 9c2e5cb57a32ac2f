#!/usr/bin/env bash
# scripts/valkey-cluster-start.sh — start a throwaway Valkey/Redis Cluster for tests.
#
# Usage:
#   scripts/valkey-cluster-start.sh DIR [--tls CERTDIR]
#
#   DIR   directory for the cluster (created if missing). Node N (1..6) lives
#         in DIR/nodeN, started by redis-start.sh (redis.pid, redis.log,
#         `port`, `url`, and the cluster's nodes.conf).
#   --tls CERTDIR  every node listens with TLS only and requires a client
#         certificate (redis-start.sh --tls CERTDIR: ca.crt, server.crt/.key,
#         client.crt/.key), the cluster bus and replication use TLS too
#         (`--tls-cluster yes`), and the URLs are rediss://.
#
# Starts six redis-server processes on free loopback ports with
# `--cluster-enabled yes --cluster-node-timeout 2000`, each with its cluster
# bus on another free port (`--cluster-port`, Redis 7 or Valkey), no
# persistence; joins them with `redis-cli --cluster create --cluster-replicas 1`
# (three primaries with one replica each), and waits up to ~30 s until every
# node reports cluster_state:ok and every replica is in sync with its primary.
# Prints the comma-separated URLs of the six nodes as the only stdout line
# (also written to DIR/url); everything else goes to stderr. Stop it with
# scripts/valkey-cluster-stop.sh DIR.
set -euo pipefail

SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/lib.sh
. "$SCRIPTS/lib.sh"

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

[[ $# -eq 1 || ($# -eq 3 && $2 == --tls) ]] || usage
[[ $1 != -h && $1 != --help ]] || usage
DIR=$(abs_path "$1")
NODES=6
TLS_ARGS=()
CLUSTER_TLS=()
if [[ $# -eq 3 ]]; then
    use_tls "$3"
    TLS_ARGS=(--tls "$TLS_DIR")
    CLUSTER_TLS=(--tls-cluster yes)
fi

command -v redis-cli >/dev/null 2>&1 || die "redis-cli not found (apt-get install redis-tools)"
command -v redis-server >/dev/null 2>&1 || die "redis-server not found (apt-get install redis-server)"
# --cluster-port (the bus on a port of its own, not PORT+10000) needs Redis 7 or Valkey.
version=$(redis-server --version | sed -n 's/.* v=\([0-9]*\)\..*/\1/p')
if ! [[ $version =~ ^[0-9]+$ ]] || ((version < 7)); then
    die "$(redis-server --version | cut -d' ' -f1-3) is too old: the test cluster needs Redis 7 or Valkey"
fi
[[ ! -e $DIR/url ]] || die "$DIR already holds a cluster; stop it first (valkey-cluster-stop.sh $DIR)"
mkdir -p "$DIR"

cli() {
    rcli "$@"
}

PORTS=()
URLS=()
for n in $(seq 1 "$NODES"); do
    node=$DIR/node$n
    mkdir -p "$node"
    url=$("$SCRIPTS/redis-start.sh" "$node" "${TLS_ARGS[@]}" -- \
        --cluster-enabled yes --cluster-port "$(free_port)" "${CLUSTER_TLS[@]}" \
        --cluster-config-file "$node/nodes.conf" --cluster-node-timeout 2000)
    PORTS+=("${url##*:}")
    URLS+=("$url")
done

ADDRS=()
for port in "${PORTS[@]}"; do
    ADDRS+=("127.0.0.1:$port")
done

log "creating the cluster: ${ADDRS[*]} (log $DIR/create.log)"
if ! cli "${PORTS[0]}" --cluster create "${ADDRS[@]}" --cluster-replicas 1 --cluster-yes \
    >"$DIR/create.log" 2>&1; then
    tail_log "$DIR/create.log"
    die "redis-cli --cluster create failed"
fi

# Every node sees a healthy cluster, and every replica has its primary's data.
cluster_ready() {
    local port info repl
    for port in "${PORTS[@]}"; do
        info=$(cli "$port" cluster info 2>/dev/null) || return 1
        grep -q '^cluster_state:ok' <<<"$info" || return 1
        grep -q "^cluster_known_nodes:$NODES" <<<"$info" || return 1
        repl=$(cli "$port" info replication 2>/dev/null) || return 1
        if grep -q '^role:slave' <<<"$repl"; then
            grep -q '^master_link_status:up' <<<"$repl" || return 1
            grep -q '^master_sync_in_progress:0' <<<"$repl" || return 1
        fi
    done
}

if ! wait_for 30 cluster_ready; then
    for port in "${PORTS[@]}"; do
        cli "$port" cluster info >&2 || true
    done
    die "the cluster did not become ready within 30 s"
fi

LIST=$(
    IFS=,
    echo "${URLS[*]}"
)
echo "$LIST" >"$DIR/url"
log "cluster ready: $LIST"
echo "$LIST"
