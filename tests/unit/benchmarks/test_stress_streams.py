"""The streamed-load soak's leavers: the share asked for, evenly spread over the round."""

import itertools

from benchmarks.stress_streams import leavers


def test_leavers_are_the_share_asked_for_spread_evenly():
    chosen = sorted(leavers(1024, 0.15))
    assert len(chosen) == 153  # floor(1024 * 0.15)
    gaps = {b - a for a, b in itertools.pairwise(chosen)}
    assert gaps <= {6, 7}, "one stream in every six or seven"
    assert leavers(100, 0.0) == frozenset() and len(leavers(10, 1.0)) == 10
