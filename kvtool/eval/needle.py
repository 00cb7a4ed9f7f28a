"""Needle in a haystack: can the model still find one sentence after reading under a KV budget?

For every (policy, budget) run, length L, depth d and trial:

1. the haystack (a file, or a directory's ``*.txt`` files concatenated in sorted order, repeated if it is
   too short) is cut to ``L − needle tokens`` tokens with the model's tokenizer, so the document is ≈ L tokens;
2. the needle sentence is inserted on the sentence boundary nearest to token ``d · L`` — depth 0 puts it at
   the very start of the document and depth 1 at the very end (exactly);
3. the document is read and the question asked through the same path as ``kvtool ask``
   (``Session.read`` + ``Session.ask``, chat template, pinned question, greedy decoding);
4. the answer is scored by containment of the expected answer (:func:`kvtool.eval.metrics.contains_answer`:
   whitespace-normalised, case-insensitive).

The default needle is a passkey, regenerated per trial from ``random.Random(seed + trial)``.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtool.errors import UsageError
from kvtool.eval import (
    Grid,
    Reporter,
    Timer,
    load_once,
    make_session,
    model_settings,
    report,
    text_document,
)
from kvtool.eval.metrics import contains_answer
from kvtool.runtime.session import Session
from kvtool.runtime.settings import parse_recall

PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key?"
MIN_HAYSTACK_TOKENS = 16

_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s)")


@dataclass(frozen=True)
class Needle:
    text: str
    question: str
    answer: str


def passkey_needle(seed: int, trial: int) -> Needle:
    """The default needle of trial ``trial``: a 5-digit pass key drawn from ``random.Random(seed + trial)``."""
    key = str(random.Random(seed + trial).randint(10000, 99999))
    return Needle(PASSKEY_NEEDLE.format(key=key), PASSKEY_QUESTION, key)


# --------------------------------------------------------------------------------------------- haystack


def tokenize_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Token ids and (start, end) character offsets (None when the tokenizer cannot give them)."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [(int(a), int(b)) for a, b in enc["offset_mapping"]]
    except (NotImplementedError, ValueError, TypeError, KeyError):
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), None


class Haystack:
    """The haystack text tokenized once, long enough for the longest length; cut per length."""

    def __init__(self, text: str, tokenizer: Any, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.repeated = False
        need = max_tokens + 8  # margin: the last tokens of a cut piece may be a word cut in two
        chars = need * 8 + 1024
        while True:
            piece = text[:chars]
            ids, offsets = tokenize_offsets(tokenizer, piece)
            if len(ids) >= need or chars >= len(text):
                break
            chars *= 2
        if len(ids) < need:
            reps = need // max(1, len(ids)) + 2
            piece = "\n\n".join([text] * reps)
            ids, offsets = tokenize_offsets(tokenizer, piece)
            self.repeated = True
        self.text = piece
        self.ids = ids
        self.offsets = offsets

    def cut(self, n: int) -> tuple[str, list[int]]:
        """The first ``n`` tokens as text, and each token's start character."""
        n = min(n, len(self.ids))
        if self.offsets is not None:
            end = max(b for _, b in self.offsets[:n])
            return self.text[:end], [a for a, _ in self.offsets[:n]]
        text = self.tokenizer.decode(self.ids[:n], skip_special_tokens=True).rstrip("\ufffd")
        return text, [round(i * len(text) / n) for i in range(n)]


def sentence_boundaries(text: str) -> list[int]:
    """Indices just after a sentence end (``.``, ``!``, ``?``, closing quotes) that whitespace follows."""
    return [m.end() for m in _SENTENCE_END.finditer(text)]


