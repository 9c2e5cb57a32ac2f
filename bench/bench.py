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

Backlogs are inserted in transactions of --per-txn rows (100) with a ~220-byte jsonb payload and a
traceparent in the metadata. Python only orchestrates: nothing it does sits on a measured path.
The result is one markdown section, printed and written between `<!-- bench:begin -->` and
`<!-- bench:end -->` of DOCS_DIR/benchmarks.md, plus DOCS_DIR/bench-latency.png.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import report
from harness import (Env, Perf, Relay, create_slot, current_lsn, insert_backlog, log, proc_cpu_seconds,
                     proc_hwm_mib, still_running, wait_pending, wait_rusage)
from steady import phase_steady


# ---- backlog phases ---------------------------------------------------------------------------


def phase_recvlogical(env: Env) -> dict:
    a = env.a
    log("phase pg_recvlogical")
    url = env.fresh_db("bench_recvlogical")
    create_slot(url, "bench_recvlogical")
    insert_backlog(url, a.events, a.per_txn)
    endpos = current_lsn(url)
    argv = [a.pg_recvlogical, "-d", url, "--slot", "bench_recvlogical", "--start",
            "-o", "proto_version=1", "-o", "publication_names=outbox_relay",
            "-f", "/dev/null", "--endpos", endpos, "--no-loop"]
    perf = Perf(env, "pg_recvlogical")
    sampler = env.cpu_sampler()
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    rc, cpu, rss = wait_rusage(p)
    wall = time.monotonic() - t0
    servers = sampler.stop()
    perf.stop()
    err = p.stderr.read().decode(errors="replace")
    if rc != 0:
        raise RuntimeError(f"pg_recvlogical failed ({rc}): {err}")
    env.drop_db("bench_recvlogical")
    return {"phase": "pg_recvlogical", "events": a.events, "drain_s": wall, "total_s": wall,
            "cpu_s": cpu, "rss_mib": rss, "servers": servers}


def run_relay_backlog(env: Env, name: str, url: str, ready: str, events: int | None = None,
                      **settings: str) -> dict:
    a = env.a
    events = events or a.events
    env.flush_redis()
    perf = Perf(env, name)
    sampler = env.cpu_sampler()
    relay = Relay(env, name, env.relay_env(url, **settings), ready)
    try:
        t_done = wait_pending(env, events, a.timeout, relay.alive)
        servers = sampler.stop()
        perf.stop()
        cpu_end = proc_cpu_seconds(relay.p.pid)
        hwm = proc_hwm_mib(relay.p.pid)
        metrics = relay.metrics()
    finally:
        relay.stop()
    if math.isnan(relay.t_ready):
        raise RuntimeError(f"{name}: never saw {ready!r} in {relay.log_path}")
    return {"events": events, "drain_s": t_done - relay.t_ready,
            "total_s": t_done - relay.t_spawn, "startup_s": relay.t_ready - relay.t_spawn,
            "cpu_s": cpu_end - relay.cpu_ready, "cpu_startup_s": relay.cpu_ready,
            "rss_mib": hwm, "servers": servers,
            # Stream: Valkey writes; poll mode: poll rounds.
            "batches": metrics.get("outbox_batch_duration_seconds_count", math.nan)}


def phase_stream(env: Env) -> dict:
    log("phase stream")
    url = env.fresh_db("bench_stream")
    create_slot(url, "bench_stream")
    insert_backlog(url, env.a.events, env.a.per_txn)
    r = run_relay_backlog(env, "stream", url, "replication stream started",
                          OUTBOX_SLOT="bench_stream", OUTBOX_RECOVERY="false", OUTBOX_ON_SLOT_LOST="stop")
    env.drop_db("bench_stream")
    return dict(r, phase="stream")


def phase_huge(env: Env) -> dict:
    """One transaction of --huge-rows rows, streamed: the relay must not hold it in memory."""
    n = env.a.huge_rows
    log(f"phase huge: one transaction of {n:,} rows")
    url = env.fresh_db("bench_huge")
    create_slot(url, "bench_huge")
    insert_backlog(url, n, n)
    r = run_relay_backlog(env, "huge", url, "replication stream started", events=n,
                          OUTBOX_SLOT="bench_huge", OUTBOX_RECOVERY="false", OUTBOX_ON_SLOT_LOST="stop")
    env.drop_db("bench_huge")
    return dict(r, phase="huge")


def phase_poller(env: Env, pollers: int) -> dict:
    log(f"phase poller x{pollers}")
    name = f"bench_poll{pollers}"
    url = env.fresh_db(name)
    insert_backlog(url, env.a.events, env.a.per_txn)
    r = run_relay_backlog(env, f"poll{pollers}", url, "running in poll mode", OUTBOX_MODE="poll",
                          OUTBOX_BATCH_SIZE="500", OUTBOX_POLLERS=str(pollers))
    env.drop_db(name)
    return dict(r, phase=f"poller{pollers}")


