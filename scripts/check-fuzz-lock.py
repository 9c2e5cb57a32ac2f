#!/usr/bin/env python3
"""scripts/check-fuzz-lock.py — fuzz/Cargo.lock pins what the relay is built with.

Usage: scripts/check-fuzz-lock.py

fuzz/ is a workspace of its own (cargo fuzz builds it on nightly), with its own lock file. Every
package it shares with the main Cargo.lock must be at a version the main lock has, so the fuzz
targets exercise the relay as it ships. After a dependency update, refresh it: copy Cargo.lock
to fuzz/Cargo.lock and run `cargo check --manifest-path fuzz/Cargo.toml --bins` (which adds the
fuzzer's own crates). Exits 1 naming each package that differs.
"""
import sys
import tomllib
from pathlib import Path

root = Path(__file__).resolve().parent.parent


def versions(lock: Path) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for p in tomllib.loads(lock.read_text())["package"]:
        out.setdefault(p["name"], set()).add(p["version"])
    return out


if len(sys.argv) > 1:
    print(__doc__.strip(), file=sys.stderr)
    sys.exit(2)
main = versions(root / "Cargo.lock")
fuzz = versions(root / "fuzz" / "Cargo.lock")
bad = [(name, sorted(v), sorted(main[name])) for name, v in sorted(fuzz.items())
       if name in main and not v <= main[name]]
for name, got, want in bad:
    print(f"fuzz/Cargo.lock has {name} {', '.join(got)}; Cargo.lock has {', '.join(want)}")
if bad:
    print("refresh it: cp Cargo.lock fuzz/Cargo.lock && "
          "cargo check --manifest-path fuzz/Cargo.toml --bins", file=sys.stderr)
    sys.exit(1)
print(f"fuzz/Cargo.lock: {len(fuzz)} packages, each shared one at a version of Cargo.lock")
