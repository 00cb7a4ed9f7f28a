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
#: the variants each long row answers on its reads (``grow`` equals ``shared`` at 32K, where the archive is under
#: SCAN; ``sum`` and ``layer`` left the 128K row after its first read, having lost every 32K trial so far)
SELECTS_32K = "shared,sum,layer,again"
SELECTS_128K = "shared,grow,again"
TASKS = {
    "variants-name-32k": needle("32k", 10, "h2o", kind="name", extra=(*DIAGNOSE, "--recall-select", SELECTS_32K)),
    "variants-name-128k": needle("128k", 4, "h2o", kind="name", extra=(*DIAGNOSE, "--recall-select", SELECTS_128K)),
    # the number, which ``shared`` finds 12/12 at 128K: what ``again`` as a default past the scan would have to keep
    "variants-number-128k": needle("128k", 4, "h2o", extra=(*DIAGNOSE, "--recall-select", "shared,again")),
    "paraphrase-1k": needle("1k", 10, "full,h2o", kind="paraphrase", extra=DIAGNOSE),
    "twofact-1k": needle("1k", 10, "full,h2o", kind="twofact", extra=DIAGNOSE),
    # inside the model's range (8K positions), `full` beside the default on the same reads
    "paraphrase-8k": needle("8k", 3, "full,h2o", kind="paraphrase",
                            extra=(*DIAGNOSE, "--recall-select", "shared,again")),
    "paraphrase-32k": needle("32k", 3, "h2o", kind="paraphrase", extra=(*DIAGNOSE, "--recall-select", "shared,again")),
    "paraphrase-128k": needle("128k", 1, "h2o", kind="paraphrase",
                              extra=(*DIAGNOSE, "--recall-select", "shared,again")),
}
#: how long each log's trials took when they ran (a rerun resumes them all in seconds)
RAN: dict[str, str] = {
    "variants-name-32k": "several sessions, at low priority beside other runs",
    "variants-name-128k": "four sessions: 10 minutes a read alone on one core, up to 2.5 hours beside other runs",
    "variants-number-128k": "two sessions, about 10 minutes a read on one core",
    "paraphrase-1k": "one session beside other runs",
    "twofact-1k": "one session beside other runs",
    "paraphrase-8k": "about 40 minutes on one core beside other runs",
    "paraphrase-32k": "one session beside other runs",
    "paraphrase-128k": "about 10 minutes a read on one core",
}
#: the invented name's rows (their misses are diagnosed below the table) and the number's, which the default must keep
NAME_ROWS = (("32K (10 trials per depth)", "variants-name-32k"), ("128K (4 trials per depth)", "variants-name-128k"))
VARIANT_ROWS = (*((f"name, {label}", task) for label, task in NAME_ROWS),
                ("number, 128K (4 trials per depth)", "variants-number-128k"))
