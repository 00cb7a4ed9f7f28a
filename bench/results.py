"""Regenerate docs/results.md: every evaluation table behind kvtool's claims, with 95% intervals.

    python bench/results.py                 # the whole grid (resumable: rerun after a stop, finished cells are kept)
    python bench/results.py --only needle,agreement
    python bench/results.py --quick         # fewer trials/questions/windows: a smoke run of the pipeline
    python bench/results.py --only agreement --policies h2o,h2o+vatp --budgets 256   # a piece of the grid
    python bench/results.py --scratch /tmp/try --only needle --policies razor --trials 1  # nothing tracked written

The grid tables hold every policy at budgets 256 and 1024 (bench/evidence.py; rows run with ``--policies``
are merged into them); the claims table is bench/claims.py's; the default settings' section is
bench/defaults.py's and the quantized K/V section bench/kv_tables.py's (their commands run with kvtool's own
answering defaults, not pinned).

Each table is one ``kvtool eval ... --json --resume bench/results-runs/NAME.jsonl`` command (printed under the
table with its run time), so anyone can rerun one table; the kvpress side-by-side is
``python bench/peer/compare.py``. Raw results go to docs/results-data.json; docs/results.md is written
whole from them (do not edit it by hand: edit this script). The total run time is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import cite_table
import defaults
import evidence
import kv_tables

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DOC = ROOT / "docs" / "results.md"
DATA = ROOT / "docs" / "results-data.json"
RESUME = ROOT / "bench" / "results-runs"  # tracked: a later session resumes what an earlier one finished
START, END = "<!-- RESULTS START -->", "<!-- RESULTS END -->"
CORPUS = "../shared/corpus"
POLICIES = "sink,h2o,tova,snapkv,keydiff,snapkv+caote"
ORDER = ("needle", "needle-recall", "agreement", "ppl", "needle-1024", "ppl-1024", "distinctiveness", "razor-bytes",
         "peer", "needle-multi", "needle-name-1k", "needle-multi-1k", "needle-name-8k", "needle-multi-8k", "block-64",
         "block-256", "recall-page-16", "recall-page-64", "archive-float16", "archive-int8", "needle-recall-2k",
         "needle-recall-long", "needle-recall-32k", "needle-32k-full", "needle-recall-64k", *defaults.TASKS,
         *kv_tables.TASKS, "citations")
PAGES = (16, 64)  # archive page sizes compared with the default 32 (needle with recall, the default policy)
BLOCKS = (64, 256)  # block sizes compared with the default 128 (the agreement table) for the default policy


def _default_policy() -> str:
    from kvtool.runtime.settings import Settings

    return Settings().policy


DEFAULT = _default_policy()  # the block-size rows and the recall rows follow the default, whatever it is
#: how long a table's trials took when they ran, for the tables a rerun resumes in seconds
RAN = {"needle-recall": "the recall trials ran beside other runs at low priority",
       "needle-recall-2k": "the recall trials ran in 424 s beside other runs",
       "needle-recall-long": "this session's `full`, `tova`, `snapkv` and `keydiff` trials ran in 7,730 s beside "
                             "other runs",
       "needle-recall-32k": "the recall trials ran in 5,743 s beside other runs",
       "needle-32k-full": "over three sessions; each dense trial took 10 to 12 minutes alone on 2 threads (the "
                          "first, 1,290 s, beside another run)",
       "needle-recall-64k": "the trials ran in 1,782 s beside other runs"}
# needle-recall shares needle's log: its full and eviction-only trials are needle's, resumed
LOGS = {"needle-recall": "needle", "agreement-aord": "agreement", "needle-multi-1k": "needle-multi"}


def tasks(opts: argparse.Namespace) -> dict[str, list[str]]:
    """Every task's ``kvtool eval`` argv; the grid tables (needle, agreement, ppl) come from bench/evidence.py."""
    trials = str(opts.trials or (3 if opts.quick else 10))
    multi_trials = str(opts.trials or (3 if opts.quick else 5))
    pols = POLICIES.split(",")
    recall_rows = ["--policies", f"full,sink,{DEFAULT}", "--budgets", "256", "--recall", "0,256"]
    out = evidence.grid_tasks(opts.policies or evidence.grid_policies(), opts.budgets or evidence.BUDGETS,
                              int(trials), opts.samples or (4 if opts.quick else 16))
    return {
        **out,
        **defaults.TASKS,  # the default settings' section: kvtool's own answering defaults
        **kv_tables.TASKS,  # --kv-dtype at equal tokens and equal bytes, with the default settings
        # recall for sink (the best eviction-only policy of the first six run at 256) and the default
        "needle-recall": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths", "1k",
                          "--depths", "0.1,0.5,0.9", "--trials", trials, *recall_rows, "--max-new-tokens", "16"],
        # longer haystacks: with and without recall, compact positions (--positions auto) past the
        # model's 8,192 positions; penalty 1 as for 2K (1.1 drops a repeated digit of the number). 8K: full and
        # every base policy of the first tables (not the snapkv+caote combination: time); 32K: the default only,
        # without full (a dense 32K pass takes 10+ minutes per trial here: needle-32k-full runs ten per depth).
        **{f"needle-recall-{name}": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths",
                                     length, "--depths", "0.1,0.5,0.9", "--trials", trials, "--policies", *policies,
                                     "--budgets", "256", "--max-new-tokens", "16", "--recall", "0,256",
                                     "--repetition-penalty", "1"]
           for name, length, policies in (("long", "8k", ["full," + ",".join(pols[:-1])]),
                                          ("32k", "32k", [DEFAULT, "--no-full"]))},
        # past 32,768 archived tokens per head (compact: every token scored, in two passes): a sample
        "needle-recall-64k": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths", "64k",
                              "--depths", "0.1,0.5,0.9", "--trials", "1", "--policies", DEFAULT, "--no-full",
                              "--budgets", "256", "--max-new-tokens", "16", "--recall", "0,256",
                              "--repetition-penalty", "1"],
        # the dense reference at 32K: ten trials per depth (a dense 32K pass takes 10+ minutes per trial here)
        "needle-32k-full": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths", "32k",
                            "--depths", "0.1,0.5,0.9", "--trials", "10", "--policies", "full", "--budgets", "256",
                            "--max-new-tokens", "16", "--repetition-penalty", "1"],
        # 2K haystack without the repetition penalty: at 1.1 it drops a repeated digit of the number (see render)
        "needle-recall-2k": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths", "2k",
                             "--depths", "0.1,0.5,0.9", "--trials", trials, "--policies", f"full,{DEFAULT}",
                             "--budgets", "256", "--max-new-tokens", "16", "--recall", "0,256",
                             "--repetition-penalty", "1"],
        # the archive's page size and storage dtype: the default + recall 256 on needle's 1K trials
        **{f"recall-page-{p}": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths", "1k",
                                "--depths", "0.1,0.5,0.9", "--trials", trials, "--policies", DEFAULT, "--budgets",
                                "256", "--max-new-tokens", "16", "--recall", "256", "--recall-page", str(p)]
           for p in PAGES},
        **{f"archive-{dt}": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths", "1k",
                             "--depths", "0.1,0.5,0.9", "--trials", trials, "--policies", DEFAULT, "--budgets", "256",
                             "--max-new-tokens", "16", "--recall", "256", "--archive-dtype", dt]
           for dt in ("float16", "int8")},
        "needle-multi": ["eval", "needle", "--haystack", f"{CORPUS}/paul_graham_essays", "--lengths", "1k",
                         "--depths", "0.1,0.5,0.9", "--trials", multi_trials, "--needles", "3",
                         "--policies", "full," + POLICIES, "--budgets", "256", "--max-new-tokens", "24"],
        **needle_kinds(trials, multi_trials, recall_rows),
        **{f"block-{b}": ["eval", "agreement", "--doc", f"{CORPUS}/paul_graham_essays/aord.txt", "--questions-file",
                          "bench/data/aord_questions.txt", "--policies", DEFAULT, "--budgets",
                          "256" if opts.quick else "256,1024", "--max-new-tokens", "24", "--first-tokens", "8",
                          "--block-size", str(b)] for b in BLOCKS},
    }


