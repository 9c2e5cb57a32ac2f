"""The steady-load phase of bench/bench.py: the stream under single-row transactions at fixed
rates (examples/load_gen), then at rising rates until it no longer keeps up. Latency per event is
the task hash's `pending_since` (the relay's clock when it wrote the task) minus the row's commit
timestamp (`pg_xact_commit_timestamp` of the xid load_gen recorded), on the same machine clock.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import time
from pathlib import Path

import psycopg

from harness import Env, Relay, current_lsn, log, proc_cpu_seconds, wait_pending, wait_sent


def steady_rates(a: argparse.Namespace) -> tuple[list[int], list[int]]:
    fixed = [int(x) for x in a.rates.split(",") if x]
    ramp = [int(x) for x in a.ramp.split(",") if x]
    return fixed, ramp


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return math.nan
    k = max(0, min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[k]


def latencies(env: Env, url: str, rows_file: Path,
              add_ms: float = 0.0) -> tuple[list[tuple[int, float]], int]:
    """(commit time in unix µs, commit-to-enqueued latency in ms) of the rows in rows_file, in
    commit order, and how many of them never reached Valkey. add_ms is added to each latency:
    over a link, the one-way delay between the relay's stamp and the task landing in Valkey."""
    ids, xids = [], []
    with open(rows_file) as f:
        for line in f:
            event_id, xid = line.rstrip("\n").split("\t")
            ids.append(event_id)
            xids.append(xid)
    commit_us: dict[str, int] = {}
    with psycopg.connect(url, autocommit=True) as c:
        for i in range(0, len(xids), 50_000):
            chunk = list(set(xids[i:i + 50_000]))
            for x, us in c.execute(
                "SELECT x, (extract(epoch FROM pg_xact_commit_timestamp(x::xid)) * 1000000)::bigint "
                "FROM unnest(%s::text[]) AS x", (chunk,)
            ):
                commit_us[x] = us
    out, missing = [], 0
    for i in range(0, len(ids), 10_000):
        pipe = env.redis.pipeline(transaction=False)
        for event_id in ids[i:i + 10_000]:
            pipe.hget(f"asynq:{{default}}:t:{event_id}", "pending_since")
        for xid, since in zip(xids[i:i + 10_000], pipe.execute()):
            us = commit_us.get(xid)
            if since is None or us is None:
                missing += 1
                continue
            out.append((us, (int(since) / 1000 - us) / 1000 + add_ms))
    out.sort()
    return out, missing


def median(values: list[float]) -> float:
    return percentile(sorted(values), 0.5)


def settle(url: str, relay: Relay, delivered: int, slot: str, timeout: float = 60.0) -> float:
    """Waits until the relay stopped marking rows published and the walsender has sent the WAL
    of those updates, so a load step does not start with the previous one's debt. Returns the
    rows the relay marked so far."""
    deadline = time.monotonic() + timeout
    marked, since = -1.0, time.monotonic()
    while time.monotonic() < deadline:
        m = relay.metrics()
        now_marked = (m.get("outbox_rows_marked_total", 0)
                      + m.get("outbox_rows_mark_dropped_total", 0))
        if now_marked != marked:
            marked, since = now_marked, time.monotonic()
        if marked >= delivered or time.monotonic() - since > 0.5:
            break
        time.sleep(0.05)
    target = current_lsn(url)
    took, sent = wait_sent(url, slot, target, max(0.0, deadline - time.monotonic()), 0.05)
    if not math.isnan(took):
        return marked
    log(f"  the walsender sent up to {sent}, not {target}, before the next step")
    return marked


