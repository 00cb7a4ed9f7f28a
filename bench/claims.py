"""The claims of the seed papers, restated as relative claims the embedded model can test, with verdicts.

Each claim compares two rows of the grid (``bench/evidence.py``) on the same units — needle trials,
agreement questions, perplexity windows — at each budget: a *cell* is the paired difference of the
per-unit measures (higher is better in every table) with a 95% bootstrap interval over the units.

Cell verdicts, by the kind of claim (δ: the margin of the table, ``MARGINS``):

* ``better`` (A beats B): holds when the interval is above 0, does not hold when it is below 0,
  inside the noise when it contains 0;
* ``competitive`` (A is not worse than B by more than δ): holds when the interval is above −δ, does
  not hold when it is below −δ, inside the noise otherwise;
* ``close`` (A and B within δ of each other): holds when the interval lies inside [−δ, δ], does not
  hold when it lies wholly outside it, inside the noise otherwise.

A claim's verdict from its cells, by its quantifier: ``every`` (at every budget, on every table) holds
when every cell holds and does not hold when any cell does not; ``most`` holds when more than half the
cells hold and does not hold when at least half do not (no majority can hold); otherwise inside the noise.
"""

from __future__ import annotations

from dataclasses import dataclass

from grid_units import units

HOLDS, FAILS, NOISE = "holds", "does not hold", "inside the noise"
TABLES = ("needle", "agreement", "ppl")
#: δ per table, in the table's unit: found-rate (0–1), token F1 (0–1), perplexity gap (percentage points)
MARGINS = {"needle": 0.10, "agreement": 0.05, "ppl": 2.0, "correlation": 0.0}
_UNIT = {"needle": (" pp", 100.0, 0), "agreement": ("", 1.0, 2), "ppl": (" pp", 1.0, 1), "correlation": ("", 1.0, 2)}


@dataclass(frozen=True)
class Claim:
    paper: str
    text: str  # the claim restated for this model
    a: str  # the policy claimed better / competitive / close
    b: str  # what it is compared with
    kind: str = "better"  # better | competitive | close
    quantifier: str = "every"  # every | most
    quote: str = ""  # the paper's own number: model, benchmark, figure


def cell_verdict(low: float, high: float, kind: str = "better", margin: float = 0.0) -> str:
    """One paired difference's verdict (see the module docstring)."""
    if kind == "better":
        return HOLDS if low > 0 else FAILS if high < 0 else NOISE
    if kind == "competitive":
        return HOLDS if low > -margin else FAILS if high < -margin else NOISE
    if kind == "close":
        if -margin < low and high < margin:
            return HOLDS
        return FAILS if low > margin or high < -margin else NOISE
    raise ValueError(f"unknown kind of claim {kind!r}")


def claim_verdict(cells: list[str], quantifier: str = "every", expected: int | None = None) -> str:
    """A claim's verdict from its cells' (see the module docstring); no cell: inside the noise.

    ``expected``: how many cells the claim has once every table is run. With fewer, a verdict the
    missing cells could still change says so: "holds so far (2 of 6 cells)".
    """
    if not cells:
        return NOISE
    n, holds, fails = len(cells), cells.count(HOLDS), cells.count(FAILS)
    if quantifier == "every":
        verdict = FAILS if fails else HOLDS if holds == n else NOISE
        final = verdict == FAILS
    elif quantifier == "most":
        verdict = HOLDS if 2 * holds > n else FAILS if 2 * fails >= n else NOISE
        total = max(n, expected or n)
        final = 2 * holds > total or 2 * fails >= total
    else:
        raise ValueError(f"unknown quantifier {quantifier!r}")
    if expected is None or n >= expected or final:
        return verdict
    return f"{verdict} so far ({n} of {expected} cells)"


def paired_cells(data: dict, a: str, b: str, budgets: list[int], seed: int = 0) -> list[dict]:
    """Per (table, budget) where both rows were run on the same units: the paired difference a − b."""
    from kvtool.eval.stats import paired_difference

    out = []
    for table in TABLES:
        for budget in budgets:
            xa, xb = units(data, table, a, budget), units(data, table, b, budget)
            if xa is None or xb is None or len(xa) != len(xb):
                continue
            d = paired_difference(xa, xb, seed=seed)
            out.append({"table": table, "budget": budget, "value": d.value, "low": d.low, "high": d.high,
                        "units": len(xa)})
    return out


def fmt_cell(c: dict) -> str:
    unit, scale, digits = _UNIT[c["table"]]
    where = c["table"] if c.get("budget") is None else f"{c['table']} @ {c['budget']}"
    return (f"{where} {scale * c['value']:+.{digits}f}{unit} [{scale * c['low']:+.{digits}f}, "
            f"{scale * c['high']:+.{digits}f}]")


