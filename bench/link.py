"""Links with latency for bench/bench.py: examples/latency_proxy (or, with `--link-via queue`,
examples/latency_queue) in front of Postgres and Valkey,
the proxy's own lateness from its counters, and the calibration of each link (round trips of
Valkey PING and Postgres `SELECT 1`, direct and through the proxy).

A link is a delay D in ms each way, or None for the direct connection (no proxy at all).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis

from harness import Env, log, proc_cpu_seconds


def parse_delays(text: str) -> list[float | None]:
    """`direct,0,0.5,1,2` -> [None, 0.0, 0.5, 1.0, 2.0]."""
    out: list[float | None] = []
    for x in text.split(","):
        x = x.strip()
        if x:
            out.append(None if x == "direct" else float(x))
    return out


def label(delay: float | None) -> str:
    return "direct" if delay is None else f"{delay:g} ms"


VIAS = {
    "proxy": "examples/latency_proxy (a TCP proxy: each byte crosses loopback twice, through"
             " the proxy's process)",
    "queue": "examples/latency_queue (one connection, each packet held in a netfilter queue:"
             " the kernel's path, no second connection)",
}
_leftovers_removed = False


def _is_queue_link(pid: str) -> bool:
    """Whether `pid` is a latency_queue still running (its tests' binary is
    `latency_queue-HASH`, its name cut to 15 characters)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip().startswith("latency_queue")
    except OSError:
        return False


def remove_leftover_queue_rules() -> None:
    """The iptables rules of examples/latency_queue processes that were killed (each removes its
    own when its standard input closes or a signal comes); they carry
    `outbox-bench-queue-PID`."""
    for table in ("filter", "nat", "mangle"):
        out = subprocess.run(["iptables-save", "-t", table], capture_output=True, text=True,
                             check=True).stdout
        for line in out.splitlines():
            m = re.search(r"outbox-bench-queue-(\d+)", line)
            if line.startswith("-A ") and m:
                pid = m.group(1)
                if not _is_queue_link(pid):
                    log(f"  removing a leftover rule of latency_queue {pid}: {line}")
                    subprocess.run(["iptables", "-w", "-t", table, "-D"] + line.split()[1:],
                                   check=True)


