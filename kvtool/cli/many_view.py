"""The progress of a many-document run on stderr: documents done / total, tokens/s, failures, ETA.

* ``live`` (stderr is a terminal): a rich progress bar, redrawn a few times a second, with the document
  being read and how far; each finished document prints one line above it.
* ``plain`` (a log, a pipe, CI): each document's one-line summary, and a progress line at most every
  :data:`PROGRESS_SECONDS` (500 documents print 500 summaries, not thousands of 10 % lines).
* ``quiet``: only the documents that failed, one line each.

stdout carries the records and nothing else. Listener calls only update counters (the live bar is drawn
by rich's refresh thread), so the view costs the run nothing measurable.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID

from kvtool.cli.dashboard import format_duration, format_rate
from kvtool.cli.shown import plain_column, shown_text
from kvtool.core.events import PrefillProgress
from kvtool.errors import printable, short_path
from kvtool.runtime.events import PhaseProgress
from kvtool.runtime.many import DocumentFinished, DocumentStarted, Outcome, RunStarted, WorkerLost

#: plain mode prints a progress line at most this often (seconds)
PROGRESS_SECONDS = 10.0


class ManyView:
    """Listener for the events of :mod:`kvtool.runtime.many` (and, in one process, the engine's prefill
    progress); a context manager that starts and stops the live bar."""

    def __init__(self, mode: str, console: Console, verb: str = "answered", unit: str = "answer") -> None:
        self.mode = mode
        self.console = console
        self.verb = verb
        self.unit = unit
        self.total = 0
        self.complete_before = 0
        self.done = 0
        self.failed = 0
        self.records = 0
        self.tokens = 0
        self.started = time.monotonic()
        self.current: dict[str, str] = {}  # path -> what it is doing (live: the documents in flight)
        self._last_progress = time.monotonic()
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> ManyView:
        if self.mode == "live":
            self._progress = Progress(
                # the description names the documents in flight: drawn as text, never parsed as markup
                plain_column("{task.description}"), BarColumn(), MofNCompleteColumn(),
                plain_column("{task.fields[rate]}"), plain_column("{task.fields[failed]}"),
                plain_column("ETA {task.fields[eta]}"),
                console=self.console, transient=False, redirect_stdout=False, redirect_stderr=False,
            )
            self._progress.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        progress, self._progress = self._progress, None
        if progress is not None:
            try:
                self._refresh()
                progress.stop()
            except Exception:  # a failure to redraw must not hide the run's own exception
                if exc_type is None:
                    raise
        return False

    # ------------------------------------------------------------------ events
    def __call__(self, event: Any) -> None:
        if isinstance(event, RunStarted):
            self.total, self.complete_before = event.total, event.complete
            self.started = self._last_progress = time.monotonic()
            if self._progress is not None:
                self._task = self._progress.add_task("documents", total=event.total, completed=event.complete,
                                                     rate="", failed="", eta="?")
        elif isinstance(event, DocumentStarted):
            self.current[short_path(event.path)] = "reading" if event.attempt == 1 else f"retry {event.attempt}"
        elif isinstance(event, DocumentFinished):
            self._finished(event)
        elif isinstance(event, WorkerLost):
            then = "retried on another worker" if event.retried else "not retried"
            self._line(f"worker lost while reading {short_path(event.path)} (attempt {event.attempt}: "
                       f"{event.reason}); {then}", style="yellow", always=False)
        elif isinstance(event, PrefillProgress | PhaseProgress):
            self._engine(event)
        else:
            return  # the engine's other events (memory samples, notes, decode steps) are one document's detail
        self._refresh()
        self._maybe_progress_line()

    def _engine(self, event: Any) -> None:
        """One process: the document being read and how far (live), a progress line every 10 s (plain)."""
        if isinstance(event, PrefillProgress) and self.current:
            path = next(iter(self.current))
            total = event.tokens_total
            of = f" / {total:,}" if total and total >= event.tokens_done else ""
            self.current[path] = f"{event.tokens_done:,}{of} tokens"

    def _finished(self, event: DocumentFinished) -> None:
        self.current.pop(short_path(event.path), None)
        self.done += 1
        self.records += event.records
        self.tokens += event.tokens
        n = self.complete_before + self.done
        if event.error is not None:
            self.failed += 1
            quiet = self.mode == "quiet"  # the prefix says it is an error already
            self._line(f"[{n}/{self.total}] {short_path(event.path)}: {'' if quiet else 'error: '}{event.error}",
                       style="red", always=True, prefix="kvtool: error: " if quiet else "")
            return
        what = f"{event.records} {self.unit}{'s' if event.records != 1 else ''}"
        rate = format_rate(event.tokens / event.seconds if event.seconds > 0 else None)
        notes = "".join(f" · note: {note}" for note in event.notes)
        self._line(f"[{n}/{self.total}] {short_path(event.path)}: {what}, {event.tokens:,} tokens in "
                   f"{event.seconds:.1f} s ({rate}){notes}", style="green")

    # ------------------------------------------------------------------ figures
    def rate(self) -> float | None:
        seconds = time.monotonic() - self.started
        return self.tokens / seconds if self.tokens and seconds > 0 else None

    def eta(self) -> float | None:
        """Documents left × seconds per document so far (in a pool, the pool's pace)."""
        left = self.total - self.complete_before - self.done
        if not self.done:
            return None
        return left * (time.monotonic() - self.started) / self.done

    def _refresh(self) -> None:
        if self._progress is None or self._task is None:
            return
        doing = ", ".join(f"{printable(p, one_line=True)} ({what})" for p, what in list(self.current.items())[:2])
        self._progress.update(
            self._task, completed=self.complete_before + self.done,
            description=f"{self.verb.replace('answered', 'asking')} {doing}" if doing else "documents",
            rate=format_rate(self.rate()), failed=f"{self.failed} failed" if self.failed else "",
            eta=format_duration(self.eta()),
        )

    def _maybe_progress_line(self) -> None:
        if self.mode != "plain" or time.monotonic() - self._last_progress < PROGRESS_SECONDS:
            return
        self._last_progress = time.monotonic()
        doing = "".join(f" · {p}: {what}" for p, what in list(self.current.items())[:2])
        self._plain(f"progress: {self.complete_before + self.done}/{self.total} documents · {self.failed} failed · "
                    f"{format_rate(self.rate())} · ETA {format_duration(self.eta())}{doing}")

    # ------------------------------------------------------------------ output
    def _line(self, line: str, style: str, always: bool = False, prefix: str = "") -> None:
        """A document's line: every mode but quiet, and in quiet mode the failures (``always``)."""
        if self.mode == "quiet" and not always:
            return
        if self.mode == "live":
            self.console.print(shown_text(line, style=style), soft_wrap=True)
        else:
            self._plain(prefix + line)

    def _plain(self, line: str) -> None:
        self.console.print(printable(line), markup=False, highlight=False, soft_wrap=True)

    def note(self, line: str) -> None:
        """A note about the run (resumed pairs, skipped files): not in quiet mode."""
        if self.mode != "quiet":
            self._line(f"note: {line}", style="yellow")

    def summary(self, outcome: Outcome, where: str | None = None) -> str:
        """The run's closing line."""
        parts = [f"{self.verb} {outcome.answered + outcome.complete_before} of {outcome.total} documents",
                 f"{self.records:,} {self.unit}{'s' if self.records != 1 else ''} in "
                 f"{format_duration(outcome.seconds)}"]
        if outcome.tokens:
            parts.append(f"{format_rate(outcome.tokens_per_second)}")
        if outcome.failed:
            parts.append(f"{outcome.failed} failed")
        if outcome.complete_before:
            parts.append(f"{outcome.complete_before} done before" + (f" (in {where})" if where else ""))
        return " · ".join(parts)
