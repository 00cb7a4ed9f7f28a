"""``kvtool profile``: the predicted memory plan of a run; with ``--doc``, measured against a real prefill.

The plan itself is :func:`kvtool.runtime.profiling.plan` (formulas in :mod:`kvtool.runtime.memory`). This module parses
the flags, measures the runtime baseline, loads the model (its real dimensions and parameter bytes),
optionally reads a document under the meter, and prints a table or one JSON object on stdout.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from kvtool.cli.options import READ_SETTINGS, FormatOpt, JsonOpt, ProfileOpt, QuietOpt, capped_option, with_settings
from kvtool.cli.output import dashboard, emit_json, sayer
from kvtool.errors import UsageError

DocOpt = Annotated[list[str] | None, typer.Option("--doc", help="Also read this document ('-' = stdin) or load this "
                                                  ".kvc, answer --question about it and report the measured peak "
                                                  "against the prediction; repeat it to read documents one after the "
                                                  "other in one cache, as a run over many documents does.")]
QuestionOpt = Annotated[str | None, typer.Option("--question", help="What --doc asks about each document (its answer "
                                                 "is measured too); default: what the document is about.")]
DocTokensOpt = Annotated[int | None, capped_option("doc_tokens", "--doc-tokens", help="Document length in tokens for "
                                                   "the dense (no eviction) comparison.")]
MemoryOpt = Annotated[str | None, typer.Option("--memory", help="Memory available (8GiB, 512MiB, 2GB): largest "
                                               "budget that fits and longest document dense transformers holds.")]


@with_settings(*READ_SETTINGS, "max_new_tokens")
def profile(
    profile_name: ProfileOpt = None,
    doc: DocOpt = None,
    question: QuestionOpt = None,
    doc_format: FormatOpt = None,
    doc_tokens: DocTokensOpt = None,
    memory: MemoryOpt = None,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    flags: dict[str, Any] | None = None,
) -> None:
    """Predicted memory plan (weights, KV, scratch, activations, peak); --doc measures a real read and answer."""
    run_profile(flags or {}, profile=profile_name, doc=doc, doc_tokens=doc_tokens, memory=memory, json_out=json_out,
                quiet=quiet, doc_format=doc_format, question=question)


def run_profile(
    overrides: dict[str, Any],
    profile: str | None = None,
    doc: list[str] | str | None = None,
    doc_tokens: int | None = None,
    memory: str | None = None,
    json_out: bool = False,
    quiet: bool = False,
    doc_format: str | None = None,
    question: str | None = None,
) -> dict[str, Any]:
    """Everything ``kvtool profile`` does after flag parsing; returns the printed plan."""
    from kvtool.cli.ask import _open_input
    from kvtool.runtime import store
    from kvtool.runtime.budget import parse_size
    from kvtool.runtime.settings import resolve_settings

    # Bad input fails before torch is imported and before seconds are spent loading the model.
    if question is not None and not question.strip():
        raise UsageError("--question is empty")
    limit = parse_size(memory) if memory is not None else None
    paths = [doc] if isinstance(doc, str) else list(doc or [])
    inputs: list[tuple[str, Any]] = []
    try:
        for path in paths:
            kind, source = _open_input(path, doc_format, quiet)
            inputs.append((kind, path if kind == "kvc" else source))
            if kind == "kvc" and len(inputs) == 1:  # its settings are the run's, as `ask` reads it
                overrides = store.settings_overrides(source, overrides)
        settings = resolve_settings(profile, overrides)
        return _plan_and_measure(settings, inputs, doc_tokens, limit, json_out, quiet, question)
    finally:
        for kind, source in inputs:
            if kind == "document":
                source.close()  # a read abandoned partway (or never begun) closes its file now


def _plan_and_measure(settings: Any, inputs: list[tuple[str, Any]], doc_tokens: int | None, limit: int | None,
                      json_out: bool, quiet: bool, question: str | None) -> dict[str, Any]:
    """The plan (from a config alone, or from the loaded model) and, with documents, the measured reads and answers
    (``question``: None asks ``profiling.DEFAULT_QUESTION``)."""
    # Everything heavy is imported before the baseline so that it counts the runtime, not the model.
    import rich.console  # noqa: F401 (counted in the baseline, as the table drawn later needs it)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from kvtool.cli import plan_view  # noqa: F401
    from kvtool.runtime import profiling
    from kvtool.runtime.model import config_directory
    from kvtool.runtime.session import Session

    found = config_directory(settings.model)  # a local checkpoint directory, or a cached id's snapshot
    if found is not None and not profiling.has_weights(found[0]):
        model_dir, name = found
        if inputs:
            raise UsageError(f"{name} ({model_dir}) holds no weights: it can be planned (--memory, --doc-tokens), "
                             "not read (drop the document)")
        return _show(profiling.plan_from_config(model_dir, settings, doc_tokens, limit, name=name), json_out)
    rss_before_load = profiling.process_rss()
    say = sayer(quiet)
    with dashboard(quiet) as dash:
        session = Session(settings, listener=dash if inputs else None, say=say)
        baseline = 0 if session.loaded.device.type == "cuda" else profiling.warm_baseline(
            session.model, session.loaded.device, rss_before_load)
        resolved = session.settings  # the block chosen for the device
        result = profiling.plan(session, resolved, doc_tokens=doc_tokens, memory=limit, runtime_baseline=baseline)
        if inputs:
            measured = profiling.measure(session, inputs, question or profiling.DEFAULT_QUESTION)
            docs = measured["documents"]
            n = doc_tokens if doc_tokens is not None else max(d["document_tokens"] + d["prefix_tokens"] for d in docs)
            # the plan of what was read and asked: policy full keeps every token read, the snapshot and recall's
            # scores size by the document's length, recall's queries by the question's
            asked = [d["question_tokens"] for d in docs if d["question_tokens"] is not None]
            result = profiling.plan(session, resolved, doc_tokens=n, memory=limit, runtime_baseline=baseline,
                                    question_tokens=max(asked) if asked else None)
            # the dense comparison: --doc-tokens if given, else the (longest) document just read
            dense_n = doc_tokens if doc_tokens is not None else max(d["document_tokens"] for d in docs)
            result["dense"] = profiling.plan(session, resolved, doc_tokens=dense_n, runtime_baseline=baseline)["dense"]
            predicted = result["predicted_peak_bytes"]
            result["measured"] = {**measured, "predicted_peak_bytes": predicted,
                                  "ratio": round(measured["peak_bytes"] / predicted, 4) if predicted else None}
    return _show(result, json_out)


def _show(result: dict[str, Any], json_out: bool) -> dict[str, Any]:
    """The plan on stdout: JSON, or the table (a pipe or file gets one wide enough not to wrap)."""
    from rich.console import Console

    from kvtool.cli.plan_view import render_plan

    if json_out:
        emit_json(result)
    else:
        render_plan(result, Console(highlight=False, width=None if sys.stdout.isatty() else 120))
    return result
