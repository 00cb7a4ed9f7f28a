"""Where output goes: content on stdout (text or JSON), everything else on stderr.

Shared by every command, so that "stdout stays clean for pipelines" is decided in one place.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def sayer(quiet: bool) -> Callable[[str], None]:
    """A function that prints a note on stderr, or nothing with ``--quiet``."""

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    return say


@contextmanager
def dashboard(quiet: bool) -> Iterator[Any]:
    """The engine's event listener for this terminal (live view, plain lines, or nothing)."""
    from kvtool.cli.dashboard import choose_mode, make_listener

    console = stderr_console()
    with make_listener(choose_mode(quiet, console.is_terminal), console) as dash:
        yield dash


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def write_text(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()
