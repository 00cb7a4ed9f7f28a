"""The policy grid of docs/results.md: every seed method at budgets 256 and 1024, agreement pooled over documents.

Used by ``bench/results.py``: which ``kvtool eval`` commands make the grid tables, how the agreement runs
over several documents are pooled into one table (intervals over all their questions), how a run over a
subset of policies is merged into the table it belongs to, and the sections it renders (the claims table's
included). The per-unit measurements the claims compare in pairs are bench/grid_units.py's.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

import claims
from grid_units import suffix

CORPUS = "../shared/corpus"
ESSAYS = f"{CORPUS}/paul_graham_essays"
TEXTS = f"{CORPUS}/sherlock_holmes.txt,{CORPUS}/pride_and_prejudice.txt,{ESSAYS}"
#: every base policy, in the order of the tables
BASES = ("sink", "h2o", "tova", "snapkv", "scissorhands", "keydiff", "razor")
#: every modifier (as a spec component) and the bases its paper applies it to
MODIFIERS = {"vatp": ("h2o", "scissorhands"), "caote": ("h2o", "tova", "snapkv"),
             "fastcaote": ("h2o", "tova", "snapkv"), "caote(greedy=true)": ("h2o", "tova", "snapkv")}
BUDGETS = (256, 1024)
#: the needle haystack and the perplexity context are SCALE × the budget: a quarter of the text is kept
SCALE = 4
#: the agreement documents: (name, document, questions, kind); bench/data/README.md says where each comes from
DOCS = (("aord", f"{ESSAYS}/aord.txt", "bench/data/aord_questions.txt", "essay"),
        ("pride", "bench/data/pride_chapter3.txt", "bench/data/pride_chapter3_questions.txt", "novel chapter"),
        ("langdes", "bench/data/langdes_part1.txt", "bench/data/langdes_part1_questions.txt", "technical text"))


def grid_policies() -> list[str]:
    """Every base, each followed by the modifiers that apply to it (``h2o``, ``h2o+vatp``, ``h2o+caote``, ...)."""
    out: list[str] = []
    for base in BASES:
        out.append(base)
        out += [f"{base}+{mod}" for mod, bases in MODIFIERS.items() if base in bases]
    return out


def length_for(budget: int) -> str:
    """The haystack / context length for a budget: ``SCALE × budget`` tokens (``1k`` for 256)."""
    n = SCALE * budget
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def grid_tasks(policies: list[str], budgets: Iterable[int], trials: int, samples: int) -> dict[str, list[str]]:
    """The ``kvtool eval`` argv of each grid task: needle and ppl per budget, agreement per document."""
    pols = ",".join(policies)
    budgets = list(budgets)
    tasks: dict[str, list[str]] = {}
    for b in budgets:
        # past 1K tokens the default repetition penalty (1.1) drops repeated digits of the number: off
        penalty = [] if b == 256 else ["--repetition-penalty", "1"]
        tasks[f"needle{suffix(b)}"] = ["eval", "needle", "--haystack", ESSAYS, "--lengths", length_for(b),
                                       "--depths", "0.1,0.5,0.9", "--trials", str(trials), "--policies",
                                       f"full,{pols}", "--budgets", str(b), "--max-new-tokens", "16", *penalty]
        tasks[f"ppl{suffix(b)}"] = ["eval", "ppl", "--text", TEXTS, "--context", length_for(b), "--continuation",
                                    "32", "--samples", str(samples), "--policies", f"full,{pols}", "--budgets", str(b)]
    for name, doc, questions, _ in DOCS:
        tasks[f"agreement-{name}"] = ["eval", "agreement", "--doc", doc, "--questions-file", questions, "--policies",
                                      pols, "--budgets", ",".join(map(str, budgets)), "--max-new-tokens", "24",
                                      "--first-tokens", "8"]
    return tasks


# --------------------------------------------------------------------------------------------- merging
def _row_key(row: dict) -> tuple:
    return (row["policy"], row["budget"], row.get("recall", 0), row.get("length"), row.get("depth"))


def merge(old: dict | None, new: dict) -> dict:
    """A task's result with ``new``'s rows replacing ``old``'s of the same (policy, budget, cell).

    A run over some policies (``bench/results.py --policies ...``) thus adds to its table instead of
    replacing it; the flags that compare rows (best, significant) are recomputed over the merged rows.
    Rows measured under other settings (a task whose command or kvtool's defaults changed: more trials,
    another needle, a new default placement) are never merged in: ``new`` replaces them whole.
    """
    if old is None or old["result"].get("task") != new["result"].get("task") or not _same_table(old, new):
        return new
    res = dict(new["result"])
    fresh = {_row_key(r) for r in res["results"]}
    rows = [r for r in old["result"]["results"] if _row_key(r) not in fresh] + res["results"]
    order = {p: i for i, p in enumerate(["full", *grid_policies()])}  # the grid's order, whatever ran last
    res["results"] = sorted(rows, key=lambda r: order.get(r["policy"], len(order)))
    if res.get("task") == "needle":
        from kvtool.eval.needle import summarize

        res["summary"] = summarize(res["results"])
    elif res.get("task") == "ppl":
        _flag_ppl(res["results"])
    return {**new, "command": _with_policies(new["command"], res["results"]), "result": res}


def _same_table(old: dict, new: dict) -> bool:
    """Whether two results were measured under the same settings but for the grid's policies and budgets."""
    def rest(entry: dict) -> dict:
        return {k: v for k, v in entry["result"].get("settings", {}).items() if k not in ("policies", "budgets")}

    return rest(old) == rest(new)