def needle_kinds(trials: str, multi_trials: str, recall_rows: list[str]) -> dict[str, list[str]]:
    """A name (a word, not a number) and three labelled numbers (one asked), each with and without recall, at
    1K and 8K tokens (the number's rows are needle-recall and needle-recall-long)."""
    out = {}
    for kind, extra, n, tokens in (("name", ["--needle-kind", "name"], trials, "16"),
                                   ("multi", ["--needles", "3"], multi_trials, "24")):
        for length, penalty in (("1k", []), ("8k", ["--repetition-penalty", "1"])):
            out[f"needle-{kind}-{length}"] = ["eval", "needle", *extra, "--haystack", f"{CORPUS}/paul_graham_essays",
                                              "--lengths", length, "--depths", "0.1,0.5,0.9", "--trials", n,
                                              *recall_rows, "--max-new-tokens", tokens, *penalty]
    return out


def run_eval(name: str, argv: list[str]) -> dict:
    own = name in defaults.TASKS or name in kv_tables.TASKS  # measured with kvtool's own answering defaults
    argv = argv if own else evidence.pinned_answering(argv)
    log = LOGS.get(name, name)
    resume = RESUME / f"{log}.jsonl"
    full = [sys.executable, "-m", "kvtool.cli.app", *argv, "--resume", os.path.relpath(resume, ROOT), "--json"]
    t0 = time.perf_counter()
    print(f"[{name}] kvtool {shlex.join(argv)}", flush=True)
    proc = subprocess.run(full, cwd=ROOT, stdout=subprocess.PIPE, text=True)  # progress bar stays on stderr
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}); rerun to resume")
    print(f"[{name}] {seconds:.0f} s", flush=True)
    return {"command": f"kvtool {shlex.join(argv)} --resume {os.path.relpath(resume, ROOT)} --json",
            "seconds": round(seconds, 1), "result": json.loads(proc.stdout)}


