"""Uncertainty for evaluation tables: Wilson intervals for rates, bootstrap intervals for means.

Every figure kvtool's evaluators print carries a 95% interval, and a table marks which cells differ
significantly from its best cell. Two kinds of comparison:

* rates (needle found-rate, exact match): Wilson score interval per cell; the difference between two
  independent rates gets Newcombe's hybrid score interval (method 10 of Newcombe 1998), built from the
  two Wilson intervals; significant when it excludes 0;
* means over the same sample units (perplexity gap per window, token-F1 per question): percentile
  bootstrap over units for one cell; a *paired* bootstrap of the per-unit differences between two cells
  (the same windows/questions were used by both), significant when its interval excludes 0.

Rows are compared within their budget (``best_in_group``): a user picks a policy for the budget they
can afford, so a policy at 256 is judged against the best policy at 256, not against the best policy at
1024 (nor against ``full``, which has no budget and is the reference row).

Pure functions (no torch): the bootstrap uses ``random.Random(seed)``, so tables are reproducible.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

Z95 = 1.959963984540054


@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided 95% interval."""

    value: float
    low: float
    high: float

    def excludes(self, x: float = 0.0) -> bool:
        return x < self.low or x > self.high

    def as_dict(self, digits: int = 4) -> dict[str, float]:
        return {"value": round(self.value, digits), "low": round(self.low, digits), "high": round(self.high, digits)}


def wilson(k: int, n: int, z: float = Z95) -> Interval:
    """Wilson score interval for k successes out of n (n = 0 gives [0, 1])."""
    if n <= 0:
        return Interval(0.0, 0.0, 1.0)
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must be within 0..n={n}")
    p = k / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    # the bounds are exactly 0 and 1 at k = 0 and k = n (rounding would leave 1e-16 off)
    low = 0.0 if k == 0 else max(0.0, centre - half)
    high = 1.0 if k == n else min(1.0, centre + half)
    return Interval(p, low, high)


def newcombe_difference(k1: int, n1: int, k2: int, n2: int, z: float = Z95) -> Interval:
    """Interval for p1 − p2 of two independent proportions (Newcombe's hybrid score method)."""
    a, b = wilson(k1, n1, z), wilson(k2, n2, z)
    d = a.value - b.value
    low = d - math.sqrt((a.value - a.low) ** 2 + (b.high - b.value) ** 2)
    high = d + math.sqrt((a.high - a.value) ** 2 + (b.value - b.low) ** 2)
    return Interval(d, max(-1.0, low), min(1.0, high))


def _percentile(sorted_xs: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of an already sorted list."""
    if not sorted_xs:
        raise ValueError("no values")
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def bootstrap_mean(values: Sequence[float], resamples: int = 2000, seed: int = 0) -> Interval:
    """Mean of ``values`` with a percentile-bootstrap 95% interval over the units.

    One value gives a degenerate interval (no spread can be estimated from one unit).
    """
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("bootstrap of no values")
    mean = sum(xs) / len(xs)
    if len(xs) == 1:
        return Interval(mean, mean, mean)
    rng = random.Random(seed)
    n = len(xs)
    means = sorted(sum(xs[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return Interval(mean, _percentile(means, 0.025), _percentile(means, 0.975))


def paired_difference(a: Sequence[float], b: Sequence[float], resamples: int = 2000, seed: int = 0) -> Interval:
    """Mean of a − b over paired units (same windows/questions) with a bootstrap 95% interval."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    return bootstrap_mean([x - y for x, y in zip(a, b, strict=True)], resamples, seed)


def fmt_interval(iv: Interval, digits: int = 2, pct: bool = False) -> str:
    """``0.80 [0.49, 0.94]`` (or ``80% [49, 94]``) for tables."""
    if pct:
        return f"{100 * iv.value:.0f}% [{100 * iv.low:.0f}, {100 * iv.high:.0f}]"
    return f"{iv.value:.{digits}f} [{iv.low:.{digits}f}, {iv.high:.{digits}f}]"


def best_in_group(
    groups: Sequence[Hashable], scores: Sequence[float], higher_is_better: bool = True
) -> list[int | None]:
    """For each row, the index of the best-scoring row of its group (ties: the first such row).

    Used to mark significance per budget: row k is compared with ``best_in_group(...)[k]``. A row alone
    in its group (``full``, which has no budget) has nothing to be compared with: None.
    """
    if len(groups) != len(scores):
        raise ValueError(f"{len(groups)} groups for {len(scores)} scores")
    best: dict[Hashable, int] = {}
    for k, (g, s) in enumerate(zip(groups, scores, strict=True)):
        j = best.get(g)
        if j is None or (s > scores[j] if higher_is_better else s < scores[j]):
            best[g] = k
    sizes = Counter(groups)
    return [best[g] if sizes[g] > 1 else None for g in groups]
