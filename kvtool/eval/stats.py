"""Uncertainty for evaluation tables: Wilson intervals for rates, bootstrap intervals for means.

Every figure kvtool's evaluators print carries a 95% interval, and a table marks which cells differ
significantly from its best cell. Two kinds of comparison:

* rates (needle found-rate, exact match): Wilson score interval per cell; the difference between two
  independent rates gets Newcombe's hybrid score interval (method 10 of Newcombe 1998), built from the
  two Wilson intervals; significant when it excludes 0;
* means over the same sample units (perplexity gap per window, token-F1 per question): percentile
  bootstrap over units for one cell; a *paired* bootstrap of the per-unit differences between two cells
  (the same windows/questions were used by both), significant when its interval excludes 0;
* two rates on the same units (needle trials answered by two policies): Newcombe's paired score interval
  (``newcombe_paired``).

Choosing one policy among many compares each with the incumbent on several tables: at 95% per comparison
some would pass by chance. Those comparisons use p-values instead (McNemar's mid-p test on the discordant
pairs for 1/0 outcomes; a sign-flip permutation test for means), adjusted by Holm's step-down
method over every comparison made (``holm``).

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
    """Mean of a − b over paired units (same trials/windows/questions) with a 95% interval: Newcombe's
    paired score interval when both are 1/0 outcomes (``newcombe_paired``), else a bootstrap of the
    per-unit differences."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    if a and _binary(a) and _binary(b):
        pairs = list(zip(a, b, strict=True))
        return newcombe_paired(pairs.count((1.0, 1.0)), pairs.count((1.0, 0.0)), pairs.count((0.0, 1.0)),
                               pairs.count((0.0, 0.0)))
    return bootstrap_mean([x - y for x, y in zip(a, b, strict=True)], resamples, seed)


def newcombe_paired(both: int, only_a: int, only_b: int, neither: int, z: float = Z95) -> Interval:
    """Interval for p_a − p_b of two rates measured on the same units (Newcombe 1998, "Improved confidence
    intervals for the difference between binomial proportions based on paired data", method 10): the
    two Wilson intervals combined with the correlation φ of the pairs.

    A percentile bootstrap of 1/0 differences is too narrow when few pairs disagree: 4 trials found by
    a and none by b out of 30 gives [+3, +27] pp by bootstrap, [-1, +28] here (McNemar mid-p 0.06)."""
    n = both + only_a + only_b + neither
    if n <= 0:
        raise ValueError("no pairs")
    wa, wb = wilson(both + only_a, n, z), wilson(both + only_b, n, z)
    d = wa.value - wb.value
    den = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    cross = both * neither - only_a * only_b  # φ's numerator, shrunk by n/2 when positive (Newcombe's φ̂)
    phi = 0.0 if den == 0 else (cross - n / 2 if cross > n / 2 else min(cross, 0)) / math.sqrt(den)
    la, ua, lb, ub = wa.value - wa.low, wa.high - wa.value, wb.value - wb.low, wb.high - wb.value
    low = d - math.sqrt(max(0.0, la * la - 2 * phi * la * ub + ub * ub))
    high = d + math.sqrt(max(0.0, ua * ua - 2 * phi * ua * lb + lb * lb))
    return Interval(d, max(-1.0, low), min(1.0, high))


def _binary(xs: Sequence[float]) -> bool:
    return all(x == 0.0 or x == 1.0 for x in xs)


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


def sign_test(wins: int, losses: int) -> float:
    """Two-sided mid-p value of ``wins`` against ``losses`` discordant pairs under a fair coin: McNemar's
    test for paired 1/0 outcomes (pairs that agree carry no information), in the mid-p form Fagerland,
    Lydersen and Laake (2013) recommend over the exact conditional one, which is conservative (5 wins to
    none: mid-p 0.031, exact 0.063)."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n - 0.5 * math.comb(n, k) / 2.0**n
    return min(1.0, 2.0 * tail)


def paired_p_value(a: Sequence[float], b: Sequence[float], resamples: int = 10000, seed: int = 0) -> float:
    """Two-sided p-value of "a and b have the same mean" over paired units.

    1/0 outcomes (a needle found or not): ``sign_test`` on the discordant pairs. Other measures: a
    sign-flip permutation test of the mean difference (each unit's difference keeps its size, its sign is
    drawn at random), exact over every sign pattern up to 2¹⁴ of them, else ``resamples`` draws (with
    the observed pattern counted, so p is never 0)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    if _binary(a) and _binary(b):
        return sign_test(sum(x > y for x, y in zip(a, b, strict=True)), sum(x < y for x, y in zip(a, b, strict=True)))
    diffs = [x - y for x, y in zip(a, b, strict=True) if x != y]
    if not diffs:
        return 1.0
    observed = abs(sum(diffs)) - 1e-12 * len(diffs)  # float ties count as extreme as the observed
    n = len(diffs)
    if n <= 14:
        hits = sum(abs(sum(d if mask >> i & 1 else -d for i, d in enumerate(diffs))) >= observed
                   for mask in range(1 << n))
        return hits / (1 << n)
    rng = random.Random(seed)
    hits = sum(abs(sum(d if rng.random() < 0.5 else -d for d in diffs)) >= observed for _ in range(resamples))
    return (hits + 1) / (resamples + 1)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment: the adjusted p of each comparison, in the given order (significant at
    level α when ≤ α; controls the chance of any false positive among all of them at α)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    out = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        out[i] = running
    return out
