"""The far-recall figures straight from the ``--resume`` logs, while their runs are still going.

``bench/results.py`` writes docs/results.md from each task's finished ``--json`` output; the far-recall rows take
hours per read on a CPU, so this prints the same tables (bench/recall_variants.py) from whatever trials a log
holds so far: every rate with its 95% Wilson interval and its trial count, each variant paired with ``shared``
on the trials both answered. A log's records are keyed ``POLICY[@BUDGET][+recallN][+SELECT]|LENGTH|DEPTH|TRIAL``;
the last record of a key wins (a ``--diagnose`` read logs it again).

    python bench/recall_logs.py [LOG_DIR]   # default bench/results-runs; reads TASK.jsonl for each task
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

import recall_variants

from kvtool.eval.stats import wilson

HERE = Path(__file__).resolve().parent


def parse_key(key: str) -> tuple[str, int, str, int, float, int]:
    """(policy, recall, select, length, depth, trial) of a needle log key."""
    cell, length, depth, trial = key.split("|")
    parts = cell.split("+")
    policy = parts[0].split("@")[0]
    recall = next((int(p.removeprefix("recall")) for p in parts[1:] if p.startswith("recall")), 0)
    rest = [p for p in parts[1:] if not p.startswith("recall")]
    return policy, recall, "+".join(rest) or "shared", int(length), float(depth), int(trial)


def read_log(path: Path) -> dict[str, dict]:
    """key → the last record of that key (a torn last line is skipped, as ``--resume`` does)."""
    out: dict[str, dict] = {}
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[row["key"]] = row["record"]
    return out


def task_data(records: dict[str, dict], command: str) -> dict:
    """A log's records shaped as ``kvtool eval needle --json`` output (cells and a summary per row)."""
    cells: dict[tuple, dict] = {}
    for key, rec in records.items():
        policy, recall, select, length, depth, trial = parse_key(key)
        budget = rec.get("budget")  # a grid of several budgets keeps them apart, as its --json output does
        cell = cells.setdefault((policy, budget, recall, select, length, depth), {
            "policy": policy, "budget": budget, "recall": recall, "select": select, "length": length,
            "depth": depth, "answers": []})
        cell["answers"].append({"trial": trial, **rec})
    summary: dict[tuple, list[int]] = {}
    for (policy, _, recall, select, _, _), cell in cells.items():
        kn = summary.setdefault((policy, recall, select), [0, 0])
        kn[0] += sum(a["correct"] for a in cell["answers"])
        kn[1] += len(cell["answers"])
    rows = [{"policy": p, "recall": r, "select": s, "correct": k, "total": n} for (p, r, s), (k, n) in summary.items()]
    return {"command": command, "seconds": 0.0, "result": {"results": list(cells.values()), "summary": rows}}


def rates(data: dict, task: str) -> list[str]:
    """One line per row of a task: found / trials [95% Wilson], diagnosed trials and median recall seconds."""
    lines = []
    for row in sorted(data[task]["result"]["summary"], key=lambda r: (r["policy"], r["recall"], r["select"])):
        k, n = row["correct"], row["total"]
        iv = wilson(k, n)
        answers = [a for c in data[task]["result"]["results"] for a in c["answers"]
                   if (c["policy"], c["recall"], c["select"]) == (row["policy"], row["recall"], row["select"])]
        diag = sum("diagnose" in a for a in answers)
        secs = [a["recall_seconds"] for a in answers if a.get("recall_seconds") is not None]
        med = f", median recall {statistics.median(secs):.1f} s" if secs and row["recall"] else ""
        name = row["policy"] + (f" + recall {row['recall']}" if row["recall"] else "") + (
            f" `{row['select']}`" if row["recall"] else "")
        lines.append(f"- {name}: {k}/{n} [{100 * iv.low:.0f}, {100 * iv.high:.0f}] ({diag} diagnosed{med})")
    return lines


def logged(tasks: dict[str, list[str]], argv: list[str]) -> Iterator[tuple[str, list[str], str, dict[str, dict]]]:
    """(task, its argv, its command, its records) for each of ``tasks`` with a ``TASK.jsonl`` in the log directory
    ``argv[1]`` (default bench/results-runs)."""
    logs = Path(argv[1]) if len(argv) > 1 else HERE / "results-runs"
    for task, args in tasks.items():
        path = logs / f"{task}.jsonl"
        if path.is_file():
            yield task, args, f"kvtool {shlex.join(args)} --resume {os.path.relpath(path)} --json", read_log(path)


def main(argv: list[str]) -> int:
    data = {task: task_data(records, command) for task, _, command, records in logged(recall_variants.TASKS, argv)}
    for task in data:
        print(f"### {task}\n\n`{data[task]['command']}`\n")
        print("\n".join(rates(data, task)) + "\n")
    for label, task in recall_variants.NAME_ROWS:
        if task in data:
            print(f"Misses at {label} (`shared`):\n\n{recall_variants.table_misses(data, task)}\n")
            print(recall_variants.miss_summary(data, task, label.split(" ")[0]) + "\n")
    print(recall_variants.table_variants(data) + "\n")
    print(f"Recall seconds: {recall_variants.time_line(data)}\n")
    print(recall_variants.table_kinds(data) + "\n")
    print(recall_variants.verdict(data))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
