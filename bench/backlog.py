"""The backlog phases of bench/bench.py: a backlog committed before the consumer starts, then
the time until the last event is in Valkey (or, for pg_recvlogical, until its end position)."""

from __future__ import annotations

import math
import subprocess
import time

from harness import (Env, Perf, Relay, create_slot, current_lsn, insert_backlog, log, proc_cpu_seconds,
                     proc_hwm_mib, still_running, wait_pending, wait_rusage)
from link import lateness


def recvlogical_backlog(env: Env, name: str, events: int, payload_bytes: int | None = None,
                        links=None) -> dict:
    """pg_recvlogical draining a backlog of `events` rows to /dev/null, over `links`
    (bench/link.py) when given."""
    a = env.a
    url = env.fresh_db(name)
    create_slot(url, name)
    insert_backlog(url, events, a.per_txn, payload_bytes)
    endpos = current_lsn(url)
    argv = [a.pg_recvlogical, "-d", links.pg_url(url) if links else url, "--slot", name,
            "--start", "-o", "proto_version=1", "-o", "publication_names=outbox_relay",
            "-f", "/dev/null", "--endpos", endpos, "--no-loop"]
    perf = Perf(env, name)
    proxies = links.snapshot() if links else {}
    sampler = env.cpu_sampler()
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         preexec_fn=env.consumer_preexec())
    rc, cpu, rss = wait_rusage(p)
    wall = time.monotonic() - t0
    servers = sampler.stop()
    perf.stop()
    err = p.stderr.read().decode(errors="replace")
    if rc != 0:
        raise RuntimeError(f"pg_recvlogical failed ({rc}): {err}")
    env.drop_db(name)
    return {"phase": "pg_recvlogical", "events": events, "drain_s": wall, "total_s": wall,
            "cpu_s": cpu, "rss_mib": rss, "servers": servers,
            "link": lateness(proxies, links.snapshot()) if links else {}}


def phase_recvlogical(env: Env) -> dict:
    log("phase pg_recvlogical")
    return recvlogical_backlog(env, "bench_recvlogical", env.a.events)


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
            "batches": metrics.get("outbox_batch_duration_seconds_count", math.nan),
            # Seconds of Valkey writes under way, summed: over the drain, the mean writes in
            # flight (Little's law; the relay has no gauge of its own).
            "write_s": metrics.get("outbox_batch_duration_seconds_sum", math.nan)}


def stream_backlog(env: Env, name: str, events: int, payload_bytes: int | None = None,
                   links=None) -> dict:
    """The relay's stream draining a backlog of `events` rows into Valkey, reaching Postgres and
    Valkey over `links` (bench/link.py) when given."""
    url = env.fresh_db(name)
    create_slot(url, name)
    insert_backlog(url, events, env.a.per_txn, payload_bytes)
    settings = dict(OUTBOX_SLOT=name, OUTBOX_RECOVERY="false", OUTBOX_ON_SLOT_LOST="stop")
    relay_url = url
    if links:
        relay_url = links.pg_url(url)
        settings["OUTBOX_VALKEY_URL"] = links.redis_url(env.a.redis_url)
    proxies = links.snapshot() if links else {}
    r = run_relay_backlog(env, name, relay_url, "replication stream started", events, **settings)
    env.drop_db(name)
    return dict(r, phase="stream", link=lateness(proxies, links.snapshot()) if links else {})


def phase_stream(env: Env) -> dict:
    log("phase stream")
    return stream_backlog(env, "bench_stream", env.a.events)


def phase_huge(env: Env) -> dict:
    """One transaction of --huge-rows rows, streamed: the relay must not hold it in memory."""
    n = env.a.huge_rows
    log(f"phase huge: one transaction of {n:,} rows")
    url = env.fresh_db("bench_huge")
    create_slot(url, "bench_huge")
    insert_backlog(url, n, n)
    r = run_relay_backlog(env, "huge", url, "replication stream started", events=n,
                          OUTBOX_SLOT="bench_huge", OUTBOX_RECOVERY="false",
                          OUTBOX_ON_SLOT_LOST="stop")
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