WHAT = {"shared": "one ranking for every head, each question row's attention maximised over the rows; the default "
                  "(`auto`) while every head's archive fits one scan",
        "sum": "the question rows' attention summed instead of maximised",
        "layer": "each layer recalls by its own heads' ranking",
        "grow": "tokens per head grow with the archive's square root past 32K archived (512 at 128K)",
        "again": "a second recall after the answer's first 4 tokens, their queries voting beside the question's; the "
                 "default (`auto`) past 32,768 archived tokens per head"}


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
        f"{label} | − `shared`, paired [95%]; found only by it / only by `shared` (McNemar)" for label, _ in rows)
    lines = [head + " |", "|---" * (1 + 2 * len(rows)) + "|"]
    for sel in selects:
        cells = []
        for _, by in rows:
            got, base = by.get(sel), by.get("shared")
            if got is None:
                cells += ["not run", "–"]
                continue
            cells += [_rate(_found(got), bold=sel == "shared"),
                      "–" if sel == "shared" or base is None else _paired(got, base)]
        lines.append(f"| `{sel}` ({WHAT[sel]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _found(got: dict) -> tuple[int, int]:
    return sum(bool(a["correct"]) for a in got.values()), len(got)


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


def _count(data: dict, task: str, policy: str, recall: int, select: str = "shared") -> tuple[int, int] | None:
    rows = [r for r in data.get(task, {}).get("result", {}).get("summary", [])
            if r["policy"] == policy and r.get("recall", 0) == recall and r.get("select", "shared") == select]
    return (rows[0]["correct"], rows[0]["total"]) if rows else None


KIND_ROWS = (("paraphrase (`Which village is the chef from?` of `Our ship's cook was born in the mountain village "
              "of X.`)", "paraphrase"),
             ("two facts (`What did the keeper of the old lighthouse hide in the cellar?`)", "twofact"))


#: the harder needles' columns: per length, what answered there (``full`` only inside the model's range)
KIND_COLUMNS = (("1k", ("full", "shared")), ("8k", ("full", "shared", "again")), ("32k", ("shared", "again")),
                ("128k", ("shared", "again")))


def auto_at(length: str) -> str:
    """What the default (``auto``) selects at a needle row's length: ``again`` where a head archives past one scan."""
    return "again" if length == "128k" else "shared"


def table_kinds(data: dict) -> str:
    """The harder needles: ``full`` inside the model's range, ``shared`` and ``again`` past it; the default's cell
    (``auto``: ``shared`` up to 32K, ``again`` at 128K) in bold."""
    head = ["| needle", *(f"`{sel}`, {length.upper()}" + (" (default)" if sel == auto_at(length) else "")
                          for length, sels in KIND_COLUMNS for sel in sels)]
    lines = [" | ".join(head) + " |", "|---" * len(head) + "|"]
    for label, kind in KIND_ROWS:
        cells = [_rate(_count(data, f"{kind}-{length}", *(("full", 0) if sel == "full" else ("h2o", 256, sel))),
                       bold=sel == auto_at(length)) for length, sels in KIND_COLUMNS for sel in sels]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def time_line(data: dict) -> str:
    """The median seconds a question spent recalling, per variant and row, against ``shared`` on the same reads."""
    parts = []
    for label, task in VARIANT_ROWS:
        secs = recall_seconds(data, task)
        base = secs.get("shared")
        if not base:
            continue
        parts.append(f"{label.split(' (')[0]}: " + ", ".join(
            f"`{sel}` {s:.1f} s" + ("" if sel == "shared" else f" ({s / base:.2f}×)") for sel, s in secs.items()))
    return "; ".join(parts)


def _command(data: dict, task: str) -> str:
    t = data[task]
    ran = f" (resumed from its log; the trials ran in {RAN[task]})" if task in RAN else ""
    return f"- `{t['command']}` — {t['seconds']:.0f} s{ran}"


def miss_summary(data: dict, task: str, label: str) -> str:
    """One sentence over a row's diagnosed misses (``shared``): where the needle ranked, whether it was held."""
    got = trials(data, task).get("shared", {})
    diagnosed = [a for a in got.values() if a.get("diagnose")]
    misses = [a["diagnose"]["needles"][0] for a in diagnosed if not a["correct"]]
    if not diagnosed:
        return ""
    first = sum(n.get("rank") == 1 for n in misses)
    held = sum(n["held"] == 1.0 for n in misses)
    found = [a["diagnose"]["needles"][0] for a in diagnosed if a["correct"]]
    return (f"{label}: {len(misses)} of {len(diagnosed)} diagnosed trials missed; in {first} of them the needle's "
            f"passage ranked first and in {held} every KV head of every layer held all its tokens after recall "
            f"(found trials: ranked first in {sum(n.get('rank') == 1 for n in found)} of {len(found)}).")


def kinds_line(data: dict) -> str:
    """The calibration of the paraphrase (the screen's wordings, then the kind's own 1K row), and the default past
    the model's range as a share of dense's rate inside it."""
    para, two = _count(data, "paraphrase-1k", "full", 0), _count(data, "twofact-1k", "full", 0)
    out = []
    if para:
        out.append(f"the paraphrase's `full` found {_rate(para)} at 1K (the kind's calibration: at least 7 in 10)")
        edge = [(length.upper(), _count(data, f"paraphrase-{length}", "full", 0),
                 _count(data, f"paraphrase-{length}", "h2o", 256, auto_at(length)))
                for length, sels in KIND_COLUMNS[1:] if "full" in sels]
        out += [f"at {length}, the edge of the model's range, `full` found {_rate(full)} and the default {_rate(own)}"
                for length, full, own in edge if full and own]
        far = [(length.upper(), _count(data, f"paraphrase-{length}", "h2o", 256, auto_at(length)))
               for length, sels in KIND_COLUMNS if "full" not in sels]
        if para[0] and any(kn for _, kn in far):
            out.append("past the model's range the default found " + ", ".join(
                f"{kn[0]}/{kn[1]} at {length} ({kn[0] / kn[1] / (para[0] / para[1]):.2f}× `full`'s rate at 1K)"
                for length, kn in far if kn))
    if two:
        out.append(f"the two facts' `full` found {_rate(two)}: an answer that names one of the two deeds at random "
                   "is right half the time, so this model does not combine the facts even with the whole cache")
    return "; ".join(out)


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def section(data: dict) -> list[str]:
    """The section's markdown lines (empty when none of its tasks has run)."""
    if not any(t in data for t in TASKS):
        return []
    out = ["## Far recall: what the ranking misses, its variants, and needles in other words", "", INTRO, ""]
    for label, task in NAME_ROWS:
        if task in data:
            out += [f"**Every missed trial of the invented name at {label}, default (`shared`)** (`--diagnose`):", "",
                    table_misses(data, task), "", miss_summary(data, task, label.split(" ")[0]), ""]
    out += [MISSES, "", "### The variants on the same reads", "", VARIANTS, "", table_variants(data), "",
            f"Median seconds a question spent recalling (first pass, scoring the archive, reading back; each "
            f"variant answered right after the others on the same read, so under the same load): {time_line(data)}.",
            "", verdict(data), "", "### Needles that do not repeat the question", "", KINDS, "", table_kinds(data), "",
            f"{_capital(kinds_line(data))}.", "", KINDS_AFTER, ""]
    out += [_command(data, t) for t in TASKS if t in data]
    return [*out, ""]


INTRO = ("Every needle above repeats the question's words, and the invented name was the hardest of them (25/30 at "
         "32K, 3/12 at 128K). This section measures why (`--diagnose`: for each trial, where recall's shared ranking "
         "put the needle's passage, whether every KV head holds it after recall, and which recalled passage the "
         "answer copied from), the variants of the selection the literature suggests (`--recall-select`, each "
         "answering the same reads as the default), and needles phrased in other words than their question. The "
         "rows are the default settings' (`h2o` @ 256, recall 256, the question alone), at ten trials per depth at "
         "32K and four at 128K as in the table above; on this shared 2-core machine a 32K read took 3 to 45 "
         "minutes and a 128K read 10 minutes to two and a half hours, depending on what ran beside it.")
MISSES = ("**What the diagnosis shows.** At both lengths the misses are not ranking failures: the needle's passage "
          "is the first of the shared ranking and every head of every layer holds all of its tokens, and the answer "
          "copies a phrase of another recalled passage instead (`name of the` and a year at 128K, the essays' "
          "closing `Y Combinator` at 32K). The ranking each layer would make alone puts the needle first in its "
          "best layer but hundreds of passages down in the median one, which is why one shared ranking wins (the "
          "`layer` row below). What moves a miss is therefore not finding the needle but what else comes back with "
          "it, and what the answer starts from.")
VARIANTS = ("Each row is the same reads answered once per `--recall-select` (found / trials [95% Wilson]); the "
            "paired columns are the variant minus `shared` on the same trials (Newcombe's paired interval) and the "
            "trials only one of them found (McNemar's mid-p). `grow` is `shared` at 32K (the archive is under "
            "32,768 tokens per head there), so it runs at 128K only; `sum` and `layer` ran on the first 128K read "
            "only (both missed it: `sum` ranked the needle 25th, `layer` left it in 20% of the heads' slots).")
def verdict(data: dict) -> str:
    """Why the default is ``auto``, from the rows: ``again`` against ``shared`` on the same reads at 128K (the name
    and the number) and at 32K, and what it costs."""
    rows = {task: trials(data, task) for _, task in VARIANT_ROWS}
    name32, name128, number128 = (rows.get(t, {}) for _, t in VARIANT_ROWS)

    def pair(by: dict) -> str:
        if "again" not in by or "shared" not in by:
            return "not run"
        return (f"`again` {_rate(_found(by['again']))} against `shared` {_rate(_found(by['shared']))}: "
                f"{_paired(by['again'], by['shared'])}")

    secs = recall_seconds(data, "variants-name-128k")
    cost = (f"; its recall takes {secs['again'] / secs['shared']:.2f}× `shared`'s at 128K (two scans of the "
            "archive; the target allows 2×)") if secs.get("again") and secs.get("shared") else ""
    return ("**The default is `auto`: `shared` while every head's archive fits one scan (32,768 tokens), `again` "
            f"past it.** On the same reads at 128K: the name, {pair(name128)}; the number, {pair(number128)}. At "
            f"32K the name, {pair(name32)}{cost}. Below the scan the two are inside each other's noise and "
            "every table inside the model's range was measured under `shared`, so `auto` keeps `shared` there "
            "and those tables stand; past it `again` is the only variant that turned misses into finds. Summing "
            "the rows' attention (`sum`) adds up what the question's function words (`What`, `is`, `the`) attend "
            "to, generic attractors that then outrank the needle (25th to 43rd passage where `shared` ranks it "
            "first), and per-layer rankings (`layer`) leave most layers without the needle (a fifth of the (head, "
            "token) pairs held): both lose trials `shared` finds. Recalling more as the archive grows (`grow`, 512 "
            "tokens at 128K) brings back more distractors beside a needle that was already in, and copies them.")


KINDS = ("The paraphrase shares one word with its question (`village`) and a synonym pair (`cook`, `chef`): "
         "calibrated on `full` at 1K before anything else, as a needle that shares no word at all is beyond the "
         "135M model even dense (`The treaty was signed in the harbour town of X.` asked `Where was the agreement "
         "concluded?`: 0 of 9, three trials per depth, every answer `The agreement concluded was in the 1990s.`); "
         "with two shared words (`peace`, `town`) it found 6 of 9, with one and a synonym pair 9 of 9. The two-fact "
         "needle puts the holder of a role at the cell's depth and two deeds (the holder's and another invented "
         "person's) at seeded depths; an answer naming the other's thing is wrong.")
KINDS_AFTER = ("At 8K dense attention answers `The chef from the village that chose Lisp over other languages.` in "
               "eight of its nine trials: a needle in other words is lost at the edge of the model's range even with "
               "the whole cache, where recall's ranking still finds it in a third. "
               "The paraphrase's misses at 1K under the default rank the needle first too; three of them ran out of "
               "the 16 answer tokens mid-name (`The village from which the chef from is from is the village of "
               "Thamiqu`), as the other rows' answers never do. The screen's wordings and their logs: "
               "`bench/results-runs/paraphrase-screen-*.jsonl` (`kvtool eval needle --needle-kind paraphrase` with "
               "the wording patched in, three trials per depth at 1K, `full` only).")