class Proxy:
    """One link process in front of `upstream` (host:port): examples/latency_proxy, or with
    `--link-via queue` examples/latency_queue. Both take the same arguments, print the address
    to connect to and write the same counters."""

    def __init__(self, env: Env, name: str, upstream: str, delay_ms: float):
        global _leftovers_removed
        self.delay_ms = delay_ms
        self.name = name
        self.stats_path = env.workdir / f"proxy-{name}.json"
        binary = env.a.latency_proxy
        self.queue = env.a.link_via == "queue"
        if self.queue:
            binary = env.a.latency_queue
            if not _leftovers_removed:
                remove_leftover_queue_rules()
                _leftovers_removed = True
        self.p = subprocess.Popen(
            [binary, "--upstream", upstream, "--delay-ms", str(delay_ms),
             "--stats", str(self.stats_path), "--exit-with-stdin"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=env.consumer_preexec(),
            # Its own session: a Ctrl-C in the benchmark's terminal does not reach it, and
            # closing its standard input stops it through the exit that removes its rules.
            start_new_session=True,
            stderr=open(env.workdir / f"proxy-{name}.log", "w"), text=True)
        line = self.p.stdout.readline().strip()
        if not line.startswith("listening "):
            self.p.kill()
            raise RuntimeError(f"{Path(binary).name} did not start ({line!r}); "
                               f"see proxy-{name}.log")
        self.addr = line.split()[1]

    def via(self, url: str) -> str:
        """url with its host:port replaced by the proxy's."""
        u = urlsplit(url)
        auth = u.netloc.rsplit("@", 1)[0] + "@" if "@" in u.netloc else ""
        return urlunsplit((u.scheme, auth + self.addr, u.path, u.query, u.fragment))

    def stats(self) -> dict:
        return json.loads(self.stats_path.read_text())

    def cpu_s(self) -> float:
        return proc_cpu_seconds(self.p.pid)

    def stop(self) -> None:
        """Closes its standard input: the queue link removes its rules and exits."""
        self.p.stdin.close()
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            if self.queue:
                remove_leftover_queue_rules()
        if self.p.returncode != 0:
            # A link that failed (a refused verdict, say) delayed wrongly: its run is void.
            raise RuntimeError(f"{self.name} exited with {self.p.returncode}; see "
                               f"proxy-{self.name}.log")


def upstream_of(url: str) -> str:
    u = urlsplit(url)
    return f"{u.hostname}:{u.port}"


SIDES = ("both", "valkey", "postgres")


class Links:
    """The proxies of one link setting: relay <-> Postgres and relay <-> Valkey (none if direct)."""

    def __init__(self, env: Env, delay: float | None, tag: str = "", sides: str = "both"):
        """`sides`: which links get the proxy: `both`, `valkey` (Postgres direct, for
        pg_recvlogical too) or `postgres` (Valkey direct)."""
        if sides not in SIDES:
            raise ValueError(f"link sides {sides!r}: one of {', '.join(SIDES)}")
        self.delay = delay
        self.pg = self.valkey = None
        if delay is not None:
            if sides in ("both", "postgres"):
                self.pg = Proxy(env, f"pg{tag}", upstream_of(env.pg_url), delay)
            if sides in ("both", "valkey"):
                self.valkey = Proxy(env, f"valkey{tag}", upstream_of(env.a.redis_url), delay)

    def pg_url(self, url: str) -> str:
        return self.pg.via(url) if self.pg else url

    def redis_url(self, url: str) -> str:
        return self.valkey.via(url) if self.valkey else url

    def add_ms(self) -> float:
        """The one-way delay to Valkey: `pending_since` is stamped by the relay when it sends a
        write, which lands this much later."""
        return (self.delay or 0.0) if self.valkey else 0.0

    def snapshot(self) -> dict:
        """Each proxy's counters and CPU seconds, as of after this call (the counters' file is
        replaced every 200 ms)."""
        proxies = [(k, p) for k, p in (("pg", self.pg), ("valkey", self.valkey)) if p]
        if proxies:
            time.sleep(0.25)
        return {k: (p.stats(), p.cpu_s()) for k, p in proxies}

    def stop(self) -> None:
        for p in (self.pg, self.valkey):
            if p:
                p.stop()


def lateness(before: dict, after: dict) -> dict:
    """The proxies' lateness (µs a chunk left after its due time) between two snapshots, both
    directions of every proxy: chunks, p50, p99 (bucket upper bounds) and the proxy CPU."""
    if not after:
        return {}  # a direct connection: no proxy
    hist: list[int] = []
    bounds: list[float] = []
    chunks, cpu, max_late = 0, 0.0, 0.0
    for key, (st1, cpu1) in after.items():
        st0, cpu0 = before.get(key, (None, 0.0))
        cpu += cpu1 - cpu0
        bounds = st1["bucket_bounds_us"]
        for d in ("up", "down"):
            h1 = st1[d]["late_hist"]
            h0 = st0[d]["late_hist"] if st0 else [0] * len(h1)
            diff = [a - b for a, b in zip(h1, h0)]
            hist = [a + b for a, b in zip(hist, diff)] if hist else diff
            chunks += sum(diff)
            max_late = max(max_late, st1[d]["max_late_us"])

    def q(frac: float) -> float:
        if not chunks:
            return math.nan
        need, seen = frac * chunks, 0
        for b, n in zip(bounds, hist):
            seen += n
            if seen >= need:
                return b
        return bounds[-1]

    return {"chunks": chunks, "p50_us": q(0.5), "p99_us": q(0.99),
            "max_us_since_start": max_late, "proxy_cpu_s": cpu}


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[max(0, min(len(values) - 1, math.ceil(q * len(values)) - 1))]


def round_trips(env: Env, links: Links, n: int) -> dict:
    """Valkey PING and Postgres `SELECT 1` round trips (ms) over the link, from this Python
    process, one at a time."""
    out: dict = {}
    r = redis.Redis.from_url(links.redis_url(env.a.redis_url))
    try:
        r.ping()
        rtt = []
        for _ in range(n):
            t0 = time.perf_counter()
            r.ping()
            rtt.append((time.perf_counter() - t0) * 1e3)
        out["valkey_p50_ms"], out["valkey_p99_ms"] = _pct(rtt, 0.5), _pct(rtt, 0.99)
    finally:
        r.close()
    with psycopg.connect(links.pg_url(env.pg_url), autocommit=True) as c:
        c.execute("SELECT 1")
        rtt = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.execute("SELECT 1").fetchone()
            rtt.append((time.perf_counter() - t0) * 1e3)
    out["pg_p50_ms"], out["pg_p99_ms"] = _pct(rtt, 0.5), _pct(rtt, 0.99)
    return out


def phase_calibrate(env: Env, delays: list[float | None], n: int) -> list[dict]:
    """Each link's round trips, and the proxy's own lateness while they ran: a D-ms link should
    show 2*D plus what the direct connection takes."""
    log("phase calibrate: round trips over each link")
    rows = []
    for delay in delays:
        links = Links(env, delay, tag="-cal")
        try:
            before = links.snapshot()
            rt = round_trips(env, links, n)
            late = lateness(before, links.snapshot()) if links.pg else {}
        finally:
            links.stop()
        row = dict(rt, delay=delay, **{f"late_{k}": v for k, v in late.items()})
        log(f"  {label(delay)}: valkey PING p50 {rt['valkey_p50_ms']:.3f} ms, "
            f"p99 {rt['valkey_p99_ms']:.3f} ms; postgres SELECT 1 p50 {rt['pg_p50_ms']:.3f} ms")
        rows.append(row)
    return rows


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1))
