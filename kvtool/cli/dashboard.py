"""Progress display on stderr for a run: a rich live view on terminals, a few plain lines otherwise.

The engine knows nothing about this module: it only calls a listener with the events from
:mod:`kvtool.core.events`. Everything here writes to a console on **stderr**, because stdout carries the
answer and must stay clean for pipelines (``kvtool ... > answer.txt``).

Three modes (see :func:`choose_mode`):

* ``"live"``: a :class:`rich.live.Live` view redrawn a few times a second from the latest event.
  Events only store a reference, so a listener call costs next to nothing and never slows the engine.
* ``"plain"``: for logs and CI (stderr not a terminal). No cursor movement, no ANSI, a handful of lines
  for a whole run: prefill start, every ~10 % of the document, prefill end, decode rate, notes, summary.
* ``"quiet"``: nothing at all (errors are reported by the CLI, not here).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from types import TracebackType
from typing import Any

from rich.console import Console, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from kvtool.cli.shown import shown_text
from kvtool.core.events import DecodeProgress, Event, MemorySample, Note, PrefillProgress, RunSummary
from kvtool.errors import printable
from kvtool.runtime.events import CalibrationProgress, DecodeStarting, PhaseProgress
from kvtool.runtime.memory import format_bytes

MODES = ("live", "plain", "quiet")

#: Live redraws per second. Four is smooth enough for a human and keeps rendering cost negligible.
REFRESH_PER_SECOND = 4.0
#: Plain mode prints a prefill line each time another tenth of the document is done...
PLAIN_STEPS = 10
#: ...or, while the document length is unknown, at most this often (in engine seconds).
PLAIN_INTERVAL_S = 10.0
#: Nested stats (per-layer lists...) are shown as compact JSON cut to this length; ``--json`` has them whole.
MAX_VALUE_CHARS = 80

_BAR_WIDTH = 40


# --------------------------------------------------------------------------- formatting helpers


#: plain mode reports a step (model load, writing a .kvc, ...) only when it took at least this long
PLAIN_PHASE_SECONDS = 1.0

def format_rate(x: float | None, unit: str = "tok/s") -> str:
    """A rate such as ``"1,234 tok/s"`` or ``"12.3 tok/s"``; ``"n/a"`` when unknown (no time elapsed yet)."""
    if x is None or not _is_finite(x):
        return f"n/a {unit}"
    return f"{_three_digits(x)} {unit}"


def format_duration(seconds: float | None) -> str:
    """``H:MM:SS`` like most progress bars, so an ETA reads at a glance; ``"?"`` when unknown."""
    if seconds is None or not _is_finite(seconds) or seconds < 0:
        return "?"
    total = int(round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def format_parts(event: PrefillProgress, sep: str = ", ") -> str:
    """``", page 12 / 40"`` (or chapter/section) for documents with pages or chapters; ``""`` otherwise."""
    if not event.parts_done or not event.parts_unit or (event.parts_unit == "section" and not event.parts_total):
        return ""
    of = f" / {event.parts_total:,}" if event.parts_total else ""
    return f"{sep}{event.parts_unit} {event.parts_done:,}{of}"


def _is_finite(x: float) -> bool:
    try:
        return math.isfinite(x)
    except TypeError:
        return False


def _three_digits(x: float) -> str:
    """About three significant digits without scientific notation: 0.123, 1.23, 12.3, 123, 1,234."""
    ax = abs(x)
    if ax >= 100:
        return f"{x:,.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1 or ax == 0:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _format_float(x: float) -> str:
    if not _is_finite(x):
        return str(x)
    if x == int(x) and abs(x) >= 1:
        return f"{int(x):,}"
    return _three_digits(x)


def _format_stat(key: str, value: Any) -> str:
    """Format one stats value for humans, using the key's suffix for units (same keys as ``--json``)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        if key.endswith("_bytes") or key == "bytes":
            return format_bytes(value)
        if key.endswith("_per_second"):
            return format_rate(value, "tok/s" if "token" in key else "/s")
        if key.endswith("seconds"):
            return f"{_three_digits(value)} s" if _is_finite(value) else "n/a"
        if isinstance(value, int):
            return f"{value:,}"
        return _format_float(value)
    if isinstance(value, str):
        return value
    if isinstance(value, dict | list | tuple):
        text = json.dumps(value, separators=(",", ":"), default=str)
    else:
        text = str(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


def _policy_share(time_split: dict[str, float]) -> tuple[float, float, float] | None:
    """(score + evict, score, evict) as percentages of the whole block time.

    The whole block time is the sum of every entry in ``time_split`` (forward, probs, score, evict and
    anything the engine adds later), so the figure answers "how much of each block does the eviction
    policy cost", independent of whether the engine reports per-block or cumulative seconds.
    """
    try:
        total = sum(float(v) for v in time_split.values())
        score = float(time_split.get("score", 0.0))
        evict = float(time_split.get("evict", 0.0))
    except (TypeError, ValueError):
        return None
    if not time_split or total <= 0 or not math.isfinite(total):
        return None
    return 100.0 * (score + evict) / total, 100.0 * score / total, 100.0 * evict / total


def _known_total(event: PrefillProgress) -> int | None:
    """The document length if it is usable: an estimate below what is already read is stale, so unknown."""
    total = event.tokens_total
    if total is None or total <= 0 or total < event.tokens_done:
        return None
    return total


def _rate(count: float, seconds: float) -> float | None:
    return count / seconds if seconds > 0 else None


# --------------------------------------------------------------------------- mode selection


def choose_mode(quiet: bool, stderr_is_tty: bool) -> str:
    """``quiet`` wins; otherwise live on a terminal and plain lines when stderr goes to a file or pipe."""
    if quiet:
        return "quiet"
    return "live" if stderr_is_tty else "plain"


def make_listener(mode: str, console: Console | None = None) -> Dashboard:
    """Build the event listener for ``mode``; the default console writes to stderr, never stdout."""
    return Dashboard(mode, console)


# --------------------------------------------------------------------------- the dashboard


class Dashboard:
    """Listener for engine events that shows progress on stderr; use it as a context manager.

    ``with make_listener(mode) as dash: engine.run(..., emit=dash)``. In live mode entering starts a
    :class:`rich.live.Live` and leaving stops it, also when the run ends with an exception or Ctrl-C,
    so the terminal is never left with a hidden cursor or a half-drawn view. Outside the ``with`` block
    live mode draws nothing live, but notes and the summary are still printed.

    Listener calls only store the latest event (plus a little bookkeeping in plain mode); the live view is
    rendered by rich's refresh thread at :data:`REFRESH_PER_SECOND`, so the engine's speed is unaffected.
    """

    def __init__(
        self,
        mode: str = "live",
        console: Console | None = None,
        *,
        refresh_per_second: float = REFRESH_PER_SECOND,
        live_during_decode: bool | None = None,
    ) -> None:
        """``live_during_decode``: keep redrawing while tokens are generated.

        By default only when stdout is not the terminal this view draws on: when the answer streams to
        the same terminal, a redraw on stderr would move the cursor over it, so the view is stopped when
        decoding starts (:class:`DecodeStarting`, before the first token is written) and the decode rate
        is printed as a line at the end instead.
        """
        if mode not in MODES:
            raise ValueError(f"unknown dashboard mode {mode!r}; expected one of {', '.join(MODES)}")
        self.mode = mode
        self.console = console if console is not None else Console(stderr=True)
        self.refresh_per_second = refresh_per_second
        if live_during_decode is None:
            live_during_decode = not _shares_terminal(self.console)
        self.live_during_decode = live_during_decode

        self._live: Live | None = None
        self._prefill: PrefillProgress | None = None
        self._prefill_done = False
        self._decode: DecodeProgress | None = None
        self._decode_reported = False
        self._decode_shown_live = False
        self._summary: dict[str, Any] | None = None
        self._calibration: CalibrationProgress | None = None
        self._answering = False  # an answer started: no prefill is coming any more (e.g. a cache was loaded)
        # Slow steps by name: the latest event, when it was first seen, when it finished (None: running).
        self._phases: dict[str, tuple[PhaseProgress, float, float | None]] = {}
        # Plain-mode throttling state.
        self._plain_step = -1
        self._plain_last_seconds = 0.0

    # ------------------------------------------------------------------ context manager

    @property
    def live(self) -> Live | None:
        """The running live display, or None (other modes, outside ``with``, after decoding froze it)."""
        return self._live

    def __enter__(self) -> Dashboard:
        if self.mode == "live" and self._live is None:
            self._live = Live(
                console=self.console,
                get_renderable=self.render,
                refresh_per_second=self.refresh_per_second,
                transient=False,
                # stdout is the answer channel: never capture it into the stderr view.
                redirect_stdout=False,
                redirect_stderr=True,
            )
            self._live.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        try:
            self._stop_live()
        except Exception:
            # A failure to redraw (e.g. stderr closed) must not hide the run's own exception.
            if exc_type is None:
                raise
        if exc_type is None and self._summary is None:
            # A run that ended without a summary still gets its closing lines.
            self._finish_prefill()
            self._finish_decode()
        return False

    def _stop_live(self) -> None:
        live, self._live = self._live, None
        if live is not None:
            live.stop()  # final redraw shows the last state, then the cursor comes back

    # ------------------------------------------------------------------ listener

    def __call__(self, event: Event) -> None:
        """Receive one engine event. Unknown event types are ignored so the engine can add new ones."""
        if self.mode == "quiet":
            return
        if isinstance(event, PrefillProgress):
            self._on_prefill(event)
        elif isinstance(event, DecodeProgress):
            self._on_decode(event)
        elif isinstance(event, DecodeStarting):
            self._on_decode_starting()
        elif isinstance(event, Note):
            self._print_line(f"note: {event.message}", style="yellow")
        elif isinstance(event, RunSummary):
            self._on_summary(event.stats)
        elif isinstance(event, CalibrationProgress):
            self._on_calibration(event)
        elif isinstance(event, PhaseProgress):
            self._on_phase(event)

    def _on_phase(self, event: PhaseProgress) -> None:
        """A slow step: a row of the live view; in plain mode (a log) one line when a step that took at
        least ``PLAIN_PHASE_SECONDS`` ends (quick steps stay silent: a line per 0.0 s step is noise).

        Steps come before or after prefill (never during it): one after it means the document is read.
        """
        self._finish_prefill()
        now = time.monotonic()
        known = self._phases.get(event.name)
        if known is None or (known[2] is not None and not event.finished):  # new, or the same step again
            known = (event, now, None)
        started, ended = known[1], known[2]
        if ended is None and event.finished:
            ended = now
            if self.mode == "plain" and now - started >= PLAIN_PHASE_SECONDS:
                self._plain(f"{event.name}: done in {now - started:.1f} s")
        self._phases[event.name] = (event, started, ended)

    def _on_calibration(self, event: CalibrationProgress) -> None:
        """Razor's one-time calibration: a row of the live view, or a line when it starts and ends."""
        first = self._calibration is None
        self._calibration = event
        finished = event.total is not None and event.done >= event.total
        if self.mode == "plain" and (first or finished):
            self._plain(f"{event.what}: {'done' if finished else 'started'}")

    def _on_prefill(self, event: PrefillProgress) -> None:
        first = self._prefill is None
        self._prefill = event
        if self.mode != "plain":
            return
        total = _known_total(event)
        if first:
            size = f"{total:,} tokens" if total is not None else "length unknown"
            self._plain(f"prefill: started, document {size}")
            self._plain_last_seconds = event.seconds
        if total is not None:
            # One line per tenth of the document crossed (never the 100 % one: the "done" line follows).
            step = min(PLAIN_STEPS - 1, event.tokens_done * PLAIN_STEPS // total)
            due = step > self._plain_step and not first
            self._plain_step = max(self._plain_step, step)
        else:
            due = event.seconds - self._plain_last_seconds >= PLAIN_INTERVAL_S
        if not due:
            return
        self._plain_last_seconds = event.seconds
        of = f" / {total:,} tokens ({100 * event.tokens_done // total}%)" if total is not None else " tokens"
        self._plain(
            f"prefill: {event.tokens_done:,}{of}{format_parts(event)}, "
            f"{format_rate(_rate(event.tokens_done, event.seconds))}, "
            f"cache max {event.cache_max:,} tokens/head, evicted {event.evicted_total:,}"
        )

    def _on_decode_starting(self) -> None:
        """An answer is about to stream: stop the view now if it shares the answer's terminal."""
        self._finish_prefill()
        self._answering = True
        if self._live is not None and not self.live_during_decode:
            self._stop_live()  # returns after the last redraw: nothing is drawn over the answer

    def _on_decode(self, event: DecodeProgress) -> None:
        self._finish_prefill()
        self._decode = event
        if self._live is not None:
            if self.live_during_decode:
                self._decode_shown_live = True
            else:
                self._stop_live()  # freeze the prefill view before the answer streams to the terminal

    def _on_summary(self, stats: dict[str, Any]) -> None:
        self._finish_prefill()
        self._summary = dict(stats)
        if self.mode == "live":
            self._stop_live()  # the final frame stays on screen, the table goes below it
            self._finish_decode()
            self.console.print(self.summary_table(stats))
        else:
            self._finish_decode()
            self._plain("summary:")
            for key, value in stats.items():
                self._plain(f"  {key}: {_format_stat(key, value)}")

    def _finish_prefill(self) -> None:
        """Mark prefill complete; plain mode reports the final count and rate once."""
        if self._prefill_done or self._prefill is None:
            return
        self._prefill_done = True
        if self.mode == "plain":
            p = self._prefill
            self._plain(
                f"prefill: done, {p.tokens_done:,} tokens in {p.seconds:.1f} s "
                f"({format_rate(_rate(p.tokens_done, p.seconds))}), evicted {p.evicted_total:,}, "
                f"peak {_peak_memory(p.memory)}"
            )

    def _finish_decode(self) -> None:
        """Report the decode rate once, unless the live view already showed it."""
        if self._decode_reported or self._decode is None or self._decode_shown_live:
            return
        self._decode_reported = True
        d = self._decode
        self._print_line(
            f"decode: {d.tokens:,} tokens in {d.seconds:.1f} s ({format_rate(_rate(d.tokens, d.seconds))})",
            style="cyan",
        )

    # ------------------------------------------------------------------ output

    def _plain(self, line: str) -> None:
        # No markup, no highlighting, no wrapping: one log line per call, no escape codes even on a tty.
        self.console.print(printable(line), markup=False, highlight=False, soft_wrap=True)

    def _print_line(self, line: str, style: str) -> None:
        """A notice line: plain text in plain mode, styled in live mode (printed above a running view)."""
        if self.mode == "plain":
            self._plain(line)
        else:
            self.console.print(shown_text(line, style=style), soft_wrap=True)

    def render(self) -> RenderableType:
        """The live view for the latest state; called by rich's refresh thread, cheap and side-effect free."""
        prefill, decode = self._prefill, self._decode  # read once: the engine thread may replace them
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        calibration = self._calibration
        if calibration is not None:
            of = f" / {calibration.total:,}" if calibration.total else ""
            grid.add_row("razor", shown_text(f"{calibration.what}: {calibration.done:,}{of}"))
        self._render_phases(grid)
        if prefill is None:
            running = any(ended is None for _, _, ended in list(self._phases.values()))
            if not (running or self._answering):
                grid.add_row("prefill", shown_text("waiting for the first block…", style="dim"))
            return grid
        grid.add_row("prefill", self._render_progress(prefill, self._prefill_done))
        grid.add_row(
            "cache",
            shown_text(
                f"min {prefill.cache_min:,} · mean {prefill.cache_mean:,.1f} · max {prefill.cache_max:,} "
                f"tokens per KV head · evicted {prefill.evicted_total:,} tokens"
            ),
        )
        grid.add_row("memory", shown_text(_memory_text(prefill.memory)))
        share = _policy_share(prefill.time_split)
        if share is not None:
            grid.add_row(
                "policy",
                shown_text(f"{share[0]:.1f}% of block time (score {share[1]:.1f}% · evict {share[2]:.1f}%)"),
            )
        if decode is not None:
            grid.add_row(
                "decode",
                shown_text(f"{decode.tokens:,} tokens · {format_rate(_rate(decode.tokens, decode.seconds))}"),
            )
        return grid

    def _render_phases(self, grid: Table) -> None:
        """One row per slow step: a bar (or elapsed time when the total is unknown), then "done in …"."""
        now = time.monotonic()
        for event, started, ended in list(self._phases.values()):  # a copy: the engine thread may add one
            elapsed = (ended if ended is not None else now) - started
            if ended is not None:
                grid.add_row("step", shown_text(f"{event.name}: done in {elapsed:.1f} s", style="dim"))
                continue
            amount = _format_amount(event.done, event.unit)
            of = f" / {_format_amount(event.total, event.unit)}" if event.total is not None else ""
            detail = f"{event.name}: {amount}{of} · elapsed {format_duration(elapsed)}"
            if event.total is None or event.total <= 1:  # one opaque step: a bar would say nothing
                grid.add_row("step", shown_text(f"{event.name}… elapsed {format_duration(elapsed)}"))
            else:
                grid.add_row("step", _bar_row(ProgressBar(total=event.total, completed=event.done,
                                                          width=_BAR_WIDTH), detail))

    @staticmethod
    def _render_progress(event: PrefillProgress, done: bool) -> RenderableType:
        rate = _rate(event.tokens_done, event.seconds)
        total = event.tokens_done if done else _known_total(event)
        bar = ProgressBar(total=total, completed=event.tokens_done, width=_BAR_WIDTH)
        parts = format_parts(event, sep=" · ")
        if done:
            detail = (f"done · {event.tokens_done:,} tokens{parts} · {format_rate(rate)} · "
                      f"{format_duration(event.seconds)}")
        elif total is None:
            detail = (
                f"{event.tokens_done:,} / ? tokens{parts} · {format_rate(rate)} · "
                f"elapsed {format_duration(event.seconds)} · ETA ?"
            )
        else:
            eta = (total - event.tokens_done) / rate if rate else None
            pct = 100.0 * event.tokens_done / total
            detail = (
                f"{pct:3.0f}% {event.tokens_done:,} / {total:,} tokens{parts} · {format_rate(rate)} · "
                f"elapsed {format_duration(event.seconds)} · ETA {format_duration(eta)}"
            )
        return _bar_row(bar, detail)

    def summary_table(self, stats: dict[str, Any]) -> Table:
        """The run's figures in a table, keys in the ``--json`` order and spelling so both read alike."""
        table = Table(title="run summary", show_header=True, header_style="bold", title_justify="left")
        table.add_column("figure", no_wrap=True)
        table.add_column("value", overflow="fold")
        for key, value in stats.items():
            # Text, not str: a model name like "[org]/x" must not be parsed as rich markup (shown_text).
            table.add_row(shown_text(key), shown_text(_format_stat(str(key), value)))
        return table


def _format_amount(n: int | None, unit: str) -> str:
    if n is None:
        return "?"
    return format_bytes(n) if unit == "bytes" else f"{n:,} {unit}".rstrip()


def _bar_row(bar: ProgressBar, detail: str) -> Table:
    row = Table.grid(padding=(0, 1))
    row.add_column(no_wrap=True)
    row.add_column()
    row.add_row(bar, shown_text(detail))
    return row


def _peak_memory(memory: MemorySample) -> str:
    """The most telling peak for a one-line report: CUDA's when running there, else the process RSS."""
    if memory.cuda_peak_bytes is not None:
        return f"CUDA {format_bytes(memory.cuda_peak_bytes)}"
    return f"RSS {format_bytes(memory.peak_rss_bytes)}"


def _memory_text(memory: MemorySample) -> str:
    text = f"RSS {format_bytes(memory.rss_bytes)} (peak {format_bytes(memory.peak_rss_bytes)})"
    cuda = (memory.cuda_allocated_bytes, memory.cuda_reserved_bytes, memory.cuda_peak_bytes)
    if any(v is not None for v in cuda):
        text += (
            f" · CUDA allocated {format_bytes(cuda[0])} · reserved {format_bytes(cuda[1])}"
            f" · peak {format_bytes(cuda[2])}"
        )
    return text


def _shares_terminal(console: Console) -> bool:
    """Whether stdout is a terminal that ``console`` draws on too (same device), so a live view would
    redraw over the answer. A console without a descriptor (a test's buffer) counts as shared."""
    try:
        if not sys.stdout.isatty():
            return False
        out = os.fstat(sys.stdout.fileno())
    except (AttributeError, ValueError, OSError):  # closed or replaced stdout
        return False
    try:
        err = os.fstat(console.file.fileno())
    except (AttributeError, ValueError, OSError):
        return True
    return out.st_rdev == err.st_rdev  # the same terminal device, whichever descriptor reaches it
