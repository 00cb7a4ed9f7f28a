"""The tables of docs/results.md drawn from one ``kvtool eval`` result each (markdown), for bench/results.py.

Needle (found per length and depth), agreement, perplexity, the kvpress side-by-side, block sizes and the
archive's page size and dtype; every figure with its 95% interval.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAGES = (16, 64)  # archive page sizes compared with the default 32 (needle with recall, the default policy)
BLOCKS = (64, 256, 1024)  # block sizes compared with the default 128 (the agreement table) for the default policy
#: the GPU's pairing (budget 4K: block 1,024 on CUDA, 128 on CPU): needles at 16K tokens, default settings
GPU_BLOCKS = (128, 256, 1024)  # the tables' block, a CPU's auto at budget 4K, a GPU's
GPU_KINDS = ("number", "name")


def _default_policy() -> str:
    from kvtool.runtime.settings import Settings

    return Settings().policy


DEFAULT = _default_policy()  # the block-size rows and the recall rows follow the default, whatever it is


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
    """Token F1 of the default policy at block 64/128/256/1,024; each against block 128 by a paired bootstrap."""
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


def table_gpu_block(data: dict, ran: dict[str, str]) -> str:
    """The GPU's and a CPU's ``auto`` block against the tables' 128 at budget 4K (16K-token needles, the default
    settings): found per block, and each block against 128 on the same trials (Newcombe's paired interval);
    ``ran``: how long the trials of a log took when they ran."""
    from kvtool.eval.stats import newcombe_paired, wilson

    def trials(kind: str, block: int) -> dict | None:
        task = data.get(f"block-needle-{kind}-{block}")
        if task is None:
            return None
        return {(r["depth"], a["trial"]): bool(a["correct"]) for r in task["result"]["results"] for a in r["answers"]}

    base = GPU_BLOCKS[0]
    lines = ["| needle | " + " | ".join(f"block {b}" for b in GPU_BLOCKS) + " | "
             + " | ".join(f"{b:,} vs {base} (same trials)" for b in GPU_BLOCKS[1:]) + " |",
             "|---|" + "---|" * (2 * len(GPU_BLOCKS) - 1)]
    cmds = []
    for kind in GPU_KINDS:
        runs = {b: trials(kind, b) for b in GPU_BLOCKS}
        if any(r is None for r in runs.values()):
            continue
        cells = [f"{_iv(wilson(sum(r.values()), len(r)).as_dict(), pct=True)} ({sum(r.values())}/{len(r)})"
                 for r in runs.values()]
        b = runs[base]
        for block in GPU_BLOCKS[1:]:
            a = runs[block]
            keys = sorted(a.keys() & b.keys())
            d = newcombe_paired(sum(a[k] and b[k] for k in keys), sum(a[k] and not b[k] for k in keys),
                                sum(b[k] and not a[k] for k in keys), sum(not a[k] and not b[k] for k in keys))
            cells.append(f"{100 * d.value:+.0f} pp [{100 * d.low:+.0f}, {100 * d.high:+.0f}]"
                         + (" ✱" if d.excludes(0.0) else " (inside the noise)"))
        lines.append(f"| {'a 5-digit number' if kind == 'number' else 'an invented name'} | " + " | ".join(cells)
                     + " |")
        tasks = [data[f"block-needle-{kind}-{b}"] for b in GPU_BLOCKS]
        cmds += [f"`{t['command']}` — {t['seconds']:.0f} s" + (f" (resumed from its log; {ran[name]})" if name in ran
                 else "") for name, t in zip((f"block-needle-{kind}-{b}" for b in GPU_BLOCKS), tasks, strict=True)]
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
