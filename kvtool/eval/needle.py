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

The default needle is a 5-digit secret number, regenerated per trial from ``random.Random(seed + trial)``.
"""

from __future__ import annotations

import bisect
import dataclasses
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtool.config import SHARED_RECALL_SELECT, recall_select_spec
from kvtool.core.recall import RecallTrace
from kvtool.errors import UsageError
from kvtool.eval import (
    PROMPT_MARGIN,
    CellLog,
    Grid,
    Reporter,
    Timer,
    load_once,
    model_range,
    model_settings,
    report,
    text_document,
)
from kvtool.eval.diagnose import diagnose as diagnosis
from kvtool.eval.metrics import contains_answer
from kvtool.eval.stats import best_in_group, newcombe_difference, wilson
from kvtool.runtime.budget import parse_recall
from kvtool.runtime.memory import compact_positions
from kvtool.runtime.session import Session
from kvtool.runtime.tokens import encode_text

# Wording measured on the embedded 135M model: with "The pass key is N ..." / "What is the pass key?" the
# model defines the phrase "pass key" instead of reading the text (dense: 0 of 12 at 512-1K tokens);
# "secret number" is read back (docs/results.md).
PASSKEY_NEEDLE = "The secret number is {key}. Remember it: the secret number is {key}."
PASSKEY_QUESTION = "What is the secret number?"
#: the multi-needle variant: k labelled pass keys in one document, the question asks for one label
LABELS = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black", "silver", "golden")
LABELLED_NEEDLE = "The secret number of the {label} door is {key}. Remember it: the {label} door opens with {key}."
LABELLED_QUESTION = "What is the secret number of the {label} door?"
#: the word needle: an invented name (no prior to guess it from), asked the same way as the number
NAME_NEEDLE = "The secret name is {key}. Remember it: the secret name is {key}."
NAME_QUESTION = "What is the secret name?"
_SYLLABLES = ("ka", "lo", "mi", "ren", "tha", "vo", "zel", "dra", "quin", "sa", "bel", "tor", "nex", "pi", "ru", "gan")
#: the paraphrased needle: the question asks for an invented village in other words than the sentence states it,
#: sharing one anchor word (``village``) and a synonym pair (cook, chef); calibrated on the embedded model
#: (docs/evaluation.md): with no shared word at all even the dense model does not find it at 1K tokens
PARAPHRASE_NEEDLE = "Our ship's cook was born in the mountain village of {key}."
PARAPHRASE_QUESTION = "Which village is the chef from?"
#: the two-fact needle: who holds a role (at the cell's depth), what that person did and what another did (at seeded
#: depths); only the first fact says whose deed the question means, so the answer must combine two places
TWOFACT_ROLE = "The keeper of the old lighthouse is named {name}."
TWOFACT_DEED = "{name} hid a {thing} in the cellar."
TWOFACT_QUESTION = "What did the keeper of the old lighthouse hide in the cellar?"
_THINGS = ("compass", "lantern", "violin", "telescope", "hammer", "candle", "mirror", "saddle", "kettle", "anchor",
           "feather", "helmet", "bottle", "ribbon", "trumpet", "basket")
#: ``--needle-kind``: what the default needle hides
NEEDLE_KINDS = ("number", "name", "paraphrase", "twofact")
#: the needle and the question each kind's resume fingerprint names
_KIND_TEXT = {"number": ("passkey", PASSKEY_QUESTION), "name": ("name", NAME_QUESTION),
              "paraphrase": (PARAPHRASE_NEEDLE, PARAPHRASE_QUESTION),
              "twofact": (f"{TWOFACT_ROLE} {TWOFACT_DEED}", TWOFACT_QUESTION)}
MIN_HAYSTACK_TOKENS = 16

_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*(?=\s)")


@dataclass(frozen=True)
class Needle:
    text: str
    question: str
    answer: str
    wrong: str | None = None  # an answer naming this (a distractor's answer) is wrong, even beside ``answer``

    def found(self, answer: str) -> bool:
        """Whether ``answer`` names the expected answer (and not the distractor's)."""
        return contains_answer(answer, self.answer) and not (self.wrong and contains_answer(answer, self.wrong))


def passkey_needle(seed: int, trial: int) -> Needle:
    """The default needle of trial ``trial``: a 5-digit pass key drawn from ``random.Random(seed + trial)``."""
    key = str(random.Random(seed + trial).randint(10000, 99999))
    return Needle(PASSKEY_NEEDLE.format(key=key), PASSKEY_QUESTION, key)


def invented_name(rng: random.Random) -> str:
    """A three-syllable name no text has (no prior to guess it from)."""
    return "".join(rng.choice(_SYLLABLES) for _ in range(3)).capitalize()


def name_needle(seed: int, trial: int) -> Needle:
    """The word needle of trial ``trial``: an invented three-syllable name from ``random.Random(seed + trial)``."""
    key = invented_name(random.Random(seed + trial))
    return Needle(NAME_NEEDLE.format(key=key), NAME_QUESTION, key)


def paraphrase_needle(seed: int, trial: int) -> Needle:
    """The paraphrased needle of trial ``trial``: an invented town, asked for in other words."""
    key = invented_name(random.Random(seed + trial))
    return Needle(PARAPHRASE_NEEDLE.format(key=key), PARAPHRASE_QUESTION, key)


def twofact_needles(seed: int, trial: int) -> list[Needle]:
    """The two-fact needle of trial ``trial``: [the role's holder (asked: its answer is the thing that person hid;
    the other's thing makes an answer wrong), the holder's deed, another person's deed]."""
    rng = random.Random(seed * 6151 + trial)
    name = invented_name(rng)
    other = invented_name(rng)
    while other == name:
        other = invented_name(rng)
    thing, wrong = rng.sample(_THINGS, 2)
    return [Needle(TWOFACT_ROLE.format(name=name), TWOFACT_QUESTION, thing, wrong),
            Needle(TWOFACT_DEED.format(name=name, thing=thing), "", ""),
            Needle(TWOFACT_DEED.format(name=other, thing=wrong), "", "")]


def labelled_needles(seed: int, trial: int, k: int) -> list[Needle]:
    """The k needles of trial ``trial`` in the multi-needle variant; the first is the one asked for."""
    rng = random.Random(seed * 7919 + trial)
    labels = rng.sample(LABELS, k)
    keys = rng.sample(range(10000, 100000), k)
    return [Needle(LABELLED_NEEDLE.format(label=lab, key=key), LABELLED_QUESTION.format(label=lab), str(key))
            for lab, key in zip(labels, keys, strict=True)]


# --------------------------------------------------------------------------------------------- haystack


def tokenize_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]] | None]:
    """Token ids (the haystack is data: plain text) and (start, end) character offsets (None when the
    tokenizer cannot give them)."""
    return encode_text(tokenizer, text, offsets=True)


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


