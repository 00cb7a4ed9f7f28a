"""The "Quantized K/V in the same bytes" section of docs/results.md, written by ``bench/results.py``.

``--kv-dtype`` on the default policy with the default settings, per cache dtype D: perplexity at equal tokens
(256) and at equal bytes (5 MiB), the number needle at 1K and the agreement questions at equal bytes (one
``kvtool eval`` command per table and D, resumed from ``bench/results-runs/kv-*-D.jsonl``), and the prefill
speed and peak of ``bench/kv_dtype.py`` (its saved JSON reports; that bench is run on its own, on a quiet
machine). Paired rows share their windows, trials and questions.
"""

from __future__ import annotations

import json
from pathlib import Path

from evidence import ESSAYS, TEXTS

DTYPES = ("auto", "int8", "int4")
HEAD = {"auto": "float32 (model dtype)", "int8": "int8", "int4": "int4 (+ 128 newest in 16 bits)"}
BYTES = "5MiB"  # equal bytes: every dtype gets this byte budget
TASKS = {
    **{f"kv-ppl-{d}": ["eval", "ppl", "--text", TEXTS, "--context", "1k", "--continuation", "32", "--samples", "8",
                       "--policies", "h2o", "--budgets", f"256,{BYTES}", "--kv-dtype", d, "--threads", "1"]
       for d in DTYPES},
    **{f"kv-needle-{d}": ["eval", "needle", "--haystack", ESSAYS, "--lengths", "1k", "--depths", "0.1,0.5,0.9",
                          "--trials", "5", "--policies", "h2o", "--no-full", "--budgets", BYTES, "--recall", "0,auto",
                          "--kv-dtype", d, "--max-new-tokens", "16", "--threads", "1"] for d in DTYPES},
    **{f"kv-agree-{d}": ["eval", "agreement", "--doc", f"{ESSAYS}/aord.txt", "--questions-file",
                         "bench/data/aord_questions.txt", "--policies", "h2o", "--budgets", BYTES, "--max-new-tokens",
                         "24", "--first-tokens", "8", "--kv-dtype", d, "--threads", "1"] for d in DTYPES},
}
#: bench/kv_dtype.py reports (bench/results-runs/), newest first: a dtype's figures come from the first that has it
SPEED = {"8k": ("kv-dtype-8k-int4.json", "kv-dtype-8k.json"), "32k": ("kv-dtype-32k-int4.json", "kv-dtype-32k.json")}


def _rows(data: dict, task: str) -> list[dict]:
    return data.get(task, {}).get("result", {}).get("results", [])


def _ppl(data: dict, d: str, equal_bytes: bool) -> dict | None:
    """The h2o row of dtype ``d``'s perplexity run at equal tokens (256) or equal bytes."""
    rows = [r for r in _rows(data, f"kv-ppl-{d}") if r["policy"] == "h2o" and (r["budget"] == 256) != equal_bytes]
    return rows[0] if rows else None


def _pct(iv, noise_word: bool = False) -> str:
    noise = " (noise)" if noise_word and iv.low <= 0 <= iv.high else ""
    return f"{iv.value:+.2f}% [{iv.low:+.2f}, {iv.high:+.2f}]{noise}"


def ppl_rows(data: dict) -> list[str]:
    from kvtool.eval.stats import bootstrap_mean

    out = []
    for label, equal_bytes, against_dense in (("perplexity vs float32 cache, **equal tokens** (256)", False, False),
                                              (f"perplexity gap to dense, **equal bytes** ({BYTES})", True, True),
                                              ("perplexity vs float32 cache, equal bytes", True, False)):
        base = _ppl(data, "auto", equal_bytes)
        cells = []
        for d in DTYPES:
            row = _ppl(data, d, equal_bytes)
            if row is None or base is None:
                cells.append("not run")
            elif against_dense:
                cells.append(_pct(bootstrap_mean([100 * (s["ppl"] / s["dense_ppl"] - 1) for s in row["samples"]])))
            elif d == "auto":
                cells.append("–")
            else:  # the same windows, paired
                ratio = [100 * (s["ppl"] / b["ppl"] - 1) for s, b in zip(row["samples"], base["samples"], strict=True)]
                cells.append(_pct(bootstrap_mean(ratio), noise_word=True))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def _trials(data: dict, d: str, recall: int) -> list[float]:
    rows = [r for r in _rows(data, f"kv-needle-{d}") if r.get("recall", 0) == recall]
    return [float(a["correct"]) for r in sorted(rows, key=lambda r: r["depth"]) for a in r["answers"]]


