"""Plain text: the UTF-8 stream as it is, in pieces (see :func:`kvtool.runtime.document.iter_text`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvtool.runtime.documents import Part


class TextReaderParts:
    """Plain text has no pages or headings: one section, handed out in 64 KiB pieces."""

    unit = "section"
    total = 1

    def __init__(self, pieces: Iterable[str]) -> None:
        self.pieces = pieces
        self.notes: list[str] = []

    def parts(self) -> Iterator[Part]:
        first = True
        for piece in self.pieces:
            yield Part(text=piece, new_unit=first)
            first = False
