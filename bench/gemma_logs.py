"""The Gemma 3 270M figures straight from the ``--resume`` logs, while their runs are still going.

``bench/results.py`` writes docs/results.md's Gemma section (bench/gemma_tables.py) from each task's finished
``--json`` output; on this CPU the tasks take many hours, so this prints the same comparisons from whatever a
log holds so far: per perplexity task, each policy and budget's mean per-window gap to dense (the same
``exp(nll − dense nll) − 1`` as ``kvtool eval ppl``) with its bootstrap interval over the windows done, and the
needle table (``full`` beside the default settings, paired on the same trials) over the trials done.

    python bench/gemma_logs.py [LOG_DIR]   # default bench/results-runs; reads TASK.jsonl for each task
"""

from __future__ import annotations

import math
import sys

import gemma_tables
from recall_logs import logged, task_data

from kvtool.eval.stats import bootstrap_mean


def ppl_lines(records: dict[str, dict]) -> list[str]:
    """One line per policy and budget of a perplexity log: the mean window gap [95% bootstrap] and its windows."""
    rows: dict[str, list[float]] = {}
    for key, rec in records.items():
        cell = key.split("|")[0]
        if cell == "dense" or not isinstance(rec, dict):
            continue
        rows.setdefault(cell, []).append(100.0 * (math.exp(rec["nll"] - rec["dense_nll"]) - 1.0))
    dense = sum(1 for key in records if key.startswith("dense|"))
    out = [f"- dense reference: {dense} window(s)"]
    for cell in sorted(rows):
        gaps = rows[cell]
        if len(gaps) < 2:
            out.append(f"- {cell}: window gap {gaps[0]:+.2f}% (one window: no interval)")
            continue
        iv = bootstrap_mean(gaps)
        noise = ": inside the noise" if iv.low <= 0 <= iv.high else ""
        out.append(f"- {cell}: mean window gap {iv.value:+.2f}% [{iv.low:+.2f}, {iv.high:+.2f}] over {len(gaps)} "
                   f"windows{noise}")
    return out


def main(argv: list[str]) -> int:
    needles = {}
    for task, args, command, records in logged(gemma_tables.TASKS, argv):
        print(f"### {task}\n\n`{command}`\n")
        if args[1] == "ppl":
            print("\n".join(ppl_lines(records)) + "\n")
        else:
            needles[task] = task_data(records, command)
    if needles:
        print(gemma_tables.table_needles(needles) + "\n")
        for name, _, _ in gemma_tables.NEEDLE:
            if any(f"gemma-{kind}-{name}-seeds" in needles for kind in gemma_tables.KINDS):
                print(gemma_tables.table_seed_needles(needles, name) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
