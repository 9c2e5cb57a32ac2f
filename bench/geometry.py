"""The production-geometry phases of bench/bench.py (issue 16): the relay with a delay of D ms
each way to Postgres and to Valkey (examples/latency_proxy), pg_recvlogical over the same path to
Postgres; then payloads of several sizes, on the usual server and on one with fsync on.

- `link`: per D, a backlog drained by pg_recvlogical and by the stream (in rounds, as the
  loopback phases), then the stream under steady load at fixed rates.
- `payload` / `fsync`: per payload size and D, pg_recvlogical and the stream on the same kind of
  backlog (events/s and payload MB/s); `fsync` runs on the second server (fsync=on,
  synchronous_commit=on, full_page_writes=on) and adds steady load at --fsync-rates.
"""

from __future__ import annotations

import argparse
import math
import statistics

import psycopg

from backlog import median_run, recvlogical_backlog, stream_backlog
from harness import SIZED_INSERT, Env, log
from link import SIDES, Links, label, parse_delays
from steady import run_steady


def add_geometry_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("production geometry (phases calibrate, link, payload, fsync, ceiling)")
    g.add_argument("--latency-proxy", help="the latency_proxy example binary")
    g.add_argument("--latency-queue", help="the latency_queue example binary")
    g.add_argument("--link-via", default="proxy", choices=("proxy", "queue"),
                   help="how a link delays: proxy (examples/latency_proxy, a second TCP "
                        "connection through a process) or queue (examples/latency_queue: the "
                        "same connection, packets held in a netfilter queue; needs root)")
    g.add_argument("--pg-fsync-url", help="a second Postgres with fsync on (the fsync phase)")
    g.add_argument("--link-delays", default="direct,0,0.5,1,2",
                   help="ms each way; `direct` is no proxy at all, 0 the proxy without delay")
    g.add_argument("--link-events", type=int, help="events per link backlog (100000; quick 10000)")
    g.add_argument("--link-rates", default="1000,5000,10000", help="steady rates over each link (empty: drains only)")
    g.add_argument("--link-sides", default="both", choices=SIDES,
                   help="which links of the link phase get the delay: both (the production "
                        "geometry), valkey (Postgres direct for the relay and pg_recvlogical: "
                        "does the relay's pipeline hide the Valkey round trip?) or postgres")
    g.add_argument("--link-cpu-split", action="store_true",
                   help="run the link phase's drains with the CPUs split as --ceiling-cpu-split "
                        "does (the links' processes on the consumer's side): Valkey and the "
                        "relay then take no CPU from the walsender, as when they have hosts of "
                        "their own")
    g.add_argument("--calibrate-round-trips", type=int, default=1000,
                   help="PINGs and SELECT 1s per link in the calibrate phase")
    g.add_argument("--payload-sizes", default="200,2048,16384", help="payload bytes")
    g.add_argument("--payload-mib", type=int, default=64,
                   help="payload MiB per backlog at most (fewer events for large payloads)")
    g.add_argument("--payload-delays", default="1", help="links of the payload phase")
    g.add_argument("--fsync-delays", default="1", help="links of the fsync phase")
    g.add_argument("--fsync-rates", default="5000", help="steady rates of the fsync phase")
    g.add_argument("--ceiling-rates",
                   default="5000,7500,10000,12500,15000,17500,20000,25000,30000,35000,40000",
                   help="the ceiling search's rates, each tried until one is not held")
    g.add_argument("--ceiling-cpu-split", action="store_true",
                   help="run the ceiling phase with Postgres, load_gen and the harness on the "
                        "first half of the CPUs and Valkey and the consumer (pg_recvlogical or "
                        "the relay) on the other half, as when the sink and the relay have hosts "
                        "of their own")


def eps(r: dict) -> float:
    return r["events"] / r["drain_s"]


def pair(rl: list[dict], st: list[dict]) -> dict:
    """Medians of a consumer pair run in rounds: each one's median run, and the median of the
    per-round ratios stream / pg_recvlogical (drain only, and the stream with its start-up)."""
    ratios = [eps(s) / eps(r) for r, s in zip(rl, st)]
    with_startup = [s["events"] / s["total_s"] / eps(r) for r, s in zip(rl, st)]
    return {"recvlogical": median_run(rl), "stream": median_run(st), "ratios": ratios,
            "ratio": statistics.median(ratios),
            "ratio_with_startup": statistics.median(with_startup),
            "ratios_with_startup": with_startup}


def drains_over_links(env: Env, delays: list[float | None],
                      runs: dict[str, dict[str, list[dict]]]) -> None:
    """The link phase's drains: each round, pg_recvlogical then the relay over each link."""
    a = env.a
    for i in range(a.repeat):
        for d in delays:
            log(f"  round {i + 1}, link {label(d)}")
            links = Links(env, d, tag=f"-link{i}", sides=a.link_sides)
            try:
                rl = recvlogical_backlog(env, "bench_link_rl", a.link_events, links=links)
                st = stream_backlog(env, "bench_link_st", a.link_events, links=links)
            finally:
                links.stop()
            log(f"    pg_recvlogical {eps(rl):,.0f}/s, stream {eps(st):,.0f}/s "
                f"({eps(st) / eps(rl):.2f})")
            slot = runs.setdefault(label(d), {"rl": [], "st": []})
            slot["rl"].append(rl)
            slot["st"].append(st)


