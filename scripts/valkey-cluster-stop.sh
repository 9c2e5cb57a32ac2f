#!/usr/bin/env bash
# scripts/valkey-cluster-stop.sh — stop a cluster started by valkey-cluster-start.sh.
#
# Usage:
#   scripts/valkey-cluster-stop.sh DIR [--keep]
#
#   DIR     the directory given to valkey-cluster-start.sh
#   --keep  keep DIR (logs, nodes.conf); without it DIR is removed.
#
# Stops every node in DIR/node* with redis-stop.sh (SHUTDOWN NOSAVE, then
# SIGTERM, then SIGKILL). Not an error if nodes are not running or DIR is
# missing.
set -euo pipefail

SCRIPTS=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/lib.sh
. "$SCRIPTS/lib.sh"

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

DIR=""
KEEP=0
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

for node in "$DIR"/*/; do
    node=${node%/}
    [[ -f $node/port ]] || continue
    "$SCRIPTS/redis-stop.sh" "$node" --keep
done
rm -f "$DIR/url"

if ((!KEEP)); then
    assert_removable_dir "$DIR"
    rm -rf -- "$DIR"
    log "removed $DIR"
fi
