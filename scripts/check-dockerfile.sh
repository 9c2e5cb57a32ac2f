#!/usr/bin/env bash
# scripts/check-dockerfile.sh — replays the Dockerfile's build stage without a Docker engine.
#
# Usage: scripts/check-dockerfile.sh [--full]
#
# Reads the Dockerfile itself (no copy of its steps lives here): for the instructions of the
# first stage (FROM ... AS builder, up to the next FROM) it does what Docker would, in a fresh
# temp directory standing for the image's file system:
#   WORKDIR d   -> cd into $TMP/d (created)
#   COPY a.. d  -> copies those paths of the build context (this checkout, minus what
#                  .dockerignore excludes) into the work directory
#   RUN cmd     -> runs cmd with /bin/sh -c in the work directory
# Any other instruction in that stage stops the script: teach it first.
#
# Without --full (what .ci/run does), every `cargo build` of a RUN becomes `cargo check`
# (same flags, --locked included) and an `install` of the built binary is skipped: this
# proves that the stub layout is a manifest cargo accepts, that Cargo.lock satisfies --locked,
# that the dependencies compile for the release profile against the stubs, and that the real
# sources then compile in the layout the second COPY builds. It does not prove the link step,
# nor the runtime stage (apt-get, useradd), nor the base images. With --full the build runs
# as written (a release build with LTO: many minutes on 2 cores) and the binary is installed
# under $TMP instead of /usr/local/bin, then run with --version.
#
# The cargo registry is shared (CARGO_HOME); the target directory is the temp dir's own, so
# the stub-then-real fingerprint handling is exercised as in a clean image.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FULL=0
[[ ${1:-} == --full ]] && FULL=1

TMP=$(mktemp -d /tmp/outbox-relay-dockerfile.XXXXXX)
trap 'rm -rf -- "$TMP"' EXIT
FS=$TMP/fs
mkdir -p "$FS"
WORK=$FS

die() {
    echo "check-dockerfile: $*" >&2
    exit 1
}

# The build context: the checkout without .dockerignore's entries (simple names only).
CONTEXT=$TMP/context
mkdir -p "$CONTEXT"
EXCLUDES=()
if [[ -f $ROOT/.dockerignore ]]; then
    while IFS= read -r pat; do
        pat=${pat%%#*}
        pat=${pat//[[:space:]]/}
        [[ -n $pat ]] && EXCLUDES+=(--exclude="${pat%/}")
    done <"$ROOT/.dockerignore"
fi
tar -C "$ROOT" "${EXCLUDES[@]}" -cf - . | tar -C "$CONTEXT" -xf -

# The Dockerfile's instructions, continuation lines joined, comments dropped.
mapfile -t INSTRUCTIONS < <(
    sed -e 's/^[[:space:]]*#.*$//' "$ROOT/Dockerfile" |
        awk '{ if (sub(/\\$/, "")) { buf = buf $0 " " } else { print buf $0; buf = "" } }' |
        grep -v '^[[:space:]]*$'
)

stage=0
steps=0
for line in "${INSTRUCTIONS[@]}"; do
    read -r op rest <<<"$line"
    case ${op^^} in
    FROM)
        stage=$((stage + 1))
        ((stage == 1)) || break
        echo "==> FROM $rest (the base image is not checked)"
        ;;
    WORKDIR)
        WORK=$FS/${rest#/}
        mkdir -p "$WORK"
        echo "==> WORKDIR $rest"
        ;;
    COPY)
        [[ $rest != --* ]] || die "COPY with options is not supported: $line"
        read -r -a args <<<"$rest"
        dest=${args[-1]}
        unset 'args[-1]'
        echo "==> COPY ${args[*]} $dest"
        case $dest in
        /*) target=$FS$dest ;;
        *) target=$WORK/$dest ;;
        esac
        for src in "${args[@]}"; do
            [[ -e $CONTEXT/$src ]] || die "COPY $src: not in the build context"
            if [[ ${#args[@]} -gt 1 || $dest == */ ]]; then
                mkdir -p "$target"
                cp -a "$CONTEXT/$src" "$target/"
            else
                mkdir -p "$(dirname "$target")"
                cp -a "$CONTEXT/$src" "$target"
            fi
        done
        ;;
    RUN)
        cmd=$rest
        if ((FULL)); then
            cmd=${cmd//\/usr\/local\/bin/$TMP/bin}
            mkdir -p "$TMP/bin"
        else
            cmd=${cmd//cargo build/cargo check}
            # Nothing is linked by `cargo check`: drop the install of the binary.
            cmd=$(sed -E 's/&& *install [^&]*target\/release\/outbox-relay[^&]*//' <<<"$cmd")
        fi
        echo "==> RUN $cmd"
        (cd "$WORK" && env -u CARGO_TARGET_DIR /bin/sh -ec "$cmd") || die "RUN failed: $cmd"
        ;;
    *)
        die "instruction $op in the build stage: this script does not replay it yet"
        ;;
    esac
    steps=$((steps + 1))
done
((steps >= 6)) || die "replayed only $steps instructions: the Dockerfile parse broke"
if ((FULL)); then
    "$TMP/bin/outbox-relay" --version
fi
echo "check-dockerfile: the build stage's $steps instructions replayed ($( ((FULL)) && echo full build || echo cargo check))"
