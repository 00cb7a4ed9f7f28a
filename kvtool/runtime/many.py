"""Many documents in one run: one loaded model, one cache, a record per (document, question).

``kvtool ask DOC... --question Q`` (and ``summarize``, ``prefill``) loads the model once and reads each
document in turn into the same cache (emptied between documents: its buffers are allocated once, so the
process does not grow from one document to the next). Every answer becomes a *record*, a dict with the
document's path, the question, the answer and the stats of ``--json``; a document that fails
(unreadable, hostile, over a cap, empty) becomes one error record with its one-line error and exit code,
and the run goes on with the next one.

The pieces, shared by the serial runner here and the Ray back end (:mod:`kvtool.runtime.cluster`):

* :class:`Task`: what is done to every document (command, settings, questions); its settings fingerprint
  marks each record, so that a rerun knows which pairs are already answered under the same settings.
* :class:`Job`: one document and the pairs still to do for it.
* :class:`DocumentWorker`: a loaded session that turns a job into records (a Ray actor holds one).
* :class:`Driver`: the records as they arrive, each written once, counted, reported to a listener; the
  run's :class:`Outcome` and exit code.

Nothing here imports torch at module level: options and documents are checked before the model loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtool import __version__
from kvtool.errors import (
    EXIT_PARTIAL,
    EXIT_RUNTIME,
    EXIT_USAGE,
    KvtoolError,
    UsageError,
    first_line,
    printable,
    short_path,
)
from kvtool.kvc.format import is_kvc
from kvtool.runtime.many_log import document_key, record_key
from kvtool.runtime.settings import Settings

COMMANDS = ("ask", "summarize", "prefill")
#: how many times a document is handed to a worker before it is reported failed (workers lost reading it)
MAX_ATTEMPTS = 3


@dataclass
class Task:
    """What a run does to every document: the command, its settings and questions (Ray ships it to workers)."""

    command: str
    settings: Settings
    questions: list[str] = field(default_factory=list)  # ask
    length: str = "medium"  # summarize
    cite: bool = False  # ask --cite
    doc_format: str | None = None  # --format
    force: bool = False  # prefill --force: rewrite existing caches
    #: 16 hex digits of what decides a record's content, computed once when the task is made (see
    #: :func:`settings_fingerprint`) and shipped with it: a copy whose settings a Ray pool adapted to its
    #: workers (the device ``auto`` resolved, the threads, the model's absolute path) keeps the same value,
    #: so the driver and every worker stamp and resume with one fingerprint.
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if not self.fingerprint:
            self.fingerprint = settings_fingerprint(self)

    def keys(self) -> list[str]:
        """What one document gives a record for: each question, the summary, or the saved cache."""
        if self.command == "ask":
            return list(self.questions)
        return ["summary" if self.command == "summarize" else "prefill"]


def settings_fingerprint(task: Task) -> str:
    """16 hex digits of what decides a record's content: the command and every setting that changes an answer,
    as the user asked for them (``--device auto`` stays ``auto``). Not the threads, the device's place or the
    Ray pool: those change the speed, not the answer."""
    values = asdict(task.settings)
    values.pop("threads", None)
    if values.get("model"):
        values["model"] = os.path.abspath(str(values["model"]))
    extra: dict[str, Any] = {"format": task.doc_format or "auto"}
    if task.command == "ask":
        extra["cite"] = task.cite
    elif task.command == "summarize":
        extra["length"] = task.length
    payload = json.dumps({"command": task.command, "settings": values, **extra}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


@dataclass
class Job:
    """One document of a run and what is still to do for it."""

    path: str  # as given or found: the records' ``path`` (and the resume key)
    location: str  # the absolute path a worker opens (a Ray worker runs in another directory)
    keys: list[str]  # questions still to answer, or ["summary"], or ["prefill"]
    output: str | None = None  # prefill: the .kvc to write
    attempts: int = 0  # workers it was handed to (more than one: a worker was lost while reading it)


def check_not_an_input(output: str, paths: Iterable[str]) -> None:
    """``-o`` must not name one of the run's documents (appending records to it would damage it)."""
    if not os.path.exists(output):
        return
    for p in paths:
        with contextlib.suppress(OSError):
            if os.path.samefile(p, output):
                raise UsageError(f"output {short_path(output)} is one of the documents; choose another -o")


