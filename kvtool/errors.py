"""Errors users see: one line on stderr and a documented exit code (see docs/cli.md "Exit codes")."""

from __future__ import annotations

import json
import re
import reprlib
from typing import Any

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_PARTIAL = 3  # many documents: some failed (each has its error record), the others were answered
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # SIGTERM or SIGHUP (128 + 15, the shell's convention for SIGTERM)
EXIT_PIPE = 141  # the reader of stdout closed the pipe (128 + 13, SIGPIPE: what `cat | head -c1` reports for cat)


class KvtoolError(Exception):
    """An error with a one-line message meant for the user, never a traceback."""

    exit_code: int = EXIT_RUNTIME

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(KvtoolError):
    """Bad input or options (exit code 2).

    ``field`` names the setting at fault in the engine's own words (``budget``, ``block_size``): lower
    layers never spell a command-line flag; the CLI maps the field to its flag when it prints the line.
    """

    exit_code = EXIT_USAGE

    def __init__(self, message: str, exit_code: int | None = None, field: str | None = None) -> None:
        super().__init__(message, exit_code)
        self.field = field


def first_line(e: BaseException, limit: int = 160) -> str:
    """The first non-empty line of an exception's message (at most ``limit`` characters), else its type name."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 80
_SHOWN.maxlevel = 2
_SHOWN.maxdict = _SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxset = 4
_SHOWN.maxlong = 40


def shown(value: object) -> str:
    """``repr(value)`` for an error message, bounded whatever ``value`` is (a value read from a file).

    A huge string, a deep or self-similar structure (YAML aliases, a "billion laughs") or a 5,000-digit
    number is shown by its start: never walked whole, never a line longer than a couple hundred characters.
    """
    try:
        return _SHOWN.repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails is named by its type
        return f"<{type(value).__name__}>"


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP, raised from the signal handler so that cleanup runs exactly as for Ctrl-C.

    A ``KeyboardInterrupt`` subclass: every ``finally`` (temp files of a ``.kvc`` write) and every handler of
    Ctrl-C also handles it; only the final message and exit code differ.
    """

    def __init__(self, signame: str) -> None:
        super().__init__(signame)
        self.signame = signame


def interrupt_exit(e: BaseException) -> tuple[str, int]:
    """The one line and the exit code for Ctrl-C (130) or a termination signal (143)."""
    if isinstance(e, Terminated):
        return f"kvtool: terminated ({e.signame})", EXIT_TERMINATED
    return "kvtool: interrupted", EXIT_INTERRUPTED


# C0 controls but tab and newline, DEL and C1 controls: ESC starts ANSI/OSC sequences, CR rewrites a line.
# Then the Unicode characters that reorder or split what a terminal shows: the bidi marks, embeddings,
# overrides and isolates (U+202E turns "txt.exe" into "exe.txt"), and the line and paragraph separators.
_ABOVE_C0 = "\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
_CONTROL = re.compile(f"[\x00-\x08\x0b-\x1f{_ABOVE_C0}]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object, one_line: bool = False) -> str:
    """``text`` with every terminal control character shown as ``\\xNN`` (bidi and separator characters as
    ``\\uNNNN``): printed literally, never obeyed.

    For user-supplied strings (file names, .kvc metadata, model names, document headings) on their way to a
    terminal; rich markup is a separate concern (print through ``rich.text.Text`` or with ``markup=False``).
    ``one_line`` also escapes newlines and tabs, so that an error stays one line.
    """
    out = _CONTROL.sub(_escape, str(text))
    return out.replace("\n", "\\n").replace("\t", "\\t") if one_line else out


#: the most characters of a path a message or a progress line shows (its start and its end)
PATH_SHOWN = 160


def short_path(path: object, limit: int = PATH_SHOWN) -> str:
    """``path`` as a message shows it: controls escaped (:func:`printable`, one line) and, past ``limit``
    characters, its start and its end (the file name) around an ellipsis: a path of any length (a 4 KiB
    one from a list, a 100 KiB argument) is one readable line, never printed whole."""
    raw = str(path)
    head = printable(raw[:limit], one_line=True)  # only what is shown is escaped: bounded whatever the length
    if len(raw) <= limit and len(head) <= limit:
        return head
    keep = limit // 2
    tail = printable(raw[-limit:], one_line=True)
    return f"{head[: limit - keep - 1]}…{tail[-keep:]}"


# Inside JSON: what ``printable`` escapes and ``json.dumps(ensure_ascii=False)`` leaves raw (DEL, the C1 controls
# with U+009B, an 8-bit CSI; the bidi and separator characters), and lone surrogates (a file name's bytes that are
# not UTF-8, which no terminal or UTF-8 file can hold). C0 controls json already escapes.
_JSON_RAW = re.compile(f"[{_ABOVE_C0}\ud800-\udfff]")


def json_text(obj: Any, **kwargs: Any) -> str:
    """``obj`` as JSON (``json.dumps`` with ``ensure_ascii=False`` and ``kwargs``) whose every terminal control
    character, bidi override and lone surrogate is a ``\\uXXXX`` escape: safe on a terminal, and the data reads
    back unchanged (``json.loads`` turns each escape into its character). Every JSON kvtool prints or logs is
    written by this function.

    Only string contents can hold such characters (JSON's own syntax is ASCII), so escaping the dumped text is
    escaping the strings."""
    return _JSON_RAW.sub(_json_escape, json.dumps(obj, ensure_ascii=False, **kwargs))


def _json_escape(m: re.Match[str]) -> str:
    return f"\\u{ord(m.group()):04x}"