def run_peer(quick: bool) -> dict | None:
    argv = [sys.executable, "bench/peer/compare.py", "--trials", "2" if quick else "3"]
    t0 = time.perf_counter()
    print("[peer] python bench/peer/compare.py", flush=True)
    proc = subprocess.run(argv, cwd=ROOT)
    if proc.returncode != 0:
        print("[peer] failed: the side-by-side table is left out (see its output above)", flush=True)
        return None
    data = json.loads((RESUME / "peer.json").read_text())
    data["wall_seconds"] = round(time.perf_counter() - t0, 1)
    return data


# --------------------------------------------------------------------------------------------- tables
def _iv(x: dict | None, digits: int = 2, pct: bool = False) -> str:
    if x is None:
        return "–"
    if pct:
        return f"{100 * x['value']:.0f}% [{100 * x['low']:.0f}, {100 * x['high']:.0f}]"
    return f"{x['value']:.{digits}f} [{x['low']:.{digits}f}, {x['high']:.{digits}f}]"


def _label(policy: str, budget) -> str:
    return f"`{policy}`" if budget is None else f"`{policy}` @ {budget}"


def table_needle(task: dict) -> str:
    """One column per (length, depth): where a policy finds the needle matters as much as how often."""
    from kvtool.eval.stats import wilson

    res = task["result"]
    lengths, depths = res["settings"]["lengths"], res["settings"]["depths"]
    cols = [(L, d) for L in lengths for d in depths]
    head = [f"depth {d:g}" if len(lengths) == 1 else f"{L} tokens, depth {d:g}" for L, d in cols]
    lines = ["| policy | " + " | ".join(head) + " | all |", "|---|" + "---|" * (len(cols) + 1)]
    for row in res["summary"]:
        key = (row["policy"], row["budget"], row.get("recall", 0))
        cells = []
        for L, d in cols:
            cs = [c for c in res["results"] if (c["policy"], c["budget"], c.get("recall", 0)) == key
                  and c["length"] == L and c["depth"] == d]
            k, n = sum(c["correct"] for c in cs), sum(c["trials"] for c in cs)
            cells.append(f"{k}/{n}")
        mark = " ✱" if row.get("significant") else (" (best)" if row.get("best") else "")
        mark += " ↓" if row.get("below_full") else ""
        iv = wilson(row["correct"], row["total"])
        label = _label(row["policy"], row["budget"]) + (f" + recall {key[2]}" if key[2] else "")
        lines.append(f"| {label} | " + " | ".join(cells) +
                     f" | {_iv(iv.as_dict(), pct=True)} ({row['correct']}/{row['total']}){mark} |")
    return "\n".join(lines)


def table_agreement(task: dict) -> str:
    res = task["result"]
    lines = ["| policy | exact match | token F1 | ROUGE-L | KL(dense‖policy), first 8 tokens | top-1 agreement |",
             "|---|---|---|---|---|---|"]
    for r in res["results"]:
        mark = " ✱" if r["significant"] else (" (best)" if r["best"] else "")
        lines.append(f"| {_label(r['policy'], r['budget'])} | {_iv(r['exact_match'], pct=True)} | "
                     f"{_iv(r['f1'])}{mark} | {_iv(r['rouge_l'])} | {_iv(r['kl'], 3)} | {_iv(r['top1'])} |")
    return "\n".join(lines)