def insert_needle(haystack: str, needle: str, depth: float, token_starts: list[int] | None = None,
                  avoid: list[tuple[int, int]] | None = None) -> tuple[str, int]:
    """Insert ``needle`` at ``depth`` ∈ [0, 1]; returns (document, index of the needle's first character).

    Depth 0: the document starts with the needle. Depth 1: it ends with the needle. Otherwise the needle goes
    on the sentence boundary nearest to the target (token ``round(depth · n)`` when ``token_starts`` are given,
    else character ``round(depth · len)``), falling back to the nearest whitespace, then the target itself.
    ``avoid`` = [(start, end), ...] keeps the insertion point out of those spans (other needles' text).
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
    def allowed(i: int) -> bool:
        return 0 < i < n and not any(a <= i <= b for a, b in avoid or ())

    candidates = [b for b in sentence_boundaries(haystack) if allowed(b)]
    if not candidates:
        candidates = [i for i, ch in enumerate(haystack) if ch.isspace() and allowed(i)]
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
    needles: int = 1  # > 1: the multi-needle variant (k labelled pass keys, the question asks for one)
    resume: str | None = None  # a JSONL file of finished trials (--resume)
    recalls: list[int] = dataclasses.field(default_factory=lambda: [0])  # recall budgets per bounded run
    selects: list[str] = dataclasses.field(default_factory=lambda: [SHARED_RECALL_SELECT])  # per recall budget
    kind: str = "number"  # the default needle: a secret number, an invented name, ... (NEEDLE_KINDS)
    diagnose: bool = False  # record why each trial was found or missed (kvtool/eval/diagnose.py)

    def needles_for(self, trial: int) -> list[Needle]:
        """The needles of one trial; the first is the one asked for (the only one unless ``needles`` > 1)."""
        if self.needle is not None:
            return [self.needle]
        if self.needles > 1:
            return labelled_needles(self.grid.settings.seed, trial, self.needles)
        seed = self.grid.settings.seed
        if self.kind == "twofact":
            return twofact_needles(seed, trial)
        make = {"name": name_needle, "paraphrase": paraphrase_needle}.get(self.kind, passkey_needle)
        return [make(seed, trial)]

    def answers_of(self, run: Any) -> list[Answered]:
        """What each read of ``run`` is answered under: (recall budget, ``--recall-select``); ``full`` and
        recall 0 once, every other recall budget once per select."""
        recalls = self.recalls if run.budget is not None else [0]
        return [(rec, sel) for rec in recalls for sel in (self.selects if rec else [SHARED_RECALL_SELECT])]

    def places_recall(self, max_positions: int | None) -> bool:
        """Whether ``--recall-placement`` can change an answer: some cell recalls (a bounded policy with a
        recall budget) and some read passes ``max_positions``, the model's range, so that ``--positions auto``
        turns compact (a haystack of L tokens streams the chat prefix too: L + ``PROMPT_MARGIN`` counts)."""
        return (any(self.recalls) and any(p != "full" for p in self.grid.policies)
                and any(compact_positions(self.grid.settings.positions, max_positions, L + PROMPT_MARGIN)
                        for L in self.lengths))

    def settings(self, max_positions: int | None = None) -> dict[str, Any]:
        custom = self.needle
        return {
            "haystack": str(self.haystack_path),
            "lengths": self.lengths,
            "depths": self.depths,
            "trials": self.trials,
            "needles": self.needles,
            "needle": custom.text if custom else ("labelled passkeys" if self.needles > 1 else
                                                  _KIND_TEXT[self.kind][0]),
            "question": custom.question if custom else (LABELLED_QUESTION if self.needles > 1 else
                                                        _KIND_TEXT[self.kind][1]),
            "answer": custom.answer if custom else None,
            "max_new_tokens": self.max_new_tokens,
            "recalls": self.recalls,
            "selects": self.selects,
            **self.grid.describe(answers=True, placement=self.places_recall(max_positions)),
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


def parse_selects(text: str) -> list[str]:
    """``--recall-select`` of the needle grid: a comma list of selects ("shared,grow,sum+again"), in order, unique."""
    out: list[str] = []
    for part in text.split(","):
        if part.strip():
            sel = recall_select_spec(part.strip())
            if sel not in out:
                out.append(sel)
    if not out:
        raise UsageError(f"--recall-select needs at least one value ({SHARED_RECALL_SELECT}: the grid's default)")
    return out


#: what one read is answered under: (recall budget, ``--recall-select``)
Answered = tuple[int, str]


def trial_key(label: str, recall: int, length: int, depth: float, trial: int,
              select: str = SHARED_RECALL_SELECT) -> str:
    """The resume-log key of one trial (recall 0 keeps the key of runs made before recall existed, the default
    select that of runs made before ``--recall-select``)."""
    run = label if recall == 0 else f"{label}+recall{recall}"
    if recall and select != SHARED_RECALL_SELECT:
        run += f"+{select}"
    return f"{run}|{length}|{depth}|{trial}"


def build_document(haystack: Haystack, needles: list[Needle], length: int, depth: float, seed: int, trial: int,
                   needle_tokens: int) -> tuple[str, int, list[int]]:
    """The trial's document: the asked needle at ``depth``, the others (if any) at seeded other depths.

    Returns (text, character index of the asked needle, token start characters of the haystack cut).
    """
    text, spans, starts = place_needles(haystack, needles, length, depth, seed, trial, needle_tokens)
    return text, spans[0][0], starts


def place_needles(haystack: Haystack, needles: list[Needle], length: int, depth: float, seed: int, trial: int,
                  needle_tokens: int) -> tuple[str, list[tuple[int, int]], list[int]]:
    """:func:`build_document` with every needle's character span [start, end), in the order of ``needles``."""
    hay, starts = haystack.cut(length - needle_tokens)
    text, at = insert_needle(hay, needles[0].text, depth, starts)
    rng = random.Random(seed * 104729 + trial)
    spans = [(at, at + len(needles[0].text))]
    for other in needles[1:]:
        before = len(text)
        text, pos = insert_needle(text, other.text, rng.uniform(0.02, 0.98), None, avoid=spans)
        grown = len(text) - before
        spans = [(a + grown, b + grown) if a >= pos else (a, b) for a, b in spans] + [(pos, pos + len(other.text))]
    return text, spans, starts


