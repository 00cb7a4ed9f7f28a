"""The process's standard streams: no library ever prompts on stdin, and a closed stream is made harmless.

Standard library only, importable from every layer. stdin may carry the document (``kvtool ask -``), so a
library that asks a question there (transformers' "do you wish to run the custom code? [y/N]") would take
its answer from the document: :func:`no_prompts` makes every such question an error instead. A process
started with stdout or stderr closed (``>&-``, ``2>&-``) has no descriptor 1 or 2: the next file opened
would take that number, and Python's ``print(file=None)`` falls back to stdout, so an error line meant for
stderr would land in the answers. :func:`guard_closed_streams` points the missing descriptors at
``/dev/null`` first. A process started in a directory that was deleted since has no current directory:
:func:`missing_cwd` says so before anything (torch's MKL dies with its own fatal error there) needs it.
"""

from __future__ import annotations

import builtins
import contextlib
import getpass
import io
import os
import sys
from collections.abc import Iterator
from typing import Any

from kvtool.errors import KvtoolError


class PromptRefused(KvtoolError):
    """A library asked a question on stdin while kvtool ran (exit 1): nothing is ever answered there."""


def _refuse(prompt: object = "", *args: Any, **kwargs: Any) -> str:
    text = " ".join(str(prompt).split())[:120]
    raise PromptRefused(f"a library asked a question on stdin ({text!r}); kvtool never answers prompts, "
                        "and stdin may hold the document")


@contextlib.contextmanager
def no_prompts() -> Iterator[None]:
    """``input()`` and ``getpass()`` raise :class:`PromptRefused` inside the block (restored after).

    Python-level prompts go through these two functions; nothing kvtool calls reads ``sys.stdin`` itself
    except the document reader, which holds its own reference to the stream.
    """
    saved = builtins.input, getpass.getpass
    builtins.input = _refuse
    getpass.getpass = _refuse
    try:
        yield
    finally:
        builtins.input, getpass.getpass = saved


def guard_closed_streams() -> tuple[bool, bool]:
    """Point a closed descriptor 1 or 2 at ``/dev/null`` and give ``sys.stdout``/``sys.stderr`` a writer there.

    Returns ``(stdout_closed, stderr_closed)`` as the process found them, so the caller can refuse a run
    whose output would be lost. Nothing happens when both are open.
    """
    closed = []
    for fd, name in ((1, "stdout"), (2, "stderr")):
        missing = getattr(sys, name) is None or not _fd_open(fd)
        closed.append(missing)
        if not missing:
            continue
        with contextlib.suppress(OSError):
            null = os.open(os.devnull, os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
        if getattr(sys, name) is None:
            with contextlib.suppress(OSError, ValueError):
                setattr(sys, name, io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True))
    return closed[0], closed[1]


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def missing_cwd() -> str | None:
    """One line when the current directory no longer exists (deleted while a shell sat in it), else None.

    Checked at startup, before torch is imported: loading torch there ends in MKL's own fatal error (exit 2,
    no line of ours), and every relative path would fail later as an internal ``FileNotFoundError``."""
    try:
        os.getcwd()
    except FileNotFoundError:
        return ("the current directory no longer exists (it was deleted): cd to an existing directory and run "
                "kvtool again")
    except OSError:  # unreadable above us (EACCES): absolute paths still work, and relative ones say why
        return None
    return None
