"""What ``ask`` and ``summarize`` do, between parsing flags and printing: shared by both commands.

Input is validated before the model loads (bad input fails in milliseconds), the document (or a
``.kvc`` cache) is read once, then each question restores the post-document cache and answers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from kvtool.cli import dashboard, emit_json, sayer, write_text
from kvtool.document import open_document
from kvtool.events import RunSummary
from kvtool.session import Answer, ReadResult, Session
from kvtool.settings import resolve_settings


def _open_input(path: str) -> tuple[str, Any]:
    """('kvc', header) for a saved cache (detected by content), else ('text', Document)."""
    from kvtool import store

    if path != "-" and store.is_kvc(path):
        return "kvc", store.read_header(path)
    return "text", open_document(path)


def _run(
    path: str,
    overrides: dict[str, Any],
    profile: str | None,
    quiet: bool,
    work: Callable[[Session, ReadResult], list[Answer]],
) -> tuple[Session, ReadResult, list[Answer], dict[str, Any]]:
    kind, source = _open_input(path)
    if kind == "kvc":
        from kvtool import store

        overrides = store.settings_overrides(source, overrides)
    settings = resolve_settings(profile, overrides)
    with dashboard(quiet) as dash:
        session = Session(settings, listener=dash, say=sayer(quiet), show_progress=not quiet)
        meter = session.engine.meter
        with meter.track():
            if kind == "kvc":
                from kvtool import store

                read = store.load_cache(path, session)
            else:
                read = session.read(source)
            answers = work(session, read)
        stats = session.stats(read, meter.peak_bytes())
        dash(RunSummary(stats))
    return session, read, answers, stats


def run_ask(
    path: str,
    questions: list[str],
    overrides: dict[str, Any],
    profile: str | None = None,
    json_out: bool = False,
    jsonl: bool = False,
    quiet: bool = False,
) -> None:
    stream = not (json_out or jsonl)

    def work(session: Session, read: ReadResult) -> list[Answer]:
        out = []
        for i, q in enumerate(questions):
            if stream and i:
                write_text("\n")
            ans = session.ask(read, q, on_text=write_text if stream else None)
            if stream:
                write_text("\n")
            if jsonl:
                emit_json({"question": ans.question, "answer": ans.answer, "tokens": ans.tokens,
                           "decode_tokens_per_second": round(ans.tokens_per_second, 2)})
            out.append(ans)
        return out

    _, _, answers, stats = _run(path, overrides, profile, quiet, work)
    if json_out:
        emit_json({"answers": [{"question": a.question, "answer": a.answer} for a in answers], "stats": stats})
    elif jsonl:
        emit_json({"stats": stats})


def run_summarize(
    path: str,
    length: str,
    overrides: dict[str, Any],
    profile: str | None = None,
    json_out: bool = False,
    quiet: bool = False,
) -> None:
    def work(session: Session, read: ReadResult) -> list[Answer]:
        ans = session.summarize(read, length, on_text=None if json_out else write_text)
        if not json_out:
            write_text("\n")
        return [ans]

    _, _, answers, stats = _run(path, overrides, profile, quiet, work)
    if json_out:
        emit_json({"summary": answers[0].answer, "length": length, "stats": stats})
    sys.stdout.flush()