def phase_link(env: Env) -> dict:
    a = env.a
    delays = parse_delays(a.link_delays)
    log(f"phase link: D = {', '.join(label(d) for d in delays)}; {a.repeat} rounds")
    runs: dict[str, dict[str, list[dict]]] = {}
    split = None
    try:
        if a.link_cpu_split:
            env.split_cpus()
            split = [sorted(side) for side in env.split]
        drains_over_links(env, delays, runs)
    finally:
        env.unsplit_cpus()
    backlog = [dict(pair(v["rl"], v["st"]), delay=d)
               for d, v in zip(delays, (runs[label(d)] for d in delays))]
    rates = [int(x) for x in a.link_rates.split(",") if x]
    steady = []
    for d in delays if rates else []:
        log(f"  steady load over link {label(d)}: {a.link_rates} /s, {a.repeat} times each")
        links = Links(env, d, tag="-steady", sides=a.link_sides)
        try:
            steps = run_steady(env, "bench_link_steady", rates * a.repeat, [], links)
        finally:
            links.stop()
        steady.append({"delay": d, "steps": steps})
    return {"backlog": backlog, "steady": steady, "events": a.link_events,
            "sides": a.link_sides, "cpu_split": split}


def payload_events(a: argparse.Namespace, size: int) -> int:
    """Events of a payload backlog: --link-events, or fewer so that the payloads stay under
    --payload-mib."""
    return max(a.per_txn, min(a.link_events, a.payload_mib * 2**20 // size))


def phase_payloads(env: Env, fsync: bool) -> dict:
    a = env.a
    name = "fsync" if fsync else "payload"
    sizes = [int(x) for x in a.payload_sizes.split(",") if x]
    delays = parse_delays(a.fsync_delays if fsync else a.payload_delays)
    log(f"phase {name}: payloads {a.payload_sizes} B, D = {', '.join(label(d) for d in delays)}")
    runs: dict[tuple[str, int], dict[str, list[dict]]] = {}
    for i in range(a.repeat):
        for d in delays:
            links = Links(env, d, tag=f"-{name}{i}")
            try:
                for size in sizes:
                    n = payload_events(a, size)
                    log(f"  round {i + 1}, link {label(d)}, {size:,} B payloads, {n:,} events")
                    rl = recvlogical_backlog(env, f"bench_{name}_rl", n, size, links)
                    st = stream_backlog(env, f"bench_{name}_st", n, size, links)
                    slot = runs.setdefault((label(d), size), {"rl": [], "st": []})
                    slot["rl"].append(rl)
                    slot["st"].append(st)
            finally:
                links.stop()
    rows = []
    for d in delays:
        for size in sizes:
            v = runs[(label(d), size)]
            rows.append(dict(pair(v["rl"], v["st"]), delay=d, size=size,
                             payload_bytes=actual_payload_bytes(env, size)))
    steady = []
    if fsync and a.fsync_rates:
        rates = [int(x) for x in a.fsync_rates.split(",") if x]
        for d in delays:
            log(f"  steady load with fsync on, link {label(d)}: {a.fsync_rates} /s")
            links = Links(env, d, tag="-fsync-steady")
            try:
                steps = run_steady(env, "bench_fsync_steady", rates * a.repeat, [], links)
            finally:
                links.stop()
            steady.append({"delay": d, "steps": steps})
    return {"rows": rows, "steady": steady, "settings": pg_settings(env)}


def actual_payload_bytes(env: Env, size: int) -> float:
    """The mean length of the payload text that a backlog of `size`-byte payloads holds (one
    transaction of rows inserted and rolled back)."""
    url = env.fresh_db("bench_payload_size")
    try:
        with psycopg.connect(url) as c:
            blob = max(0, size - 42)
            c.execute(SIZED_INSERT, {"lo": 1, "hi": 20, "blob": blob, "chunks": blob // 32})
            n = c.execute("SELECT avg(octet_length(payload::text)) FROM outbox_events").fetchone()[0]
            c.rollback()
        return float(n)
    finally:
        env.drop_db("bench_payload_size")


def pg_settings(env: Env) -> dict:
    with env.admin() as c:
        return dict(c.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN "
            "('fsync', 'synchronous_commit', 'full_page_writes', 'wal_sync_method')").fetchall())


def median_steps(steps: list[dict]) -> list[dict]:
    """Steps of the same target rate grouped: the median of each figure, and every run's p99."""
    by: dict[int, list[dict]] = {}
    for st in steps:
        by.setdefault(st["target"], []).append(st)
    out = []
    for target, group in by.items():
        med = {k: statistics.median(st[k] for st in group)
               for k in ("achieved", "p50_ms", "p99_ms", "max_ms", "relay_cpu_us_per_event",
                         "tasks_per_write", "writes_in_flight")
               if all(not math.isnan(st[k]) for st in group)}
        out.append(dict(med, target=target, runs=len(group),
                        p99_runs=[st["p99_ms"] for st in group],
                        kept_up=all(st["kept_up"] for st in group)))
    return out