def plan(task: Task, paths: Iterable[str], done: set[tuple[str, str]] | None = None,
         outputs: dict[str, str] | None = None) -> tuple[list[Job], int]:
    """The jobs of a run: each document with the pairs ``done`` does not hold (keyed by
    :func:`~kvtool.runtime.many_log.document_key`: a resumed run skips the rest, however the document is
    spelled). For ``prefill``, an output that is a ``.kvc`` (a regular file, by its content) counts as done
    unless ``--force``; anything else there (a dangling link, another file) is not done, and the document's
    own check says why it is not overwritten. Returns (jobs, number of documents already complete)."""
    done = done or set()
    jobs, complete = [], 0
    for path in paths:
        output = outputs.get(path) if outputs is not None else None
        key = document_key(path)
        keys = [k for k in task.keys() if (key, k) not in done]
        if task.command == "prefill" and output is not None and not task.force and is_kvc(output):
            keys = []
        if not keys:
            complete += 1
            continue
        jobs.append(Job(path=path, location=os.path.abspath(path), keys=keys, output=output))
    return jobs, complete


# --------------------------------------------------------------------------------------------- records
def error_record(path: str, message: str, exit_code: int, fingerprint: str, question: str | None = None) -> dict:
    """The one record of a document that failed: its path, the one-line error, the exit code it would have
    had on its own (2: bad input, 1: a failure while running), and the question it failed on, if any."""
    out: dict[str, Any] = {"path": path}
    if question is not None:
        out["question"] = question
    out.update({"error": message, "exit_code": exit_code, "settings": fingerprint})
    return out


def is_setting_error(e: BaseException) -> bool:
    """Whether an error raised while answering is about the settings, not the document: a ``UsageError``
    naming a setting (``field``), such as a question the budget cannot hold. Every document would fail the
    same way, so the run stops there (exit 2) instead of reading them all. Recall's own errors (memory for
    what the archive holds) depend on the document: those are its record."""
    return isinstance(e, UsageError) and e.field is not None and e.field != "recall"


def describe_error(e: BaseException) -> str:
    """The one line an error record carries (the CLI passes its own, which names flags)."""
    if isinstance(e, KvtoolError):
        return printable(str(e), one_line=True)
    return printable(f"{type(e).__name__}: {first_line(e)}", one_line=True)


