"""What every reader shares: the :class:`Part` it hands out, the caps on what it holds, safe cuts.

A reader's working set is bounded whatever the file claims: no part is longer than :data:`PART_CHARS`
characters (a long page, chapter or paragraph is handed out in pieces, cut at a safe boundary found
by a bounded look-back), and every cap below is checked as bytes are read, not from what a header says.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from kvtool.errors import UsageError

#: the longest text one part carries (characters); longer units are handed out in pieces
PART_CHARS = 64 * 1024
#: how far back from a cut point a boundary (space, punctuation) is looked for, in characters
LOOKBACK_CHARS = 4096
#: the longest heading or title kept for citations (characters)
TITLE_CHARS = 200
#: characters after which a piece may be cut (CJK and common punctuation, ideographic space): text
#: without ASCII spaces (Chinese, Japanese) is cut just after one of these, else at a character
_PUNCT = frozenset("。、，．！？；：」』）》〉】…\u3000.,;:!?)]}\"'")


@dataclass
class Part:
    """One piece of extracted text and where it sits in the document.

    ``text`` already carries its separator from the previous part (readers add a blank line between
    pages or chapters), so the parts' texts concatenated are the extracted text. ``fraction`` is the
    share of the source (bytes, or extracted characters where the reader holds the whole text) read
    once this part is consumed: progress and length estimates come from it.
    """

    text: str
    page: int | None = None  # 1-based page number (PDF)
    chapter: int | None = None  # 1-based chapter number (EPUB)
    title: str | None = None  # chapter or section heading
    new_unit: bool = True  # whether this part starts a new page/chapter/section (counted in progress)
    fraction: float | None = None  # share of the source consumed through this part (0..1), if known


class Reader(Protocol):
    """What every format's reader offers."""

    unit: str  # "page", "chapter" or "section": what progress counts
    total: int | None  # how many units, when known before reading
    notes: list[str]  # things worth telling the user once the document is read (e.g. empty pages)

    def parts(self) -> Iterator[Part]: ...


def require(module: str, fmt: str) -> None:
    """A one-line error when the ``documents`` extra is missing (kvtool itself reads text without it), or is
    installed but does not import (a dependency of it missing or broken): the module is imported here, so a
    broken install is named with what to install, not met as an ``ImportError`` halfway through a read."""
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"reading {fmt.upper()} needs the documents extra: pip install 'kvtool[documents]'")
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - ImportError, or whatever a broken package raises as it loads
        text = " ".join(str(e).split())
        name = getattr(e, "name", None) or ""
        missing = "lxml_html_clean" if "lxml_html_clean" in text or name.startswith("lxml.html.clean") else (
            name.split(".")[0] if isinstance(e, ImportError) and name else None)
        fix = f"pip install {missing}" if missing and missing != module else "pip install 'kvtool[documents]'"
        raise UsageError(f"reading {fmt.upper()} needs {module}, which is installed but does not import "
                         f"({type(e).__name__}: {text[:120]}): {fix}") from None


def cut_point(text: str, limit: int, prefer: str = " ", lookback: int = LOOKBACK_CHARS) -> int:
    """Where to cut ``text`` so that the first piece has at most ``limit`` characters.

    Just before ``prefer`` (a space: BPE tokenization across the cut then matches the whole text), else
    before any whitespace, else just after punctuation, else a hard cut at a character boundary. Only
    the last ``lookback`` characters before ``limit`` are looked at: linear in the text, however long.
    """
    if len(text) <= limit:
        return len(text)
    lo = max(1, limit - lookback)
    at = text.rfind(prefer, lo, limit)
    if at > 0:
        return at
    for i in range(limit - 1, lo - 1, -1):
        c = text[i]
        if c.isspace():
            return i
        if c in _PUNCT:
            return i + 1
    return limit


def split_text(text: str, limit: int = PART_CHARS, prefer: str = " ") -> Iterator[str]:
    """``text`` in pieces of at most ``limit`` characters, each cut by :func:`cut_point`."""
    start = 0
    while len(text) - start > limit:
        at = cut_point(text[start : start + limit + 1], limit, prefer)
        yield text[start : start + at]
        start += at
    if start < len(text):
        yield text[start:]


def title_of(text: str) -> str | None:
    """A heading as a title: whitespace collapsed, at most :data:`TITLE_CHARS` characters."""
    return " ".join(text[: 4 * TITLE_CHARS].split())[:TITLE_CHARS] or None


class TextOut:
    """Extracted text built up as a stream and handed out in pieces of at most :data:`PART_CHARS`.

    Whitespace is collapsed the way a browser shows text: runs of whitespace become one space, each
    line (a block: paragraph, heading, list item) is trimmed and empty lines are dropped. ``take``
    returns the text ready to hand out (cut at a safe boundary) and keeps the rest, so that the held
    text never exceeds about two parts however long a line or word is.
    """

    def __init__(self) -> None:
        self.buf: list[str] = []
        self.size = 0
        self.any = False  # some text was written (a later line starts with a newline)
        self.line = False  # the current line has text
        self.space = False  # whitespace seen since the last word on this line

    def write(self, data: str) -> None:
        words = data.split()
        if not words:
            self.space = self.space or bool(data)
            return
        if not self.line:
            sep = "\n" if self.any else ""
            self.line = self.any = True
        else:
            sep = " " if data[0].isspace() or self.space else ""  # else the word goes on across the call
        self._put(sep + " ".join(words))
        self.space = data[-1].isspace()

    def end_line(self) -> None:
        self.line = self.space = False

    def _put(self, s: str) -> None:
        if s:
            self.buf.append(s)
            self.size += len(s)

    def take(self, final: bool = False) -> list[str]:
        """Pieces ready to hand out: all the text when ``final``, else whole parts' worth, the rest kept."""
        if not final and self.size < 2 * PART_CHARS:
            return []
        pieces = list(split_text("".join(self.buf)))
        rest = "" if final or not pieces else pieces.pop()
        self.buf, self.size = ([rest], len(rest)) if rest else ([], 0)
        return pieces
