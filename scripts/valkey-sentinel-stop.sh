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

# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

parse_stop_args "$@"
stop_server_dirs "$DIR"
