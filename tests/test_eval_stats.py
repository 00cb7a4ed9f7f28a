"""Interval arithmetic against known values, resumption, agreement metrics on hand-made answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool.eval import CellLog
from kvtool.eval.metrics import exact_match, rouge_l, token_f1
from kvtool.eval.stats import (
    best_in_group,
    bootstrap_mean,
    holm,
    newcombe_difference,
    newcombe_paired,
    paired_difference,
    paired_p_value,
    sign_test,
    wilson,
)


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    [  # reference values: Newcombe (1998) Table I, and R's binom::binom.wilson / statsmodels proportion_confint
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),
        (20, 20, 0.8389, 1.0),
        (5, 10, 0.2366, 0.7634),
    ],
)
def test_wilson_matches_published_values(k: int, n: int, low: float, high: float) -> None:
    iv = wilson(k, n)
    assert iv.value == pytest.approx(k / n)
    assert iv.low == pytest.approx(low, abs=1e-4) and iv.high == pytest.approx(high, abs=1e-4)


def test_newcombe_difference_matches_published_example() -> None:
    # Newcombe (1998), "Interval estimation for the difference between independent proportions", example (a):
    # 56/70 − 48/80 = 0.2, method 10 interval 0.0524 to 0.3339
    iv = newcombe_difference(56, 70, 48, 80)
    assert iv.value == pytest.approx(0.2)
    assert iv.low == pytest.approx(0.0524, abs=1e-3) and iv.high == pytest.approx(0.3339, abs=1e-3)
    assert iv.excludes(0.0)
    assert not newcombe_difference(5, 10, 6, 10).excludes(0.0)


def test_bootstrap_mean_is_seeded_and_brackets_the_mean() -> None:
    xs = [0.1, 0.4, 0.35, 0.8, 0.55, 0.2, 0.9, 0.05]
    a, b = bootstrap_mean(xs, seed=1), bootstrap_mean(xs, seed=1)
    assert a == b and a.low < a.value < a.high
    assert a.value == pytest.approx(sum(xs) / len(xs))
    # the percentile interval of a mean of 8 values lies inside the data's range
    assert min(xs) <= a.low and a.high <= max(xs)
    constant = bootstrap_mean([2.0] * 5)
    assert (constant.low, constant.value, constant.high) == (2.0, 2.0, 2.0)


def test_paired_difference_sees_a_consistent_shift_that_unpaired_noise_hides() -> None:
    base = [1.0, 5.0, 2.0, 8.0, 3.0, 9.0, 4.0, 7.0]
    shifted = [x + 0.5 for x in base]
    iv = paired_difference(shifted, base)
    assert iv.value == pytest.approx(0.5) and iv.low == pytest.approx(0.5) and iv.excludes(0.0)
    with pytest.raises(ValueError):
        paired_difference([1.0], [1.0, 2.0])


def test_newcombe_paired_matches_the_published_example() -> None:
    """Cavo et al. 2012 in Fagerland, Lydersen & Laake, *Statistical Analysis of Contingency Tables*, ch. 8:
    59 both, 6 / 16 one only, 80 neither: −0.0621 (95% CI −0.1186 to −0.0046)."""
    iv = newcombe_paired(59, 6, 16, 80)
    assert (round(iv.value, 4), round(iv.low, 4), round(iv.high, 4)) == (-0.0621, -0.1186, -0.0046)


def test_paired_rates_use_newcombe_and_keep_their_coverage() -> None:
    """1/0 outcomes on the same trials: 4 found by a only, none by b only, in 30 trials. A percentile
    bootstrap calls that significant; the paired score interval does not (McNemar mid-p 0.0625). Over
    simulated pairs the interval covers the true difference about 95% of the time."""
    import random

    a = [1.0] * 9 + [0.0] * 21
    b = [1.0] * 5 + [0.0] * 25
    assert not paired_difference(a, b).excludes(0.0)
    assert bootstrap_mean([x - y for x, y in zip(a, b, strict=True)]).excludes(0.0)
    assert sign_test(4, 0) == pytest.approx(0.0625)
    rng = random.Random(7)
    for p11, p10, p01, n in ((0.15, 0.1, 0.02, 30), (0.4, 0.1, 0.1, 30), (0.6, 0.2, 0.05, 20)):
        hits = 0
        for _ in range(1500):
            cells = [0, 0, 0, 0]
            for _ in range(n):
                u = rng.random()
                cells[0 if u < p11 else 1 if u < p11 + p10 else 2 if u < p11 + p10 + p01 else 3] += 1
            iv = newcombe_paired(*cells)
            hits += iv.low <= p10 - p01 <= iv.high
        assert 0.93 <= hits / 1500 <= 0.99


def test_p_values_match_brute_force_and_holm_steps_down() -> None:
    from math import comb

    for wins, losses in ((5, 0), (7, 2), (3, 3), (0, 0)):
        n, k = wins + losses, min(wins, losses)
        # mid-p: P(X < k) + P(X = k) / 2, doubled, X ~ Binomial(n, 1/2)
        brute = 1.0 if n == 0 else min(1.0, 2 * (sum(comb(n, i) for i in range(k)) + comb(n, k) / 2) / 2**n)
        assert sign_test(wins, losses) == pytest.approx(brute)
    assert paired_p_value([1.0, 0.0, 1.0], [0.0, 0.0, 1.0]) == sign_test(1, 0)  # 1/0 outcomes: McNemar
    # means: every sign pattern of the differences 1, 2, 3 — |sum| ≥ 6 in 2 of 8
    assert paired_p_value([1.5, 2.5, 3.5, 0.2], [0.5, 0.5, 0.5, 0.2]) == pytest.approx(2 / 8)
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.001]) == pytest.approx([0.5, 0.002])


def test_best_in_group_compares_rows_within_their_budget() -> None:
    budgets = [None, 256, 256, 1024, 1024, 256]
    f1 = [1.0, 0.5, 0.6, 0.7, 0.9, 0.6]
    # full (None) is alone: nothing to compare with; at 256 the first 0.6 wins the tie; at 1024 0.9 wins
    assert best_in_group(budgets, f1) == [None, 2, 2, 4, 4, 2]
    assert best_in_group(budgets, f1, higher_is_better=False) == [None, 1, 1, 3, 3, 1]
    with pytest.raises(ValueError):
        best_in_group([1, 2], [0.5])


def test_needle_summary_marks_significance_per_budget_and_against_full() -> None:
    from kvtool.eval.needle import summarize

    cells = [
        {"policy": "full", "budget": None, "correct": 30, "trials": 30},
        {"policy": "sink", "budget": 256, "correct": 10, "trials": 30},
        {"policy": "h2o", "budget": 256, "correct": 5, "trials": 30},
        {"policy": "tova", "budget": 256, "correct": 0, "trials": 30},
        {"policy": "tova", "budget": 256, "recall": 256, "correct": 28, "trials": 30},
        {"policy": "sink", "budget": 256, "recall": 256, "correct": 12, "trials": 30},
    ]
    summary = summarize(cells)
    recalled = {r["policy"]: r for r in summary if r["recall"]}
    rows = {r["policy"]: r for r in summary if not r["recall"]}
    # recall rows are compared with recall rows: they do not make the eviction-only rows "significant"
    assert recalled["tova"]["best"] and recalled["sink"]["significant"]
    assert rows["sink"]["best"] and not rows["full"]["best"]  # full is the reference, alone in its group
    # 10/30 vs 5/30: Newcombe's interval for the difference contains 0; 10/30 vs 0/30 does not
    assert not rows["h2o"]["significant"] and rows["tova"]["significant"]
    assert all(rows[p]["below_full"] for p in ("sink", "h2o", "tova")) and not rows["full"]["below_full"]


def test_agreement_metrics_on_hand_made_answers() -> None:
    ref = "Sherlock Holmes lives at 221B Baker Street."
    assert exact_match(ref, "sherlock holmes lives at 221b baker street")
    assert not exact_match(ref, "Holmes lives at 221B Baker Street.")
    # 6 of 7 reference words, all 6 candidate words: P = 1, R = 6/7
    assert token_f1(ref, "Holmes lives at 221B Baker Street") == pytest.approx(2 * 1 * (6 / 7) / (1 + 6 / 7))
    assert token_f1(ref, "Watson") == 0.0 and token_f1("", "") == 1.0 and token_f1("a", "") == 0.0
    # LCS of "the cat sat on the mat" and "the cat lay on the mat" is 5 words of 6 each
    assert rouge_l("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    assert rouge_l("a b c d", "d c b a") == pytest.approx(0.25)


def test_cell_log_resumes_only_matching_settings(tmp_path: Path) -> None:
    path = tmp_path / "runs" / "log.jsonl"
    calls: list[str] = []

    def work(key: str) -> dict[str, str]:
        calls.append(key)
        return {"v": key}

    log = CellLog(path, "needle", {"seed": 0})
    assert log.cached("a", lambda: work("a")) == {"v": "a"}
    assert log.cached("b", lambda: work("b")) == {"v": "b"}
    # a run killed mid-write leaves a torn line: it is skipped
    with open(path, "a", encoding="utf-8") as fh:
        fh.write('{"task": "needle", "fing')
    again = CellLog(path, "needle", {"seed": 0})
    assert again.cached("a", lambda: work("a2")) == {"v": "a"} and "b" in again
    assert calls == ["a", "b"]  # nothing finished was recomputed
    other = CellLog(path, "needle", {"seed": 1})  # other settings: nothing reused
    assert "a" not in other and other.ignored == 2
    lines = [json.loads(x) for x in path.read_text().splitlines()[:2]]
    assert {ln["key"] for ln in lines} == {"a", "b"}
