"""Fidelity to dense, reference-free: what eviction changes in the answers, whatever the model's ability.

For one document and a list of questions, every question is answered by ``full`` (the dense cache in
the model's dtype, whatever ``--kv-dtype`` the runs use: the reference) and by each (policy, budget) run
of the grid, through the same path as ``kvtool ask`` (greedy decoding, chat template, pinned question).
Per question and run:

* **exact match**, **token F1** (SQuAD's bag-of-words F1) and **ROUGE-L** of the run's answer against
  the dense answer (``kvtool.eval.metrics``);
* **KL(dense ‖ policy)** and **top-1 agreement** of the next-token distributions over the first
  ``first_tokens`` tokens of the *dense* answer, teacher-forced in both runs (``Session.forced_logits``),
  so both distributions are taken on the same context.

Per run: exact-match rate with a Wilson interval; F1, ROUGE-L, KL and top-1 means with bootstrap
intervals over questions; ``significant`` marks a run whose F1 differs from the best run's at the
same budget (paired bootstrap over the same questions). Resumable with ``--resume`` (one line per
finished question).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvtool.config import SCAN
from kvtool.documents import read_lines
from kvtool.errors import UsageError
from kvtool.eval import (
    PROMPT_MARGIN,
    CellLog,
    Grid,
    Reporter,
    Run,
    Timer,
    load_once,
    load_text,
    make_session,
    model_range,
    model_settings,
    report,
)
from kvtool.eval.metrics import exact_match, kl_divergence, rouge_l, token_f1, top1_agreement
from kvtool.eval.stats import best_in_group, bootstrap_mean, paired_difference, wilson
from kvtool.runtime.memory import compact_positions
from kvtool.runtime.tokens import encode_text

if TYPE_CHECKING:
    from kvtool.runtime.prompt import Rendered

MAX_QUESTIONS = 10_000


@dataclass
class AgreementTask:
    grid: Grid
    doc_path: Path
    questions: list[str]
    first_tokens: int = 8
    max_new_tokens: int = 48
    resume: str | None = None

    def settings(self, max_positions: int | None = None, doc_tokens: int | None = None) -> dict[str, Any]:
        """The task's settings for its resume fingerprint; ``--recall-placement`` only where it can act:
        a document of ``doc_tokens`` (None: unknown) read past ``max_positions``, the model's range."""
        placement = compact_positions(self.grid.settings.positions, max_positions, doc_tokens)
        select = doc_tokens is None or doc_tokens > SCAN  # a head's archive can pass one scan (``auto`` acts)
        return {
            "doc": str(self.doc_path),
            "questions": len(self.questions),
            "first_tokens": self.first_tokens,
            "max_new_tokens": self.max_new_tokens,
            **self.grid.describe(answers=True, recall=True, placement=placement, select=select),
        }


def document_tokens(path: Path, tokenizer: Any, max_positions: int | None) -> int | None:
    """The tokens a read of ``path`` streams, when that is at most ``max_positions`` (None: more, or unknown).

    Reads at most a bounded prefix: a document whose text runs past 8 bytes per position of the model's
    range is taken as longer than the range without tokenizing it."""
    if max_positions is None:
        return None
    cap = 8 * max_positions
    text = load_text(path, "--doc", max_bytes=cap)
    if len(text.encode("utf-8")) >= cap:
        return None
    n = len(encode_text(tokenizer, text)) + PROMPT_MARGIN
    return n if n <= max_positions else None


def read_questions_file(path: Path, notify: Callable[[str], None] | None = None) -> list[str]:
    """One question per non-empty line; a clear error naming the file when it has none (``notify``: told
    before a FIFO, which may wait for a writer, is opened)."""
    qs = read_lines(path, "--questions-file", notify=notify)
    if not qs:
        raise UsageError(f"--questions-file {path} has no questions (one per line)")
    if len(qs) > MAX_QUESTIONS:
        raise UsageError(f"--questions-file {path} has {len(qs)} questions; at most {MAX_QUESTIONS}")
    return qs


