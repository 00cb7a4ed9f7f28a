"""The far-recall section of docs/results.md, written by ``bench/results.py``: recall's variants on the same reads
(``--recall-select``), why the invented name is missed (``--diagnose``), and the harder needle kinds.

Each variant answers every read of its task, so a variant and the default (``shared``) are paired trial by trial:
a Newcombe paired interval of the difference and McNemar's mid-p on the trials only one of them found. A
variant inside the noise does not become the default.
"""

from __future__ import annotations

import statistics

from defaults import _rate, needle

DIAGNOSE = ("--diagnose",)
#: the variants each long row answers on its reads (``grow`` equals ``shared`` at 32K: its archive is under SCAN)
SELECTS_32K = "shared,sum,layer,again"
SELECTS_128K = "shared,sum,layer,grow,again"
TASKS = {
    "variants-name-32k": needle("32k", 10, "h2o", kind="name", extra=(*DIAGNOSE, "--recall-select", SELECTS_32K)),
    "variants-name-128k": needle("128k", 4, "h2o", kind="name", extra=(*DIAGNOSE, "--recall-select", SELECTS_128K)),
    "paraphrase-1k": needle("1k", 10, "full,h2o", kind="paraphrase", extra=DIAGNOSE),
    "twofact-1k": needle("1k", 10, "full,h2o", kind="twofact", extra=DIAGNOSE),
    "paraphrase-32k": needle("32k", 3, "h2o", kind="paraphrase", extra=DIAGNOSE),
    "paraphrase-128k": needle("128k", 1, "h2o", kind="paraphrase", extra=DIAGNOSE),
}
#: how long each log's trials took when they ran (a rerun resumes them all in seconds)
RAN: dict[str, str] = {}
VARIANT_ROWS = (("32K (10 trials per depth)", "variants-name-32k"), ("128K (4 trials per depth)", "variants-name-128k"))
WHAT = {"shared": "today's default: one ranking for every head, each question row's attention maximised over the rows",
        "sum": "the question rows' attention summed instead of maximised",
        "layer": "each layer recalls by its own heads' ranking",
        "grow": "tokens per head grow with the archive's square root past 32K archived (512 at 128K)",
        "again": "a second recall after the answer's first 4 tokens, their queries voting beside the question's"}


def trials(data: dict, task: str, recall: int = 256) -> dict[str, dict[tuple[float, int], dict]]:
    """select → (depth, trial) → the answer record (with its diagnosis) of a needle task's recall rows."""
    out: dict[str, dict[tuple[float, int], dict]] = {}
    for cell in data.get(task, {}).get("result", {}).get("results", []):
        if cell.get("recall", 0) == recall:
            got = out.setdefault(cell.get("select", "shared"), {})
            for a in cell["answers"]:
                got[(cell["depth"], a["trial"])] = a
    return out


def _paired(a: dict, b: dict) -> str:
    """``a`` − ``b`` on their common trials: the paired difference and McNemar's mid-p."""
    from kvtool.eval.stats import newcombe_paired, sign_test

    common = sorted(set(a) & set(b))
    if not common:
        return "–"
    pairs = [(a[c]["correct"], b[c]["correct"]) for c in common]
    both, only_a = sum(x and y for x, y in pairs), sum(x and not y for x, y in pairs)
    only_b, neither = sum(y and not x for x, y in pairs), sum(not x and not y for x, y in pairs)
    d = newcombe_paired(both, only_a, only_b, neither)
    noise = ", inside the noise" if d.low <= 0 <= d.high else ""
    return (f"{100 * d.value:+.0f} pp [{100 * d.low:+.0f}, {100 * d.high:+.0f}]{noise}; {only_a} / {only_b} "
            f"(mid-p {sign_test(only_a, only_b):.2f})")


def table_variants(data: dict) -> str:
    """Every variant against ``shared`` on the same reads, per long row."""
    rows = [(label, trials(data, task)) for label, task in VARIANT_ROWS]
    selects = [s for s in WHAT if any(s in r for _, r in rows)]
    head = "| `--recall-select` | " + " | ".join(
        f"name, {label} | − `shared`, paired [95%]; found only by it / only by `shared` (McNemar)"
        for label, _ in rows)
    lines = [head + " |", "|---" * (1 + 2 * len(rows)) + "|"]
    for sel in selects:
        cells = []
        for _, by in rows:
            got, base = by.get(sel), by.get("shared")
            if got is None:
                cells += ["not run", "–"]
                continue
            found = sum(a["correct"] for a in got.values())
            cells += [_rate((found, len(got)), bold=sel == "shared"),
                      "–" if sel == "shared" or base is None else _paired(got, base)]
        lines.append(f"| `{sel}` ({WHAT[sel]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def recall_seconds(data: dict, task: str) -> dict[str, float]:
    """select → the median seconds a question spent recalling (first pass, scoring, reading back)."""
    out = {}
    for sel, got in trials(data, task).items():
        secs = [a["recall_seconds"] for a in got.values() if a.get("recall_seconds") is not None]
        if secs:
            out[sel] = statistics.median(secs)
    return out


def table_misses(data: dict, task: str, select: str = "shared") -> str:
    """Each missed trial of one row (``select``): where the needle ranked, what the heads held, what was copied."""
    lines = ["| depth, trial | answer | needle rank (per layer: best, median) | score / cut-off / top | held "
             "(layers with all of it / with under half) | the answer copied from |", "|---|---|---|---|---|---|"]
    for (depth, trial), a in sorted(trials(data, task).get(select, {}).items()):
        d = a.get("diagnose")
        if a["correct"] or not d:
            continue
        n = d["needles"][0]
        lr = n.get("layer_rank") or {}
        copied = "; ".join(f"`{c['text'].strip()}` ({c['tokens']} tokens, passage {c['rank']}"
                           + (", the needle" if c["needle"] is not None else "") + ")" for c in d.get("copied", []))
        answer = a["answer"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {depth:g}, {trial} | `{answer}` | {n.get('rank')} ({lr.get('best')}, {lr.get('median')}) | "
                     f"{n.get('score')} / {n.get('cutoff')} / {n.get('top')} | {n['held']:.2f} "
                     f"({len(n['layers_in'])} / {len(n['layers_out'])}) | {copied or '–'} |")
    return "\n".join(lines)