def unpublished(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as c:
        return c.execute(
            "SELECT count(*) FROM outbox_events WHERE published_at IS NULL").fetchone()[0]


def load(env: Env, url: str, rate: int, seconds: float, rows_file: Path) -> dict:
    """Runs examples/load_gen; its JSON line plus its own CPU seconds (wait4)."""
    conns = max(2, min(32, math.ceil(rate / 1250)))
    log(f"  steady {rate:,}/s for {seconds:g} s ({conns} connections)")
    p = subprocess.Popen([env.a.load_gen, "--database-url", url, "--rate", str(rate),
                          "--seconds", str(seconds), "--connections", str(conns),
                          "--out", str(rows_file)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    # Blocking, so this process does not poll while the load runs (its output is one line).
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = rc = os.waitstatus_to_exitcode(status)
    cpu = ru.ru_utime + ru.ru_stime
    out, err = p.communicate()
    if rc != 0:
        raise RuntimeError(f"load_gen failed ({rc}): {err}")
    return dict(json.loads(out.strip().splitlines()[-1]), cpu_s=cpu, connections=conns)


def steady_step(env: Env, url: str, relay: Relay, rate: int, add_ms: float = 0.0) -> dict:
    a = env.a
    rows_file = env.workdir / f"load-{rate}.tsv"
    env.flush_redis()
    cpu0 = proc_cpu_seconds(relay.p.pid)
    m0 = relay.metrics()
    sampler = env.cpu_sampler()
    g = load(env, url, rate, a.step_seconds, rows_file)
    conns = g["connections"]
    inserted = int(g["inserted"])
    t_end = time.monotonic()
    backlog_at_end = inserted - env.pending()
    try:
        drained_after = wait_pending(env, inserted, max(30.0, 3 * a.step_seconds),
                                     relay.alive) - t_end
    except RuntimeError as e:
        log(f"  not drained: {e}")
        drained_after = math.nan
    servers = sampler.stop()
    cpu = proc_cpu_seconds(relay.p.pid) - cpu0
    m1 = relay.metrics()
    writes = (m1.get("outbox_batch_duration_seconds_count", math.nan)
              - m0.get("outbox_batch_duration_seconds_count", math.nan))
    write_s = (m1.get("outbox_batch_duration_seconds_sum", math.nan)
               - m0.get("outbox_batch_duration_seconds_sum", math.nan))
    timed, missing = latencies(env, url, rows_file, add_ms)
    rows_file.unlink()
    lat = sorted(ms for _, ms in timed)
    p99 = percentile(lat, 0.99)
    # A relay that falls behind builds a backlog: latency climbs through the step. Drift is how
    # much the median of the last fifth of the events exceeds that of the first fifth.
    fifth = max(1, len(timed) // 5)
    drift = (median([ms for _, ms in timed[-fifth:]]) - median([ms for _, ms in timed[:fifth]])
             if timed else math.nan)
    kept_up = (g["achieved_rate"] >= 0.95 * rate and missing == 0
               and not math.isnan(drained_after) and p99 <= a.max_p99_ms
               and drift <= a.max_drift_ms)
    step = {"target": rate, "achieved": g["achieved_rate"], "events": inserted,
            "connections": conns, "missing": missing, "backlog_at_end": backlog_at_end,
            "drained_after_s": drained_after, "p50_ms": percentile(lat, 0.50), "p99_ms": p99,
            "max_ms": lat[-1] if lat else math.nan, "drift_ms": drift, "kept_up": kept_up,
            "relay_cpu_us_per_event": cpu / max(inserted, 1) * 1e6, "relay_cpu_s": cpu,
            "load_gen_cpu_s": g["cpu_s"], "servers": servers,
            "tasks_per_write": inserted / writes if writes else math.nan,
            # Little's law over the sampled span (the step and its drain).
            "writes_in_flight": write_s / servers["span_s"] if servers["span_s"] else math.nan}
    # A CDF for the plot: 500 quantiles are plenty.
    step["cdf_ms"] = [percentile(lat, (i + 1) / 500) for i in range(500)] if lat else []
    log(f"    achieved {g['achieved_rate']:,.0f}/s, p50 {step['p50_ms']:.1f} ms, "
        f"p99 {p99:.1f} ms, max {step['max_ms']:.1f} ms, drift {drift:.1f} ms, "
        f"relay CPU {step['relay_cpu_us_per_event']:.1f} µs/event, "
        f"{step['tasks_per_write']:.1f} tasks/write, kept up: {kept_up}")
    return step


def phase_steady(env: Env) -> list[dict]:
    log("phase steady load")
    fixed, ramp = steady_rates(env.a)
    return run_steady(env, "bench_steady", fixed, ramp)


def run_steady(env: Env, name: str, fixed: list[int], ramp: list[int], links=None) -> list[dict]:
    """The stream under load_gen at each fixed rate, then at each ramp rate until one is not kept
    up. With `links` (bench/link.py), the relay reaches Postgres and Valkey through them; the
    load generator and the measurements stay direct."""
    url = env.fresh_db(name)
    # The backlog phases before leave gigabytes of WAL and dirty buffers behind: checkpoint them
    # now, or the checkpointer writes them out during the first load steps.
    with env.admin() as c:
        c.execute("CHECKPOINT")
    settings = dict(OUTBOX_SLOT=name, OUTBOX_RECOVERY="false", OUTBOX_ON_SLOT_LOST="stop")
    relay_url, add_ms = url, 0.0
    if links is not None:
        relay_url, add_ms = links.pg_url(url), links.add_ms()
        settings["OUTBOX_VALKEY_URL"] = links.redis_url(env.a.redis_url)
    relay = Relay(env, name, env.relay_env(relay_url, **settings), "replication stream started")
    steps: list[dict] = []

    def step(rate: int) -> dict:
        st = steady_step(env, url, relay, rate, add_ms)
        steps.append(st)
        st["marked_so_far"] = settle(url, relay, sum(x["events"] for x in steps), name)
        # Rows in Valkey whose published_at the relay never set (the recovery poller, off
        # here, would re-send them).
        st["unpublished_after"] = unpublished(url)
        if st["unpublished_after"]:
            log(f"    delivered but still unpublished in the table: {st['unpublished_after']:,} rows")
        return st

    try:
        relay.wait_ready(60)
        for rate in fixed:
            step(rate)
        if not all(st["kept_up"] for st in steps):
            log("  a fixed rate was not kept up: no ramp")
            ramp = []
        for rate in ramp:
            st = step(rate)
            st["ramp"] = True
            if not st["kept_up"]:
                break
    finally:
        relay.stop()
    env.drop_db(name)
    return steps