def table_ppl(task: dict) -> str:
    res = task["result"]
    lines = [f"Dense perplexity (pooled): **{res['reference']['ppl']:.3f}**.", "",
             "| policy | ppl | gap % (pooled) | mean window gap % [95%] | KL(dense‖policy) [95%] | top-1 [95%] |",
             "|---|---|---|---|---|---|"]
    for r in res["results"]:
        g = r["window_gap_pct"]
        mark = " ✱" if r["significant"] else (" (best)" if r["best"] else "")
        lines.append(f"| {_label(r['policy'], r['budget'])} | {r['ppl']:.3f} | {r['ppl_gap_pct']:+.2f} | "
                     f"{g['value']:+.2f} [{g['low']:+.2f}, {g['high']:+.2f}]{mark} | {_iv(r['kl_interval'], 4)} | "
                     f"{_iv(r['top1_interval'])} |")
    return "\n".join(lines)


def table_peer(peer: dict) -> str:
    from kvtool.runtime.memory import format_bytes

    lines = ["| policy | tool | needle found [95%] | token F1 vs own dense [95%] | peak RSS | wall time |",
             "|---|---|---|---|---|---|"]
    for r in sorted(peer["rows"], key=lambda x: (x["policy"] != "full", x["policy"], x["impl"])):
        lines.append(f"| `{r['policy']}` | {r['impl']} | {_iv(r['needle'], pct=True)} ({r['needle_found']}/"
                     f"{r['needle_total']}) | {_iv(r['f1_vs_own_full'])} | {format_bytes(r['peak_rss_bytes'])} | "
                     f"{r['seconds']:.0f} s |")
    return "\n".join(lines)


def peer_differences(peer: dict) -> list[str]:
    """Per policy, kvtool against kvpress: the found-rate difference (Newcombe) and whether the F1 intervals overlap."""
    from kvtool.eval.stats import newcombe_difference

    by = {(r["impl"], r["policy"]): r for r in peer["rows"]}
    out, gaps, overlaps = [], [], []
    for policy in sorted({r["policy"] for r in peer["rows"]} - {"full"}):
        a, b = by.get(("kvtool", policy)), by.get(("kvpress", policy))
        if a is None or b is None:
            continue
        d = newcombe_difference(a["needle_found"], a["needle_total"], b["needle_found"], b["needle_total"])
        fa, fb = a["f1_vs_own_full"], b["f1_vs_own_full"]
        overlap = fa["low"] <= fb["high"] and fb["low"] <= fa["high"]
        gaps.append(fb["value"] - fa["value"])
        overlaps.append(overlap)
        rss = a["peak_rss_bytes"] / b["peak_rss_bytes"]
        out.append(f"`{policy}`: needle {a['needle_found']}/{a['needle_total']} (kvtool) vs {b['needle_found']}/"
                   f"{b['needle_total']} (kvpress), difference {100 * d.value:+.0f} points [{100 * d.low:+.0f}, "
                   f"{100 * d.high:+.0f}] — {'significant' if d.excludes(0.0) else 'inside the noise'}; token F1 "
                   f"{fa['value']:.2f} vs {fb['value']:.2f} — intervals "
                   f"{'overlap' if overlap else 'do not overlap'}; peak RSS {rss:.2f}× kvpress's.")
    if gaps:
        ahead = sum(g > 0 for g in gaps)
        noise = "each difference is inside its intervals" if all(overlaps) else "not every interval overlaps"
        out.append(f"kvpress's token F1 is higher in {ahead} of {len(gaps)} policies (by {min(gaps):+.2f} to "
                   f"{max(gaps):+.2f}): {noise}; a consistent sign is what prefill-then-compress (which scores "
                   "with the whole document in view) would be expected to show against a bounded prefill.")
    return out


def table_blocks(data: dict) -> str:
    """Token F1 of the default policy at block 64/128/256; each against block 128 by a paired bootstrap."""
    from kvtool.eval.stats import paired_difference

    def per_question(task: dict) -> dict:
        return {r["budget"]: [a["f1"] for a in r["answers"]] for r in task["result"]["results"]
                if r["policy"] == DEFAULT}

    aord = data.get("agreement-aord", data["agreement"])  # the block rows read aord.txt only
    base = per_question(aord)
    lines = ["| block | " + " | ".join(f"token F1 @ {b} (vs 128)" for b in sorted(base)) + " |",
             "|---|" + "---|" * len(base)]
    for block, task in [(128, aord)] + [(b, data.get(f"block-{b}")) for b in BLOCKS]:
        if task is None:
            continue
        f1 = per_question(task)
        cells = []
        for budget in sorted(base):
            mean = sum(f1[budget]) / len(f1[budget])
            if block == 128:
                cells.append(f"{mean:.2f}")
                continue
            d = paired_difference(f1[budget], base[budget])
            cells.append(f"{mean:.2f} ({d.value:+.2f} [{d.low:+.2f}, {d.high:+.2f}]"
                         f"{', significant' if d.excludes(0.0) else ''})")
        lines.append(f"| {block} | " + " | ".join(cells) + " |")
    cmds = [f"`{data[f'block-{b}']['command']}` — {data[f'block-{b}']['seconds']:.0f} s" for b in BLOCKS
            if f"block-{b}" in data]
    return "\n".join(lines + [""] + cmds)


