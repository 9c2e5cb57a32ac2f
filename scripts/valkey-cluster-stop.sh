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

# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

parse_stop_args "$@"
stop_server_dirs "$DIR"
