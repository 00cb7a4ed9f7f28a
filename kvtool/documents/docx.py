"""DOCX with the standard library: ``word/document.xml`` parsed as it inflates, sections at headings.

An incremental parse is used rather than python-docx: it is several times faster and never holds
the document's whole object tree in memory; a heading paragraph (style
``Heading N`` or ``Title``) starts a new section, named by its text in citations. Text is written to
the section as expat reports it, so a paragraph of any length is handed out in parts of at most 64K
characters (:mod:`kvtool.documents.zipxml` caps what the ZIP may inflate to).
"""

from __future__ import annotations

import pyexpat
from collections.abc import Iterator
from typing import BinaryIO

from kvtool.documents.base import PART_CHARS, Part, split_text, title_of
from kvtool.documents.zipxml import Container, XmlFeed
from kvtool.errors import UsageError

W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
SECTION_CHARS = 16 * 1024  # a long section without headings is handed out in pieces of about this size
_BREAKS = (W + "br", W + "cr")


class _Sections:
    """Paragraph events in, parts out: paragraphs joined by a newline, sections by a blank line."""

    def __init__(self) -> None:
        self.ready: list[Part] = []
        self.buf: list[str] = []
        self.size = 0
        self.sep = ""  # written before the next paragraph's text
        self.title: str | None = None
        self.new_unit = True
        self.in_p = self.in_t = self.heading = self.has_text = False
        self.blank: list[str] = []  # a paragraph's leading whitespace, kept until its text shows it is not blank
        self.heading_text: list[str] = []
        self.blank_chars = self.heading_chars = 0

    def start(self, tag: str, attrs: dict[str, str]) -> None:
        if tag == W + "p":
            self.end_paragraph()
            self.in_p, self.heading, self.has_text = True, False, False
            self.blank, self.heading_text = [], []
            self.blank_chars = self.heading_chars = 0
        elif tag == W + "pStyle" and self.in_p:
            self.heading = attrs.get(W + "val", "").lower().startswith(("heading", "title"))
        elif tag == W + "t":
            self.in_t = True
        elif tag == W + "tab" and self.in_p:
            self.text("\t")
        elif tag in _BREAKS and self.in_p:
            self.text("\n")

    def end(self, tag: str) -> None:
        if tag == W + "t":
            self.in_t = False
        elif tag == W + "p":
            self.end_paragraph()

    def data(self, text: str) -> None:
        if self.in_t:
            self.text(text)

    def text(self, s: str) -> None:
        if not self.has_text:
            if not s.strip():
                if self.blank_chars < PART_CHARS:  # longer runs of leading whitespace are cut short
                    self.blank.append(s)
                    self.blank_chars += len(s)
                return
            self.has_text = True
            if self.heading:
                self.flush()
                self.title, self.new_unit = title_of(s), True
            self.write(self.sep + "".join(self.blank))
            self.sep, self.blank = "", []
        if self.heading and self.heading_chars < 1024:
            self.heading_text.append(s[:1024])
            self.heading_chars += len(self.heading_text[-1])
        self.write(s)

    def end_paragraph(self) -> None:
        if self.in_p and self.has_text:
            if self.heading:
                self.title = title_of("".join(self.heading_text))
            self.sep = "\n"
            if self.size >= SECTION_CHARS:
                self.flush()
        self.in_p = self.has_text = False

    def write(self, s: str) -> None:
        if not s:
            return
        self.buf.append(s)
        self.size += len(s)
        if self.size >= 2 * PART_CHARS:  # a long paragraph: hand out all but the tail, mid-paragraph
            pieces = list(split_text("".join(self.buf)))
            tail = pieces.pop()
            self._emit(pieces)
            self.buf, self.size = [tail], len(tail)

    def flush(self) -> None:
        """End the current part at a paragraph boundary (a heading, or a section grown long)."""
        if self.buf:
            self._emit(list(split_text("".join(self.buf))))
            self.buf, self.size = [], 0
            self.sep = "\n\n"

    def _emit(self, pieces: list[str]) -> None:
        for piece in pieces:
            self.ready.append(Part(text=piece, title=self.title, new_unit=self.new_unit))
            self.new_unit = False


class DocxReaderParts:
    """Paragraphs of a Word document, grouped into sections by headings."""

    unit = "section"
    total = None

    def __init__(self, source: str | BinaryIO, name: str) -> None:
        self.name = name
        self.notes: list[str] = []
        self.box = Container(source, name, "DOCX")
        try:
            if "word/document.xml" not in self.box.names:
                raise UsageError(f"{name} is not a valid DOCX (corrupt: word/document.xml is missing)")
            self.box.prescan(["word/document.xml"])  # a bomb is refused now, before a paragraph reaches a model
        except BaseException:
            self.box.close()
            raise

    def close(self) -> None:
        """Close the container now (a read abandoned partway, or never started)."""
        self.box.close()

    def parts(self) -> Iterator[Part]:
        sections = _Sections()
        feed = XmlFeed(sections.start, sections.end, sections.data)
        claimed = self.box.zip.getinfo("word/document.xml").file_size  # progress only: never trusted
        emitted = False
        try:
            with self.box.open("word/document.xml") as f:
                while True:
                    chunk = f.read()
                    try:
                        feed.feed(chunk, f"{self.name}: word/document.xml", final=not chunk)
                    except pyexpat.ExpatError as e:
                        raise self.box.corrupt(f"word/document.xml: {e}") from None
                    if not chunk:
                        sections.end_paragraph()
                        sections.flush()
                    fraction = min(1.0, f.read_bytes / claimed) if claimed else None
                    for part in sections.ready:
                        part.fraction = fraction
                        emitted = True
                        yield part
                    sections.ready.clear()
                    if not chunk:
                        break
        finally:
            self.box.close()
        if not emitted:
            raise UsageError(f"{self.name} has no text")
