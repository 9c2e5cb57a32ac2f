#!/usr/bin/env bash
# scripts/valkey-sentinel-stop.sh — stop the servers started by valkey-sentinel-start.sh.
#
# Usage:
#   scripts/valkey-sentinel-stop.sh DIR [--keep]
#
#   DIR     the directory given to valkey-sentinel-start.sh
#   --keep  keep DIR (logs, sentinel configs); without it DIR is removed.
#
# Stops the sentinels first (so they do not react to the rest going away),
# then every other server in DIR/*, with redis-stop.sh. Not an error if
# servers are not running or DIR is missing.
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

for pass in sentinels others; do
    for node in "$DIR"/*/; do
        node=${node%/}
        [[ -f $node/port ]] || continue
        case "$(basename "$node")" in
        sentinel*) [[ $pass == sentinels ]] || continue ;;
        *) [[ $pass == others ]] || continue ;;
        esac
        "$SCRIPTS/redis-stop.sh" "$node" --keep
    done
done
rm -f "$DIR/url"

if ((!KEEP)); then
    assert_removable_dir "$DIR"
    rm -rf -- "$DIR"
    log "removed $DIR"
fi
