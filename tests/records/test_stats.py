"""Median and ratio intervals: known ranks, coverage on seeded simulations, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainplan.errors import SpecError
from trainplan.records.stats import median_ci, overlap, rank_coverage, rate_ci, ratio_ci


def test_rank_coverage_matches_the_binomial_formula():
    assert rank_coverage(6, 1) == 1 - 2 / 64
    # l = 6 of n = 20: 1 - 2 P(B <= 5), B ~ Bin(20, 1/2)
    tail = sum(math.comb(20, i) for i in range(6)) / 2**20
    assert rank_coverage(20, 6) == pytest.approx(1 - 2 * tail)


@pytest.mark.parametrize("n, low_rank, high_rank", [(6, 1, 6), (10, 2, 9), (20, 6, 15),
                                                    (100, 40, 61)])
def test_median_interval_uses_the_tabulated_order_statistics(n, low_rank, high_rank):
    # Ranks as in the standard tables (e.g. Conover 1999, table A3): n = 20 -> x(6), x(15).
    iv = median_ci(np.arange(1, n + 1) * 10.0)
    assert (iv.low, iv.high) == (low_rank * 10.0, high_rank * 10.0)
    assert iv.method == "rank" and iv.enough and iv.coverage >= 0.95
    assert iv.estimate == pytest.approx(np.median(np.arange(1, n + 1) * 10.0))


@pytest.mark.parametrize("n, coverage", [(1, 0.0), (3, 0.75), (5, 0.9375)])
def test_too_few_samples_give_min_max_and_say_so(n, coverage):
    iv = median_ci([3.0, 1.0, 2.0, 5.0, 4.0][:n])
    values = [3.0, 1.0, 2.0, 5.0, 4.0][:n]
    assert (iv.low, iv.high) == (min(values), max(values))
    assert iv.method == "range" and not iv.enough and iv.coverage == pytest.approx(coverage)


@pytest.mark.parametrize("n", [3, 7, 50, 1000])
def test_interval_contains_the_median(n):
    x = np.random.default_rng(n).lognormal(size=n)
    iv = median_ci(x)
    assert iv.low <= np.median(x) <= iv.high and iv.n == n


def test_rank_interval_coverage_on_a_seeded_simulation():
    """2000 samples of 15 from a lognormal (true median 1): coverage equals the exact binomial."""
    rng = np.random.default_rng(0)
    trials = [median_ci(rng.lognormal(size=15)) for _ in range(2000)]
    covered = np.mean([iv.low <= 1.0 <= iv.high for iv in trials])
    exact = trials[0].coverage  # 1 - 2 P(Bin(15, 1/2) <= 3) = 0.9648
    assert exact == pytest.approx(0.96484375)
    assert abs(covered - exact) < 0.02  # 4.5 binomial standard errors


def test_ratio_is_total_over_total_and_seeded():
    tokens, seconds = [100.0, 100.0, 300.0], [1.0, 1.0, 2.0]
    iv = ratio_ci(tokens, seconds)
    assert iv.estimate == 500.0 / 4.0  # not the mean of per-launch rates (116.7)
    assert iv == ratio_ci(tokens, seconds)  # same seed, same interval
    assert iv.low <= iv.estimate <= iv.high and not iv.enough  # 3 launches: flagged


def test_bootstrap_coverage_on_a_seeded_simulation():
    """Rates over 40 steps with noisy times: the 95% interval covers the true rate ~95%."""
    rng = np.random.default_rng(1)
    true_rate = 1000.0 / 0.5  # tokens per step / mean step time
    hits = 0
    for seed in range(300):
        times = rng.gamma(shape=20.0, scale=0.5 / 20.0, size=40)  # mean 0.5 s
        iv = rate_ci([1000.0] * 40, times, seed=seed)
        hits += iv.low <= true_rate <= iv.high
    assert 0.89 <= hits / 300 <= 0.99


def test_bootstrap_interval_narrows_with_more_samples():
    rng = np.random.default_rng(2)
    small = ratio_ci(rng.random(20) + 1, rng.random(20) + 1)
    large = ratio_ci(rng.random(1000) + 1, rng.random(1000) + 1)
    assert (large.high - large.low) < (small.high - small.low) / 3 and large.enough


def test_overlap():
    a, b = median_ci([1, 2, 3, 4, 5, 6, 7]), median_ci([10, 11, 12, 13, 14, 15, 16])
    assert not overlap(a, b) and overlap(a, median_ci([5, 6, 7, 8, 9, 10, 11]))


@pytest.mark.parametrize("call, message", [
    (lambda: median_ci([]), "empty"),
    (lambda: median_ci([1.0, float("nan")]), "not finite"),
    (lambda: median_ci([1, 2, 3], confidence=95), "confidence = 95"),
    (lambda: ratio_ci([1, 2], [1]), "differ in length"),
    (lambda: ratio_ci([1, 2], [1, 0]), "must be > 0"),
    (lambda: ratio_ci([1, 2], [1, 1], n_boot=5), "n_boot = 5"),
])
def test_bad_input_is_refused(call, message):
    with pytest.raises(SpecError, match=message):
        call()