def insert_needle(haystack: str, needle: str, depth: float, token_starts: list[int] | None = None) -> tuple[str, int]:
    """Insert ``needle`` at ``depth`` ∈ [0, 1]; returns (document, index of the needle's first character).

    Depth 0: the document starts with the needle. Depth 1: it ends with the needle. Otherwise the needle goes
    on the sentence boundary nearest to the target (token ``round(depth · n)`` when ``token_starts`` are given,
    else character ``round(depth · len)``), falling back to the nearest whitespace, then the target itself.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if depth == 0.0:
        hay = haystack.lstrip()
        return needle + (" " + hay if hay else ""), 0
    if depth == 1.0:
        hay = haystack.rstrip()
        return (hay + " " if hay else "") + needle, len(hay) + 1 if hay else 0
    n = len(haystack)
    if token_starts:
        target = token_starts[min(round(depth * len(token_starts)), len(token_starts) - 1)]
    else:
        target = round(depth * n)
    candidates = [b for b in sentence_boundaries(haystack) if 0 < b < n]
    if not candidates:
        candidates = [i for i, ch in enumerate(haystack) if ch.isspace() and 0 < i < n]
    pos = min(candidates, key=lambda b: (abs(b - target), b)) if candidates else target
    after = "" if haystack[pos : pos + 1].isspace() else " "
    before = "" if pos == 0 else " "
    return haystack[:pos] + before + needle + after + haystack[pos:], pos + len(before)


# --------------------------------------------------------------------------------------------- task


@dataclass
class NeedleTask:
    grid: Grid
    haystack_path: Path
    haystack: str
    lengths: list[int]
    depths: list[float]
    trials: int
    needle: Needle | None  # None: the passkey needle, new per trial
    max_new_tokens: int
    recalls: list[int] = dataclasses.field(default_factory=lambda: [0])  # recall budgets per bounded run

    def needle_for(self, trial: int) -> Needle:
        return self.needle if self.needle is not None else passkey_needle(self.grid.settings.seed, trial)

    def settings(self) -> dict[str, Any]:
        custom = self.needle
        return {
            "haystack": str(self.haystack_path),
            "lengths": self.lengths,
            "depths": self.depths,
            "trials": self.trials,
            "needle": custom.text if custom else "passkey",
            "question": custom.question if custom else PASSKEY_QUESTION,
            "answer": custom.answer if custom else None,
            "max_new_tokens": self.max_new_tokens,
            "recalls": self.recalls,
            **self.grid.describe(),
        }


def custom_needle(needle: str | None, question: str | None, answer: str | None) -> Needle | None:
    if needle is None and question is None and answer is None:
        return None
    if not (needle and needle.strip() and question and question.strip() and answer and answer.strip()):
        raise UsageError("a custom needle needs all of --needle, --question and --answer (non-empty)")
    return Needle(" ".join(needle.split()), question.strip(), answer.strip())


def parse_recalls(text: str) -> list[int]:
    """``--recall`` of the needle grid: a comma list of recall budgets ("0,256", "off,4k"), in order, unique."""
    out: list[int] = []
    for part in text.split(","):
        if part.strip():
            r = parse_recall(part.strip())
            if r not in out:
                out.append(r)
    if not out:
        raise UsageError("--recall needs at least one value (0 = eviction only)")
    return out


def run_needle(task: NeedleTask, reporter: Reporter) -> dict[str, Any]:
    timer = Timer()
    loaded = load_once(task.grid, reporter.say)
    tok = loaded.tokenizer
    haystack = Haystack(task.haystack, tok, max(task.lengths))
    if haystack.repeated:
        reporter.say(f"note: the haystack has fewer than {max(task.lengths)} tokens; it is repeated to fill")
    needles = [task.needle_for(t) for t in range(task.trials)]
    needle_tokens = [len(tok(" " + n.text + " ", add_special_tokens=False)["input_ids"]) for n in needles]
    for L in task.lengths:
        if L - max(needle_tokens) < MIN_HAYSTACK_TOKENS:
            raise UsageError(f"length {L} is too short for the needle ({max(needle_tokens)} tokens)")

    runs = task.grid.runs()
    cells: list[dict[str, Any]] = []
    total = sum(len(task.recalls) if run.budget is not None else 1 for run in runs) * len(task.lengths) * len(
        task.depths) * task.trials
    with reporter.bar(total):
        for run in runs:
            recalls = task.recalls if run.budget is not None else [0]
            session = make_session(task.grid, run, loaded, reporter.say)
            if max(recalls):
                # One read serves every recall budget of this run: archiving does not change what the
                # cache keeps, so the eviction-only answer is the same read answered with recall 0.
                settings = dataclasses.replace(task.grid.settings_for(run), recall=str(max(recalls)))
                session = Session(settings, listener=None, say=reporter.say, loaded=loaded)
            for L in task.lengths:
                for d in task.depths:
                    row = {rec: {
                        "policy": run.policy, "budget": session.budget_tokens, "recall": rec, "length": L,
                        "depth": d, "needle_token": None, "document_tokens": None, "trials": task.trials,
                        "correct": 0, "accuracy": 0.0, "answers": [],
                    } for rec in recalls}  # fmt: skip
                    for t, needle in enumerate(needles):
                        reporter.doing(f"{run.label} L={L} depth={d:g} trial {t + 1}/{task.trials}")
                        hay, starts = haystack.cut(L - needle_tokens[t])
                        text, at = insert_needle(hay, needle.text, d, starts)
                        read = session.read(text_document(text, f"<haystack L={L} depth={d:g}>"))
                        for rec in recalls:
                            session.engine.config.recall = rec
                            ans = session.ask(read, needle.question)
                            ok = contains_answer(ans.answer, needle.answer)
                            cell = row[rec]
                            if t == 0:
                                cell["needle_token"] = bisect.bisect_left(starts, at - 1) if d > 0 else 0
                                cell["document_tokens"] = read.document_tokens
                            cell["correct"] += int(ok)
                            cell["answers"].append({"trial": t, "expected": needle.answer, "answer": ans.answer,
                                                    "correct": ok})
                            reporter.advance()
                        session.engine.config.recall = max(recalls)
                    for cell in row.values():
                        cell["accuracy"] = round(cell["correct"] / task.trials, 4)
                        cells.append(cell)
    summary = summarize(cells)
    return report("needle", {**model_settings(loaded), **task.settings()}, cells, timer.seconds(), summary=summary)


def summarize(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Accuracy per (policy, budget, recall) over every length, depth and trial, with a 95% Wilson interval."""
    out: dict[tuple[str, Any, int], dict[str, Any]] = {}
    for c in cells:
        rec = c.get("recall", 0)
        row = out.setdefault((c["policy"], c["budget"], rec), {"policy": c["policy"], "budget": c["budget"],
                                                              "recall": rec, "correct": 0, "total": 0})
        row["correct"] += c["correct"]
        row["total"] += c["trials"]
    for row in out.values():
        row["accuracy"] = round(row["correct"] / row["total"], 4) if row["total"] else 0.0
        row["wilson95"] = [round(x, 4) for x in wilson(row["correct"], row["total"])]
    return list(out.values())


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a success rate k/n (sound for small n and rates near 0 or 1)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