def _with_policies(command: str, rows: list[dict]) -> str:
    """``command`` with its ``--policies`` naming every policy of the merged table (one command makes it)."""
    argv = shlex.split(command)
    if "--policies" not in argv:
        return command
    argv[argv.index("--policies") + 1] = ",".join(dict.fromkeys(r["policy"] for r in rows))
    return shlex.join(argv)


def _flag_ppl(rows: list[dict]) -> None:
    """Best (lowest mean window gap) per budget and significance against it, from the per-window samples."""
    from kvtool.eval.stats import best_in_group, paired_difference

    gaps = [[100.0 * (s["ppl"] / s["dense_ppl"] - 1.0) for s in r["samples"]] for r in rows]
    best = best_in_group([r["budget"] for r in rows], [sum(g) / len(g) for g in gaps], higher_is_better=False)
    for k, r in enumerate(rows):
        b = best[k]
        r["best"] = k == b
        r["significant"] = (b is not None and k != b and len(gaps[k]) == len(gaps[b])
                            and paired_difference(gaps[k], gaps[b]).excludes(0.0))


# --------------------------------------------------------------------------------------------- pooling
def pool_agreement(per_doc: list[dict], seed: int = 0) -> dict:
    """One agreement result over several documents: each (policy, budget) row's questions concatenated.

    Rows present in every document are pooled; intervals are over all the questions (Wilson for exact
    match, bootstrap for the means); ``significant`` is the paired bootstrap of token F1 against the best
    row at the same budget, over the same questions.
    """
    from kvtool.eval.stats import best_in_group, bootstrap_mean, paired_difference, wilson

    keys = [(r["policy"], r["budget"]) for r in per_doc[0]["result"]["results"]]
    by_doc = [{(r["policy"], r["budget"]): r for r in d["result"]["results"]} for d in per_doc]
    keys = [k for k in keys if all(k in d for d in by_doc)]
    answers = {k: [a for d in by_doc for a in d[k]["answers"]] for k in keys}
    f1s = [[a["f1"] for a in answers[k]] for k in keys]
    best = best_in_group([k[1] for k in keys], [sum(f) / len(f) for f in f1s])
    rows = []
    for i, k in enumerate(keys):
        ans = answers[k]
        exact = [a.get("exact") for a in ans]
        kls = [a["kl"] for a in ans if a.get("kl") is not None]
        top1 = [a["top1"] for a in ans if a.get("top1") is not None]
        rouge = [a["rouge_l"] for a in ans if a.get("rouge_l") is not None]
        b = best[i]
        rows.append({
            "policy": k[0], "budget": k[1], "questions": len(ans),
            "exact_match": wilson(sum(map(bool, exact)), len(ans)).as_dict() if None not in exact else None,
            "f1": bootstrap_mean(f1s[i], seed=seed).as_dict(),
            "rouge_l": bootstrap_mean(rouge, seed=seed).as_dict() if len(rouge) == len(ans) else None,
            "kl": bootstrap_mean(kls, seed=seed).as_dict(5) if kls else None,
            "top1": bootstrap_mean(top1, seed=seed).as_dict() if top1 else None,
            "best": i == b,
            "significant": b is not None and i != b and paired_difference(f1s[i], f1s[b], seed=seed).excludes(0.0),
            "answers": ans,
        })
    docs = [d["result"]["settings"]["doc"] for d in per_doc]
    return {"command": " ; ".join(d["command"] for d in per_doc), "seconds": sum(d["seconds"] for d in per_doc),
            "result": {"task": "agreement", "settings": {"docs": docs}, "results": rows}}