def needle_rows(data: dict) -> list[str]:
    from kvtool.eval.stats import paired_difference, wilson

    out = []
    for label, recall in (("number needle, 1K, equal bytes, eviction only", 0),
                          ("number needle, 1K, equal bytes, default (recall)", 256)):
        base, cells = _trials(data, "auto", recall), []
        for d in DTYPES:
            xs = _trials(data, d, recall)
            if not xs:
                cells.append("not run")
                continue
            iv, k = wilson(int(sum(xs)), len(xs)), int(sum(xs))
            cell = f"{k}/{len(xs)} [{100 * iv.low:.0f}, {100 * iv.high:.0f}]"
            if d != "auto" and len(xs) == len(base) and xs != base:
                diff = paired_difference(xs, base)
                cell += f" ({100 * diff.value:+.0f} pp [{100 * diff.low:+.0f}, {100 * diff.high:+.0f}])"
            cells.append(cell)
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def agreement_rows(data: dict) -> list[str]:
    from kvtool.eval.stats import bootstrap_mean, paired_difference

    def per_question(d: str, key: str) -> list[float]:
        return [a[key] for r in _rows(data, f"kv-agree-{d}") for a in r["answers"]]

    out = []
    for label, key in (("agreement with the dense answer, token F1, equal bytes (12 `aord.txt` questions)", "f1"),
                       ("agreement, top-1 of the next token, equal bytes", "top1")):
        base, cells = per_question("auto", key), []
        for d in DTYPES:
            xs = per_question(d, key)
            if not xs:
                cells.append("not run")
                continue
            m = bootstrap_mean(xs)
            cell = f"{m.value:.2f} [{m.low:.2f}, {m.high:.2f}]"
            if d != "auto" and len(xs) == len(base):
                diff = paired_difference(xs, base)
                cell += f" ({diff.value:+.2f} [{diff.low:+.2f}, {diff.high:+.2f}])"
            cells.append(cell)
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


def _speed(runs: Path, length: str) -> tuple[dict, dict[str, str]]:
    """Each dtype's figures at ``length`` from the newest report that has it, and which report that was."""
    figures: dict = {}
    source: dict[str, str] = {}
    for name in SPEED[length]:
        path = runs / name
        if not path.exists():
            continue
        for d, fig in json.loads(path.read_text())["dtypes"].items():
            if d not in figures:
                figures[d], source[d] = fig, name
    return figures, source


def speed_rows(runs: Path) -> list[str]:
    """Prefill speed and peak RSS of bench/kv_dtype.py at equal tokens (1k), each ratio within one run."""
    out = []
    figures = {length: _speed(runs, length)[0] for length in ("8k", "32k")}  # each run's reports read once
    eight = figures["8k"]
    if eight:
        runs_8k = [json.loads((runs / n).read_text())["dtypes"] for n in SPEED["8k"] if (runs / n).exists()]
        float32 = " / ".join(f"{r['auto']['prefill_tps']:.0f}" for r in runs_8k if "auto" in r)
        cells = []
        for d in DTYPES:
            f = eight.get(d)
            cells.append("not run" if f is None else f"{float32} tok/s (one per run)" if d == "auto" else
                         f"{f['speed_ratio']:.2f}× ({', '.join(f'{x:.2f}' for x in f['speed_ratio_repeats'])})")
        out.append("| prefill speed at 8K, **equal tokens** (1k), each ratio against float32 in its own run | "
                   + " | ".join(cells) + " |")
    for length, note in (("8k", ""), ("32k", " (one run each)")):
        figs = figures[length]
        if figs:
            cells = [("not run" if figs.get(d) is None else f"{figs[d]['peak_rss_bytes'] / 1e9:.2f} GB" if d == "auto"
                      else f"{figs[d]['peak_ratio']:.2f}×") for d in DTYPES]
            out.append(f"| peak RSS at {length.upper()}, equal tokens{note} | " + " | ".join(cells) + " |")
    return out