def table_archive(data: dict) -> str:
    """The default + recall 256 on the same 1K needle trials, by archive page size and storage dtype,
    each against the shipped setting (32-token pages, the model's dtype; Newcombe interval)."""
    from kvtool.eval.stats import newcombe_difference, wilson

    def found(task: dict | None) -> tuple[int, int] | None:
        if task is None:
            return None
        rows = [r for r in task["result"]["summary"] if r["policy"] == DEFAULT and r.get("recall", 0)]
        return (rows[0]["correct"], rows[0]["total"]) if rows else None

    base = found(data.get("needle-recall"))
    variants = [("32 (default)", "model's (float32)", base)]
    variants += [(str(p), "model's (float32)", found(data.get(f"recall-page-{p}"))) for p in PAGES]
    variants[1:1] = [("32", dt, found(data.get(f"archive-{dt}"))) for dt in ("float16", "int8")]
    lines = ["| page size | archive dtype | found | vs the default |", "|---|---|---|---|"]
    for page, dtype, kn in variants:
        if kn is None:
            continue
        k, n = kn
        diff = "–"
        if base is not None and not page.endswith("(default)"):
            d = newcombe_difference(k, n, *base)
            diff = f"{100 * d.value:+.0f} pp [{100 * d.low:+.0f}, {100 * d.high:+.0f}]" + (
                " ✱" if d.excludes(0.0) else " (inside the noise)")
        lines.append(f"| {page} | {dtype} | {_iv(wilson(k, n).as_dict(), pct=True)} ({k}/{n}) | {diff} |")
    return "\n".join(lines)


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
                xa, xb = evidence.units(data, table, cand, budget), evidence.units(data, table, incumbent, budget)
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


