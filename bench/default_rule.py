"""Which policy the evidence supports as kvtool's default: the rule of docs/results.md and its outcome.

``choose_default`` applies ``DEFAULT_RULE`` to the agreement and needle tables (bench/results.py prints both);
``beside_the_rule`` reports the tables the rule does not use.
"""

from __future__ import annotations

from typing import NamedTuple

from grid_units import units
from result_tables import DEFAULT

#: the default-policy rule, as the page states it (``choose_default`` applies it)
DEFAULT_RULE = ("The rule: a candidate is never significantly below the best policy at its budget in the agreement "
                "table (token F1) nor in the needle table (found-rate), and only policies run in both compete. A "
                "candidate replaces the default (`{default}`) only when it beats it in some table and budget with a "
                "p-value under 0.05 after Holm's adjustment over every comparison made (McNemar's mid-p test on the "
                "paired needle trials, a sign-flip permutation test on F1 per question), and is significantly worse "
                "in none: with many policies compared, some beat the default at 95% by chance.")


class Cell(NamedTuple):
    """One comparison of a candidate with the default: mean difference and p-value over the same units."""

    policy: str
    table: str
    budget: int
    diff: float
    p: float


def choose_default(data: dict, incumbent: str = DEFAULT) -> list[str]:
    """Which policy the data supports as the default, and whether it should replace ``incumbent``: the rule
    ``DEFAULT_RULE`` states (printed above its outcome on the page). A policy the agreement table has not run
    yet can neither win nor set the bar; a default that is itself no candidate leaves the candidates' highest
    mean F1 named, the others being inside each other's noise."""
    from kvtool.eval.needle import summarize
    from kvtool.eval.stats import holm, paired_p_value

    agreement, needle = data.get("agreement"), data.get("needle")
    if agreement is None:
        return ["(agreement table not run)"]
    rows = agreement["result"]["results"]
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["policy"], []).append(r)
    budgets = sorted({r["budget"] for r in rows})
    score = {p: sum(r["f1"]["value"] for r in rs) / len(rs) for p, rs in by.items()}
    worse = {p for p, rs in by.items() if any(r["significant"] for r in rs)}
    agreement_worse = set(worse)
    below = ", ".join(f"`{p}`" for p in sorted(worse)) or "none"
    out = [f"Mean token F1 against the dense answer over budgets {budgets}: " +
           ", ".join(f"`{p}` {score[p]:.2f}" for p in sorted(score, key=score.get, reverse=True)) +
           f"; significantly below the best policy at some budget: {below}."]
    if needle is not None:
        both = [r for r in needle["result"]["results"] if r["policy"] in score or r["budget"] is None]
        acc = [r for r in summarize(both) if r["budget"] is not None and not r.get("recall")]
        out.append("Needle found-rate (eviction only, all lengths; the policies of the agreement table): " + ", ".join(
            f"`{r['policy']}` @ {r['budget']} {100 * r['accuracy']:.0f}%{' ✱' if r['significant'] else ''}"
            for r in acc) + ".")
        worse |= {r["policy"] for r in acc if r["significant"]}
    candidates = sorted((p for p in score if p not in worse), key=score.get, reverse=True)
    if not candidates:
        return out + ["No policy is within the interval of the best in every table."]
    out.append(f"Never significantly below the best at its budget in either table: "
               f"{', '.join(f'`{p}`' for p in candidates)}.")
    if incumbent not in candidates:
        where = "the needle table" if incumbent not in agreement_worse else "the agreement table"
        return out + [f"The default `{incumbent}` is significantly below the best in {where}. The candidates are "
                      f"inside each other's noise; of them the highest mean F1 is **`{candidates[0]}`**. kvtool "
                      f"still defaults to `{incumbent}`: the default-settings section below was measured with it, "
                      "and moves with the default."]
    cells: list[Cell] = []  # every candidate against the incumbent, on the same units
    for cand in (c for c in candidates if c != incumbent):
        for table in ("needle", "agreement"):
            for budget in budgets:
                xa, xb = units(data, table, cand, budget), units(data, table, incumbent, budget)
                if xa is None or xb is None or len(xa) != len(xb) or len(xa) < 2:
                    continue
                diff = sum(xa) / len(xa) - sum(xb) / len(xb)
                cells.append(Cell(cand, table, budget, diff, paired_p_value(xa, xb)))
    if not cells:
        return out + [f"No candidate shares units with `{incumbent}`: the default stays **`{incumbent}`**."]
    adjusted = holm([c.p for c in cells])
    worse_somewhere = {c.policy for c in cells if c.diff < 0 and c.p <= 0.05}
    better = sorted((a, c) for c, a in zip(cells, adjusted, strict=True) if c.diff > 0)  # most significant first

    def cell(c: Cell, adj: float) -> str:
        unit = f"{100 * c.diff:+.0f} pp" if c.table == "needle" else f"{c.diff:+.2f} F1"
        return (f"`{c.policy}` {c.table} @ {c.budget} {unit} (p = {c.p:.3f}; {adj:.3f} after Holm over "
                f"{len(cells)} cells)")

    wins = [(a, c) for a, c in better if a <= 0.05 and c.policy not in worse_somewhere]
    if wins:
        return out + [f"Beats the default `{incumbent}` beyond the noise: {cell(wins[0][1], wins[0][0])}: the "
                      f"data supports **`{wins[0][1].policy}`**."]
    closest = f" The closest: {cell(better[0][1], better[0][0])}." if better else ""
    return out + [f"No candidate beats `{incumbent}` in any cell once the {len(cells)} comparisons are adjusted "
                  f"(Holm): the default stays **`{incumbent}`**.{closest}"]


def beside_the_rule(data: dict) -> list[str]:
    """The tables the rule does not use (fixed before they were run), reported beside it: they may disagree."""
    out = []
    multi = data.get("needle-multi")
    if multi is not None:
        rows = [r for r in multi["result"]["summary"] if r["budget"] is not None]
        out.append("Multi-needle found-rate (not in the rule): " + ", ".join(
            f"`{r['policy']}` {r['correct']}/{r['total']}{' ✱' if r['significant'] else ''}" for r in rows) + ".")
    ppl = data.get("ppl")
    if ppl is not None:
        rows = [r for r in ppl["result"]["results"] if r["budget"] is not None]
        gaps = [f"`{r['policy']}` {r['window_gap_pct']['value']:+.1f}%{' ✱' if r['significant'] else ''}" for r in rows]
        out.append("Mean perplexity gap per window (not in the rule): " + ", ".join(gaps) + ".")
    return out
