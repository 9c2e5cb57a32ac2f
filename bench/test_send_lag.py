"""The send-lag arithmetic of bench/send_lag.py and bench/ceiling.py's load window, on made-up
samples (no servers). Run by .ci/run with the benchmark's venv:
bench/.venv/bin/python bench/test_send_lag.py"""

from __future__ import annotations

import math
import os
import subprocess
import threading
import unittest

from ceiling import load_window
from send_lag import SendLag, lsn, verdict


def probe(samples: list[tuple[float, float, int, int | None]]) -> SendLag:
    """A SendLag holding `samples` (query start s, query end s, flushed, sent), never started."""
    p = SendLag.__new__(SendLag)
    p.samples = samples
    return p


class Lags(unittest.TestCase):
    def test_an_lsn_is_its_byte_position(self):
        self.assertEqual(lsn("0/10"), 16)
        self.assertEqual(lsn("16/B374D848"), (0x16 << 32) | 0xB374D848)

    def test_a_walsender_that_sent_everything_flushed_has_no_lag(self):
        p = probe([(0.0, 0.002, 100, 100), (0.025, 0.027, 200, 250), (0.05, 0.052, 300, 300)])
        self.assertEqual(p.lags_ms(0, 1), [0.0, 0.0, 0.0])

    def test_the_lag_runs_from_the_end_of_the_query_that_first_saw_the_byte_flushed(self):
        # Byte 151 (the first unsent at the last sample) was first seen flushed by the second
        # sample, whose query ended at 0.027: the last sample started at 0.075.
        p = probe([(0.0, 0.002, 100, 100), (0.025, 0.027, 200, 200),
                   (0.050, 0.052, 300, 150), (0.075, 0.077, 400, 150)])
        self.assertEqual([round(x, 6) for x in p.lags_ms(0, 1)], [0.0, 0.0, 23.0, 48.0])

    def test_a_walsender_stopped_exactly_at_a_flushed_position_waits_for_the_next_byte(self):
        # Sent 200, and 200 was flushed at the second sample: the first unsent byte (201) was
        # first seen flushed by the third.
        p = probe([(0.0, 0.002, 100, 100), (0.025, 0.027, 200, 200),
                   (0.050, 0.052, 300, 200), (0.075, 0.077, 400, 200)])
        self.assertEqual([round(x, 6) for x in p.lags_ms(0, 1)], [0.0, 0.0, 0.0, 23.0])

    def test_a_backlog_first_seen_by_the_sample_itself_counts_as_none(self):
        # Flushed and not yet sent, both first seen now: the byte may have been flushed just
        # before the query, so the lower bound is 0.
        p = probe([(0.0, 0.002, 100, 100), (0.025, 0.027, 200, 150)])
        self.assertEqual(p.lags_ms(0, 1), [0.0, 0.0])

    def test_samples_outside_the_window_or_without_a_walsender_are_left_out(self):
        p = probe([(0.0, 0.002, 100, 100), (0.025, 0.027, 200, None),
                   (0.050, 0.052, 300, 150), (0.075, 0.077, 400, 400)])
        self.assertEqual([round(x, 6) for x in p.lags_ms(0.01, 0.06)], [23.0])

    def test_drift_is_the_last_fifth_median_above_the_first_fifths(self):
        # In time order, not sorted: a lag that fell through the step drifts below zero.
        lags = [150.0] * 5 + [10.0] * 10 + [0.0] * 5
        v = verdict(lags)
        self.assertEqual(v["lag_samples"], 20)
        self.assertEqual(v["lag_drift_ms"], -150.0)
        self.assertEqual(v["lag_p99_ms"], 150.0)
        self.assertEqual(v["lag_p50_ms"], 10.0)

    def test_no_samples_give_no_verdict(self):
        v = verdict([])
        self.assertEqual(v["lag_samples"], 0)
        self.assertTrue(math.isnan(v["lag_drift_ms"]) and math.isnan(v["lag_p99_ms"]))


class LoadWindow(unittest.TestCase):
    """bench/ceiling.py takes the probe's samples from load_gen's own window."""

    @staticmethod
    def summary(start: float, end: float, inserted: int = 1000) -> dict:
        return {"load_start_monotonic_s": start, "load_end_monotonic_s": end,
                "inserted": inserted}

    def test_a_window_within_the_run_is_the_window(self):
        self.assertEqual(load_window(self.summary(10.3, 12.3), 5000, 10.0, 12.5), (10.3, 12.3))

    def test_a_window_outside_the_run_is_another_clock(self):
        for start, end in [(9.9, 12.3), (10.3, 12.6), (1e6, 1e6 + 2), (12.3, 10.3)]:
            with self.assertRaisesRegex(RuntimeError, "not within its run"):
                load_window(self.summary(start, end), 5000, 10.0, 12.5)

    def test_a_load_that_inserted_nothing_fails_the_step(self):
        with self.assertRaisesRegex(RuntimeError, "inserted nothing in the 5,000/s step"):
            load_window(self.summary(10.3, 12.3, inserted=0), 5000, 10.0, 12.5)


