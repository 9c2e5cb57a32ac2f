"""The walsender's send lag while a ceiling step runs with pg_recvlogical (bench/ceiling.py), so
that decoding alone is held by the latency rules the relay's steps are held by.

pg_recvlogical writes to /dev/null and the harness cannot see when each event reached it. What
it can see is how far the walsender streaming the slot has got: every `interval` seconds, on a
thread, one backend reads the WAL flushed so far and the walsender's sent position. A sample's
lag is the time since the first byte the walsender had not yet sent was seen flushed, and 0 when
it had sent everything flushed. No consumer of the slot can have an event before the walsender
sent it (it passes a commit only once the transaction is in its socket), so the lag is a lower
bound on any consumer's latency (commit to receipt): a position counts as flushed from the end
of the first query that saw it, and a sample's time is the start of its own query. (Strictly,
the unsent byte may be an insert whose commit follows it; with the benchmark's single-row
autocommit inserts that is microseconds.)
"""

from __future__ import annotations

import bisect
import math
import threading
import time

import psycopg

from harness import log, proc_schedstat
from steady import median, percentile


def lsn(text: str) -> int:
    """A pg_lsn's text ('16/B374D848') as a byte position."""
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


class SendLag:
    """Samples (time, WAL flushed, sent by the walsender of `slot`) from construction until
    `stop()`; `close()` ends its connection and returns its backend's CPU seconds, counted from
    the backend's start (so that a step's Postgres backends can be read without the probe: call
    it after the step's CpuSampler stopped)."""

    QUERY = ("SELECT pg_current_wal_flush_lsn()::text, "
             "(SELECT r.sent_lsn::text FROM pg_replication_slots s "
             "JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = %s)")

    def __init__(self, url: str, slot: str, interval: float = 0.025):
        self.slot, self.interval = slot, interval
        # A Postgres that hangs must not hang the run: the thread is joined with a timeout.
        # (`options` replaces any the URL carries; the harness's URLs carry none.)
        self._begin(psycopg.connect(url, autocommit=True, options="-c statement_timeout=5s"))

    def _begin(self, conn) -> None:
        """Starts sampling on `conn` (bench/test_send_lag.py passes a connection of its own)."""
        self.conn = conn
        try:
            self.backend = self.conn.execute("SELECT pg_backend_pid()").fetchone()[0]
            # (query start, query end, WAL flushed, sent or None when no walsender streams)
            self.samples: list[tuple[float, float, int, int | None]] = []
            self.error: BaseException | None = None
            self.done = threading.Event()
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
        except BaseException:
            self.conn.close()
            raise

    def _run(self) -> None:
        try:
            while not self.done.wait(self.interval):
                t0 = time.monotonic()
                flushed, sent = self.conn.execute(self.QUERY, (self.slot,)).fetchone()
                self.samples.append((t0, time.monotonic(), lsn(flushed),
                                     lsn(sent) if sent else None))
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def stop(self, raise_error: bool = True, timeout: float = 10.0) -> None:
        """Stops sampling, waiting at most `timeout` seconds for a query under way. Raises the
        probe's own failure (a query that did not return, or one that failed) unless
        `raise_error` is false (when the step already failed, its error is the one to report)."""
        self.done.set()
        self.thread.join(timeout=timeout)
        if raise_error and self.thread.is_alive():
            raise RuntimeError(f"send-lag probe: a query did not return within {timeout:g} s")
        if raise_error and self.error:
            raise RuntimeError(f"send-lag probe failed: {self.error}") from self.error

    def close(self) -> float:
        """Closes the connection (unless the thread still uses it: a query that never returned;
        the daemon thread keeps it then) and returns the backend's CPU seconds, or 0 if the
        backend is gone (Postgres died, which the step reports)."""
        try:
            return proc_schedstat(self.backend)[0]
        except (OSError, ValueError):
            log("  send-lag probe: its backend is gone, its CPU not counted")
            return 0.0
        finally:
            if not self.thread.is_alive():
                self.conn.close()

    def lags_ms(self, t0: float, t1: float) -> list[float]:
        """The lag of each sample whose query started between t0 and t1 (monotonic), in order,
        in ms. A sample taken while no walsender streamed the slot has no lag and is left out
        (the caller checks that pg_recvlogical is alive)."""
        ends = [s[1] for s in self.samples]
        flushed = [s[2] for s in self.samples]
        out = []
        for i, (start, _, f, sent) in enumerate(self.samples):
            if not t0 <= start <= t1 or sent is None:
                continue
            if sent >= f:
                out.append(0.0)
                continue
            # The first sample that saw a byte past `sent` flushed (at or before this one, as
            # this one saw f > sent): the byte was flushed before that query ended, and sample
            # i read `sent` after its own query started.
            j = bisect.bisect_right(flushed, sent, 0, i + 1)
            out.append(max(0.0, start - ends[j]) * 1e3)
        return out


def verdict(lags: list[float]) -> dict:
    """p50, p99 and drift of a step's lags, drift as the relay's steps measure it: the median of
    the last fifth above that of the first fifth."""
    if not lags:
        return {"lag_samples": 0, "lag_p50_ms": math.nan, "lag_p99_ms": math.nan,
                "lag_drift_ms": math.nan}
    fifth = max(1, len(lags) // 5)
    ordered = sorted(lags)
    return {"lag_samples": len(lags), "lag_p50_ms": percentile(ordered, 0.50),
            "lag_p99_ms": percentile(ordered, 0.99),
            "lag_drift_ms": median(lags[-fifth:]) - median(lags[:fifth])}
