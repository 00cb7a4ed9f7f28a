"""``kvtool ask`` and ``kvtool summarize``: read a document (or a ``.kvc`` cache) once, then answer.

Input is validated before the model loads (bad input fails in milliseconds), the document (or a
``.kvc`` cache) is read once, then each question restores the post-document cache and answers.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from kvtool.cli import many
from kvtool.cli.many import FilesFromOpt, LogOpt, QuestionOpt, RayOpt, WorkersOpt
from kvtool.cli.options import (
    ANSWER_SETTINGS,
    FormatOpt,
    JsonOpt,
    ProfileOpt,
    QuietOpt,
    StatsOpt,
    read_questions,
    with_settings,
)
from kvtool.cli.output import dashboard, emit_json, sayer, write_text
from kvtool.errors import UsageError, printable

CiteOpt = Annotated[bool, typer.Option("--cite", help="Under each answer, the document spans (page, chapter or "
                                       "section) it drew on, found from its attention.")]


@with_settings(*ANSWER_SETTINGS)
def ask(
    file: Annotated[str | None, typer.Argument(help="Document (text, Markdown, HTML, PDF, EPUB, DOCX), '-' for "
                                           "stdin, or a .kvc cache from `kvtool prefill`.")] = None,
    questions: Annotated[list[str] | None, typer.Argument(help="One or more questions (with --question or "
                                                           "--questions-file: more documents).")] = None,
    question: QuestionOpt = None,
    questions_file: Annotated[Path | None, typer.Option("--questions-file", help="One question per line.")] = None,
    files_from: FilesFromOpt = None,
    output: LogOpt = None,
    ray: RayOpt = None,
    workers: WorkersOpt = None,
    cite: CiteOpt = False,
    doc_format: FormatOpt = None,
    profile: ProfileOpt = None,
    json_out: JsonOpt = False,
    jsonl: Annotated[bool, typer.Option("--jsonl", help="One JSON line per answer as it completes.")] = False,
    stats: StatsOpt = False,
    quiet: QuietOpt = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Answer questions about a document (or many: DOC... --question Q) read under a KV budget."""
    if question or questions_file is not None:  # every argument is a document
        documents = [d for d in (file, *(questions or [])) if d is not None]
        asked = read_questions(question, questions_file, sayer(quiet))
        if many.is_many(documents, files_from, output, ray):
            many.run_many("ask", documents, flags or {}, profile=profile, quiet=quiet, files_from=files_from,
                          output=output, ray=ray, workers=workers, questions=asked, cite=cite, doc_format=doc_format)
            return
        many.refuse_many_options("ask", workers=workers)
        file, questions_list = (documents[0] if documents else None), asked
    else:
        many.refuse_many_options("ask", files_from=files_from, output=output, ray=ray, workers=workers)
        questions_list = read_questions(questions, questions_file, sayer(quiet))
    if file is None:
        raise UsageError("give a document: kvtool ask FILE QUESTION..., or kvtool ask DOC... --question QUESTION")
    run_ask(file, questions_list, flags or {}, profile=profile, json_out=json_out, jsonl=jsonl, quiet=quiet,
            cite=cite, doc_format=doc_format, full_stats=stats)


