"""Markdown: read as it is (the model reads Markdown well); ``#`` headings start sections for citations."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from kvtool.runtime.documents import Part

_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


class MarkdownReaderParts:
    """Pieces of the text (cut before a newline, so a heading line is never split), split at headings."""

    unit = "section"
    total = None

    def __init__(self, pieces: Iterable[str]) -> None:
        self.pieces = pieces
        self.notes: list[str] = []

    def parts(self) -> Iterator[Part]:
        title: str | None = None
        for piece in self.pieces:
            start = 0
            for m in _HEADING.finditer(piece):
                if m.start() > start:
                    yield Part(text=piece[start : m.start()], title=title, new_unit=False)
                title = m.group(1).strip()
                start = m.start()
                yield Part(text=piece[start : m.end()], title=title, new_unit=True)
                start = m.end()
            if start < len(piece):
                yield Part(text=piece[start:], title=title, new_unit=False)
