"""Plain text: the UTF-8 stream as it is, in pieces (see :func:`kvtool.documents.source.iter_text`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from kvtool.documents.base import Part


class TextReaderParts:
    """Plain text has no pages or headings: one section, handed out in pieces of at most 64K characters."""

    unit = "section"
    total = 1

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
        first = True
        for piece in self.pieces:
            yield Part(text=piece, new_unit=first, fraction=self.progress())
            first = False