def sections(data: dict) -> list[tuple]:
    """The tables written from one eval command each: (data key, heading, text above the table, table)."""
    return [
        ("needle", "Needle in a haystack (one needle), budget 256 on 1K tokens",
         "The needle is a 5-digit *secret number* (`The secret number is N. Remember it: the secret number is N.`), "
         "a new number per trial, asked as `What is the secret number?`. The earlier *pass key* wording made the "
         "135M model define the phrase instead of reading the text (dense found 0 of 12 at 1K tokens, depths "
         "0.1–0.5); with the secret-number wording the dense model finds it where the table shows.", table_needle),
        ("needle-recall", "Needle with recall",
         "The same trials, for `sink` (the best eviction-only policy at budget 256 among the six run first; `razor` "
         "is better in the full grid above) and the default "
         f"(`{DEFAULT}`), "
         "each also answering with `--recall 256`: evicted tokens archived in 32-token pages; every KV head "
         "scores its archive exactly against the queries of the question's own tokens (not the instruction "
         "and chat template around it), the resulting attention is summed per "
         "document position over all heads and layers, and every head brings back the most relevant positions "
         "(with the 8 tokens before and 24 after each) for the answer. The eviction-only and recall rows of a "
         "policy answer from the same read. Earlier selections on these trials: Quest's bound alone, "
         "`sink` 11/30 and `h2o` 28/30; per-head pages re-ranked by exact max q·k, `sink` 24/30, `h2o` 29/30; "
         "the shared ranking with every suffix row voting, `sink` 30/30, `h2o` 29/30.",
         table_needle),
        ("needle-recall-2k", "Needle with recall on a 2K haystack, no repetition penalty",
         f"`full`, the default (`{DEFAULT}`) and the default + recall 256 at budget 256 on a 2K-token haystack, "
         "answered with `--repetition-penalty 1` (off). With the default penalty (1.1 on the answer's own tokens) "
         "and the earlier per-head selection "
         f"`{DEFAULT}` + recall found 7 of these 30 numbers, and "
         "18 of its 23 misses stopped at or skipped a digit the answer had already written (`60494` → `6049`, "
         "`27611` → `2761`). With per-head pages (re-ranked) and no penalty it found 23/30: "
         "11–16 of the 90 KV heads held all five digits and the answers came out cut (`419` for `41190`, "
         "`52` for `52445`); the shared ranking puts them in all 90.", table_needle),
        ("needle-recall-long", "Needle with recall on an 8K haystack",
         "`full` and every policy at budget 256, each with and without recall 256, on an 8K-token haystack, "
         "no repetition penalty. SmolLM2-135M was trained on 8,192 positions: with the chat template and the "
         "question the haystack passes that, so `full` reads past its range and the bounded rows use compact "
         "positions (`--positions auto`); recall scores each archived key where it would land among the kept "
         "ones. With the default penalty (1.1) `full` found 15/30 (0/10 at depth 0.1, 6/10 at 0.5, 9/10 at "
         "0.9). With the earlier per-head selection `h2o` + recall found 0/30 at 8K; with the shared ranking "
         "and every suffix row voting, 30/30. Where a policy + recall misses a whole depth, see "
         "[recall-history.md](recall-history.md).", table_needle),
        ("needle-recall-32k", "Needle with recall on a 32K haystack",
         "The same on a 32K-token haystack (four times the model's trained positions). Recall scores all of "
         "the ~32,500 archived tokens per KV head exactly. Before the ranking used the question's own rows "
         "only (every suffix row voting, at most 8,192 tokens scored per head) it found 2 of 6 (0/2 at depth "
         "0.1, 2/2 at 0.5, 0/2 at 0.9): the instruction's and template's rows attended to essay titles and "
         "dates, and the bound's pre-selection dropped the needle's page in most heads.", table_needle),
        ("needle-32k-full", "The dense reference on the 32K haystack (ten trials per depth)",
         "`full` on the ten trials of each depth above (the same needles), no repetition penalty: the "
         "whole cache at absolute positions, four times the range SmolLM2-135M was trained on. Every answer "
         "is underscores, line breaks and stray words (`_\\nThe\\n_.-\\n_…` at depth 0.1, `the one._\\nthe."
         "TheThe…` at 0.5, nearly the same string for every needle of a depth): the model does not read 32K tokens "
         "at all. A dense 32K pass is quadratic in length: 10 to 12 minutes per trial alone on this 2-core "
         "machine (21 minutes beside another run), so the 30 trials ran over three sessions, resumed from the "
         "log.", table_needle),
        ("needle-recall-64k", "Needle with recall on a 64K haystack (a sample)",
         f"`{DEFAULT}` with and without recall 256 at budget 256 on a 64K-token haystack, one trial per depth. "
         "About 65,000 tokens per KV head are archived: past the 32,768 whose scores recall holds, so every "
         "archived token is scored in two passes (the normaliser, then the probabilities).", table_needle),
        ("needle-multi", "Needle in a haystack (three needles, one asked)",
         "Three labelled secret numbers (`the red door opens with N`) at seeded depths; the question asks for "
         "the one at the cell's depth.", table_needle),
        ("needle-1024", "Needle in a haystack (one needle), budget 1024 on 4K tokens",
         "The same needle at budget 1024 in a 4K-token haystack (a quarter kept, as 256 of 1K), no repetition "
         "penalty (past 1K tokens the default 1.1 drops a repeated digit of the number).", table_needle),
        ("agreement", "Agreement with the dense answer",
         evidence.agreement_intro(data.get("agreement")), table_agreement),
        ("ppl", "Perplexity under eviction",
         "Budget 256, windows of 1K context + 32 continuation tokens spread over *The Adventures of Sherlock Holmes*, "
         "*Pride and Prejudice* and the essays; the continuation is fed one token at a time so eviction runs "
         "as in generation. The dense reference is one plain transformers forward.", table_ppl),
        ("ppl-1024", "Perplexity under eviction, budget 1024 on 4K-token contexts",
         "The same at budget 1024 with 4K tokens of context (a quarter kept).", table_ppl),
    ]


