"""The report of the production-geometry phases (bench/geometry.py, bench/ceiling.py,
bench/link.py's calibration): one markdown section, written between
`<!-- bench-geometry:begin -->` and `<!-- bench-geometry:end -->` of benchmarks.md.
"""

from __future__ import annotations

import argparse

from ceiling import cores
from geometry import eps, median_steps
from link import VIAS
from report import _header, _nan, _num, _rate, cpu_cell, cpu_split

BEGIN, END = "<!-- bench-geometry:begin -->", "<!-- bench-geometry:end -->"


def _d(delay) -> str:
    return "direct (no proxy)" if delay is None else f"{delay:g} ms"


def _via(a: argparse.Namespace) -> str:
    return VIAS[getattr(a, "link_via", "proxy")]


def _calibrate(a: argparse.Namespace, rows: list[dict]) -> list[str]:
    lines = [
        "**The links**: round trips from the benchmark's Python process, one at a time, direct"
        f" and through {_via(a)} with a delay of D each way; the proxy's lateness is"
        " how long after its due time each chunk (with the queue: each packet) was let go (from"
        " the link's own counters, both directions of both links, quarter-power-of-two buckets:"
        " upper bounds). Below, \"proxy\" means whichever link ran.", "",
        "| D each way | Valkey PING p50 ms | p99 ms | Postgres SELECT 1 p50 ms | p99 ms "
        "| proxy lateness p50 µs | p99 µs | chunks |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {_d(r['delay'])} | {_num(r['valkey_p50_ms'], 3)} | {_num(r['valkey_p99_ms'], 3)} "
            f"| {_num(r['pg_p50_ms'], 3)} | {_num(r['pg_p99_ms'], 3)} "
            f"| {_num(r.get('late_p50_us'), 1)} | {_num(r.get('late_p99_us'), 1)} "
            f"| {r.get('late_chunks', '—')} |")
    return lines + [""]


def _pair_cells(p: dict) -> str:
    rl, st = p["recvlogical"], p["stream"]
    writes = st.get("batches")
    tpw = st["events"] / writes if writes and not _nan(writes) else float("nan")
    inflight = st.get("write_s", float("nan")) / st["drain_s"]
    cpu = st["cpu_s"] / st["events"] * 1e6
    return (f"{_rate(eps(rl))} | {_rate(eps(st))} | **{p['ratio']:.2f}** "
            f"| {p['ratio_with_startup']:.2f} | {', '.join(f'{x:.2f}' for x in p['ratios'])} "
            f"| {_num(cpu, 1)} | {_num(tpw, 1)} | {_num(inflight, 2)} "
            f"| {_num(st['link'].get('p99_us'), 0)} | {_num(st['link'].get('proxy_cpu_s'), 2)}")


PAIR_HEAD = ("pg_recvlogical events/s | stream events/s | ratio (median) | ratio with start-up "
             "| ratio per round | relay CPU µs/event | tasks per Valkey write "
             "| Valkey writes in flight (mean) | proxy lateness p99 µs | proxies' CPU s |")


LINK_SIDES = {
    "both": "pg_recvlogical reaches Postgres through the same proxy as the relay, the relay"
            " reaches Valkey through a second one",
    "valkey": "only Valkey is behind the proxy (a control: the relay and pg_recvlogical reach"
              " Postgres directly, so the ratio shows whether the relay's pipeline hides the"
              " Valkey round trip)",
    "postgres": "only Postgres is behind the proxy, for the relay and pg_recvlogical alike"
                " (a control: the relay reaches Valkey directly)",
}


