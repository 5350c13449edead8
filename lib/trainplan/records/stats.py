"""Medians and rates with 95% intervals, for measurements that are few and noisy.

Two methods, both distribution-free:

- `median_ci`: the rank-based (binomial order-statistic) interval for the
  median. With x_(1) <= ... <= x_(n) sorted, [x_(l), x_(n+1-l)] contains the
  population median with probability 1 - 2 P(B <= l - 1), B ~ Binomial(n, 1/2)
  (Conover 1999, "Practical Nonparametric Statistics", 3rd ed., sec. 3.2;
  Hahn and Meeker 1991, "Statistical Intervals", sec. 5.2). We take the
  largest l whose coverage is still >= the requested confidence, so the
  interval is exact-or-conservative. Below n = 6 even [min, max] covers less
  than 95% (1 - 2 / 2^n: 75% at 3, 93.75% at 5): then min and max are returned,
  `enough` is False and `coverage` says what they do cover.
- `ratio_ci`: a seeded percentile bootstrap (Efron and Tibshirani 1993, "An
  Introduction to the Bootstrap", ch. 13) for sum(numerators) /
  sum(denominators), e.g. tokens/s as total tokens over total time across
  launches (resampling launches) or steps (resampling steps). The percentile
  interval under-covers for small n; `enough` is False below `MIN_BOOTSTRAP`.

One parametric interval, for paired comparisons: `paired_log_ratio` is the Student-t 95%
interval of the mean of per-pair log-ratios (Student 1908; any textbook's paired t, e.g.
Montgomery, "Design and Analysis of Experiments", 9th ed., sec. 2.5.1). Log-ratios of
throughputs of back-to-back launches are close to normal and their mean is what "X% faster"
means, so the t interval is the natural one, exact under normality for any n >= 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from trainplan.errors import SpecError

MIN_BOOTSTRAP = 10  # below this a percentile bootstrap interval is too unreliable to trust


@dataclass(frozen=True)
class Interval:
    """A point estimate with an interval [low, high] and how far to trust it."""

    estimate: float  # the median, or the ratio of sums
    low: float
    high: float
    coverage: float  # rank method: exact coverage of [low, high]; bootstrap: nominal level
    method: str  # "rank", "range" (too few samples for the level), "bootstrap-percentile"
    n: int  # samples used
    enough: bool  # False: too few samples for the requested confidence (see `method`)

    def as_list(self) -> list[float]:
        """[low, high], the form records store."""
        return [self.low, self.high]


def _samples(name: str, values) -> np.ndarray:
    arr = np.asarray(values, dtype=float).ravel()
    if arr.size == 0:
        raise SpecError(f"{name} is empty; need at least one sample")
    if not np.all(np.isfinite(arr)):
        raise SpecError(f"{name} holds a value that is not finite ({arr[~np.isfinite(arr)][0]})")
    return arr


def _level(confidence: float) -> float:
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) \
            or not 0 < confidence < 1:
        raise SpecError(f"confidence = {confidence!r} is not valid; use a number in (0, 1)")
    return float(confidence)


def rank_coverage(n: int, lower_rank: int) -> float:
    """P(x_(l) <= median <= x_(n+1-l)) = 1 - 2 P(Binomial(n, 1/2) <= l - 1), l = lower_rank.

    Computed with exact integers (Python ints), so it holds for n in the thousands.
    """
    tail = sum(math.comb(n, i) for i in range(lower_rank))
    return 1.0 - 2 * tail / 2**n


def median_ci(values, confidence: float = 0.95) -> Interval:
    """Median with its rank-based (order-statistic) interval; see the module docstring."""
    x = np.sort(_samples("values", values))
    level = _level(confidence)
    n = len(x)
    median = float(np.median(x))
    if rank_coverage(n, 1) < level:
        return Interval(median, float(x[0]), float(x[-1]), rank_coverage(n, 1), "range", n, False)
    # Widen l while the coverage stays >= level; tail = sum_{i < l} C(n, i), kept exact.
    lower, tail, total = 1, 1, 2**n
    while lower + 1 <= (n + 1) // 2 and 1 - 2 * (tail + math.comb(n, lower)) / total >= level:
        tail += math.comb(n, lower)
        lower += 1
    return Interval(median, float(x[lower - 1]), float(x[n - lower]),
                    1 - 2 * tail / total, "rank", n, True)


def ratio_ci(numerators, denominators, confidence: float = 0.95, n_boot: int = 4000,
             seed: int = 0) -> Interval:
    """sum(numerators) / sum(denominators) with a seeded percentile-bootstrap interval.

    Pairs (numerator_i, denominator_i) are resampled together, n at a time with
    replacement, `n_boot` times; the interval is the (alpha/2, 1 - alpha/2)
    quantiles of the resampled ratios, widened if need be to contain the
    estimate itself (a skewed bootstrap distribution can leave it outside).
    """
    num = _samples("numerators", numerators)
    den = _samples("denominators", denominators)
    level = _level(confidence)
    if num.shape != den.shape:
        raise SpecError(f"numerators ({num.size}) and denominators ({den.size}) differ in length")
    if np.any(den <= 0):
        raise SpecError(f"denominators must be > 0; got {den[den <= 0][0]}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 100:
        raise SpecError(f"n_boot = {n_boot!r} is not valid; use a whole number >= 100")
    n = num.size
    estimate = float(num.sum() / den.sum())
    rng = np.random.default_rng(seed)
    ratios = np.empty(n_boot)
    step = max(1, 2_000_000 // n)  # resamples per batch: at most ~2M indices in memory
    for start in range(0, n_boot, step):
        idx = rng.integers(0, n, size=(min(step, n_boot - start), n))
        ratios[start:start + len(idx)] = num[idx].sum(axis=1) / den[idx].sum(axis=1)
    alpha = 1 - level
    low, high = np.quantile(ratios, [alpha / 2, 1 - alpha / 2])
    return Interval(estimate, float(min(low, estimate)), float(max(high, estimate)), level,
                    "bootstrap-percentile", n, n >= MIN_BOOTSTRAP)


def rate_ci(amounts, seconds, confidence: float = 0.95, seed: int = 0) -> Interval:
    """A rate as total amount over total time (e.g. tokens/s), with its bootstrap interval."""
    return ratio_ci(amounts, seconds, confidence=confidence, seed=seed)


def overlap(a: Interval, b: Interval) -> bool:
    """True when two intervals overlap: then neither setting is called better
    (docs/measurement.md, "Timing")."""
    return a.low <= b.high and b.low <= a.high


# Two-sided 95% quantiles of Student's t, t(0.975; df) for df = 1..30 (e.g. NIST/SEMATECH
# e-Handbook of Statistical Methods, table 1.3.6.7.2); beyond 30, `t975` uses the expansion
# of Abramowitz and Stegun 1964, eq. 26.7.5 (error < 1e-4 there).
T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
        2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
        2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)
Z975 = 1.959963984540054  # the standard normal's 0.975 quantile


def t975(df: int) -> float:
    """t(0.975; df): the table for df <= 30, A&S 26.7.5 in powers of 1/df above."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise SpecError(f"degrees of freedom = {df!r} is not valid; use a whole number >= 1")
    if df <= len(T975):
        return T975[df - 1]
    x = Z975
    g = ((x**3 + x) / 4, (5 * x**5 + 16 * x**3 + 3 * x) / 96,
         (3 * x**7 + 19 * x**5 + 17 * x**3 - 15 * x) / 384,
         (79 * x**9 + 776 * x**7 + 1482 * x**5 - 1920 * x**3 - 945 * x) / 92160)
    return x + sum(gi / df**(i + 1) for i, gi in enumerate(g))


def paired_log_ratio(treated, reference) -> Interval:
    """Mean of log(treated_i / reference_i) over pairs i, with its Student-t 95% interval:
    mean +- t975(n - 1) sd / sqrt(n), sd with n - 1 in the denominator.

    Both inputs are positive rates of the same pairs, in the same order. With one pair the
    interval is (-inf, inf) and `enough` is False."""
    a, b = _samples("treated", treated), _samples("reference", reference)
    if a.shape != b.shape:
        raise SpecError(f"treated ({a.size}) and reference ({b.size}) differ in length")
    if np.any(a <= 0) or np.any(b <= 0):
        raise SpecError("paired rates must be > 0")
    d = np.log(a) - np.log(b)
    n, mean = d.size, float(d.mean())
    if n < 2:
        return Interval(mean, -math.inf, math.inf, 0.95, "paired-t", n, False)
    half = t975(n - 1) * float(d.std(ddof=1)) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, 0.95, "paired-t", n, True)