class FakeConnection:
    """Stands in for the probe's psycopg connection: answers pg_backend_pid() with `backend`;
    the sampling query returns `sample`, raises `error`, or blocks until `release` is set."""

    def __init__(self, backend: int, sample=("0/10", "0/10"), error=None, hang=False,
                 backend_error=None):
        self.backend, self.sample, self.error = backend, sample, error
        self.backend_error = backend_error
        self.release = threading.Event()
        if not hang:
            self.release.set()
        self.entered = threading.Event()
        self.closed = False

    def execute(self, query: str, params=None):
        if self.backend_error:
            raise self.backend_error
        row = (self.backend,)
        if query == SendLag.QUERY:
            self.entered.set()
            self.release.wait()
            if self.error:
                raise self.error
            row = self.sample
        self.last = row
        return self  # as a cursor: fetchone() gives the row of the last query

    def fetchone(self):
        return self.last

    def close(self):
        self.closed = True


def started(conn: FakeConnection) -> SendLag:
    p = SendLag.__new__(SendLag)
    p.slot, p.interval = "slot", 0.001
    p._begin(conn)
    # Records the timeout each join is given (Thread instances take attributes).
    p.joins = []
    join = p.thread.join
    p.thread.join = lambda timeout=None: (p.joins.append(timeout), join(timeout))[1]
    return p


def gone_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


class StopAndClose(unittest.TestCase):
    def test_a_probe_that_sampled_stops_and_closes_its_connection(self):
        conn = FakeConnection(os.getpid(), sample=("0/20", "0/18"))
        p = started(conn)
        self.assertTrue(conn.entered.wait(5))
        p.stop()
        self.assertGreaterEqual(p.close(), 0.0)
        self.assertTrue(conn.closed)
        self.assertTrue(p.samples)
        self.assertEqual(p.samples[0][2:], (0x20, 0x18))

    def test_a_query_that_never_returns_fails_stop_and_keeps_the_connection_for_its_thread(self):
        conn = FakeConnection(os.getpid(), hang=True)
        p = started(conn)
        self.assertTrue(conn.entered.wait(5))
        with self.assertRaisesRegex(RuntimeError, "did not return within 0.2 s"):
            p.stop(timeout=0.2)
        self.assertEqual(p.joins, [0.2])
        # The thread is inside execute(): closing the connection under it is what close()
        # must not do. Its backend's CPU is still read.
        self.assertGreaterEqual(p.close(), 0.0)
        self.assertFalse(conn.closed)
        self.release_and_close(conn, p)

    def test_a_step_that_failed_keeps_its_own_error_over_a_hung_probe(self):
        conn = FakeConnection(os.getpid(), hang=True)
        p = started(conn)
        self.assertTrue(conn.entered.wait(5))
        p.stop(raise_error=False, timeout=0.2)  # does not raise
        self.assertEqual(p.joins, [0.2])
        # The thread was told to stop: once its query returns it ends, and close() closes.
        self.release_and_close(conn, p)

    def release_and_close(self, conn: FakeConnection, p: SendLag) -> None:
        """Lets the hung query return: the thread ends, and close() then closes the connection."""
        conn.release.set()
        p.thread.join(5)
        self.assertFalse(p.thread.is_alive())
        p.close()
        self.assertTrue(conn.closed)

    def test_a_failed_query_fails_stop_unless_the_step_failed_first(self):
        boom = RuntimeError("statement timeout")
        for raise_error in (True, False):
            conn = FakeConnection(os.getpid(), error=boom)
            p = started(conn)
            p.thread.join(5)
            self.assertIs(p.error, boom)
            if raise_error:
                with self.assertRaisesRegex(RuntimeError, "send-lag probe failed") as e:
                    p.stop()
                self.assertIs(e.exception.__cause__, boom)
            else:
                p.stop(raise_error=False)
            p.close()
            self.assertTrue(conn.closed)

    def test_a_connection_that_fails_at_once_is_closed_and_the_error_raised(self):
        conn = FakeConnection(os.getpid(), backend_error=RuntimeError("the server went away"))
        p = SendLag.__new__(SendLag)
        p.slot, p.interval = "slot", 0.001
        with self.assertRaisesRegex(RuntimeError, "the server went away"):
            p._begin(conn)
        self.assertTrue(conn.closed)

    def test_a_backend_that_is_gone_counts_no_cpu_and_the_connection_is_closed(self):
        conn = FakeConnection(gone_pid())
        p = started(conn)
        p.stop()
        self.assertEqual(p.close(), 0.0)
        self.assertTrue(conn.closed)


if __name__ == "__main__":
    unittest.main()
