#!/usr/bin/env bash
# scripts/pg-stop.sh — stop a throwaway PostgreSQL started by pg-start.sh.
#
# Usage:
#   scripts/pg-stop.sh DIR [fast|immediate|smart] [--keep]
#
#   DIR     the directory given to pg-start.sh
#   MODE    pg_ctl shutdown mode (default: fast). If the server does not stop
#           within 60 s it is stopped with `immediate`, then killed.
#   --keep  keep DIR (data, log, port, url) so pg-start.sh DIR can restart it
#           on the same port; without it DIR is removed.
#
# Not an error if the server is not running or DIR does not exist.
set -euo pipefail

# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

DIR=""
MODE=fast
KEEP=0
for arg in "$@"; do
    case "$arg" in
    -h | --help) usage ;;
    --keep) KEEP=1 ;;
    fast | immediate | smart) MODE=$arg ;;
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

DATA=$DIR/data
if [[ -f $DATA/PG_VERSION ]]; then
    BIN=$(pg_bindir)
    if as_pg_user "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; then
        log "stopping postgres in $DATA ($MODE)"
        if ! as_pg_user "$BIN/pg_ctl" -D "$DATA" -m "$MODE" -w -t 60 stop >&2; then
            log "pg_ctl stop -m $MODE failed; trying immediate"
            if ! as_pg_user "$BIN/pg_ctl" -D "$DATA" -m immediate -w -t 30 stop >&2; then
                pid=$(head -n 1 "$DATA/postmaster.pid" 2>/dev/null || true)
                if [[ $pid =~ ^[0-9]+$ ]]; then
                    log "killing postmaster $pid"
                    kill -KILL "$pid" 2>/dev/null || true
                fi
            fi
        fi
    else
        log "postgres in $DATA is not running"
    fi
fi

if ((!KEEP)); then
    assert_removable_dir "$DIR"
    rm -rf -- "$DIR"
    log "removed $DIR"
fi