# --------------------------------------------------------------------------------------------- output


def _heat(acc: float) -> str:
    """Red (0) → yellow (0.5) → green (1) background."""
    a = min(1.0, max(0.0, acc))
    lo, mid, hi = (215, 48, 39), (254, 224, 139), (26, 152, 80)
    x, (c0, c1) = (a * 2, (lo, mid)) if a < 0.5 else ((a - 0.5) * 2, (mid, hi))
    r, g, b = (round(u + (v - u) * x) for u, v in zip(c0, c1, strict=True))
    return f"bold black on #{r:02x}{g:02x}{b:02x}"


def render_needle(rep: dict[str, Any], console: Any) -> None:
    from rich.columns import Columns
    from rich.table import Table
    from rich.text import Text

    s = rep["settings"]
    lengths, depths = s["lengths"], s["depths"]
    groups: dict[tuple[str, Any, int], dict[tuple[int, float], float]] = {}
    for c in rep["results"]:
        groups.setdefault((c["policy"], c["budget"], c.get("recall", 0)), {})[(c["length"], c["depth"])] = c["accuracy"]
    maps = []
    for (policy, budget, rec), acc in groups.items():
        title = policy if budget is None else f"{policy} @ {budget}" + (f" + recall {rec}" if rec else "")
        t = Table(title=title, title_style="bold")
        t.add_column("length \\ depth", justify="right")
        for d in depths:
            t.add_column(f"{d:g}", justify="center")
        for L in lengths:
            t.add_row(str(L), *[Text(f"{acc[(L, d)]:.2f}", style=_heat(acc[(L, d)])) for d in depths])
        maps.append(t)
    console.print(Columns(maps, padding=(0, 2)))
    summary = Table(title=f"needle accuracy ({s['model']}, {s['trials']} trial(s) per cell)")
    for col in ("policy", "budget", "recall", "accuracy", "95% CI", "correct"):
        summary.add_column(col, justify="left" if col == "policy" else "right")
    for row in rep["summary"]:
        budget = "-" if row["budget"] is None else str(row["budget"])
        lo, hi = row.get("wilson95", (0.0, 1.0))
        summary.add_row(row["policy"], budget, str(row.get("recall", 0) or "-"),
                        Text(f"{row['accuracy']:.2f}", style=_heat(row["accuracy"])), f"{lo:.2f}–{hi:.2f}",
                        f"{row['correct']}/{row['total']}")
    console.print(summary)
    console.print(f"{rep['seconds']:.1f} s", style="dim")
