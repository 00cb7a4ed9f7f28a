"""Markdown: read as it is (the model reads Markdown well); ``#`` headings start sections for citations.

Headings are found by a scan of line starts (``str.find``), not a regular expression: linear in the
text however long its lines are or however many ``#`` and spaces they hold.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from kvtool.documents.base import Part, title_of


def heading(line: str) -> str | None:
    """The title of an ATX heading line (``## Title ##``), else ``None``; ``line`` excludes its newline."""
    level = len(line) - len(line.lstrip("#"))
    if not 1 <= level <= 6 or len(line) == level or line[level] not in " \t":
        return None
    rest = line[level:]
    if not rest.strip(" \t"):
        return None
    return title_of(rest.rstrip(" \t#") or rest)


class MarkdownReaderParts:
    """Pieces of the text (cut before a newline where one is near), split at headings."""

    unit = "section"
    total = None

    def __init__(self, pieces: Iterable[str], progress: Callable[[], float | None] = lambda: None) -> None:
        self.pieces = pieces
        self.progress = progress  # share of the file's bytes handed out so far
        self.notes: list[str] = []

    def close(self) -> None:
        """Stop the decoding stream now (its ``finally`` closes the file)."""
        close = getattr(self.pieces, "close", None)
        if close is not None:
            close()

    def parts(self) -> Iterator[Part]:
        title: str | None = None
        at_line_start = True  # the next piece starts a line (pieces may be cut mid-line)
        for piece in self.pieces:
            fraction = self.progress()
            start = 0
            for pos in _hash_lines(piece, at_line_start):
                end = piece.find("\n", pos)
                stop = len(piece) if end < 0 else end
                found = heading(piece[pos:stop])
                if found is None:
                    continue
                if pos > start:
                    yield Part(text=piece[start:pos], title=title, new_unit=False, fraction=fraction)
                title = found
                yield Part(text=piece[pos:stop], title=title, new_unit=True, fraction=fraction)
                start = stop
            if start < len(piece):
                yield Part(text=piece[start:], title=title, new_unit=False, fraction=fraction)
            at_line_start = piece.endswith("\n")


def _hash_lines(piece: str, at_line_start: bool) -> Iterator[int]:
    """Offsets of the lines of ``piece`` that start with ``#`` (one ``str.find`` pass)."""
    if at_line_start and piece.startswith("#"):
        yield 0
    i = piece.find("\n#")
    while i >= 0:
        yield i + 1
        i = piece.find("\n#", i + 1)