def needle_trial(session: Any, haystack: Haystack, needles: list[Needle], length: int, depth: float, seed: int,
                 trial: int, needle_tokens: int, answers: list[Answered],
                 diagnose: bool = False) -> dict[Answered, dict[str, Any]]:
    """Read one trial's document once and ask for the first needle under each (recall budget, select).

    One read serves every recall budget and select: archiving does not change what the cache keeps, so
    the eviction-only answer is the same read answered with recall 0. Returns (recall, select) → the
    record the resume log keeps; with ``diagnose`` each record has a ``diagnose`` entry
    (:mod:`kvtool.eval.diagnose`), taken from the same answer (a trace changes nothing the recall does).
    """
    text, spans, starts = place_needles(haystack, needles, length, depth, seed, trial, needle_tokens)
    at = spans[0][0]
    session.keep_source = diagnose
    read = session.read(text_document(text, f"<haystack L={length} depth={depth:g}>"))
    if depth == 0:
        needle_token = 0
    elif len(needles) == 1:
        needle_token = bisect.bisect_left(starts, at - 1)
    else:  # distractors shift the haystack's token starts: estimate from the character position
        needle_token = round(at / max(1, len(text)) * read.document_tokens)
    watched = [read.source.positions_in(a, b) for a, b in spans] if diagnose and read.source is not None else None
    out: dict[Answered, dict[str, Any]] = {}
    config = session.engine.config
    top, top_select = config.recall, config.recall_select
    try:
        for rec, sel in answers:
            config.recall, config.recall_select = rec, sel
            trace = session.engine.recall_trace = RecallTrace(torch.cat(watched)) if watched else None
            before = session.recall_seconds
            ans = session.ask(read, needles[0].question)
            got = out[(rec, sel)] = {"expected": needles[0].answer, "answer": ans.answer,
                                     "correct": needles[0].found(ans.answer), "budget": session.budget_tokens,
                                     "document_tokens": read.document_tokens, "needle_token": needle_token,
                                     "recall_seconds": round(session.recall_seconds - before, 3)}
            if trace is not None and watched is not None and read.source is not None:
                got["diagnose"] = diagnosis(trace, watched, read.source, ans.ids, session.tokenizer)
    finally:
        config.recall, config.recall_select = top, top_select
        session.engine.recall_trace = None
        read.close()
    return out


