#!/usr/bin/env python3
"""The end-to-end benchmark of outbox-relay; scripts/bench.sh starts the servers and runs it.

Phases, each on a fresh database migrated by `outbox-relay migrate`, on one Postgres and one
Valkey/Redis (FLUSHALL between phases):

1. pg_recvlogical: the limit. A pgoutput slot created before the backlog is inserted, drained
   through the relay's publication to /dev/null up to the LSN after the backlog.
2. stream: `outbox-relay run` draining the same kind of backlog from its slot into Valkey.
3. poller: `outbox-relay run` in poll mode (1 and 4 pollers, batch 500) on a backlog without a slot.
4. naive: examples/naive_relay, one Valkey round trip per event (what users run today).
5. steady: the stream under single-row transactions at fixed rates (examples/load_gen); latency is
   the task hash's `pending_since` (the relay's clock at write) minus the row's commit timestamp
   (`pg_xact_commit_timestamp`, track_commit_timestamp=on), on the same machine clock.

6. The production-geometry phases (issue 16, not in the default): `calibrate`, `link`,
   `payload`, `fsync` and `ceiling` (bench/geometry.py, bench/ceiling.py): the relay with a
   delay each way to Postgres and Valkey (examples/latency_proxy), payload sizes, a server with
   fsync on, and the insert ceiling with per-process CPU. Their report goes between
   `<!-- bench-geometry:begin -->` and `<!-- bench-geometry:end -->`.

Backlogs are inserted in transactions of --per-txn rows (100) with a ~220-byte jsonb payload and a
traceparent in the metadata. Python only orchestrates: nothing it does sits on a measured path.
The result is one markdown section, printed and written between `<!-- bench:begin -->` and
`<!-- bench:end -->` of DOCS_DIR/benchmarks.md, plus DOCS_DIR/bench-latency.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import report
import report_geo
from backlog import (median_run, phase_huge, phase_naive, phase_poller, phase_recvlogical,
                     phase_stream)
from ceiling import phase_ceiling
from geometry import add_geometry_args, phase_link, phase_payloads
from harness import Env, log
from link import parse_delays, phase_calibrate
from steady import phase_steady

BACKLOG = {
    "recvlogical": phase_recvlogical,
    "stream": phase_stream,
    "poller1": lambda env: phase_poller(env, 1),
    "poller4": lambda env: phase_poller(env, 4),
    "naive": phase_naive,
    "huge": phase_huge,
}

GEOMETRY = {
    "calibrate": lambda env: phase_calibrate(env, parse_delays(env.a.link_delays),
                                             env.a.calibrate_round_trips),
    "link": phase_link,
    "payload": lambda env: phase_payloads(env, fsync=False),
    "fsync": lambda env: phase_payloads(fsync_env(env), fsync=True),
    "ceiling": phase_ceiling,
}


def fsync_env(env: Env) -> Env:
    """The servers of the fsync phase: the second Postgres (fsync on), the same Valkey."""
    if not env.a.pg_fsync_url:
        raise SystemExit("the fsync phase needs --pg-fsync-url (scripts/bench.sh starts that"
                         " server when --phases names fsync)")
    return Env(argparse.Namespace(**dict(vars(env.a), pg_url=env.a.pg_fsync_url)))


# ---- main -------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pg-url", required=True)
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--relay", required=True, help="the outbox-relay binary")
    ap.add_argument("--naive", required=True, help="the naive_relay example binary")
    ap.add_argument("--load-gen", required=True, help="the load_gen example binary")
    ap.add_argument("--pg-recvlogical", default="pg_recvlogical")
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--per-txn", type=int, default=100)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--step-seconds", type=float, help="per load step (default 10, quick 2)")
    ap.add_argument("--rates", default="1000,5000", help="fixed steady rates")
    ap.add_argument("--ramp", help="rates tried after the fixed ones, until one is not kept up")
    ap.add_argument("--max-p99-ms", type=float, default=1000.0,
                    help="a load step whose p99 is higher is not kept up")
    ap.add_argument("--max-drift-ms", type=float, default=100.0,
                    help="nor one whose median latency climbs more than this through the step")
    ap.add_argument("--phases", default="recvlogical,stream,poller1,poller4,naive,steady",
                    help="comma-separated; not in the default: `huge` streams one transaction"
                         " of --huge-rows rows; `calibrate`, `link`, `payload`, `fsync` and"
                         " `ceiling` are the production-geometry phases (bench/geometry.py)")
    ap.add_argument("--huge-rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the backlog phases this many times, in rounds, and report each"
                         " phase's median run with the range")
    ap.add_argument("--timeout", type=float, default=600.0, help="per backlog phase, seconds")
    ap.add_argument("--docs-dir", required=True, help="benchmarks.md and the plot go here")
    ap.add_argument("--template", default="docs/benchmarks.md")
    ap.add_argument("--workdir", required=True, help="logs and raw results")
    ap.add_argument("--relay-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable (an OUTBOX_ setting, or e.g. GLIBC_TUNABLES) for"
                         " every relay phase, on top of the phase's own (for A/B runs)")
    ap.add_argument("--perf", action="store_true",
                    help="profile each backlog drain with `perf record -a` (reports in --workdir;"
                         " perf's sampling slows the run, so do not quote its rates)")
    ap.add_argument("--command", default="scripts/bench.sh")
    ap.add_argument("--commit", default="unknown")
    add_geometry_args(ap)
    a = ap.parse_args()
    if a.repeat < 1:
        ap.error("--repeat takes a positive number")
    try:
        a.relay_env = dict(kv.split("=", 1) for kv in a.relay_env)
    except ValueError:
        ap.error("--relay-env takes NAME=VALUE")
    if a.step_seconds is None:
        a.step_seconds = 2.0 if a.quick else 10.0
    if a.link_events is None:
        a.link_events = 10_000 if a.quick else 100_000
    if a.ramp is None:
        a.ramp = ("10000,20000,40000" if a.quick else
                  "10000,15000,20000,25000,30000,40000,50000,60000,80000,100000")

    return a


def main() -> int:
    a = parse_args()
    env = Env(a)
    phases = set(a.phases.split(","))
    unknown = phases - set(BACKLOG) - {"steady"} - set(GEOMETRY)
    if unknown:
        raise SystemExit(f"unknown phases: {', '.join(sorted(unknown))}")
    m = report.machine(env.admin, env.redis, a.commit)
    a.nproc = m["nproc"]
    steady: list[dict] = []
    runners = [(key, fn) for key, fn in BACKLOG.items() if key in phases]
    # Rounds, not phase after phase: whatever drifts on the machine meanwhile touches every phase.
    runs: dict[str, list[dict]] = {}
    for i in range(a.repeat if runners else 0):
        if a.repeat > 1:
            log(f"round {i + 1} of {a.repeat}")
        for key, fn in runners:
            runs.setdefault(key, []).append(fn(env))
    backlog = [median_run(rs) for rs in runs.values()]
    if "stream" in runs and "recvlogical" in runs:
        # The same round's stream over its pg_recvlogical: the two ran a minute apart.
        eps = lambda r: r["events"] / r["drain_s"]  # noqa: E731
        paired = [eps(st) / eps(rl) for st, rl in zip(runs["stream"], runs["recvlogical"])]
        next(r for r in backlog if r["phase"] == "stream")["paired_ratios"] = paired
    if "steady" in phases:
        steady = phase_steady(env)
    geo = {}
    for key, fn in GEOMETRY.items():
        if key in phases:
            t0 = time.monotonic()
            geo[key] = fn(env)
            log(f"phase {key} took {time.monotonic() - t0:.0f} s")

    docs = Path(a.docs_dir)
    docs.mkdir(parents=True, exist_ok=True)
    sections = []
    if backlog or steady:
        sections.append(report.markdown(a, m, backlog, steady))
        report.plot(a, steady, docs / "bench-latency.png")
        report.write_doc(sections[-1], docs / "benchmarks.md", Path(a.template))
    if geo:
        sections.append(report_geo.markdown(a, m, geo))
        report.write_doc(sections[-1], docs / "benchmarks.md", Path(a.template),
                         report_geo.BEGIN, report_geo.END)
    raw = env.workdir / "results.json"
    raw.write_text(json.dumps({"quick": a.quick, "events": a.events, "machine": m,
                               "backlog": backlog, "runs": runs, "steady": steady, "geometry": geo},
                              indent=1, default=str))
    print("\n\n".join(sections))
    log(f"wrote {docs / 'benchmarks.md'}; raw results {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