def render(data: dict, total_seconds: float) -> str:
    parts = ["Generated by `python bench/results.py` (do not edit this block by hand). Model: the embedded "
             "SmolLM2-135M-Instruct (fp32, CPU). Every cell carries a 95% interval: Wilson for rates, "
             "percentile bootstrap over questions/windows for means. ✱ marks a row significantly worse than "
             "the best row *at the same budget* (Newcombe interval for rates, paired bootstrap for means); a "
             "difference without ✱ is inside the noise. In needle tables ↓ marks a row significantly below "
             "`full` (the dense reference). A difference between two rows answered on the same trials (a "
             "claim's cell, a dtype against float32) uses Newcombe's paired score interval; choosing the "
             "default among many policies uses p-values adjusted for the number of comparisons (Holm). The "
             "tables answer with the settings they were first measured with, spelled out in each command "
             "(repetition penalty 1.1 unless a table says otherwise, no n-gram guard, the archive in the model's "
             "dtype, recalled passages merged in document order); what kvtool does with nothing but a budget is "
             "its own section, \"Answering with the default settings\".", "",
             evidence.WHAT_A_SMALL_MODEL_SHOWS, ""]
    for key, title, intro, table in sections(data):
        if key not in data:
            continue
        task = data[key]
        parts += [f"## {title}", "", intro, "", table(task), "",
                  f"`{task['command']}` — {task['seconds']:.0f} s"
                  + (f" (resumed from its log {RAN[key]})" if key == "needle-32k-full" else
                     f" (resumed from its log; {RAN[key]})" if key in RAN else ""),
                  ""]
    if "agreement" in data and any(f"block-{b}" in data for b in BLOCKS):
        parts += ["## Block size for the default policy", "",
                  f"`{DEFAULT}` on the agreement questions at prefill blocks of 64, 128 (the default) and 256 tokens; "
                  "each block size's token F1 against block 128's on the same questions (paired bootstrap).", "",
                  table_blocks(data), ""]
    if any(k in data for k in ("archive-float16", "archive-int8", *(f"recall-page-{p}" for p in PAGES))):
        cmds = [f"`{data[k]['command']}` — {data[k]['seconds']:.0f} s"
                for k in (*(f"recall-page-{p}" for p in PAGES), "archive-float16", "archive-int8") if k in data]
        parts += ["## Recall: archive page size and storage dtype", "",
                  f"`{DEFAULT}` at budget 256 + recall 256 on the needle trials above (1K tokens, depths 0.1/0.5/0.9), "
                  "with archive pages of 16, 32 and 64 tokens and with the archive stored in float16 and in int8 "
                  "(a float32 scale per token and head). The 32-token, "
                  "float32 row is the \"Needle with recall\" table's. Re-run on 2026-11-23 with the current ranking "
                  "(the question's own rows vote); with the previous one (every suffix row voting) each row also "
                  "found 29/30.", "", table_archive(data), "",
                  *[f"- {c}" for c in cmds], ""]
    parts += evidence.evidence_sections(data, DEFAULT)
    rule = choose_default(data) + beside_the_rule(data)
    parts += ["## Choosing the default policy", "", DEFAULT_RULE.format(default=DEFAULT), "",
              *[f"- {x}" for x in rule], ""]
    if data.get("peer"):
        peer = data["peer"]
        parts += ["## Side by side with NVIDIA kvpress", "",
                  f"The same cases (needle trials at {peer['length']} tokens, and the agreement questions), the same "
                  f"prompt, {peer['budget']} document tokens kept per head by both tools (kvpress: compression ratio "
                  "1 − budget/context). kvpress prefills the whole document and then compresses it (it sees "
                  "everything before it evicts, but holds it all in memory); kvtool evicts inside a bounded "
                  "block-wise prefill. Both decode greedily without a repetition penalty. F1 is against each "
                  "tool's own uncompressed answer. Rows where kvpress is better are reported as they are.", "",
                  table_peer(peer), "", *[f"- {x}" for x in peer_differences(peer)], "",
                  f"`{peer['command']}` — {peer.get('wall_seconds', peer['seconds']):.0f} s",
                  ""]
    parts += defaults.section(data)
    parts += kv_tables.section(data, RESUME)
    parts += cite_table.section(data.get("citations"))
    parts += [f"Total run time of this regeneration: {total_seconds:.0f} s (resumed cells are not re-run).", ""]
    return "\n".join(parts)


def write_doc(block: str) -> None:
    """Replace the generated block of docs/results.md (between the RESULTS markers); keep the rest."""
    text = DOC.read_text(encoding="utf-8") if DOC.exists() else f"# Results\n\n{START}\n{END}\n"
    if START not in text or END not in text:
        text = text.rstrip() + f"\n\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(f"{head}{START}\n{block.rstrip()}\n{END}{tail}", encoding="utf-8")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma list of: " + ", ".join(ORDER))
    ap.add_argument("--quick", action="store_true", help="fewer trials/windows and budget 256 for the block rows")
    ap.add_argument("--policies", default="", help="grid tables: run these policies only (merged into the tables)")
    ap.add_argument("--budgets", default="", help="grid tables: these budgets only (default 256,1024)")
    ap.add_argument("--trials", type=int, default=0, help="needle trials per cell (default 10; multi-needle 5)")
    ap.add_argument("--samples", type=int, default=0, help="perplexity windows and correlation windows (default 16)")
    ap.add_argument("--render-only", action="store_true", help="rewrite docs/results.md from docs/results-data.json")
    ap.add_argument("--scratch", default="", help="a directory for the logs, the data and the page instead of "
                    "bench/results-runs, docs/results-data.json and docs/results.md (a trial run)")
    args = ap.parse_args()
    args.policies = [p for p in args.policies.split(",") if p]
    try:
        args.budgets = [int(b) for b in args.budgets.split(",") if b]
    except ValueError:
        ap.error(f"--budgets must be a comma list of token counts (got {args.budgets!r})")
    unknown = {x for x in args.only.split(",") if x} - set(ORDER)
    if unknown or args.trials < 0 or args.samples < 0:
        ap.error(f"unknown --only table(s): {', '.join(sorted(unknown))}" if unknown else "counts must be >= 0")
    return args


