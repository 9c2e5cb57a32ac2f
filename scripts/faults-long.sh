#!/usr/bin/env bash
# scripts/faults-long.sh — the long form of the fault suite (tests/faults.rs).
#
# Usage:
#   scripts/faults-long.sh [RUNS]
#
# Runs every fault scenario RUNS times (default 1) with OUTBOX_FAULTS_LONG=1 (more kills,
# restarts and outages per scenario, a 1,000,000-row transaction), one scenario at a time,
# and prints a markdown table of what the checker found, summed per scenario: faults
# injected, transactions, committed events, delivered, missing, duplicates (ids pushed twice
# to a pending list) and leaked tasks of rolled-back transactions. Raw summary lines are kept
# in target/faults-long.log. Exits non-zero if any run failed.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
RUNS=${1:-1}
LOG=$ROOT/target/faults-long.log
mkdir -p "$ROOT/target"
: >"$LOG"

status=0
for run in $(seq 1 "$RUNS"); do
    echo "==> run $run of $RUNS" >&2
    if ! OUTBOX_FAULTS_LONG=1 "$ROOT/scripts/test.sh" --test faults --test memory -- --test-threads 1 --nocapture 2>&1 |
        tee -a "$LOG" | grep -E '^(FAULT-SUMMARY|test result|test .* \.\.\. )' >&2; then
        status=1
    fi
    grep -q 'test result: ok' "$LOG" || status=1
done

python3 - "$LOG" <<'PY'
import re, sys, collections
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    if not line.startswith("FAULT-SUMMARY"):
        continue
    kv = dict(re.findall(r"(\w+)=(\S+)", line))
    name = kv.pop("scenario")
    agg = rows.setdefault(name, collections.Counter())
    agg["runs"] += 1
    for k, v in kv.items():
        if k == "peak_rss_mib":
            agg[k] = max(agg[k], int(v))
        else:
            agg[k] += int(v)
cols = ["runs", "faults", "transactions", "committed", "delivered", "missing", "duplicates", "leaked", "out_of_order", "replays"]
print("| scenario | " + " | ".join(cols) + " |")
print("|---|" + "---:|" * len(cols))
for name, agg in rows.items():
    if name == "huge_transaction":
        continue
    print(f"| {name} | " + " | ".join(str(agg[c]) for c in cols) + " |")
total = collections.Counter()
for name, agg in rows.items():
    if name != "huge_transaction":
        total.update(agg)
print("| **all** | " + " | ".join(str(total[c]) for c in cols) + " |")
if "huge_transaction" in rows:
    h = rows["huge_transaction"]
    print(f"\nSingle transaction: {h['rows'] // h['runs']:,} rows per run, {h['runs']} run(s), all delivered; "
          f"relay peak RSS {h['peak_rss_mib']} MiB (debug build).")
PY
exit $status
