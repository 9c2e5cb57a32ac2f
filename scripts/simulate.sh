#!/usr/bin/env bash
# scripts/simulate.sh — the delivery core's simulation (tests/sim) over many schedules, spread
# over the machine's cores: the long mode, and CI's release run.
#
#   scripts/simulate.sh [SCHEDULES] [FIRST_SEED]      default: 1000000 schedules from seed 1
#   OUTBOX_SIM_JOBS=N scripts/simulate.sh ...          N processes (default: nproc)
#
# Each process runs a disjoint range of seeds. A failing schedule prints its seed and the
# command that replays it (cargo run --example simulate -- --seed N --verbose); the script then
# exits 1. Logs: target/simulate/<first seed>.<job>.log. The last line sums every process.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

total=${1:-1000000}
from=${2:-1}
jobs=${OUTBOX_SIM_JOBS:-$(nproc)}
if ! [[ $total =~ ^[0-9]+$ && $from =~ ^[0-9]+$ && $jobs =~ ^[1-9][0-9]*$ ]] || ((total == 0)); then
    echo "usage: scripts/simulate.sh [SCHEDULES] [FIRST_SEED] (positive numbers)" >&2
    exit 2
fi

cargo build --release --locked --example simulate
bin=target/release/examples/simulate
logs=target/simulate
mkdir -p "$logs"

per=$(((total + jobs - 1) / jobs))
pids=()
files=()
for ((j = 0; j < jobs; j++)); do
    start=$((from + j * per))
    n=$per
    if ((start + n > from + total)); then
        n=$((from + total - start))
    fi
    ((n > 0)) || break
    log="$logs/$from.$j.log"
    "$bin" --from "$start" --seeds "$n" >"$log" 2>&1 &
    pids+=($!)
    files+=("$log")
done

status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=1
done

# Each process ends with: "<n> schedules from seed <s>: <r> rows, <t> tasks, <f> faults,
# <secs> simulated seconds, peak bytes held by writes <p>; <k> failed, in <d>"
summary=$(for f in "${files[@]}"; do tail -n 1 "$f"; done)
echo "$summary"
echo "$summary" | awk -v jobs="${#files[@]}" -v from="$from" '
    {
        n += $1; rows += $6; tasks += $8; faults += $10; secs += $12
        peak = ($20 + 0 > peak) ? $20 + 0 : peak
        failed += $21
    }
    END {
        printf "total: %d schedules from seed %d in %d processes: %d rows, %d tasks, %d faults, %d simulated seconds, peak bytes held by one process'"'"'s writes %d; %d failed\n", n, from, jobs, rows, tasks, faults, secs, peak, failed
        exit (failed > 0 || NR != jobs)
    }' || status=1

if ((status != 0)); then
    grep -h -A12 '^simulation seed' "${files[@]}" || true
    echo "simulate: FAILED (logs in $logs/)" >&2
fi
exit "$status"
