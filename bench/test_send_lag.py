"""The send-lag arithmetic of bench/send_lag.py, on made-up samples (no servers). Run by .ci/run
with the benchmark's venv: bench/.venv/bin/python bench/test_send_lag.py"""

from __future__ import annotations

import math
import unittest

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


if __name__ == "__main__":
    unittest.main()
