"""The report of bench/bench.py: the machine, one markdown section, the latency plot, and the
section's place in benchmarks.md (between the markers, so the prose around it stays hand-written).
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import platform
import subprocess
from pathlib import Path

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

BACKLOG_PHASES = {
    "pg_recvlogical": "pg_recvlogical, pgoutput to /dev/null (the limit)",
    "stream": "**relay stream** → Valkey",
    "poller1": "relay poller, 1 poller, batch 500",
    "poller4": "relay poller, 4 pollers, batch 500",
    "naive": "naive: 1 Valkey round trip per event, batch 100",
    "huge": "relay stream, one transaction of all the rows",
}


def _sh(*argv: str) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine(admin, valkey, commit: str) -> dict:
    """What the numbers were measured on. `admin` opens a Postgres connection."""
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    os_name = "unknown"
    if Path("/etc/os-release").exists():
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                os_name = line.split("=", 1)[1].strip('"')
    with admin() as c:
        pg = c.execute("SHOW server_version").fetchone()[0]
        settings = dict(c.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN "
            "('fsync', 'synchronous_commit', 'shared_buffers', 'track_commit_timestamp')"
        ).fetchall())
    return {"nproc": len(os.sched_getaffinity(0)), "cpu": cpu, "mem_gib": mem_kib / 2**20,
            "kernel": platform.release(), "os": os_name, "postgres": pg, "pg_settings": settings,
            "redis": valkey.info("server")["redis_version"], "rustc": _sh("rustc", "--version"),
            "relay_commit": commit}


def _nan(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _rate(x: float) -> str:
    return "—" if _nan(x) else f"{x:,.0f}"


def _num(x, digits: int = 2) -> str:
    return "—" if _nan(x) else f"{x:,.{digits}f}"


def _eps(r: dict) -> float:
    return r["events"] / r["drain_s"]


def _header(a: argparse.Namespace, m: dict, first: str | None = None) -> list[str]:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if first is not None:
        first = f"{first} {now}."
    elif a.quick:
        first = (f"**QUICK RUN (`--quick`, {a.events:,} events per backlog phase, "
                 f"{a.step_seconds:g} s per load step): a smoke test of the benchmark, not a "
                 f"measurement. Do not quote these numbers.** {now}.")
    else:
        first = (f"**Full run: {a.events:,} events per backlog phase, {a.step_seconds:g} s per "
                 f"load step.** {now}.")
    built = f"relay commit `{m['relay_commit']}`"
    if " --relay " in f" {a.command} ":
        # The tree's commit, not the binary's: `--relay` after `--` names another build.
        built = (f"tree at commit `{m['relay_commit']}`; the relay binary is the one `--relay`"
                 " names, not built from it")
    lines = [first, "", f"Command: `{a.command.strip()}` ({built})", ""]
    if a.relay_env:
        extra = ", ".join(f"`{k}={v}`" for k, v in sorted(a.relay_env.items()))
        lines += [f"Relay settings added to every relay phase: {extra}.", ""]
    s = m["pg_settings"]
    return lines + [
        "| machine | |", "|---|---|",
        f"| CPU | {m['cpu']}, {m['nproc']} cores (nproc) |",
        f"| memory | {m['mem_gib']:.1f} GiB |",
        f"| OS, kernel | {m['os']}, Linux {m['kernel']} |",
        f"| PostgreSQL | {m['postgres']} (fsync={s.get('fsync')}, "
        f"synchronous_commit={s.get('synchronous_commit')}, "
        f"shared_buffers={s.get('shared_buffers')}×8kB, "
        f"track_commit_timestamp={s.get('track_commit_timestamp')}) |",
        f"| Redis | {m['redis']} |",
        f"| rustc | {m['rustc']} |",
        "",
    ]


def _backlog(a: argparse.Namespace, backlog: list[dict]) -> list[str]:
    by = {r["phase"]: r for r in backlog}
    stream = by.get("stream")
    lines = [
        f"**Backlog**: {a.events:,} events committed in {a.per_txn}-row transactions before the "
        "consumer starts; time until the last one is in Valkey."
        + (f" Each phase ran {a.repeat} times, in rounds (every phase once, then again); each"
           " row is the phase's median run (by events/s), the last column lists all runs."
           if a.repeat > 1 else ""), "",
        "| phase | events/s | drain s | with start-up s | CPU µs/event | peak RSS MiB "
        "| stream ÷ this |" + (f" events/s of the {a.repeat} runs |" if a.repeat > 1 else ""),
        "|---|---:|---:|---:|---:|---:|---:|" + ("---|" if a.repeat > 1 else ""),
    ]
    for key, label in BACKLOG_PHASES.items():
        r = by.get(key)
        if r is None:
            continue
        ratio = _eps(stream) / _eps(r) if stream else math.nan
        lines.append(
            f"| {label} | {_rate(_eps(r))} | {_num(r['drain_s'])} | {_num(r['total_s'])} "
            f"| {_num(r['cpu_s'] / r['events'] * 1e6, 1)} | {_num(r['rss_mib'], 1)} "
            f"| {_num(ratio)} |"
            + (" " + ", ".join(_rate(x) for x in r["runs_eps"]) + " |" if a.repeat > 1 else ""))
    lines.append("")
    if stream:
        parts = [f"stream / {label} = **{_eps(stream) / _eps(by[key]):.2f}**"
                 for key, label in [("pg_recvlogical", "pg_recvlogical"), ("poller1", "poller (1)"),
                                    ("poller4", "poller (4)"), ("naive", "naive")]
                 if key in by]
        if parts:
            lines += ["Ratios of events/s: " + "; ".join(parts) + ".", ""]
        if len(stream.get("paired_ratios", [])) > 1:
            lines += ["Stream / pg_recvlogical within each round: "
                      + ", ".join(f"{x:.2f}" for x in stream["paired_ratios"]) + ".", ""]
        if not _nan(stream.get("batches")) and stream.get("batches"):
            lines += [f"The stream made {stream['batches']:,.0f} Valkey writes for "
                      f"{stream['events']:,} events: {stream['events'] / stream['batches']:,.1f} "
                      "tasks per round trip on average.", ""]
    return lines + [
        "Drain time runs from the consumer being ready (relay: its `replication stream started`"
        " or `running in poll mode` log line; pg_recvlogical and naive: process start) to the"
        " last task in Valkey (LLEN polled every 20 ms); \"with start-up\" counts from process"
        " start. CPU is the process's own user+system time while draining (relay:"
        " /proc/PID/stat minus what start-up used; others: wait4), so it leaves out the"
        " walsender and Valkey; peak RSS is VmHWM. The table is ANALYZEd after the backlog is"
        " inserted, as autovacuum would do.", "",
    ]


def cpu_split(r: dict, extra_s: float = 0.0) -> dict[str, float]:
    """Where the CPU went during one consumer's run (its `servers` sample and its own CPU), in
    seconds; `extra_s` is CPU of processes the sample does not see (the latency proxies), which
    `rest` then leaves out."""
    sv = r["servers"]
    out = {"span": sv["span_s"], "busy": sv["machine_busy_s"],
           "walsender": sv.get("cpu_walsender_s", 0.0),
           "walsender_wait": sv.get("wait_walsender_s", 0.0),
           "other_pg": sv.get("cpu_pg_backend_s", 0.0) + sv.get("cpu_pg_background_s", 0.0),
           "valkey": sv.get("cpu_valkey_s", 0.0),
           "consumer": r["cpu_s"] + r.get("cpu_startup_s", 0.0)}
    out["rest"] = max(0.0, out["busy"] - extra_s - sum(
        out[k] for k in ("walsender", "other_pg", "valkey", "consumer")))
    return out


def cpu_cell(seconds: float, span: float) -> str:
    return f"{seconds:.2f} ({seconds / span:.0%})"


def _cpu(a: argparse.Namespace, backlog: list[dict], nproc: int) -> list[str]:
    """Where the machine's CPU went during each drain."""
    rows = [r for r in backlog if r.get("servers")]
    if not rows:
        return []
    lines = [
        "**Where the CPU went** during each drain (the consumer's start to the last task in"
        " Valkey): seconds on a CPU per process group, and the walsender's seconds runnable but"
        " waiting for a CPU.", "",
        "| phase | span s | walsender on CPU s | walsender waiting s | other Postgres s "
        "| Valkey s | consumer s | everything else s | machine busy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, label in BACKLOG_PHASES.items():
        r = next((r for r in rows if r["phase"] == key), None)
        if r is None:
            continue
        c = cpu_split(r)
        pct = lambda x: cpu_cell(x, c["span"])  # noqa: E731
        lines.append(
            f"| {label} | {c['span']:.2f} | {pct(c['walsender'])} | {pct(c['walsender_wait'])} "
            f"| {pct(c['other_pg'])} | {pct(c['valkey'])} | {pct(c['consumer'])} "
            f"| {pct(c['rest'])} | {c['busy'] / (nproc * c['span']):.0%} |")
    return lines + [
        "",
        "From /proc/PID/schedstat of every process under the postmaster and of the Valkey server,"
        " sampled every 25 ms (bench/harness.py `CpuSampler`); the consumer's from its own"
        " /proc/PID/stat or wait4, start-up included; \"everything else\" is the rest of the machine's"
        " busy time (/proc/stat: the benchmark's Python, the kernel's own threads, anything else"
        " running). Percentages are of the span. \"Other"
        " Postgres\" is the client backends (the relay's marking UPDATEs, the poller's queries)"
        " and the background processes.", "",
    ]


def _steady(a: argparse.Namespace, steady: list[dict]) -> list[str]:
    lines = [
        "**Steady load**: single-row transactions at a fixed rate; latency from the commit"
        " timestamp to the task hash's `pending_since`.", "",
        "| target/s | achieved/s | events | p50 ms | p99 ms | max ms | drift ms "
        "| relay CPU µs/event | tasks per write | kept up |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for st in steady:
        lines.append(
            f"| {st['target']:,} | {_rate(st['achieved'])} | {st['events']:,} "
            f"| {_num(st['p50_ms'], 1)} | {_num(st['p99_ms'], 1)} | {_num(st['max_ms'], 1)} "
            f"| {_num(st['drift_ms'], 1)} | {_num(st['relay_cpu_us_per_event'], 1)} "
            f"| {_num(st['tasks_per_write'], 1)} | {'yes' if st['kept_up'] else 'no'} |")
    sustained = [st for st in steady if st["kept_up"]]
    lines.append("")
    if sustained:
        best = max(sustained, key=lambda st: st["achieved"])
        lines += [f"Highest sustained rate: **{_rate(best['achieved'])} events/s** "
                  f"(target {best['target']:,}/s).", ""]
    return lines + [
        f"\"Kept up\": the load generator reached 95% of the target, every event arrived, p99"
        f" stayed under {a.max_p99_ms:g} ms and the median latency of the last fifth of the"
        f" events was at most {a.max_drift_ms:g} ms above that of the first fifth (\"drift\": a"
        " relay that falls behind builds a backlog, so its latency climbs through the step). The"
        " ramp stops at the first rate that is not kept up. Relay CPU and tasks per Valkey write"
        " cover the step and its drain. The load generator, Postgres, Valkey and the relay share"
        " the machine's cores.",
        "",
        "![commit-to-enqueued latency](bench-latency.png)",
        "",
    ]


def markdown(a: argparse.Namespace, m: dict, backlog: list[dict], steady: list[dict]) -> str:
    """The section between the markers."""
    lines = [BEGIN, ""] + _header(a, m)
    if backlog:
        lines += _backlog(a, backlog)
        lines += _cpu(a, backlog, m["nproc"])
    if steady:
        lines += _steady(a, steady)
    return "\n".join(lines + [END])


def plot(a: argparse.Namespace, steady: list[dict], path: Path) -> None:
    """Latency percentiles against the insert rate, and a CDF per rate."""
    steps = [st for st in steady if st["cdf_ms"]]
    if not steps:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = [st["achieved"] for st in steps]
    for key, label, style in [("p50_ms", "p50", "o-"), ("p99_ms", "p99", "s-"),
                              ("max_ms", "max", "^--")]:
        left.plot(x, [st[key] for st in steps], style, label=label)
    left.set_xscale("log")
    left.set_yscale("log")
    thousands = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}")
    left.xaxis.set_major_formatter(thousands)
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xlabel("achieved insert rate (events/s)")
    left.set_ylabel("commit → enqueued latency (ms)")
    left.set_title("latency percentiles vs insert rate")
    left.grid(True, which="both", alpha=0.3)
    left.legend()
    for st in steps:
        cdf = st["cdf_ms"]
        mark = "" if st["kept_up"] else " (not kept up)"
        right.plot(cdf, [(i + 1) / len(cdf) for i in range(len(cdf))],
                   label=f"{st['target']:,}/s{mark}")
    right.set_xscale("log")
    right.set_xlabel("commit → enqueued latency (ms)")
    right.set_ylabel("fraction of events")
    right.set_title("latency CDF per target rate")
    right.grid(True, which="both", alpha=0.3)
    right.legend(fontsize="small")
    title = "outbox-relay stream: commit-to-enqueued latency"
    if a.quick:
        title += f"  [QUICK RUN, {a.step_seconds:g} s steps: not a measurement]"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_doc(section: str, doc: Path, template: Path, begin: str = BEGIN, end: str = END) -> None:
    """Replaces the section between the markers begin and end of doc (started from template when
    missing); section includes the markers."""
    if doc.exists():
        text = doc.read_text()
    elif template.exists():
        text = template.read_text()
    else:
        text = f"# Benchmarks\n\n{begin}\n{end}\n"
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise RuntimeError(f"{doc} lacks the {begin} ... {end} markers")
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text[:start] + section + text[stop + len(end):])
