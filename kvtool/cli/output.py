"""Where output goes: content on stdout (text or JSON), everything else on stderr.

Shared by every command, so that "stdout stays clean for pipelines" is decided in one place.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console

from kvtool.errors import json_text, printable


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def sayer(quiet: bool) -> Callable[[str], None]:
    """A function that prints a note on stderr, or nothing with ``--quiet``."""

    def say(msg: str) -> None:
        if not quiet:  # notes carry file names and document text: controls are shown, never obeyed
            print(printable(msg), file=sys.stderr, flush=True)

    return say


@contextmanager
def dashboard(quiet: bool) -> Iterator[Any]:
    """The engine's event listener for this terminal (live view, plain lines, or nothing)."""
    from kvtool.cli.dashboard import choose_mode, make_listener

    console = stderr_console()
    with make_listener(choose_mode(quiet, console.is_terminal), console) as dash:
        yield dash


#: errors of a write to stdout that are the destination's fault (full disk, quota, I/O error), not kvtool's
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EIO, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)})


def emit_json(obj: Any) -> None:
    """One JSON document on stdout: strict JSON (a NaN or infinity, which JSON cannot spell, becomes null), every
    control and bidi character in its strings a ``\\uXXXX`` escape (``json_text``)."""
    sys.stdout.write(json_text(_finite(obj), allow_nan=False) + "\n")
    sys.stdout.flush()


def _finite(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (dicts, lists and tuples walked)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_text(piece: str) -> None:
    """A piece of the answer (or the text around it) on stdout: the model may copy a document's escape
    sequences, so its controls are shown (``printable``: newlines and tabs stay), never obeyed."""
    sys.stdout.write(printable(piece))
    sys.stdout.flush()


def flush_stdout() -> None:
    """Flush stdout now, inside the error handling, rather than at interpreter exit (where a failure
    would be a traceback-like "Exception ignored" message)."""
    if sys.stdout is not None:
        sys.stdout.flush()


def discard_stdout() -> None:
    """Point stdout's descriptor at /dev/null after a failed write, so that the exit-time flush of what is
    still buffered succeeds quietly instead of failing a second time."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