def judge(claim: Claim, cells: list[dict], expected: int | None = None) -> dict:
    """The claim's row: its cells with their verdicts and the claim's verdict (``expected`` cells in all)."""
    for c in cells:  # one unit gives a degenerate interval: no verdict from it
        c["verdict"] = (cell_verdict(c["low"], c["high"], claim.kind, MARGINS[c["table"]])
                        if c.get("units", 2) >= 2 else NOISE)
    verdict = claim_verdict([c["verdict"] for c in cells], claim.quantifier, expected) if cells else "not run"
    return {"paper": claim.paper, "claim": claim.text, "cells": cells, "quote": claim.quote, "verdict": verdict}


def correlation_cells(dist: dict | None) -> list[dict]:
    """KeyDiff's observation: one cell per layer, the mean Spearman correlation over windows."""
    if dist is None:
        return []
    return [{"table": "correlation", "budget": None, "layer": r["layer"], "units": dist.get("windows", 2),
             **r["spearman"]} for r in dist["layers"]]


_CAOTE = {"h2o": "H2O 16.89 → 33.31 (2K), 26.37 → 40.42 (4K)", "tova": "TOVA 37.52 → 38.08 (2K), 41.49 → 42.24 (4K)",
          "snapkv": "SnapKV 39.60 → 40.05 (2K), 45.18 → 45.34 (4K)"}
_FAST = {"h2o": "H2O +CAOTE 33.31 vs +FastCAOTE 34.07", "tova": "TOVA 38.08 vs 38.19",
         "snapkv": "SnapKV 40.05 vs 40.73"}
_LB = "Llama 3.1-8B-Instruct, LongBench (English) average, budget 2K/4K (CAOTE Table 2): "
CLAIMS = [
    *(Claim("VATP", f"value-aware scores beat attention-only scores for `{b}` on most tables and budgets",
            f"{b}+vatp", b, "better", "most",
            f"LLaMA2-7B-chat, 16 LongBench tasks, 50% KV budget: beats {n} in {k} of 16 tasks "
            f"(Vicuna-v1.5-7B-16k: {v} of 16) (VATP Table 1)")
      for b, n, k, v in (("h2o", "H2O", 12, 12), ("scissorhands", "Scissorhands", 13, 14))),
    *(Claim("CAOTE", f"adding CAOTE improves `{b}` at every budget", f"{b}+caote", b, "better", "every",
            _LB + _CAOTE[b]) for b in ("h2o", "tova", "snapkv")),
    *(Claim("CAOTE", f"FastCAOTE is close to CAOTE on `{b}` (within δ)", f"{b}+fastcaote", f"{b}+caote", "close",
            "every", "Llama 3.1-8B-Instruct, LongBench average, 2K (CAOTE Table 2): " + _FAST[b] +
            "; Spearman ≥ 0.8 between the two scores in every layer (Table 8, Llama 3.2-3B)")
      for b in ("h2o", "tova", "snapkv")),
    *(Claim("CAOTE (greedy)", f"the greedy joint eviction (`caote.greedy=true`) beats one-shot CAOTE on `{b}`",
            f"{b}+caote(greedy=true)", f"{b}+caote", "better", "every",
            "not evaluated by the paper (App. B: scoring assumes one token evicted at a time, which block "
            "eviction breaks)") for b in ("h2o", "tova", "snapkv")),
    *(Claim("KeyDiff", f"key similarity is competitive with `{b}`'s attention scores (not worse by more than δ) "
            "without computing attention", "keydiff", b, "competitive", "most",
            "Llama 3.1-8B-Instruct, LongBench (English), block prefill B = 128, budget 2K (KeyDiff Table 1): "
            "KeyDiff 44.33, SnapKV 39.60, TOVA 37.52, H2O 16.89, dense 49.20") for b in ("h2o", "tova", "snapkv")),
    *(Claim("RazorAttention", f"at equal KV bytes, `razor` beats `{b}`", "razor", b, "better", "every",
            f"Llama3-8B-Instruct, LongBench average, 3.125× compression (Razor Table 3): all KV 35.44, RA 34.86, "
            f"{'H2O 32.89' if b == 'h2o' else 'StreamingLLM 9.86'}") for b in ("h2o", "sink")),
    Claim("RazorAttention", "`razor` is near dense quality (not worse than `full` by more than δ)", "razor", "full",
          "competitive", "every", "“reduction in KV cache size by over 70% without noticeable impacts on "
          "performance” (abstract); Qwen1.5-7B-Chat LongBench average: all KV 36.03, RA 35.87 (Table 3)"),
]
#: KeyDiff's observation (one cell per layer; bench/distinctiveness.py)
CORRELATION = Claim("KeyDiff", "distinctive keys receive high attention: Spearman correlation of 1 − cosine to the "
                    "mean normalised key with the mean attention received, above 0 in most layers", "", "", "better",
                    "most", "Llama 3.2-3B-Instruct, first NarrativeQA sample, first 64 tokens: shown as a figure "
                    "(KeyDiff Figure 2), no coefficient given")