def _link(a: argparse.Namespace, link: dict) -> list[str]:
    sides = LINK_SIDES[link.get("sides", "both")]
    lines = [
        f"**Drain over a link**: {link['events']:,} events in {a.per_txn}-row transactions,"
        f" committed before the consumer starts; {sides}"
        + (f"; the CPUs split (Postgres and the harness on {link['cpu_split'][0]};"
           f" Valkey, the consumer and the links on {link['cpu_split'][1]})"
           if link.get("cpu_split") else "")
        + ". Medians of"
        f" {a.repeat} round(s); the ratio is stream / pg_recvlogical within each round; the"
        " proxy columns are the stream run's (lateness: how long after its due time a chunk"
        " left).", "",
        "| D each way | " + PAIR_HEAD,
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for p in link["backlog"]:
        lines.append(f"| {_d(p['delay'])} | {_pair_cells(p)} |")
    lines += [""] + _link_cpu(a, link["backlog"], link.get("cpu_split"))
    if not link["steady"]:
        return lines
    lines += ["**Latency over a link**: single-row transactions at fixed rates (each rate"
              f" {a.repeat} times, {a.step_seconds:g} s each, in one relay session); latency from"
              " the commit timestamp to the task in Valkey (`pending_since`, stamped by the relay"
              " as it sends the write, plus D for the write's way to Valkey). Medians of the runs;"
              " the p99 of every run beside them.", "",
              "| D each way | target/s | achieved/s | p50 ms | p99 ms | max ms | p99 of each run "
              "| relay CPU µs/event | tasks per write | writes in flight | kept up |",
              "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|:---:|"]
    for s in link["steady"]:
        for st in median_steps(s["steps"]):
            lines.append(_steady_row(_d(s["delay"]), st))
    return lines + [""]


def _link_cpu(a: argparse.Namespace, backlog: list[dict],
              split: list[list[int]] | None = None) -> list[str]:
    """Where the CPU went during the median drain of each consumer over each link: the profile
    that says what a drain over a link is bounded by."""
    lines = [
        "**Where the CPU went** during the median drain of each consumer over each link (its"
        " start to its last event): seconds on a CPU per process group, the walsender's seconds"
        " runnable but waiting for a CPU, and the share of the span. \"proxies\" is the"
        " links' processes' CPU (one on pg_recvlogical's path, one per delayed link on the"
        " relay's), a cost that a real link puts on the network and the other host. With the"
        " queue link it also holds the receivers' loopback and TCP work that the kernel does"
        " inside its verdicts (this kernel does not account interrupt time apart).", "",
        "| D each way | consumer | span s | walsender on CPU s | walsender waiting s "
        "| Valkey s | consumer s | proxies s | everything else s "
        "| machine busy (split: database / consumer side) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in backlog:
        for name, r in (("pg_recvlogical", p["recvlogical"]), ("stream", p["stream"])):
            if not r.get("servers"):
                continue
            px = r.get("link", {}).get("proxy_cpu_s", 0.0)
            c = cpu_split(r, px)
            pct = lambda x: cpu_cell(x, c["span"])  # noqa: E731
            # This table keeps the other Postgres processes in "everything else".
            lines.append(
                f"| {_d(p['delay'])} | {name} | {c['span']:.2f} | {pct(c['walsender'])} "
                f"| {pct(c['walsender_wait'])} | {pct(c['valkey'])} | {pct(c['consumer'])} "
                f"| {pct(px)} | {pct(c['rest'] + c['other_pg'])} "
                f"| {_busy(a, r, split)} |")
    return lines + [
        "",
        "As the loopback table's \"Where the CPU went\": /proc/PID/schedstat sampled every 25 ms;"
        " \"everything else\" includes the other Postgres processes.", "",
    ]


def _steady_row(first: str, st: dict) -> str:
    g = st.get
    return (f"| {first} | {st['target']:,} | {_rate(g('achieved'))} | {_num(g('p50_ms'), 1)} "
            f"| {_num(g('p99_ms'), 1)} | {_num(g('max_ms'), 1)} "
            f"| {', '.join(_num(x, 1) for x in st['p99_runs'])} "
            f"| {_num(g('relay_cpu_us_per_event'), 1)} | {_num(g('tasks_per_write'), 1)} "
            f"| {_num(g('writes_in_flight'), 2)} | {'yes' if st['kept_up'] else 'no'} |")


def _payloads(a: argparse.Namespace, res: dict, fsync: bool) -> list[str]:
    s = res["settings"]
    server = ", ".join(f"{k}={v}" for k, v in sorted(s.items()))
    lines = [
        f"**Payload sizes, {'fsync on' if fsync else 'the usual server'}** ({server}):"
        " backlogs of 100-row transactions whose payload is an incompressible hex blob; MB/s"
        f" counts payload bytes (at most {a.payload_mib} MiB of payloads per backlog). Medians of"
        f" {a.repeat} round(s); proxy columns are the stream run's.", "",
        "| D each way | payload B (measured) | events | pg_recvlogical MB/s | stream MB/s | "
        + PAIR_HEAD,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for p in res["rows"]:
        mb = lambda r: eps(r) * p["payload_bytes"] / 1e6  # noqa: E731
        lines.append(
            f"| {_d(p['delay'])} | {p['payload_bytes']:,.0f} | {p['stream']['events']:,} "
            f"| {_num(mb(p['recvlogical']), 1)} | {_num(mb(p['stream']), 1)} | {_pair_cells(p)} |")
    if res["steady"]:
        lines += ["", "Steady load on the same server (as in the link table):", "",
                  "| D each way | target/s | achieved/s | p50 ms | p99 ms | max ms "
                  "| p99 of each run | relay CPU µs/event | tasks per write | writes in flight "
                  "| kept up |",
                  "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|:---:|"]
        for s in res["steady"]:
            for st in median_steps(s["steps"]):
                lines.append(_steady_row(_d(s["delay"]), st))
    return lines + [""]


def _ceiling(a: argparse.Namespace, res: dict) -> list[str]:
    lines = [
        f"**The insert ceiling**: single-row transactions at rising rates, {a.step_seconds:g} s"
        " per step, until a rate is not held; first Postgres alone (no slot, no relay), then with"
        " pg_recvlogical streaming the slot to /dev/null (held: the load reached 95% of the"
        f" rate, the walsender sent the step's commits within {a.max_p99_ms:g} ms of its end,"
        " the bound on the relay's p99, and its send lag sampled during the load, a lower bound"
        " on any consumer's latency, kept to the relay's rules: p99 within"
        f" {a.max_p99_ms:g} ms, drift within {a.max_drift_ms:g} ms; what logical decoding"
        " itself leaves; its p99 column is the send lag's p99 and drift, and how long after"
        " the step's end the walsender had sent everything; its backends leave out the probe's),"
        " then with the relay streaming (kept up as in the steady"
        " phase; the \"consumer\" column is pg_recvlogical or the relay). CPU in cores (CPU seconds per"
        " second of the step and its drain) per process group; \"busiest\" is the busiest single"
        " Postgres or Valkey process (1.00 is a whole core).", "",
        "| run | target/s | achieved/s | p99 ms | held | load_gen | Postgres backends "
        "| walsender (waiting) | consumer | Valkey | other | machine busy | busiest |",
        "|---|---:|---:|---:|:---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    split = res.get("cpu_split")
    if split:
        db, consumer = (",".join(map(str, side)) for side in split)
        lines[0] += (
            f" **CPUs split** (`--ceiling-cpu-split`): Postgres, load_gen and the harness on CPU"
            f" {db}, Valkey and the consumer on CPU {consumer}, as when the sink and the relay have"
            " hosts of their own; \"machine busy\" is given per side (database / consumer).")
        shared = res.get("cpu_split_shared_cores")
        lines[0] += (f" CPU {','.join(map(str, shared))} of the consumer side shares a core with"
                     " the database side (hyperthreads), so the sides are not apart." if shared else
                     " No CPU of one side shares a core with the other (the guest's topology: a"
                     " virtual machine's host may still place them on one).")
    runs = (("Postgres alone", res["insert_only"]),
            ("with pg_recvlogical", res.get("recvlogical", [])),
            ("with the relay", res["stream"]))
    for run, steps in runs:
        for st in steps:
            c = cores(st)
            lines.append(
                f"| {run} | {st['target']:,} | {_rate(st['achieved'])} "
                f"| {_p99_or_catch_up(st)} | {'yes' if st['kept_up'] else 'no'} "
                f"| {c['load_gen']:.2f} | {c['backends']:.2f} "
                f"| {c['walsender']:.2f} ({c['walsender_wait']:.2f}) | {c['relay']:.2f} "
                f"| {c['valkey']:.2f} | {c['other']:.2f} | {_busy(a, st, split)} "
                f"| {st['servers'].get('top_server', '—')} {c['top']:.2f} |")
    return lines + [""]


def _busy(a: argparse.Namespace, st: dict, split: list[list[int]] | None) -> str:
    """The machine's busy share, or with the CPUs split each side's."""
    sv = st["servers"]
    if not split:
        return f"{sv['machine_busy_s'] / sv['span_s'] / a.nproc:.0%}"
    # JSON keys are strings once the results went through a file.
    per_cpu = {int(c): b for c, b in sv["cpu_busy_s"].items()}
    side = lambda cpus: sum(per_cpu[c] for c in cpus) / sv["span_s"] / len(cpus)  # noqa: E731
    return " / ".join(f"{side(cpus):.0%}" for cpus in split)


def _p99_or_catch_up(st: dict) -> str:
    """The relay's p99, or for pg_recvlogical how long the walsender took to send the step."""
    if "caught_up_s" in st:
        lag = (f"lag {_num(st['lag_p99_ms'], 1)}, drift {_num(st['lag_drift_ms'], 1)}; "
               if "lag_p99_ms" in st else "")  # results from before the probe have none
        if st["caught_up_s"] != st["caught_up_s"]:  # NaN: not within the bound
            return lag + "not sent in time"
        return lag + f"sent +{st['caught_up_s'] * 1e3:.0f} ms"
    return _num(st.get("p99_ms"), 1)


def markdown(a: argparse.Namespace, m: dict, geo: dict) -> str:
    if a.quick:
        first = ("**QUICK RUN (`--quick`): a smoke test of the benchmark, not a measurement. Do not"
                 " quote these numbers.**")
    else:
        first = (f"**Production geometry: {a.link_events:,} events per link backlog,"
                 f" {a.step_seconds:g} s per load step, {a.repeat} rounds.**")
    lines = [BEGIN, ""] + _header(a, m, first)
    if "link" in geo and "calibrate" not in geo:
        lines += [f"**The links**: {_via(a)}.", ""]
    if "calibrate" in geo:
        lines += _calibrate(a, geo["calibrate"])
    if "link" in geo:
        lines += _link(a, geo["link"])
    if "payload" in geo:
        lines += _payloads(a, geo["payload"], fsync=False)
    if "fsync" in geo:
        lines += _payloads(a, geo["fsync"], fsync=True)
    if "ceiling" in geo:
        lines += _ceiling(a, geo["ceiling"])
    return "\n".join(lines + [END])
