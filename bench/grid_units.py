"""Per-unit measurements of the grid tables: what bench/claims.py compares in pairs and bench/default_rule.py
tests the default against (needle trials, questions, perplexity windows).

Below both bench/evidence.py (which renders the claims) and bench/claims.py: neither imports the other's
caller, so there is no import circle.
"""

from __future__ import annotations


def suffix(budget: int) -> str:
    """Task-name suffix of a budget: none for 256 (the tables and logs that existed before), ``-1024`` else."""
    return "" if budget == 256 else f"-{budget}"


def units(data: dict, table: str, policy: str, budget: int | None) -> list[float] | None:
    """The per-unit measure of one row, oriented so that higher is better, in the order the units were run.

    ``needle``: 1/0 per trial (every length, depth, trial; eviction only); ``agreement``: token F1 per
    question (pooled documents); ``ppl``: minus the perplexity gap % per window. None when not run.
    """
    b = None if policy == "full" else budget
    if table == "needle":
        task = data.get(f"needle{suffix(budget)}")
        if task is None:
            return None
        cells = [c for c in task["result"]["results"] if c["policy"] == policy and c["budget"] == b
                 and not c.get("recall", 0)]
        out = [float(a["correct"]) for c in cells for a in c["answers"]]
        return out or None
    if table == "ppl":
        task = data.get(f"ppl{suffix(budget)}")
        rows = [] if task is None else [r for r in task["result"]["results"] if r["policy"] == policy and
                                        r["budget"] == b]
        return [-100.0 * (s["ppl"] / s["dense_ppl"] - 1.0) for s in rows[0]["samples"]] if rows else None
    task = data.get("agreement")
    if task is None:
        return None
    if policy == "full":
        n = len(task["result"]["results"][0]["answers"]) if task["result"]["results"] else 0
        return [1.0] * n or None  # the dense answer against itself
    rows = [r for r in task["result"]["results"] if r["policy"] == policy and r["budget"] == budget]
    return [a["f1"] for a in rows[0]["answers"]] if rows else None