# --------------------------------------------------------------------------------------------- the worker
class DocumentWorker:
    """One loaded model that reads whole documents in turn and yields their records.

    The model loads on :meth:`start` (or the first job); every job after the first reuses the session's
    cache. A document's failure is its error record, never an exception: only an interrupt (Ctrl-C,
    SIGTERM) or a failure to load the model leaves :meth:`run`.
    """

    def __init__(self, task: Task, listener: Callable[[Any], None] | None = None,
                 say: Callable[[str], None] | None = None,
                 describe: Callable[[BaseException], str] = describe_error) -> None:
        self.task = task
        self.fingerprint = task.fingerprint
        self.listener = listener
        self.say = say
        self.describe = describe
        self.session: Any = None

    def start(self) -> dict[str, Any]:
        """Load the model (once); returns what the driver checks and shows: version, device, threads."""
        if self.session is None:
            from kvtool.runtime.session import Session  # torch loads here, after every option was checked

            session = Session(self.task.settings, listener=self.listener, say=self.say)
            session.reuse_cache = True
            self.session = session
        return {"version": __version__, "device": str(self.session.loaded.device), "threads": self.session.threads,
                "pid": os.getpid(), "model_load_seconds": round(self.session.loaded.load_seconds, 3)}

    def run(self, job: Job) -> Iterator[dict[str, Any]]:
        """The records of ``job``, each as soon as it is complete; a failure ends with one error record."""
        self.start()
        session = self.session
        question: str | None = None
        answering = False
        read = None
        doc = None
        try:
            if job.output is not None:  # prefill: a cache that cannot be written is known before the read
                from kvtool.kvc.write import check_output

                check_output(job.output, self.task.force)
            kind, doc = self._open(job)
            with session.engine.meter.track():
                if kind == "kvc":
                    from kvtool.runtime import store

                    read = store.load_cache(job.location, session)
                else:
                    read = session.read(doc)
                notes = list(read.notes)
                answering = True
                for key in list(job.keys):
                    question = key if self.task.command == "ask" else None
                    record = self._do(job, key, read)
                    if notes:
                        record["notes"] = notes
                    yield record
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM, a cancelled Ray task: the run stops, nothing is recorded
            raise
        except Exception as e:  # noqa: BLE001 - one document's failure is its record; the run goes on
            if answering and is_setting_error(e):
                raise  # every document would fail the same way (a question the budget cannot hold): stop
            code = e.exit_code if isinstance(e, KvtoolError) else EXIT_RUNTIME
            message = self.describe(e).replace(job.location, job.path)  # the path as the user knows it
            yield error_record(job.path, message, code, self.fingerprint, question)
        finally:
            if read is not None:
                read.close()  # the archive's files go now; the cache itself is emptied for the next document
            _release(doc)

    def _open(self, job: Job) -> tuple[str, Any]:
        """('kvc', None) for a saved cache (by content), else ('document', an opened Document)."""
        from kvtool.documents import open_document
        from kvtool.kvc.format import is_kvc

        if self.task.doc_format in (None, "auto") and is_kvc(job.location):
            if self.task.command == "prefill":
                raise UsageError(f"{job.path} is already a .kvc cache; prefill reads a text document")
            return "kvc", None
        # a regular file only, opened without waiting: a file replaced by a FIFO since the walk listed it is
        # this document's error record, not a run stopped until something writes to it
        return "document", open_document(job.location, self.task.doc_format, regular_only=True)

    def _do(self, job: Job, key: str, read: Any) -> dict[str, Any]:
        """Answer one question (or summarize, or save the cache) and make its record."""
        session, task = self.session, self.task
        meter = session.engine.meter
        session.reset_counters()  # each record's stats are its own answer's
        if task.command == "ask":
            ans = session.ask(read, key, cite_spans=task.cite)
            cites = {} if ans.citations is None else {"citations": [c.json() for c in ans.citations]}
            return {"path": job.path, "question": key, "answer": ans.answer, **cites,
                    "stats": session.stats(read, meter.peak_bytes()), "settings": self.fingerprint}
        if task.command == "summarize":
            ans = session.summarize(read, task.length)
            return {"path": job.path, "summary": ans.answer, "length": task.length,
                    "stats": session.stats(read, meter.peak_bytes()), "settings": self.fingerprint}
        from kvtool.runtime import store

        assert job.output is not None, "a prefill job without an output"
        nbytes = store.save_cache(job.output, session, read, force=task.force)
        return {"path": job.path, "output": job.output, "bytes": nbytes,
                "stats": session.stats(read, meter.peak_bytes()), "settings": self.fingerprint}


def _release(doc: Any) -> None:
    """Close the file a document opened, whether or not it was read to the end (a failed read)."""
    stream = getattr(doc, "stream", None)
    if stream is not None and stream is not getattr(sys.stdin, "buffer", None):
        with contextlib.suppress(OSError):
            stream.close()


# --------------------------------------------------------------------------------------------- events
@dataclass
class RunStarted:
    """The run's documents: ``total`` in it, ``complete`` of them already done (resumed), ``workers``."""

    total: int
    complete: int
    workers: int = 1
    where: str = "this process"


@dataclass
class DocumentStarted:
    path: str
    attempt: int = 1


@dataclass
class DocumentFinished:
    """A document's end: its answers (records written), tokens read and generated, or its error."""

    path: str
    seconds: float
    records: int
    tokens: int
    error: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class WorkerLost:
    """A worker died (killed, node lost, out of memory) while reading ``path``; it is retried or failed."""

    path: str
    attempt: int
    reason: str
    retried: bool