# --------------------------------------------------------------------------------------------- rendering
WHAT_A_SMALL_MODEL_SHOWS = (
    "**What a 135M model can and cannot show.** SmolLM2-135M has 30 layers of 3 KV heads, reads 8,192 positions "
    "and answers short factual questions about a 2K-token text; budgets of 256 and 1024 on these 1–4K-token "
    "inputs evict 87% to 50% of the cache. The papers use 3B–70B models, 4K–100K-token inputs and budgets of "
    "2K–8K tokens on LongBench. These tables can show whether a mechanism does what its "
    "paper says *relative to the other policies on the same inputs* (the sign and size of a paired difference, "
    "with its interval); they cannot reproduce a paper's absolute scores, nor speak for long inputs, larger "
    "models, or tasks this model cannot do even without eviction. A claim that does not hold here is evidence "
    "about this model and these inputs, not a refutation of the paper.")


def agreement_intro(task: dict | None) -> str:
    """The agreement section's text: which documents and how many questions were pooled."""
    n = task["result"]["results"][0]["questions"] if task and task["result"]["results"] else 0
    docs = task["result"]["settings"].get("docs", []) if task else []
    if len(docs) < 2:  # a table written before the documents were pooled
        return f"{n} questions about one essay (`aord.txt`, 2K tokens)."
    names = {d.rsplit("/", 1)[-1] for d in docs}
    kinds = ", ".join(f"{kind} (`{name}`)" for _, doc, _, kind in DOCS if (name := doc.rsplit("/", 1)[-1]) in names)
    return (f"{n} questions pooled over {len(docs)} documents of different kinds: {kinds}; about 2K tokens each "
            "(sources in bench/data/README.md). Each policy's greedy answer against `full`'s (exact match, token "
            "F1, ROUGE-L), and the next-token distributions over the first 8 tokens of the dense answer, "
            "teacher-forced in both runs: what eviction changed, whatever the model's own ability. Intervals "
            "and ✱ are over all the questions (paired bootstrap against the best row at the same budget).")


KINDS = (("a number", "needle-recall", "needle-recall-long"), ("a name", "needle-name-1k", "needle-name-8k"),
         ("three numbers, one asked", "needle-multi-1k", "needle-multi-8k"))


