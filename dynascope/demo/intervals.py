"""95% percentile-bootstrap intervals for the reproduction table's figures.

Accuracies and the AlphaRL/RELEX recovery ratios resample the held-out problems (paired: one resample of
problem indices serves every model compared, so a ratio's numerator and denominator move together); the
per-step figures (PULSE S₁, the delta-sync share) resample the RL steps and recompute the median. Steps of
one run are autocorrelated, so the step interval says how much the median depends on which steps were
seen, not how a second run would land. ``B`` resamples from a seeded generator: the same inputs give the
same interval.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["B", "Interval", "bootstrap", "mean_interval", "median_interval", "paired_interval"]

B = 2000
LEVEL = 0.95


class Interval(tuple):
    """(value, low, high): the figure on all the data and its 95% percentile-bootstrap interval."""

    __slots__ = ()

    def __new__(cls, value: float | None, low: float | None, high: float | None) -> Interval:
        return super().__new__(cls, (value, low, high))

    @property
    def value(self) -> float | None:
        return self[0]

    @property
    def low(self) -> float | None:
        return self[1]

    @property
    def high(self) -> float | None:
        return self[2]

    def as_dict(self) -> dict[str, float | None]:
        return {"value": self.value, "ci_low": self.low, "ci_high": self.high}


def _finite(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def bootstrap(n: int, stat: Callable[[np.ndarray], float], *, b: int = B, seed: int = 0) -> Interval:
    """``stat(idx)`` on all of 0..n−1 and its 2.5–97.5 percentiles over ``b`` resamples of the indices
    with replacement. Resamples where ``stat`` is not finite (a ratio over a zero gain) are left out; with
    fewer than half of them finite the interval is NULL, as it is for n < 2."""
    value = _finite(stat(np.arange(n))) if n else None
    if n < 2:
        return Interval(value, None, None)
    rng = np.random.default_rng(seed)
    draws = np.array([stat(rng.integers(0, n, n)) for _ in range(b)], dtype=np.float64)
    draws = draws[np.isfinite(draws)]
    if len(draws) < b / 2:
        return Interval(value, None, None)
    lo, hi = np.quantile(draws, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return Interval(value, float(lo), float(hi))


def mean_interval(xs: Sequence[float], **kw) -> Interval:
    """Mean of ``xs`` (e.g. per-problem 0/1 correctness: an accuracy) with its interval over the items."""
    a = np.asarray(xs, dtype=np.float64)
    return bootstrap(len(a), lambda i: float(a[i].mean()), **kw)


def median_interval(xs: Sequence[float], **kw) -> Interval:
    """Median of ``xs`` (e.g. a per-step share) with its interval over the items."""
    a = np.asarray(xs, dtype=np.float64)
    return bootstrap(len(a), lambda i: float(np.median(a[i])), **kw)


def paired_interval(stat: Callable[..., float], *columns: Sequence[float], **kw) -> Interval:
    """``stat(*means)`` of several per-item columns resampled together (one index draw for all), e.g. the
    recovery ratio (r₁ − r_base) / (r_RL − r_base) over per-problem correctness of three models."""
    cols = [np.asarray(c, dtype=np.float64) for c in columns]
    n = len(cols[0])
    if any(len(c) != n for c in cols):
        raise ValueError("paired columns must have one value per item each")

    def one(i: np.ndarray) -> float:
        with np.errstate(divide="ignore", invalid="ignore"):
            return float(stat(*(c[i].mean() for c in cols)))

    return bootstrap(n, one, **kw)