@dataclass
class Outcome:
    """A run's totals and its exit code."""

    total: int = 0  # documents in the run
    complete_before: int = 0  # documents already done by an earlier run (resumed)
    answered: int = 0  # documents completed by this run
    failed: int = 0
    failure_codes: list[int] = field(default_factory=list)
    records: int = 0  # lines written (answers and errors)
    tokens: int = 0  # read and generated
    seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        """0: every document answered; 3 (``EXIT_PARTIAL``): some failed, others answered; when none was
        answered, what a single document would exit with (2 when every failure was bad input, else 1)."""
        if not self.failed:
            return 0
        if self.answered or self.complete_before:
            return EXIT_PARTIAL
        return EXIT_USAGE if all(c == EXIT_USAGE for c in self.failure_codes) else EXIT_RUNTIME

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Driver:
    """The records of a run as workers return them: each (document, question) written once, counted, and
    reported to ``listener``; the same for the serial runner and the Ray back end."""

    def __init__(self, task: Task, write: Callable[[dict[str, Any]], None],
                 listener: Callable[[Any], None] | None = None) -> None:
        self.task = task
        self.write = write
        self.listener = listener
        self.outcome = Outcome()
        self.written: set[tuple[str, str]] = set()
        self.started_at = time.monotonic()
        self._job_records: dict[str, int] = {}
        self._job_tokens: dict[str, int] = {}
        self._job_error: dict[str, str] = {}
        self._job_notes: dict[str, list[str]] = {}

    def emit(self, event: Any) -> None:
        if self.listener is not None:
            self.listener(event)

    def begin(self, total: int, complete: int, workers: int = 1, where: str = "this process") -> None:
        self.outcome.total, self.outcome.complete_before = total, complete
        self.started_at = time.monotonic()
        self.emit(RunStarted(total, complete, workers, where))

    def started(self, job: Job) -> None:
        job.attempts += 1
        self.emit(DocumentStarted(job.path, job.attempts))

    def take(self, job: Job, record: dict[str, Any]) -> None:
        """Write ``record`` unless its pair is already written (a document retried after a lost worker)."""
        key = record_key(record)
        if key is not None:
            if key in self.written:
                return
            self.written.add(key)
            if key[1] in job.keys:
                job.keys.remove(key[1])
        elif "error" in record:
            if job.path in self._job_error:
                return  # one error record per document
            self._job_error[job.path] = str(record["error"])
        self.write(record)
        self.outcome.records += 1
        self._job_records[job.path] = self._job_records.get(job.path, 0) + (key is not None)
        stats = record.get("stats") or {}
        tokens = int(stats.get("decode_tokens", 0) or 0)
        if self._job_records[job.path] == 1 and key is not None:  # the document itself counts once
            tokens += int(stats.get("document_tokens", 0) or 0) + int(stats.get("prefix_tokens", 0) or 0)
        self._job_tokens[job.path] = self._job_tokens.get(job.path, 0) + tokens
        self.outcome.tokens += tokens
        if record.get("notes"):
            self._job_notes[job.path] = list(record["notes"])
        if "error" in record:
            self.outcome.failure_codes.append(int(record.get("exit_code", EXIT_RUNTIME)))

    def fail(self, job: Job, message: str, exit_code: int = EXIT_RUNTIME) -> None:
        """Record ``job`` as failed by the driver itself (e.g. every worker it was given to was lost)."""
        question = job.keys[0] if self.task.command == "ask" and job.keys else None
        self.take(job, error_record(job.path, message, exit_code, self.task.fingerprint, question))

    def finished(self, job: Job, seconds: float) -> None:
        """The document is over (answered, or failed with its error record written)."""
        error = self._job_error.pop(job.path, None)
        if error is not None:
            self.outcome.failed += 1
        else:
            self.outcome.answered += 1
        self.outcome.seconds = time.monotonic() - self.started_at
        self.emit(DocumentFinished(job.path, seconds, self._job_records.pop(job.path, 0),
                                   self._job_tokens.pop(job.path, 0), error, self._job_notes.pop(job.path, [])))

    def end(self) -> Outcome:
        self.outcome.seconds = time.monotonic() - self.started_at
        return self.outcome


def run_serial(task: Task, jobs: list[Job], driver: Driver, complete: int = 0,
               engine_listener: Callable[[Any], None] | None = None, say: Callable[[str], None] | None = None,
               describe: Callable[[BaseException], str] = describe_error) -> Outcome:
    """Every job in this process, one after the other, with one loaded model."""
    worker = DocumentWorker(task, listener=engine_listener, say=say, describe=describe)
    if jobs:
        worker.start()  # a model that cannot load stops the run before any document (exit 2 or 1)
    driver.begin(len(jobs) + complete, complete)  # the clock of tokens/s and the ETA starts with the documents
    for job in jobs:
        t0 = time.monotonic()
        driver.started(job)
        for record in worker.run(job):
            driver.take(job, record)
        driver.finished(job, time.monotonic() - t0)
    return driver.end()