def table_kinds(data: dict, default: str) -> str | None:
    """Found-rate per needle kind and length for full, sink and the default, without and with recall 256."""
    from kvtool.eval.stats import wilson

    cols = [("full", None, 0), ("sink", 256, 0), ("sink", 256, 256), (default, 256, 0), (default, 256, 256)]
    head = ["`full`", "`sink` @ 256", "+ recall 256", f"`{default}` @ 256", "+ recall 256"]
    lines = ["| needle | haystack | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(cols)]
    for kind, short, long in KINDS:
        for length, key in (("1K", short), ("8K", long)):
            if key not in data:
                continue
            rows = {(r["policy"], r["budget"], r.get("recall", 0)): r for r in data[key]["result"]["summary"]}
            cells = []
            for col in cols:
                r = rows.get(col)
                cells.append("–" if r is None else f"{r['correct']}/{r['total']} "
                             f"({100 * wilson(r['correct'], r['total']).low:.0f}–"
                             f"{100 * wilson(r['correct'], r['total']).high:.0f}%)")
            lines.append(f"| {kind} | {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else None


def table_correlation(task: dict) -> str:
    res = task["result"]
    lines = ["| layer | Spearman [95%] | Pearson [95%] |", "|---|---|---|"]
    for r in res["layers"]:
        s, p = r["spearman"], r["pearson"]
        lines.append(f"| {r['layer']} | {s['value']:+.2f} [{s['low']:+.2f}, {s['high']:+.2f}] | "
                     f"{p['value']:+.2f} [{p['low']:+.2f}, {p['high']:+.2f}] |")
    m = res["mean_spearman"]
    lines += ["", f"Mean Spearman over layers {m['value']:+.2f} [{m['low']:+.2f}, {m['high']:+.2f}]; interval above 0 "
              f"in {res['layers_above_zero']} of {len(res['layers'])} layers, below 0 in {res['layers_below_zero']} "
              f"({res['windows']} windows)."]
    return "\n".join(lines)


def table_razor(task: dict) -> str:
    from kvtool.runtime.memory import format_bytes

    lines = ["| document | tokens | policy @ budget | K/V bytes held | vs dense | equal-bytes budget |",
             "|---|---|---|---|---|---|"]
    for d in task["result"]["docs"]:
        for r in d["rows"]:
            eq = "–" if r["equal_bytes_budget"] is None else f"{r['equal_bytes_budget']:.1f}"
            label = "`full`" if r["budget"] is None else f"`{r['policy']}` @ {r['budget']}"
            lines.append(f"| {d['doc']} | {d['tokens']} | {label} | {format_bytes(r['stored'])} | "
                         f"−{100 * r['reduction_vs_dense']:.1f}% | {eq} |")
    d = task["result"]["docs"][0]
    lines += ["", f"Retrieval heads: {d['retrieval_kv_heads']} of {d['kv_heads']} KV heads. With every retrieval head "
              f"whole under kvtool's per-layer budget, the budget must be {d['whole_budget']} of {d['tokens']} tokens "
              f"({100 * (1 - d['whole_budget'] / d['tokens']):.0f}% saved) on {d['doc']}; the paper's layout (no "
              f"per-layer budget: retrieval heads whole, the others 4 sinks + N/5 + 1) saves "
              f"{100 * d['paper_layout_reduction']:.0f}%."]
    return "\n".join(lines)


def evidence_sections(data: dict, default: str) -> list[str]:
    """The needle kinds, KeyDiff's correlation, razor's bytes and the claims table (markdown lines)."""
    out: list[str] = []
    kinds = table_kinds(data, default)
    if kinds:
        out += ["## Recall on three kinds of needle", "",
                "A 5-digit number (the tables above), a name (a word that is not a number) and three labelled "
                "numbers with one asked, each at 1K and 8K tokens (8K: no repetition penalty, compact positions), "
                "without and with recall 256; found / trials (95% Wilson interval).", "", kinds, ""]
    if "distinctiveness" in data:
        out += ["## Do distinctive keys receive high attention? (KeyDiff's observation)", "",
                "Per layer of a dense read (no eviction), windows of 512 tokens over the three books: the Spearman "
                "and Pearson correlations between a key's distinctiveness (1 − cosine to its head's mean normalised "
                "key, KeyDiff's score) and the mean attention it receives from the queries after it; 95% bootstrap "
                "over windows. Spearman compares rankings (what eviction uses); Pearson is dominated by the few "
                "keys with the most attention (the first token).", "", table_correlation(data["distinctiveness"]),
                "", f"`{data['distinctiveness']['command']}` — {data['distinctiveness']['seconds']:.0f} s", ""]
    if "razor-bytes" in data:
        out += ["## The memory RazorAttention holds", "",
                "K/V bytes stored after reading each agreement document (`Session.stats`, as `kvtool ask --stats "
                "--json`: `kv_cache_stored_bytes`), against the dense cache; the equal-bytes budget divides the "
                "bytes by a token's K/V in every KV head (layers × 2 × head_dim × 4 bytes × KV heads).", "",
                table_razor(data["razor-bytes"]), "",
                f"`{data['razor-bytes']['command']}` — {data['razor-bytes']['seconds']:.0f} s", ""]
    rows = claims.claims_rows(data, list(BUDGETS))
    out += ["## Claims of the papers", "", claims.RULES, "", claims.table_claims(rows), ""]
    return out


def pinned_answering(argv: list[str]) -> list[str]:
    """``argv`` of an ``eval needle``/``eval agreement`` table with the answering settings every table here
    was measured with: kvtool 0.2's defaults (repetition penalty 1.1 unless the table sets it, no n-gram
    guard, recall only where the table asks for it, the archive in the model's dtype, recalled passages at
    their document positions). kvtool's own
    defaults now recall and guard repeats instead; docs/results.md measures them in their own section.
    Pinning them keeps every table's resume log (its fingerprint) and its meaning."""
    if argv[:2] not in (["eval", "needle"], ["eval", "agreement"]):
        return argv
    extra = [] if "--repetition-penalty" in argv else ["--repetition-penalty", "1.1"]
    extra += ["--no-repeat-ngram", "0"]
    if "--archive-dtype" not in argv:
        extra += ["--archive-dtype", "auto"]
    if "--recall-placement" not in argv:
        extra += ["--recall-placement", "document"]
    if "--recall" not in argv:
        extra += ["--recall", "0" if argv[1] == "needle" else "off"]
    return [*argv, *extra]