def run_needle(task: NeedleTask, reporter: Reporter) -> dict[str, Any]:
    timer = Timer()
    loaded = load_once(task.grid, reporter.say)
    tok = loaded.tokenizer
    haystack = Haystack(task.haystack, tok, max(task.lengths))
    if haystack.repeated:
        reporter.say(f"note: the haystack has fewer than {max(task.lengths)} tokens; it is repeated to fill")
    trial_needles = [task.needles_for(t) for t in range(task.trials)]
    needle_tokens = [sum(len(encode_text(tok, " " + n.text + " ")) for n in ns)
                     for ns in trial_needles]
    for L in task.lengths:
        if L - max(needle_tokens) < MIN_HAYSTACK_TOKENS:
            raise UsageError(f"length {L} is too short for the needle(s) ({max(needle_tokens)} tokens)")
    settings = {**model_settings(loaded), **task.settings(model_range(loaded))}
    log = CellLog(task.resume, "needle", {**settings, "identity": loaded.identity})
    if log.ignored:
        reporter.say(f"note: {task.resume}: {log.ignored} line(s) from other settings are ignored")

    runs = task.grid.runs()
    cells: list[dict[str, Any]] = []
    total = sum(len(task.answers_of(run)) for run in runs) * len(task.lengths) * len(task.depths) * task.trials
    with reporter.bar(total):
        for run in runs:
            answers = task.answers_of(run)
            session = None  # built on first need: a fully resumed run loads nothing more
            for L in task.lengths:
                for d in task.depths:
                    row = {a: {
                        "policy": run.policy, "budget": None, "recall": a[0], "select": a[1], "length": L,
                        "depth": d, "needle_token": None, "document_tokens": None, "trials": task.trials,
                        "correct": 0, "accuracy": 0.0, "answers": [],
                    } for a in answers}  # fmt: skip
                    for t, needles in enumerate(trial_needles):
                        reporter.doing(f"{run.label} L={L} depth={d:g} trial {t + 1}/{task.trials}")
                        keys = {a: trial_key(run.label, a[0], L, d, t, a[1]) for a in answers}
                        missing = [a for a in answers if not _logged(log, keys[a], task.diagnose)]
                        if missing:
                            session = session or _needle_session(task, run, loaded, reporter)
                            got = needle_trial(session, haystack, needles, L, d, task.grid.settings.seed, t,
                                               needle_tokens[t], missing, task.diagnose)
                            for a, record in got.items():
                                log.put(keys[a], record)
                        for a in answers:
                            _count(row[a], t, log.get(keys[a]))
                            reporter.advance()
                    for cell in row.values():
                        iv = wilson(cell["correct"], task.trials)
                        cell["accuracy"] = round(iv.value, 4)
                        cell["interval"] = [round(iv.low, 4), round(iv.high, 4)]
                        cells.append(cell)
    summary = summarize(cells)
    return report("needle", settings, cells, timer.seconds(), summary=summary)