def run_agreement(task: AgreementTask, reporter: Reporter) -> dict[str, Any]:
    from kvtool.documents import open_document

    timer = Timer()
    torch.manual_seed(task.grid.settings.seed)
    loaded = load_once(task.grid, reporter.say)
    max_positions = model_range(loaded)
    settings = {**model_settings(loaded),
                **task.settings(max_positions, document_tokens(task.doc_path, loaded.tokenizer, max_positions)),
                "reference": "policy full (dense cache)"}
    log = CellLog(task.resume, "agreement", {**settings, "identity": loaded.identity,
                                             "question_list": task.questions})
    runs = [r for r in task.grid.runs() if r.policy != "full"]
    if not runs:
        raise UsageError("eval agreement compares policies with full: give at least one policy other than full")
    Q = len(task.questions)
    with reporter.bar(Q * (1 + len(runs))):
        # the dense reference: answers (kept in the log) and, when some run still needs them, forced logits
        dense_session = None
        dense_read = None
        dense: list[dict[str, Any]] = []
        dense_logits: list[torch.Tensor | None] = [None] * Q
        needs_logits = [any(f"{run.label}|{i}" not in log for run in runs) for i in range(Q)]
        for i, q in enumerate(task.questions):
            reporter.doing(f"full: question {i + 1}/{Q}")
            if f"full|{i}" not in log or needs_logits[i]:
                if dense_session is None:
                    # the reference is the model's own answer: K/V in its dtype whatever --kv-dtype the runs use
                    dense_session = make_session(task.grid, Run("full", None), loaded, reporter.say, kv_dtype="auto")
                    with open_document(str(task.doc_path)) as doc:  # closed even if the read fails partway
                        dense_read = dense_session.read(doc)
                if f"full|{i}" not in log:
                    ans = dense_session.answer(dense_read, _suffix(dense_session, q), q,
                                               max_new_tokens=task.max_new_tokens)
                    log.put(f"full|{i}", {"answer": ans.answer, "ids": ans.ids[: task.first_tokens]})
            rec = log.get(f"full|{i}")
            dense.append(rec)
            if needs_logits[i] and rec["ids"]:
                dense_logits[i] = dense_session.forced_logits(dense_read, q, rec["ids"])  # type: ignore[union-attr]
            reporter.advance()
        per_run: list[list[dict[str, Any]]] = []
        for run in runs:
            session = None
            read = None
            rows = []
            for i, q in enumerate(task.questions):
                reporter.doing(f"{run.label}: question {i + 1}/{Q}")
                key = f"{run.label}|{i}"
                if key not in log:
                    if session is None:
                        session = make_session(task.grid, run, loaded, reporter.say)
                        with open_document(str(task.doc_path)) as doc:
                            read = session.read(doc)
                    ans = session.answer(read, _suffix(session, q), q, max_new_tokens=task.max_new_tokens, focus=q)
                    ref = dense[i]["answer"]
                    row: dict[str, Any] = {"answer": ans.answer, "budget": session.budget_tokens,
                                           "exact": exact_match(ref, ans.answer), "f1": token_f1(ref, ans.answer),
                                           "rouge_l": rouge_l(ref, ans.answer), "kl": None, "top1": None}
                    if dense_logits[i] is not None:
                        got = session.forced_logits(read, q, dense[i]["ids"])
                        row["kl"] = kl_divergence(dense_logits[i], got)
                        row["top1"] = top1_agreement(dense_logits[i], got)
                    log.put(key, row)
                rows.append(log.get(key))
                reporter.advance()
            per_run.append(rows)
            if read is not None:
                read.close()  # one run's archive files go before the next run reads
    results = _agreement_results(task, runs, per_run, dense)
    return report("agreement", settings, results, timer.seconds(),
                  reference=[{"question": q, "answer": dense[i]["answer"]} for i, q in enumerate(task.questions)])


def _agreement_results(task: AgreementTask, runs: list[Run], per_run: list[list[dict[str, Any]]],
                       dense: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One result row per run: exact match, token F1, ROUGE-L, KL and top-1 against the dense answers."""
    Q = len(task.questions)
    results: list[dict[str, Any]] = []
    seed = task.grid.settings.seed
    f1s = [[r["f1"] for r in rows] for rows in per_run]
    budgets = [rows[0]["budget"] for rows in per_run]
    best = best_in_group(budgets, [sum(f) / Q for f in f1s])
    for k, (run, rows) in enumerate(zip(runs, per_run, strict=True)):
        b = best[k]
        exact = sum(int(r["exact"]) for r in rows)
        kls = [r["kl"] for r in rows if r["kl"] is not None]
        top1 = [r["top1"] for r in rows if r["top1"] is not None]
        results.append({
            "policy": run.policy,
            "budget": rows[0]["budget"],
            "questions": Q,
            "exact_match": wilson(exact, Q).as_dict(),
            "f1": bootstrap_mean(f1s[k], seed=seed).as_dict(),
            "rouge_l": bootstrap_mean([r["rouge_l"] for r in rows], seed=seed).as_dict(),
            "kl": bootstrap_mean(kls, seed=seed).as_dict(5) if kls else None,
            "top1": bootstrap_mean(top1, seed=seed).as_dict() if top1 else None,
            "best": k == b,
            "significant": b is not None and k != b and paired_difference(f1s[k], f1s[b], seed=seed).excludes(0.0),
            # per question, so that runs over several documents can be pooled into one table
            "answers": [{"question": q, "dense": dense[i]["answer"], "answer": rows[i]["answer"],
                         "f1": round(rows[i]["f1"], 4), "exact": bool(rows[i]["exact"]),
                         "rouge_l": round(rows[i]["rouge_l"], 4), "kl": rows[i]["kl"], "top1": rows[i]["top1"]}
                        for i, q in enumerate(task.questions)],
        })
    return results


def _suffix(session: Any, question: str) -> Rendered:
    from kvtool.runtime import prompt

    return prompt.question_suffix(session.tokenizer, question)