def save(data: dict) -> None:
    """docs/results-data.json, written whole (temp file, then rename): a stop never leaves it half-written."""
    tmp = DATA.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(DATA)


def run_task(name: str, table: dict, data: dict, args: argparse.Namespace) -> None:
    """Run one table's command(s) and put its result in ``data`` (merged with rows of earlier runs)."""
    if name == "peer":
        peer = run_peer(args.quick)
        if peer is not None:
            data["peer"] = peer
    elif name == "agreement":
        for doc in evidence.DOCS:
            key = f"agreement-{doc[0]}"
            data[key] = evidence.merge(data.get(key), run_eval(key, table[key]))
        data["agreement"] = evidence.pool_agreement([data[f"agreement-{d[0]}"] for d in evidence.DOCS])
    elif name == "distinctiveness":
        samples = str(args.samples or (3 if args.quick else 12))
        data[name] = run_script(name, ["bench/distinctiveness.py", "--samples", samples, "--window", "512",
                                       "--resume", os.path.relpath(RESUME / "distinctiveness.jsonl", ROOT)])
    elif name == "razor-bytes":
        docs = ",".join(d[1] for d in evidence.DOCS)
        budgets = ",".join(map(str, args.budgets or evidence.BUDGETS))
        argv = ["bench/razor_bytes.py", "--docs", docs, "--budgets", budgets]
        old = data.get(name)
        if old is None or old["command"] != f"python {shlex.join(argv)}":  # exact bytes: nothing to resume
            data[name] = run_script(name, argv)
    elif name == "citations":  # timings of a few trials: run once per command, again only when asked by name
        old = data.get(name)
        if old is None or old["command"] != cite_table.commands() or name in args.only.split(","):
            main = run_script(name, cite_table.MAIN)
            micro = [run_script(name, argv) for argv in cite_table.MICRO]
            seconds = main["seconds"] + sum(m["seconds"] for m in micro)
            data[name] = {"command": cite_table.commands(), "seconds": seconds,
                          "result": {**main["result"], "micro": [m["result"] for m in micro]}}
    elif name in table:
        data[name] = evidence.merge(data.get(name), run_eval(name, table[name]))
    else:
        print(f"[{name}] not in this run's budgets: skipped", flush=True)


def run_script(name: str, argv: list[str]) -> dict:
    """A bench script that prints one JSON object (its progress on stderr)."""
    t0 = time.perf_counter()
    print(f"[{name}] python {shlex.join(argv)}", flush=True)
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}); rerun to resume")
    seconds = time.perf_counter() - t0
    print(f"[{name}] {seconds:.0f} s", flush=True)
    return {"command": f"python {shlex.join(argv)}", "seconds": round(seconds, 1), "result": json.loads(proc.stdout)}


def main() -> None:
    global DOC, DATA, RESUME
    args = parse_args()
    if args.scratch:
        scratch = Path(args.scratch).resolve()
        DOC, DATA, RESUME = scratch / "results.md", scratch / "results-data.json", scratch / "results-runs"
    t0 = time.perf_counter()
    RESUME.mkdir(parents=True, exist_ok=True)
    data = json.loads(DATA.read_text()) if DATA.exists() else {}
    if not isinstance(data, dict) or "version" not in data:
        data = {"version": 2}
    if not args.render_only:
        only = {x for x in args.only.split(",") if x}
        table = tasks(args)
        for name in ORDER:  # most decisive first: a stopped run has the tables that matter most
            if not only or name in only:
                run_task(name, table, data, args)
                save(data)
        data["total_seconds"] = round(time.perf_counter() - t0, 1)
        save(data)
    total = data.get("total_seconds", 0.0)  # --render-only keeps the last run's figure
    write_doc(render(data, total))
    print(f"wrote {DOC}; this run took {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