def section(data: dict, runs: Path) -> list[str]:
    """The section's markdown lines (empty when none of its tasks has run)."""
    if not any(t in data for t in TASKS):
        return []
    budgets = {d: (_ppl(data, d, True) or {}).get("budget") for d in DTYPES}
    lines = ["| measure | " + " | ".join(HEAD[d] for d in DTYPES) + " |", "|---|---|---|---|",
             *ppl_rows(data), *needle_rows(data), *agreement_rows(data), *speed_rows(runs)]
    cmds = [f"- `{data[t]['command']}` — {data[t]['seconds']:.0f} s" for t in TASKS if t in data]
    return ["## Quantized K/V in the same bytes", "",
            INTRO.format(**{d.replace("auto", "f32"): budgets[d] for d in DTYPES}), "", *lines, "", NOTES, "",
            *cmds, *BENCH, ""]


INTRO = ("What `--kv-dtype int8` and `int4` buy and cost, on the default policy (`h2o`) with the default settings. "
         "**Equal bytes** gives every cache dtype the same byte budget, `--budget 5MiB`: {f32} tokens per head in "
         "the model's float32 (on this CPU; a GPU's bfloat16 would hold twice that), {int8} in int8, {int4} in int4 "
         "(its 128-token 16-bit window takes 2.9 MB of the 5 MiB first; at a GPU-sized budget the window is a "
         "rounding error). **Equal tokens** keeps 256 tokens per head in each: the cost of quantization alone. "
         "Paired rows share their windows, trials and questions; intervals are 95% (Wilson for rates, bootstrap for "
         "means and paired differences of means, Newcombe's paired score interval for paired rates), and a "
         "difference beside a cell is against float32.")
NOTES = ("int8 needs no window: at equal tokens its perplexity is the float32 cache's within the noise. int4 keeps "
         "its newest 128 tokens in 16 bits beside their codes (KIVI's full-precision residual); without that window "
         "it cost +16.8% [+10.2, +26.5] perplexity at equal tokens, even with the Hadamard rotation. A first "
         "measurement of the window's size on the same 8 windows (a prototype, window in float32): 64 tokens gave "
         "+2.4% [+1.0, +3.9], 128 gave +0.2% [−0.7, +1.2]; 128 is also KIVI's and transformers' `QuantizedCache` "
         "default. The float32 and int8 perplexity, needle and agreement runs were made with an earlier form of the "
         "same rotation (in-place butterfly passes instead of one product with `H`: the same orthonormal matrix, so "
         "the same values up to float32 rounding). At a realistic budget the window is small: `--budget 64MiB` holds "
         "10,483 tokens per head in int4 against 5,648 in int8 and 2,912 in bfloat16 (SmolLM2-135M, bfloat16 "
         "model). On the 8K bench's own needle (one document: its repeats are one sample) float32 found it and int8 "
         "did not at equal tokens.")
BENCH = [
    "- `python bench/kv_dtype.py --length 8k --budget 1k --repeats 2` (`bench/results-runs/kv-dtype-8k.json`: float32 "
    "and int8, every run in its own process, the dtypes in rotated order, beside other runs)",
    "- `python bench/kv_dtype.py --length 8k --budget 1k --dtypes auto,int4 --repeats 2` "
    "(`bench/results-runs/kv-dtype-8k-int4.json`: the int4 column, a quiet machine)",
    "- `python bench/kv_dtype.py --length 32k --budget 1k --dtypes auto,int4 --repeats 1` and `--dtypes auto,int8` "
    "(`bench/results-runs/kv-dtype-32k-int4.json`, `kv-dtype-32k.json`: peak only; the test suite ran beside them, "
    "so their speed ratios are not measurements)",
]
