"""How much time a suite config is taken to need before it starts (bench/suite.time_needed)."""

import pytest

from trainplan.bench.series import suite


def test_the_slowest_launch_counts_once_and_the_median_for_the_rest():
    assert suite.time_needed([30.0, 36.0, 71.0], 3) == pytest.approx(71.0 + 2 * 36.0)
    assert suite.time_needed([30.0, 36.0, 71.0], 1) == 71.0  # one more launch: the slowest
    assert suite.time_needed([], 3) == 3 * suite.FIRST_LAUNCH_GUESS_S
    # never less than the slowest launch seen, never more than every launch at the slowest
    took = [28.0, 33.0, 47.0, 38.0]
    for left in (1, 2, 3):
        assert max(took) <= suite.time_needed(took, left) <= left * max(took)