def _count(cell: dict[str, Any], trial: int, record: dict[str, Any]) -> None:
    """Add one trial's logged ``record`` to its cell."""
    if trial == 0:
        cell["needle_token"] = record["needle_token"]
        cell["document_tokens"] = record["document_tokens"]
    cell["budget"] = record["budget"]
    cell["correct"] += int(record["correct"])
    cell["answers"].append({"trial": trial, "expected": record["expected"], "answer": record["answer"],
                            "correct": record["correct"],
                            **{k: record[k] for k in ("recall_seconds", "diagnose") if k in record}})


def _logged(log: CellLog, key: str, diagnose: bool) -> bool:
    """Whether trial ``key`` is in the resume log (with ``diagnose``: with its diagnosis; a trial logged
    without one is read again, and its new record, diagnosis included, is appended)."""
    return key in log and (not diagnose or "diagnose" in log.get(key))


def _needle_session(task: NeedleTask, run: Any, loaded: Any, reporter: Reporter) -> Any:
    """The run's session; with recall budgets, one archiving session that every recall budget shares."""
    top = max(a[0] for a in task.answers_of(run))
    settings = dataclasses.replace(task.grid.settings_for(run), recall=str(top) if top else "off")
    return Session(settings, listener=None, say=reporter.say, loaded=loaded)


def summarize(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Found-rate per (policy, budget, recall, select) over every length, depth and trial, with a Wilson interval.

    ``significant`` marks a row whose difference from the best row at the same budget and recall budget
    excludes 0 (Newcombe interval); ``below_full`` one whose difference from the ``full`` row does.
    """
    out: dict[tuple[str, Any, int, str], dict[str, Any]] = {}
    for c in cells:
        rec, sel = c.get("recall", 0), c.get("select", SHARED_RECALL_SELECT)
        row = out.setdefault((c["policy"], c["budget"], rec, sel), {
            "policy": c["policy"], "budget": c["budget"], "recall": rec, "select": sel, "correct": 0, "total": 0})
        row["correct"] += c["correct"]
        row["total"] += c["trials"]
    rows = list(out.values())
    budgets = [(r["budget"], r["recall"]) for r in rows]
    rates = [r["correct"] / r["total"] if r["total"] else 0.0 for r in rows]
    best = best_in_group(budgets, rates)
    full = next((k for k, r in enumerate(rows) if r["budget"] is None), None)

    def differs(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return newcombe_difference(a["correct"], a["total"], b["correct"], b["total"]).excludes(0.0)

    for k, row in enumerate(rows):
        iv = wilson(row["correct"], row["total"])
        row["accuracy"] = round(iv.value, 4)
        row["interval"] = [round(iv.low, 4), round(iv.high, 4)]
        b = best[k]
        row["best"] = k == b
        row["significant"] = b is not None and k != b and differs(row, rows[b])
        row["below_full"] = full is not None and rates[k] < rates[full] and differs(row, rows[full])
    return rows
