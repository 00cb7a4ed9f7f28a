"""The many-document form of ``ask``, ``summarize`` and ``prefill``: a folder of documents in one run.

    kvtool ask contracts/ --question "Who signs?" --question "Until when?" -o answers.jsonl
    kvtool summarize reports/*.pdf --length short
    kvtool prefill books/ -o caches/
    kvtool ask contracts/ --question "Who signs?" --ray local --workers 2

Every option is checked, every path gathered and the output file read (resume) before torch is imported;
then one model loads (or one per Ray worker) and the documents are read in turn. stdout carries JSON
Lines (one record per document and question), or nothing with ``-o``; stderr the progress.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any

import typer

from kvtool.cli.options import capped_option
from kvtool.cli.output import stderr_console
from kvtool.errors import KvtoolError, UsageError, printable, short_path

QuestionOpt = Annotated[list[str] | None, typer.Option(
    "--question", help="A question for every document (repeatable). With --question or --questions-file, every "
    "argument is a document: files, directories (read recursively) or what a glob expanded to.")]
FilesFromOpt = Annotated[str | None, typer.Option(
    "--files-from", help="More documents: a file listing their paths, one per line or NUL-separated (find "
    "-print0); '-' reads the list from stdin.")]
LogOpt = Annotated[str | None, typer.Option(
    "--output", "-o", help="Many documents: append the JSON Lines records to this file (nothing on stdout), "
    "flushed as each answer completes; the same command run again skips what it already holds (resume).")]
RayOpt = Annotated[str | None, typer.Option(
    "--ray", help="Read the documents on a Ray cluster: local (start one here), auto or an address (join one). "
    "Needs the extra kvtool[cluster]; every path must be reachable from every node.")]
WorkersOpt = Annotated[int | None, capped_option(
    "workers", "--workers", help="With --ray: how many workers, each a loaded model on one node (default: one per GPU, "
    "else one per 2 CPU cores of each node).")]

#: the options only the many-document form takes, by their flags
MANY_ONLY = ("--files-from", "--output", "--ray", "--workers")


def is_many(documents: list[str], files_from: str | None, output: str | None = None, ray: str | None = None) -> bool:
    """Whether a run takes the many-document form (JSON Lines): more than one document, a directory, a list
    of files, an output file of records, or a Ray cluster. One file alone keeps the single-document output."""
    return (len(documents) > 1 or files_from is not None or output is not None or ray is not None
            or any(os.path.isdir(d) for d in documents))


def refuse_many_options(command: str, **given: Any) -> None:
    """The single-document form was chosen but a many-document option was given: one line, exit 2."""
    names = [flag for flag, value in zip(MANY_ONLY, (given.get("files_from"), given.get("output"), given.get("ray"),
                                                     given.get("workers")), strict=True) if value is not None]
    if names:
        form = "DOC... --question Q" if command == "ask" else "DOC..."
        raise UsageError(f"{', '.join(names)} take(s) the many-document form: kvtool {command} {form}")


def check_not_questions(documents: list[str]) -> None:
    """``kvtool ask FILE "Who signs?" --questions-file qs.txt`` (today's form with a file of questions) now names
    documents only: a missing "document" that reads like a question is refused up front, saying why."""
    for d in documents[1:]:
        if not os.path.lexists(d) and os.sep not in d and (" " in d.strip() or d.rstrip().endswith("?")):
            raise UsageError(f"{d!r} is not a file: with --question or --questions-file every argument is a "
                             "document (give questions with --question)")


def run_many(
    command: str,
    documents: list[str],
    overrides: dict[str, Any],
    *,
    profile: str | None,
    quiet: bool,
    files_from: str | None = None,
    output: str | None = None,
    ray: str | None = None,
    workers: int | None = None,
    questions: list[str] | None = None,
    length: str = "medium",
    cite: bool = False,
    doc_format: str | None = None,
    force: bool = False,
    recall_auto: bool = True,
) -> None:
    """Everything the many-document form does after option parsing; raises ``KvtoolError`` with the exit code
    when some documents failed (3) or none could be answered."""
    from kvtool.cli.dashboard import choose_mode
    from kvtool.cli.many_view import ManyView
    from kvtool.cli.output import sayer
    from kvtool.runtime.many import Task
    from kvtool.runtime.many_inputs import collect

    # options, paths, settings and the output file: all checked before torch is imported
    ray = _check_options(command, documents, output, ray, workers)
    inputs = collect(documents, files_from, kvc=command != "prefill", output=output if command != "prefill" else None,
                     notify=sayer(quiet))
    skipped = inputs.describe_skipped()
    if not inputs.paths:
        raise UsageError(f"no documents to read{f' ({skipped})' if skipped else ''}: kvtool reads "
                         ".txt, .md, .html, .pdf, .epub and .docx files")
    console = stderr_console()
    view = ManyView(choose_mode(quiet, console.is_terminal), console, **VIEW_WORDS[command])
    settings = _settings(command, inputs.paths[0], overrides, profile, recall_auto)
    task = Task(command=command, settings=settings, questions=list(questions or []), length=length, cite=cite,
                doc_format=doc_format, force=force)
    out = _Output(command, output, view)
    try:
        jobs, complete = out.plan(task, inputs.paths)
        if skipped:
            view.note(skipped)
        outcome = _execute(task, jobs, complete, out, view, ray, workers, quiet)
    finally:
        out.close()
    if not quiet:
        closing = view.summary(outcome, short_path(output) if output else None)
        console.print(printable(closing), markup=False, highlight=False, soft_wrap=True)
    if outcome.exit_code:
        where = f" (their records in {short_path(output)} say why)" if out.log is not None else ""
        raise KvtoolError(f"{outcome.failed} of {outcome.total} documents failed{where}", outcome.exit_code)


#: how the view speaks of each command's work
VIEW_WORDS = {"ask": {"verb": "answered", "unit": "answer"}, "summarize": {"verb": "summarized", "unit": "summary"},
              "prefill": {"verb": "prefilled", "unit": "cache"}}


def _check_options(command: str, documents: list[str], output: str | None, ray: str | None,
                   workers: int | None) -> str | None:
    """The many-document options that need no file: one line and exit 2 each; returns ``--ray`` checked."""
    if workers is not None and ray is None:
        raise UsageError("--workers sets the size of a Ray pool: add --ray local (or auto, or an address)")
    if ray is not None:
        from kvtool.runtime import cluster  # imports Ray, when it is installed

        cluster.require()
        ray = cluster.check_where(ray)
    if command == "prefill" and not output:
        raise UsageError("prefill needs an output directory for many documents: -o DIR/")
    if command == "ask":
        check_not_questions(documents)
    return ray


class _Output:
    """Where the records go: stdout, or ``-o FILE.jsonl`` (locked, resumed from); ``prefill``'s directory."""

    def __init__(self, command: str, output: str | None, view: Any) -> None:
        self.command = command
        self.output = output
        self.view = view
        self.log: Any = None
        self.directory: str | None = None

    def plan(self, task: Any, paths: list[str]) -> tuple[list[Any], int]:
        """Open the output (reading what an earlier run wrote) and list the jobs still to do."""
        from kvtool.runtime.many import check_not_an_input, plan
        from kvtool.runtime.many_inputs import kvc_names
        from kvtool.runtime.many_log import ResultLog

        output, view = self.output, self.view
        shown = short_path(output or "")
        outputs, done = None, set()
        if self.command == "prefill":
            assert output is not None
            self.directory = _output_directory(output)
            outputs = kvc_names(paths, self.directory)
        elif output is not None:
            check_not_an_input(output, paths)
            self.log = ResultLog(output)
            resumed = self.log.open(task.fingerprint)
            done = resumed.done
            if resumed.torn_bytes:
                view.note(f"{shown}: a torn last line ({resumed.torn_bytes} bytes) was cut off; its answer is redone")
            if resumed.other_settings:
                view.note(f"{shown} holds {resumed.other_settings} record(s) made with other settings; kept, and "
                          "their pairs are answered again with these")
        jobs, complete = plan(task, paths, done, outputs)
        if complete:
            where = shown if self.command != "prefill" else f"{shown} (--force rewrites them)"
            view.note(f"{complete} of {len(paths)} documents already done in {where}")
        return jobs, complete

    def write(self, record: dict[str, Any]) -> None:
        from kvtool.runtime.many_log import record_line

        if self.log is not None:
            self.log.write(record)
        else:
            sys.stdout.write(record_line(record) + "\n")
            sys.stdout.flush()

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def _execute(task: Any, jobs: list[Any], complete: int, out: _Output, view: Any, ray: str | None,
             workers: int | None, quiet: bool) -> Any:
    """Run the jobs in this process or on Ray, the view showing progress; Ctrl-C says how to resume."""
    from kvtool.cli.error_lines import error_line
    from kvtool.runtime.many import Driver, run_serial

    say = view.note if not quiet else None
    try:
        with view:
            driver = Driver(task, out.write, listener=view)
            if ray is not None:
                from kvtool.runtime import cluster

                return cluster.run_cluster(task, jobs, driver, ray, workers, complete, describe=error_line,
                                           directory=out.directory, say=say)
            return run_serial(task, jobs, driver, complete, engine_listener=view, say=say, describe=error_line)
    except KeyboardInterrupt:  # the live view has stopped: this line is not drawn over
        if out.log is not None and not quiet:
            print(f"kvtool: {short_path(out.output)} holds every answer completed so far ({out.log.written} this "
                  "run); run the same command again to resume", file=sys.stderr)
        raise


def _settings(command: str, first: str, overrides: dict[str, Any], profile: str | None, recall_auto: bool) -> Any:
    """The run's settings: the profile and flags; when the first document is a saved cache, the settings it
    was prefilled with fill in what the flags leave out (every other cache must match them)."""
    from kvtool.kvc.format import is_kvc, read_header
    from kvtool.runtime import store
    from kvtool.runtime.settings import resolve_settings

    asked = overrides.get("recall") is not None or resolve_settings(profile, {}).recall != "auto"
    if command != "prefill" and is_kvc(first):
        overrides = store.settings_overrides(read_header(first), overrides)
    settings = resolve_settings(profile, overrides)
    if not recall_auto and not asked:  # summarize: --recall auto means off
        settings.recall = "off"
    return settings


def _output_directory(output: str) -> str:
    """``prefill -o DIR/``: the directory the caches go to, created when missing (its parent must exist)."""
    if (os.path.lexists(output) and not os.path.isdir(output)) or output.lower().endswith(".kvc"):
        raise UsageError(f"output {output} is a file; many documents need a directory (-o DIR/), one .kvc each")
    if not os.path.isdir(output):
        parent = os.path.dirname(os.path.abspath(output.rstrip(os.sep)))
        if not os.path.isdir(parent):
            raise UsageError(f"cannot create {output}: directory {parent} does not exist")
        try:
            os.mkdir(output)
        except OSError as e:
            raise UsageError(f"cannot create {output}: {e.strerror or e}") from None
    if not os.access(output, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write into {output}: the directory is not writable")
    return output