def phase_naive(env: Env) -> dict:
    a = env.a
    log("phase naive")
    url = env.fresh_db("bench_naive")
    insert_backlog(url, a.events, a.per_txn)
    env.flush_redis()
    sampler = env.cpu_sampler()
    t0 = time.monotonic()
    p = subprocess.Popen([a.naive, "--database-url", url, "--redis-url", a.redis_url,
                          "--batch", "100"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = [math.nan]

    def alive() -> bool:
        try:
            peak[0] = proc_hwm_mib(p.pid)
        except (OSError, ValueError):
            pass
        return still_running(p.pid)

    try:
        t_done = wait_pending(env, a.events, a.timeout, alive)
        servers = sampler.stop()
    except BaseException:
        p.kill()
        raise
    rc, cpu, rss = wait_rusage(p)
    if rc != 0:
        raise RuntimeError(f"naive_relay failed ({rc}): {p.stderr.read().decode(errors='replace')}")
    env.drop_db("bench_naive")
    return {"phase": "naive", "events": a.events, "drain_s": t_done - t0, "total_s": t_done - t0,
            "cpu_s": cpu, "rss_mib": max((v for v in (peak[0], rss) if not math.isnan(v)),
                                         default=math.nan), "servers": servers}


def median_run(rs: list[dict]) -> dict:
    """The run with the median rate (the lower middle one of an even count), with every run's
    events/s beside it."""
    ranked = sorted(rs, key=lambda r: r["events"] / r["drain_s"])
    return dict(ranked[(len(ranked) - 1) // 2], runs_eps=[r["events"] / r["drain_s"] for r in rs])


# ---- main -------------------------------------------------------------------------------------


def main() -> int:
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
                    help="comma-separated; `huge` (not in the default) streams one transaction"
                         " of --huge-rows rows")
    ap.add_argument("--huge-rows", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the backlog phases this many times, in rounds, and report each"
                         " phase's median run with the range")
    ap.add_argument("--timeout", type=float, default=600.0, help="per backlog phase, seconds")
    ap.add_argument("--docs-dir", required=True, help="benchmarks.md and the plot go here")
    ap.add_argument("--template", default="docs/benchmarks.md")
    ap.add_argument("--workdir", required=True, help="logs and raw results")
    ap.add_argument("--relay-env", action="append", default=[], metavar="OUTBOX_X=VALUE",
                    help="a setting for every relay phase, on top of the phase's own (for A/B runs)")
    ap.add_argument("--perf", action="store_true",
                    help="profile each backlog drain with `perf record -a` (reports in --workdir;"
                         " perf's sampling slows the run, so do not quote its rates)")
    ap.add_argument("--command", default="scripts/bench.sh")
    ap.add_argument("--commit", default="unknown")
    a = ap.parse_args()
    if a.repeat < 1:
        ap.error("--repeat takes a positive number")
    try:
        a.relay_env = dict(kv.split("=", 1) for kv in a.relay_env)
    except ValueError:
        ap.error("--relay-env takes OUTBOX_X=VALUE")
    if a.step_seconds is None:
        a.step_seconds = 2.0 if a.quick else 10.0
    if a.ramp is None:
        a.ramp = ("10000,20000,40000" if a.quick else
                  "10000,15000,20000,25000,30000,40000,50000,60000,80000,100000")

    env = Env(a)
    phases = set(a.phases.split(","))
    m = report.machine(env.admin, env.redis, a.commit)
    steady: list[dict] = []
    runners = [(key, fn) for key, fn in [
        ("recvlogical", lambda: phase_recvlogical(env)),
        ("stream", lambda: phase_stream(env)),
        ("poller1", lambda: phase_poller(env, 1)),
        ("poller4", lambda: phase_poller(env, 4)),
        ("naive", lambda: phase_naive(env)),
        ("huge", lambda: phase_huge(env)),
    ] if key in phases]
    # Rounds, not phase after phase: whatever drifts on the machine meanwhile touches every phase.
    runs: dict[str, list[dict]] = {}
    for i in range(a.repeat):
        if a.repeat > 1:
            log(f"round {i + 1} of {a.repeat}")
        for key, fn in runners:
            runs.setdefault(key, []).append(fn())
    backlog = [median_run(rs) for rs in runs.values()]
    if "stream" in runs and "recvlogical" in runs:
        # The same round's stream over its pg_recvlogical: the two ran a minute apart.
        eps = lambda r: r["events"] / r["drain_s"]  # noqa: E731
        paired = [eps(st) / eps(rl) for st, rl in zip(runs["stream"], runs["recvlogical"])]
        next(r for r in backlog if r["phase"] == "stream")["paired_ratios"] = paired
    if "steady" in phases:
        steady = phase_steady(env)

    section = report.markdown(a, m, backlog, steady)
    docs = Path(a.docs_dir)
    docs.mkdir(parents=True, exist_ok=True)
    report.plot(a, steady, docs / "bench-latency.png")
    report.write_doc(section, docs / "benchmarks.md", Path(a.template))
    raw = env.workdir / "results.json"
    raw.write_text(json.dumps({"quick": a.quick, "events": a.events, "machine": m,
                               "backlog": backlog, "runs": runs, "steady": steady}, indent=1))
    print(section)
    log(f"wrote {docs / 'benchmarks.md'}, {docs / 'bench-latency.png'}; raw results {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