def claims_rows(data: dict, budgets: list[int]) -> list[dict]:
    """Every claim's row from the grid results (claims whose rows were not run have no cells)."""
    rows = [judge(c, paired_cells(data, c.a, c.b, budgets), len(TABLES) * len(budgets)) for c in CLAIMS]
    rows.insert(len(rows) - 3, judge(CORRELATION, correlation_cells(data.get("distinctiveness", {}).get("result"))))
    razor = razor_memory_row(data.get("razor-bytes", {}).get("result"))
    if razor is not None:
        rows.append(razor)
    return rows


def razor_memory_row(result: dict | None) -> dict | None:
    """≥ 70% KV reduction with retrieval heads kept whole: bytes are exact, so the verdict has no noise."""
    if not result or not result.get("docs"):
        return None
    docs = result["docs"]
    paper = min(d["paper_layout_reduction"] for d in docs)
    by_budget = {}
    for d in docs:
        for r in d["rows"]:
            if r["policy"] == "razor":
                by_budget.setdefault(r["budget"], []).append(r["reduction_vs_dense"])
    held = "; ".join(f"budget {b}: {100 * min(v):.0f}–{100 * max(v):.0f}% less than dense"
                     for b, v in sorted(by_budget.items()))
    whole = ", ".join(f"{d['doc']} {d['whole_budget']} of {d['tokens']}" for d in docs)
    text = (f"{held} (razor holds what `h2o` and `sink` hold at the same budget); retrieval heads "
            f"{docs[0]['retrieval_kv_heads']} of {docs[0]['kv_heads']} KV heads; the paper's layout (retrieval heads "
            f"whole, others sinks + N/5) saves {100 * paper:.0f}%; budget keeping every retrieval head whole: {whole}")
    return {"paper": "RazorAttention", "claim": "≥ 70% KV reduction with retrieval heads kept whole",
            "cells": [], "measurement": text, "verdict": HOLDS if paper >= 0.70 else FAILS,
            "quote": "Llama2-13B-64K Needle in a Haystack at 70% compression (Figure 1); Table 2's settings give "
                     "3.125× compression on long inputs (buffer max(4000, N/5), 15% of heads whole)"}


def table_claims(rows: list[dict]) -> str:
    lines = ["| paper | claim, restated for this model | measured here: paired difference [95%] | verdict | "
             "the paper's own number |", "|---|---|---|---|---|"]
    for r in rows:
        if "measurement" in r:
            measured = r["measurement"]
        elif not r["cells"]:
            measured = "not run"
        elif r["cells"][0]["table"] == "correlation":
            above = sum(c["verdict"] == HOLDS for c in r["cells"])
            below = sum(c["verdict"] == FAILS for c in r["cells"])
            spread = ", ".join(f"L{c['layer']} {c['value']:+.2f}" for c in r["cells"])
            measured = f"above 0 in {above} of {len(r['cells'])} layers, below in {below}: {spread}"
        else:
            measured = "; ".join(fmt_cell(c) + ("" if c["verdict"] == NOISE else f" ({c['verdict']})")
                                 for c in r["cells"])
        lines.append(f"| {r['paper']} | {r['claim']} | {measured} | **{r['verdict']}** | {r['quote']} |")
    return "\n".join(lines)


RULES = ("Verdicts. Each cell is the paired difference A − B over the same needle trials (found: 1/0), agreement "
         "questions (token F1 against the dense answer, three documents pooled) or perplexity windows (minus the "
         "gap to dense, %), at one budget, with a 95% interval over those units (Newcombe's paired score "
         "interval for found/not found, a bootstrap for means); higher is better in "
         "every table. *Beats*: a cell holds when its interval is above 0, does not hold when it is below 0, and "
         "is inside the noise when it contains 0. *Competitive* / *near dense*: the same against −δ. *Close*: "
         "holds when the interval lies inside [−δ, δ], does not hold when it lies wholly outside. δ = 10 points "
         "of found-rate, 0.05 token F1, 2 points of perplexity gap. A claim made *at every budget* holds when "
         "every cell holds and does not hold when any cell does not; a claim made *on most tasks* holds when "
         "more than half the cells hold and does not hold when at least half do not. Otherwise: inside the "
         "noise. While some of a claim's cells are not run yet, a verdict they could still change says *so far*. "
         "Cells inside the noise are listed without a mark.")