@with_settings(*ANSWER_SETTINGS)
def summarize(
    file: Annotated[list[str] | None, typer.Argument(help="Documents (text, Markdown, HTML, PDF, EPUB, DOCX, "
                                                     "directories read recursively), '-' for stdin, or .kvc "
                                                     "caches.")] = None,
    length: Annotated[str, typer.Option("--length", help="short, medium or long.")] = "medium",
    files_from: FilesFromOpt = None,
    output: LogOpt = None,
    ray: RayOpt = None,
    workers: WorkersOpt = None,
    doc_format: FormatOpt = None,
    profile: ProfileOpt = None,
    json_out: JsonOpt = False,
    stats: StatsOpt = False,
    quiet: QuietOpt = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Summarize a document (or many) read under a KV budget."""
    from kvtool.runtime.prompt import SUMMARY_LENGTHS

    if length not in SUMMARY_LENGTHS:  # before the document is read, not after
        raise UsageError(f"--length must be one of {', '.join(SUMMARY_LENGTHS)} (got {length!r})")
    documents = list(file or [])
    if many.is_many(documents, files_from, output, ray):
        many.run_many("summarize", documents, flags or {}, profile=profile, quiet=quiet, files_from=files_from,
                      output=output, ray=ray, workers=workers, length=length, doc_format=doc_format,
                      recall_auto=False)
        return
    many.refuse_many_options("summarize", workers=workers)
    if not documents:
        raise UsageError("give a document: kvtool summarize FILE (or DOC... for many)")
    run_summarize(documents[0], length, flags or {}, profile=profile, json_out=json_out, quiet=quiet,
                  doc_format=doc_format, full_stats=stats)


def _open_input(path: str, doc_format: str | None = None, quiet: bool = False) -> tuple[str, Any]:
    """('kvc', header) for a saved cache (detected by content), else ('document', Document)."""
    from kvtool.documents import open_document
    from kvtool.kvc.format import is_kvc, read_header

    if path != "-" and is_kvc(path) and doc_format in (None, "auto"):
        return "kvc", read_header(path)
    return "document", open_document(path, doc_format, notify=sayer(quiet))


def _run(
    path: str,
    overrides: dict[str, Any],
    profile: str | None,
    quiet: bool,
    work: Callable[[Any, Any], list[Any]],
    doc_format: str | None = None,
    full_stats: bool = False,
    verb: str = "answered",
    recall_auto: bool = True,
) -> tuple[Any, Any, list[Any], dict[str, Any]]:
    """Read the input once, call ``work``, end with one summary line (or the full table with ``full_stats``).

    ``recall_auto=False``: ``--recall auto`` (the default) means off (a summary asks about everything,
    not a passage recall could find)."""
    started = time.monotonic()

    # Files, .kvc headers and settings are checked before torch is imported (a bad path fails in ms).
    kind, source = _open_input(path, doc_format, quiet)
    try:
        return _read_and_work(path, kind, source, overrides, profile, quiet, work, started, full_stats, verb,
                              recall_auto)
    finally:
        if kind == "document":
            source.close()  # a read abandoned partway (or never begun: bad settings) closes its file now


def _read_and_work(path: str, kind: str, source: Any, overrides: dict[str, Any], profile: str | None, quiet: bool,
                   work: Callable[[Any, Any], list[Any]], started: float, full_stats: bool, verb: str,
                   recall_auto: bool) -> tuple[Any, Any, list[Any], dict[str, Any]]:
    from kvtool.runtime import store
    from kvtool.runtime.settings import resolve_settings

    asked = overrides.get("recall") is not None or resolve_settings(profile, {}).recall != "auto"
    if kind == "kvc":
        overrides = store.settings_overrides(source, overrides)
    settings = resolve_settings(profile, overrides)
    if not recall_auto and not asked:  # a .kvc's recorded recall is a default too
        settings.recall = "off"
    from kvtool.core.events import RunSummary
    from kvtool.runtime.session import Session

    with dashboard(quiet) as dash:
        session = Session(settings, listener=dash, say=sayer(quiet))
        meter = session.engine.meter
        read = None
        try:
            with meter.track():
                read = store.load_cache(path, session) if kind == "kvc" else session.read(source)
                answers = work(session, read)
            stats = session.stats(read, meter.peak_bytes())
        finally:
            if read is not None:
                read.close()  # the recall archive's files go now, not when the read is collected
        if full_stats:
            dash(RunSummary(stats))
    if not (quiet or full_stats):
        sayer(quiet)(summary_line(stats, time.monotonic() - started, verb))
    return session, read, answers, stats


def summary_line(stats: dict[str, Any], seconds: float, verb: str = "answered") -> str:
    """The end of a run in one line: wall time, what was read and how fast, peak memory, recall."""
    from kvtool.runtime.memory import format_bytes

    tokens = int(stats.get("document_tokens", 0)) + int(stats.get("prefix_tokens", 0))
    if stats.get("loaded_from"):
        read = f"{tokens:,} tokens loaded in {stats.get('cache_load_seconds', 0):.1f} s"
    else:
        read = f"{tokens:,} tokens read at {stats.get('prefill_tokens_per_second', 0):,.0f} tok/s"
    peak = stats.get("peak_memory_bytes")
    recall_tokens = int(stats.get("recall_tokens") or 0)
    default = " (default)" if stats.get("recall_mode") == "auto" else ""
    recall = (f"recall {recall_tokens} tokens/head{default} ({stats.get('recalled_pages', 0):,} pages, "
              f"{stats.get('recall_seconds', 0):.1f} s, archive {format_bytes(stats.get('archive_bytes') or 0)})"
              if recall_tokens else "recall off")
    return (f"{verb} in {seconds:.1f} s · {read} · peak {format_bytes(peak) if peak else 'n/a'} · {recall} "
            "(--stats for all figures)")


def run_ask(
    path: str,
    questions: list[str],
    overrides: dict[str, Any],
    profile: str | None = None,
    json_out: bool = False,
    jsonl: bool = False,
    quiet: bool = False,
    cite: bool = False,
    doc_format: str | None = None,
    full_stats: bool = False,
) -> None:
    """Everything ``kvtool ask`` does after option parsing: read once, answer each question, report."""
    stream = not (json_out or jsonl)

    def work(session: Any, read: Any) -> list[Any]:
        out = []
        for i, q in enumerate(questions):
            if stream and i:
                write_text("\n")
            ans = session.ask(read, q, on_text=write_text if stream else None, cite_spans=cite)
            if stream:
                write_text("\n")
                for c in ans.citations or []:
                    write_text(f"  {printable(c.line(), one_line=True)}\n")  # document text: never obeyed
            if jsonl:
                emit_json({"question": ans.question, "answer": ans.answer, "tokens": ans.tokens,
                           "decode_tokens_per_second": round(ans.tokens_per_second, 2), **_citations(ans)})
            out.append(ans)
        return out

    _, _, answers, stats = _run(path, overrides, profile, quiet, work, doc_format, full_stats)
    if json_out:
        emit_json({"answers": [{"question": a.question, "answer": a.answer, **_citations(a)} for a in answers],
                   "stats": stats})
    elif jsonl:
        emit_json({"stats": stats})


def _citations(answer: Any) -> dict[str, Any]:
    """``{"citations": [...]}`` when the answer was asked with --cite, else nothing."""
    if answer.citations is None:
        return {}
    return {"citations": [c.json() for c in answer.citations]}


def run_summarize(
    path: str,
    length: str,
    overrides: dict[str, Any],
    profile: str | None = None,
    json_out: bool = False,
    quiet: bool = False,
    doc_format: str | None = None,
    full_stats: bool = False,
) -> None:
    """Everything ``kvtool summarize`` does after option parsing."""

    def work(session: Any, read: Any) -> list[Any]:
        ans = session.summarize(read, length, on_text=None if json_out else write_text)
        if not json_out:
            write_text("\n")
        return [ans]

    _, _, answers, stats = _run(path, overrides, profile, quiet, work, doc_format, full_stats, "summarized",
                                  recall_auto=False)
    if json_out:
        emit_json({"summary": answers[0].answer, "length": length, "stats": stats})
    sys.stdout.flush()
